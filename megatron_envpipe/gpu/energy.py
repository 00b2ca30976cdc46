"""Energy of arbitrary time windows from a GPU's cumulative energy counter.

NVML's counter (``nvmlDeviceGetTotalEnergyConsumption``) only changes every
~10 ms, so reading it at a unit's start and end cannot measure a unit of a few
milliseconds. As Perseus/Merak did (perseus.md §5.4), :class:`EnergyMonitor`
polls the counter on a background thread, records ``(time, cumulative mJ)``
whenever the value changes, and answers ``E(t1) - E(t0)`` by piecewise-linear
interpolation of that trace. Interpolation assumes constant power between two
recorded samples: a window boundary that falls between samples where power
jumps (compute <-> idle) is off by at most ``jump_w * sample_spacing_s / 4``
joules, so the error shrinks with the counter's update period relative to the
window, not with the window's length alone.

Times are in the monitor's clock (``time.monotonic`` by default): windows must
be stamped with the same clock.
"""

from __future__ import annotations

import bisect
import logging
import math
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from megatron_envpipe.errors import EnvPipeError
from megatron_envpipe.gpu.base import GpuDevice

log = logging.getLogger("megatron_envpipe")


class EnergyMonitorError(EnvPipeError, RuntimeError):
    """A window the trace cannot answer (not covered, or the poller failed)."""


class InseparablePowersError(EnvPipeError, ValueError):
    """The counter samples cannot tell the labels' powers apart (too few samples)."""


@dataclass(frozen=True, slots=True)
class EnergySample:
    time_s: float
    energy_mj: float  # cumulative, monotonic


class EnergyMonitor:
    """Background poller of ``device.energy_mj()``; see the module docstring.

    ``edge_tolerance_s``: a window edge at most this far outside the trace uses
    the nearest sample (default: one poll interval, the poller's own lag).
    ``retain_s``: if set, the poller drops samples older than this (bounds
    memory for long runs; otherwise call :meth:`trim`).
    """

    def __init__(
        self,
        device: GpuDevice,
        poll_interval_s: float = 0.002,
        clock: Callable[[], float] = time.monotonic,
        edge_tolerance_s: float | None = None,
        retain_s: float | None = None,
    ) -> None:
        if not poll_interval_s > 0:
            raise ValueError(f"poll_interval_s must be > 0, got {poll_interval_s}")
        self.device = device
        self.poll_interval_s = float(poll_interval_s)
        self.edge_tolerance_s = float(poll_interval_s if edge_tolerance_s is None else edge_tolerance_s)
        self.retain_s = retain_s
        self._clock = clock
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._times: list[float] = []
        self._energies_mj: list[float] = []
        self._last_raw_mj: float | None = None
        self._offset_mj = 0.0  # added after a counter reset, to keep the trace monotonic
        self._last_read_s: float | None = None
        self._unchanged_since_sample = False
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._error: BaseException | None = None

    # -- lifecycle -----------------------------------------------------------------------
    def start(self) -> "EnergyMonitor":
        if self._thread is not None:
            return self
        self._stop.clear()
        self.sample()  # the trace starts now, not one poll interval later
        self._thread = threading.Thread(target=self._run, name="envpipe-energy-monitor", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        thread, self._thread = self._thread, None
        if thread is not None:
            self._stop.set()
            thread.join()
            if self._error is None:
                self.sample()  # extend the trace to the stop time
        self._raise_poller_error()

    @property
    def clock(self) -> Callable[[], float]:
        """The clock the trace is stamped with; stamp windows with it too."""
        return self._clock

    @property
    def running(self) -> bool:
        return self._thread is not None

    def __enter__(self) -> "EnergyMonitor":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self.sample()
                if self.retain_s is not None and self._last_read_s is not None:
                    self.trim(self._last_read_s - self.retain_s)
                self._stop.wait(self.poll_interval_s)
        except BaseException as exc:  # surfaced to the trainer on the next query
            with self._lock:
                self._error = exc
                self._changed.notify_all()

    # -- sampling ------------------------------------------------------------------------
    def sample(self) -> bool:
        """Read the counter once; record it if it changed. Returns whether it was recorded.

        The poller calls this; tests with a fake clock call it directly.
        """
        t_before = self._clock()
        raw_mj = float(self.device.energy_mj())
        t_after = self._clock()
        # The value belongs to some instant of the read call: take its middle.
        t = 0.5 * (t_before + t_after)
        with self._lock:
            last = self._last_raw_mj
            if last is not None and raw_mj == last:
                self._last_read_s = max(t, self._last_read_s or t)
                self._unchanged_since_sample = True
                return False
            if self._unchanged_since_sample and self._last_read_s is not None:
                # A stepped counter (NVML) updated somewhere between the previous,
                # unchanged read and this one: the middle is the unbiased guess.
                t_stamp = 0.5 * (self._last_read_s + t)
            else:
                t_stamp = t
            if self._times and t_stamp <= self._times[-1]:
                return False  # a concurrent read was recorded later: keep the trace ordered
            self._last_read_s = t
            self._unchanged_since_sample = False
            if last is not None and raw_mj < last:
                # Driver reload or counter wrap: continue the trace from where it was.
                log.warning("GPU energy counter went back from %.0f to %.0f mJ; continuing the trace", last, raw_mj)
                self._offset_mj += last - raw_mj
            self._last_raw_mj = raw_mj
            self._times.append(t_stamp)
            self._energies_mj.append(raw_mj + self._offset_mj)
            self._changed.notify_all()
            return True

    def samples(self) -> tuple[EnergySample, ...]:
        with self._lock:
            return tuple(EnergySample(t, e) for t, e in zip(self._times, self._energies_mj))

    def samples_between(self, t0: float, t1: float) -> tuple[EnergySample, ...]:
        """Samples in [t0, t1] plus the nearest one on each side (what interpolation there uses)."""
        with self._lock:
            i = max(bisect.bisect_right(self._times, t0) - 1, 0)
            j = min(bisect.bisect_left(self._times, t1) + 1, len(self._times))
            return tuple(EnergySample(t, e) for t, e in zip(self._times[i:j], self._energies_mj[i:j]))

    def covered_until(self) -> float | None:
        """Time of the newest sample (windows may end up to ``edge_tolerance_s`` later)."""
        with self._lock:
            return self._times[-1] if self._times else None

    def wait_covered(self, t: float, timeout_s: float = 1.0) -> None:
        """Block until a sample at or after ``t`` exists (the counter updated after ``t``).

        NVML's counter updates every ~10 ms, so a window that just ended is
        answerable only after the next update. Raises on timeout, naming why.
        """
        if self._thread is None:
            with self._lock:
                if self._times and self._times[-1] >= t - self.edge_tolerance_s:
                    return
            raise EnergyMonitorError(
                f"energy trace ends at {self.covered_until()} s, before {t:.6f} s, and the monitor is not "
                "running: start() it before the window (or call sample())"
            )
        deadline = time.monotonic() + timeout_s
        with self._changed:
            while not self._times or self._times[-1] < t:
                if self._error is not None:
                    break
                left = deadline - time.monotonic()
                if left <= 0:
                    newest = self._times[-1] if self._times else None
                    raise EnergyMonitorError(
                        f"the energy counter of {self.device.info().label()} did not change after {t:.6f} s "
                        f"within {timeout_s:g} s (newest sample at {newest}): is the GPU's counter frozen?"
                    )
                self._changed.wait(left)
        self._raise_poller_error()

    def trim(self, before_t: float) -> None:
        """Forget samples before ``before_t``, keeping one at or before it so windows from ``before_t`` work."""
        with self._lock:
            i = bisect.bisect_right(self._times, before_t) - 1
            if i > 0:
                del self._times[:i]
                del self._energies_mj[:i]

    # -- queries -------------------------------------------------------------------------
    def energy_mj_at(self, t: float) -> float:
        """Cumulative energy at ``t`` (mJ), interpolated linearly between samples."""
        self._raise_poller_error()
        with self._lock:
            return self._interpolate(t)

    def energy_j(self, t0: float, t1: float) -> float:
        """Energy in joules between ``t0`` and ``t1`` (``t0 <= t1``) on the monitor's clock."""
        if t1 < t0:
            raise ValueError(f"window ends before it starts: [{t0}, {t1}]")
        self._raise_poller_error()
        with self._lock:
            return (self._interpolate(t1) - self._interpolate(t0)) / 1000.0

    def average_power_w(self, t0: float, t1: float) -> float:
        if not t1 > t0:
            raise ValueError(f"average power needs a window of positive length, got [{t0}, {t1}]")
        return self.energy_j(t0, t1) / (t1 - t0)

    def _interpolate(self, t: float) -> float:
        times, energies = self._times, self._energies_mj
        if not times:
            raise EnergyMonitorError("the energy trace is empty: start() the monitor before the window")
        if t <= times[0]:
            if times[0] - t <= self.edge_tolerance_s:
                return energies[0]
            raise EnergyMonitorError(
                f"window edge {t:.6f} s is {times[0] - t:.6f} s before the first energy sample "
                f"({times[0]:.6f} s): the monitor started after the window, or trim() dropped it"
            )
        if t >= times[-1]:
            if t - times[-1] <= self.edge_tolerance_s:
                return energies[-1]
            raise EnergyMonitorError(
                f"window edge {t:.6f} s is {t - times[-1]:.6f} s after the last energy sample "
                f"({times[-1]:.6f} s): call wait_covered({t:.6f}) first, or the monitor is stopped"
            )
        i = bisect.bisect_right(times, t)  # times[i-1] <= t < times[i]
        t_a, t_b = times[i - 1], times[i]
        e_a, e_b = energies[i - 1], energies[i]
        return e_a + (e_b - e_a) * (t - t_a) / (t_b - t_a)

    def _raise_poller_error(self) -> None:
        if self._error is not None:
            raise EnergyMonitorError(f"energy poller failed: {self._error!r}") from self._error


def attribute_windows(
    monitor: EnergyMonitor, windows: Sequence[tuple[float, float]], wait_timeout_s: float = 1.0
) -> list[float]:
    """Energy (J) of each ``(t0, t1)`` window; waits until the trace covers the last one."""
    if not windows:
        return []
    monitor.wait_covered(max(t1 for _, t1 in windows), timeout_s=wait_timeout_s)
    return [monitor.energy_j(t0, t1) for t0, t1 in windows]


def fit_window_powers(
    monitor: EnergyMonitor,
    windows: Sequence[tuple[str, float, float]],
    other_label: str = "other",
    wait_timeout_s: float = 1.0,
) -> dict[str, float]:
    """Power of each label of ``(label, t0, t1)`` windows, by least squares on the counter.

    Interpolation blends a window's power with its neighbours' wherever the
    samples around its edges straddle a power jump. If instead each label has
    one constant power (all forwards of an iteration at one clock), every
    counter increment ``E_i - E_(i-1)`` is ``sum_label P_label * overlap_label(i)``,
    a small linear system that is exact even for windows shorter than the
    counter period. Time not in any window is ``other_label``. Windows must not
    overlap (ValueError). Returns joules per second of the monitor's clock;
    raises :class:`InseparablePowersError` if the labels cannot be told apart.
    """
    if not windows:
        return {}
    ws = sorted((float(a), float(b), str(lbl)) for lbl, a, b in windows)
    for (a0, b0, l0), (a1, _, l1) in zip(ws, ws[1:]):
        if a1 < b0:
            raise ValueError(f"windows overlap: {l0} [{a0}, {b0}] and {l1} starting at {a1}")
    span0, span1 = ws[0][0], max(b for _, b, _ in ws)
    monitor.wait_covered(span1, timeout_s=wait_timeout_s)
    monitor.energy_j(span0, span1)  # raises, naming why, if the trace does not cover the span
    samples = monitor.samples_between(span0, span1)
    # Segments tiling the time line: windows, and other_label in between and outside.
    segments: list[tuple[float, float, str]] = []
    t = -math.inf
    for a, b, lbl in ws:
        if a > t:
            segments.append((t, a, other_label))
        segments.append((a, b, lbl))
        t = b
    segments.append((t, math.inf, other_label))
    labels = sorted({lbl for _, _, lbl in segments})
    index = {lbl: i for i, lbl in enumerate(labels)}
    k = len(labels)
    normal = [[0.0] * k for _ in range(k)]
    rhs = [0.0] * k
    seg = 0
    for prev, cur in zip(samples, samples[1:]):
        t_a, t_b = prev.time_s, cur.time_s
        row = [0.0] * k
        while segments[seg][1] <= t_a:
            seg += 1
        j = seg
        while j < len(segments) and segments[j][0] < t_b:
            a, b, lbl = segments[j]
            row[index[lbl]] += min(b, t_b) - max(a, t_a)
            j += 1
        d_j = (cur.energy_mj - prev.energy_mj) / 1000.0
        for r in range(k):
            if row[r]:
                rhs[r] += row[r] * d_j
                for c in range(k):
                    normal[r][c] += row[r] * row[c]
    present = [i for i in range(k) if normal[i][i] > 0]
    solution = _solve([[normal[r][c] for c in present] for r in present], [rhs[r] for r in present])
    if solution is None:
        raise InseparablePowersError(
            f"cannot separate the powers of {[labels[i] for i in present]}: too few counter samples"
        )
    return {labels[i]: p for i, p in zip(present, solution)}


def _solve(a: list[list[float]], b: list[float]) -> list[float] | None:
    """Gaussian elimination with partial pivoting; None if (nearly) singular."""
    n = len(b)
    scale = max((abs(a[i][i]) for i in range(n)), default=0.0)
    if scale == 0.0:
        return None
    m = [row[:] + [b[i]] for i, row in enumerate(a)]
    for col in range(n):
        piv = max(range(col, n), key=lambda r: abs(m[r][col]))
        if abs(m[piv][col]) <= 1e-12 * scale:
            return None
        m[col], m[piv] = m[piv], m[col]
        for r in range(col + 1, n):
            f = m[r][col] / m[col][col]
            for c in range(col, n + 1):
                m[r][c] -= f * m[col][c]
    x = [0.0] * n
    for r in range(n - 1, -1, -1):
        x[r] = (m[r][n] - sum(m[r][c] * x[c] for c in range(r + 1, n))) / m[r][r]
    return x


# -- per-iteration energy ------------------------------------------------------------------
@dataclass(frozen=True)
class IterationEnergy:
    """One stage's energy over one training iteration."""

    iteration: int
    stage: int
    start_s: float
    end_s: float
    energy_j: float

    @property
    def time_s(self) -> float:
        return self.end_s - self.start_s

    @property
    def average_power_w(self) -> float:
        return self.energy_j / self.time_s if self.time_s > 0 else 0.0


@dataclass(frozen=True)
class PipelineIterationEnergy:
    """A whole pipeline's iteration, as Perseus accounts it: time = max over stages, energy = sum."""

    iteration: int
    time_s: float
    energy_j: float
    stages: tuple[IterationEnergy, ...]

    @classmethod
    def combine(cls, parts: Sequence[IterationEnergy]) -> "PipelineIterationEnergy":
        if not parts:
            raise ValueError("no stages to combine")
        iterations = {p.iteration for p in parts}
        if len(iterations) != 1:
            raise ValueError(f"stages of different iterations {sorted(iterations)} cannot be combined")
        stages = sorted(p.stage for p in parts)
        if len(set(stages)) != len(stages):
            raise ValueError(f"a stage appears twice: {stages}")
        return cls(
            iteration=parts[0].iteration,
            time_s=max(p.time_s for p in parts),
            energy_j=sum(p.energy_j for p in parts),
            stages=tuple(sorted(parts, key=lambda p: p.stage)),
        )


def mean_iteration(parts: Sequence[PipelineIterationEnergy], skip_first: int = 0) -> tuple[float, float]:
    """Mean ``(time_s, energy_j)`` per iteration, after dropping ``skip_first`` warm-up iterations."""
    kept = list(parts)[skip_first:]
    if not kept:
        raise ValueError(f"no iterations left after skipping {skip_first}")
    return sum(p.time_s for p in kept) / len(kept), sum(p.energy_j for p in kept) / len(kept)


class IterationEnergyMeter:
    """Brackets iterations of one stage: ``begin(i)`` ... ``end()`` -> :class:`IterationEnergy`."""

    def __init__(self, monitor: EnergyMonitor, stage: int, clock: Callable[[], float] | None = None) -> None:
        self.monitor = monitor
        self.stage = stage
        self._clock = clock or monitor.clock
        self._open: tuple[int, float] | None = None
        self.history: list[IterationEnergy] = []

    def begin(self, iteration: int, t: float | None = None) -> None:
        if self._open is not None:
            raise RuntimeError(f"iteration {self._open[0]} is still open; end() it first")
        self._open = (iteration, self._clock() if t is None else t)

    def end(self, t: float | None = None, wait_timeout_s: float = 1.0) -> IterationEnergy:
        if self._open is None:
            raise RuntimeError("end() without begin()")
        iteration, start_s = self._open
        end_s = self._clock() if t is None else t
        self._open = None
        (energy_j,) = attribute_windows(self.monitor, [(start_s, end_s)], wait_timeout_s)
        result = IterationEnergy(iteration, self.stage, start_s, end_s, energy_j)
        self.history.append(result)
        return result
