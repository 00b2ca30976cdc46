"""Energy of arbitrary time windows from a GPU's cumulative energy counter.

NVML's counter (``nvmlDeviceGetTotalEnergyConsumption``) only changes every
~100 ms on A100 (ml.energy, "Thermally stable profiling", 2026), so reading it at
a unit's start and end cannot measure a unit of a few hundred milliseconds. As
Perseus/Merak did (perseus.md §5.4), :class:`EnergyMonitor` polls the counter on
a background thread, records ``(time, cumulative mJ)`` whenever the value
changes, and answers ``E(t1) - E(t0)`` by piecewise-linear interpolation of that
trace. The counter's update period is measured, not assumed: until the monitor
has seen it change a few times under load it cannot tell an exact counter (every
read changes: the simulated GPU's exact one) from a stepped one, and a stepped
one's changes are stamped at the update ticks fitted to them
(:class:`~megatron_envpipe.gpu.energy.counter_ticks.TickGrid`), not at the reads. Interpolation assumes constant power between two
recorded samples: a window boundary that falls between samples where power
jumps (compute <-> idle) is off by at most ``jump_w * sample_spacing_s / 4``
joules, so the error shrinks with the counter's update period relative to the
window, not with the window's length alone. Whole iterations are measured at
their two edges (:mod:`~megatron_envpipe.gpu.energy.iteration_meter`, as Zeus does).

Measurement never stops training. A counter that stands still while the GPU
draws power (*stalled*) or goes back (driver reload) leaves a gap in the
trace; a window over a gap, a window the trace cannot cover, or an edge read
that fails raises an :class:`EnergyMonitorError` (or the device's own error)
whose ``reason`` names why, and the caller reports the window *unmeasured*.
The poller survives failed reads (they only thin the trace) and resumes with
the counter.

Times are in the monitor's clock (``time.monotonic`` by default): windows must
be stamped with the same clock.
"""

from __future__ import annotations

import bisect
import logging
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from megatron_envpipe.core.virtual_clock import VirtualClock
from megatron_envpipe.errors import InvalidValueError
from megatron_envpipe.gpu.devices.base import GpuDevice
from megatron_envpipe.gpu.energy.counter_errors import (
    STALLED,
    WENT_BACK,
    CounterReadError,
    CounterStalledError,
    CounterWentBackError,
    EnergyMonitorError,
)
from megatron_envpipe.gpu.energy.counter_ticks import TickGrid

__all__ = ["EnergyMonitor", "EnergySample"]

log = logging.getLogger("megatron_envpipe")

# A stepped counter (NVML: ~100 ms on A100) is assumed to update at least this often while
# the GPU draws power until its period is measured (for stall detection only).
_STEPPED_COUNTER_PERIOD_S = 0.1
# Reads under load that all changed before a counter being measured counts as exact.
_EXACT_AFTER_READS = 8
# Below this a GPU draws no power at all: only a simulated GPU idles there, and its
# counter then rightly stands still. Real GPUs idle at tens of watts.
_ZERO_POWER_W = 0.5
# The poller retries a failing counter with growing pauses, up to this one.
_MAX_RETRY_PAUSE_S = 0.5


_GAP_ERRORS: dict[str, type[EnergyMonitorError]] = {STALLED: CounterStalledError, WENT_BACK: CounterWentBackError}


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
    ``counter_period_s``: 0 for a counter that is exact at every read (an
    unchanged read at zero power is then a sample of the trace); > 0 for a
    stepped counter updating that often; None (default) to measure it: 0 once
    :data:`_EXACT_AFTER_READS` reads under load all changed, else the period of
    the update ticks fitted to the changes seen (:attr:`measured_period_s`).
    ``stall_after_s``: a stepped counter unchanged this long while the device
    reports power is stalled (default ``max(0.5, 5 * period)``, with
    :data:`_STEPPED_COUNTER_PERIOD_S` while the period is unknown); an exact
    counter is stalled as soon as it reads unchanged while the device drew power.
    """

    def __init__(
        self,
        device: GpuDevice,
        poll_interval_s: float = 0.002,
        clock: Callable[[], float] = time.monotonic,
        edge_tolerance_s: float | None = None,
        retain_s: float | None = None,
        counter_period_s: float | None = None,
        stall_after_s: float | None = None,
    ) -> None:
        if not poll_interval_s > 0:
            raise InvalidValueError(f"poll_interval_s must be > 0, got {poll_interval_s}")
        self.device = device
        self.poll_interval_s = float(poll_interval_s)
        self.edge_tolerance_s = float(poll_interval_s if edge_tolerance_s is None else edge_tolerance_s)
        self.retain_s = retain_s
        if counter_period_s is not None and not 0 <= counter_period_s < math.inf:
            raise InvalidValueError(f"counter_period_s must be a finite number >= 0 (None: measure it), "
                             f"got {counter_period_s}")
        # None while being measured; then 0 (exact) or the fitted period.
        self.counter_period_s: float | None = None if counter_period_s is None else float(counter_period_s)
        self._stall_given = stall_after_s is not None
        if stall_after_s is None:
            stall_after_s = max(0.5, 5 * (self.counter_period_s or _STEPPED_COUNTER_PERIOD_S))
        self.stall_after_s = float(stall_after_s)
        self._ticks = TickGrid()
        self._loaded_changed = 0  # reads under load that changed, while measuring
        self._loaded_unchanged = 0  # ... that did not (the counter is stepped)
        self._clock = clock
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._times: list[float] = []
        self._energies_mj: list[float] = []
        self._brackets: list[tuple[float, float]] = []  # per sample: (previous read, read that saw it)
        self._last_raw_mj: float | None = None
        self._offset_mj = 0.0  # added after a counter reset, to keep the trace monotonic
        self._last_read_s: float | None = None
        self._last_change_s: float | None = None  # read time of the last value that changed
        self._unchanged_since_sample = False
        self._stall_from: float | None = None  # trace time the open stall began (None: not stalled)
        self._gaps: list[tuple[float, float, str]] = []  # (from, to, reason): windows there are unmeasured
        self._failing: BaseException | None = None  # the last read failed with this
        self._warned_read = False
        self._thread: threading.Thread | None = None
        self._virtual: VirtualClock | None = None  # start_on()'s: polls run inside its sleeps
        self._stop = threading.Event()
        # counters, for reports
        self.read_errors = 0
        self.stalls = 0
        self.went_back = 0

    # -- lifecycle -----------------------------------------------------------------------
    def start(self) -> "EnergyMonitor":
        if self._thread is not None:
            return self
        self._stop.clear()
        self._poll_once()  # the trace starts now, not one poll interval later
        self._thread = threading.Thread(target=self._run, name="envpipe-energy-monitor", daemon=True)
        self._thread.start()
        return self

    def start_on(self, clock: VirtualClock) -> "EnergyMonitor":
        """Poll inside ``clock``'s sleeps, every poll interval of simulated time, instead of on a
        thread (a simulated GPU in virtual time: a thread would read the clock standing still)."""
        self._poll_once()
        clock.every(self.poll_interval_s, self._poll_once)
        self._virtual = clock
        return self

    def stop(self) -> None:
        thread, self._thread = self._thread, None
        if thread is not None:
            self._stop.set()
            thread.join()
            self._poll_once()  # extend the trace to the stop time

    @property
    def clock(self) -> Callable[[], float]:
        """The clock the trace is stamped with; stamp windows with it too."""
        return self._clock

    @property
    def running(self) -> bool:
        return self._thread is not None

    @property
    def failing(self) -> BaseException | None:
        """The error of the last read, while the counter keeps failing (None once a read works)."""
        return self._failing

    def __enter__(self) -> "EnergyMonitor":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _run(self) -> None:
        failures = 0
        while not self._stop.is_set():
            failures = 0 if self._poll_once() else failures + 1
            if self.retain_s is not None and self._last_read_s is not None:
                self.trim(self._last_read_s - self.retain_s)
            # A failing counter is retried ever more slowly: the poll must not busy a broken driver.
            pause = self.poll_interval_s * 2 ** min(failures, 10)
            self._stop.wait(min(pause, max(_MAX_RETRY_PAUSE_S, self.poll_interval_s)))

    def _poll_once(self) -> bool:
        """One poll; a failed read is counted and logged once, never raised (whatever the
        backend raised: this is the boundary of the poller thread). Returns whether it read."""
        try:
            self.sample()
        except Exception as exc:  # noqa: BLE001 - see the docstring; counted and reported
            if not self._warned_read:
                self._warned_read = True
                log.warning("EnvPipe: reading the energy counter of %s failed (%r); retrying, and windows "
                            "it cannot cover are reported unmeasured", self.device.info().label(), exc)
            return False
        return True

    # -- sampling ------------------------------------------------------------------------
    def sample(self) -> bool:
        """Read the counter once; record it if it changed. Returns whether it was recorded.

        The poller calls this; tests with a fake clock call it directly. Raises
        what the device raised (after counting it) when the read fails.
        """
        return self._read()[2]

    def read(self) -> tuple[float, float]:
        """Read the counter now, recording it like a poll: ``(time, cumulative mJ)`` on the
        trace's scale (continuous across counter resets). Raises what the device raised."""
        t, e, _ = self._read()
        return t, e

    @property
    def measured_period_s(self) -> float | None:
        """The counter's update period as the polls measured it (0: exact; None: not yet known)."""
        with self._lock:
            if self.counter_period_s == 0:
                return 0.0
            return self._ticks.period_s if self._ticks.updates >= self._ticks.min_updates else None

    def _read(self) -> tuple[float, float, bool]:
        period = self.counter_period_s
        exact = period == 0
        # An exact counter that reads unchanged although the GPU drew power when the read
        # began has stalled; at zero power it is right. (Power read afterwards could
        # belong to a unit that began in between.) While the period is measured, power
        # tells a read under load (which an exact counter always changes) from idle.
        power_w = self._power_w() if period is None or exact else None
        t_before = self._clock()
        try:
            raw_mj = float(self.device.energy_mj())
        except BaseException as exc:
            with self._lock:
                self.read_errors += 1
                self._failing = exc
                self._changed.notify_all()
            raise
        t_after = self._clock()
        # The value belongs to some instant of the read call: take its middle.
        t = 0.5 * (t_before + t_after)
        with self._lock:
            self._failing = None
            last = self._last_raw_mj
            loaded = power_w is None or power_w >= _ZERO_POWER_W
            if last is not None and raw_mj == last:
                if period is None and loaded:
                    self._loaded_unchanged += 1  # stepped: an exact counter moves under load
                idle = period is None and not loaded  # a flat counter at zero power is right either way
                recorded = self._unchanged_exact(t, power_w) if exact or idle else self._unchanged_stepped(t)
                return t, raw_mj + self._offset_mj, recorded
            lo = self._last_read_s if self._last_read_s is not None and last is not None else t
            if not exact and last is not None and lo < t:
                self._ticks.add(lo, t)
            if period is None and last is not None and loaded:
                self._loaded_changed += 1
                self._decide_period()
            if self.counter_period_s and self._ticks.period_s is not None and lo < t:
                # A stepped counter updated somewhere in (lo, t]: at its fitted tick there.
                t_stamp = self._ticks.stamp(lo, t)
            elif not exact and self._unchanged_since_sample and self._last_read_s is not None:
                # A stepped counter (NVML) updated somewhere between the previous,
                # unchanged read and this one: the middle is the unbiased guess.
                t_stamp = 0.5 * (self._last_read_s + t)
            else:
                t_stamp = t
            if self._times and t_stamp <= self._times[-1]:
                return t, raw_mj + self._offset_mj, False  # a concurrent read was recorded later
            if last is not None and raw_mj < last:
                # Driver reload or counter wrap: continue the trace from where it was; the energy
                # since the previous read is unknown, so windows over it are unmeasured.
                log.warning("GPU energy counter went back from %.0f to %.0f mJ; continuing the trace", last, raw_mj)
                self._offset_mj += last - raw_mj
                self._gaps.append((self._last_read_s if self._last_read_s is not None else t_stamp, t, WENT_BACK))
                self.went_back += 1
            if self._stall_from is not None:
                self._gaps.append((self._stall_from, t_stamp, STALLED))
                self._stall_from = None
            self._last_read_s = t
            self._last_change_s = t
            self._unchanged_since_sample = False
            self._last_raw_mj = raw_mj
            self._times.append(t_stamp)
            self._energies_mj.append(raw_mj + self._offset_mj)
            self._brackets.append((lo, t))
            self._changed.notify_all()
            return t, raw_mj + self._offset_mj, True

    def _decide_period(self) -> None:
        """While measuring (lock held): exact once enough reads under load all changed; stepped at
        the fitted period once the tick grid has one (earlier samples re-stamped on it)."""
        if self._loaded_unchanged == 0:
            if self._loaded_changed >= _EXACT_AFTER_READS:
                self.counter_period_s = 0.0
            return
        period = self._ticks.period_s
        if period is None or self._ticks.updates < self._ticks.min_updates:
            return
        self.counter_period_s = period
        if not self._stall_given:
            self.stall_after_s = max(0.5, 5 * period)
        for i, (lo, hi) in enumerate(self._brackets):
            if lo < hi:
                stamp = self._ticks.stamp(lo, hi)
                if (i == 0 or stamp > self._times[i - 1]) and (i + 1 == len(self._times) or stamp < self._times[i + 1]):
                    self._times[i] = stamp

    def _power_w(self) -> float | None:
        try:
            return float(self.device.power_w())
        except Exception:  # noqa: BLE001 - unknown power: a counter standing still then counts as stalled
            return None

    def _unchanged_exact(self, t: float, power_w: float | None) -> bool:
        """An exact counter read unchanged at ``t`` (lock held): a sample of a flat stretch at
        zero power, else a stall. Returns whether recorded."""
        self._last_read_s = max(t, self._last_read_s or t)
        if self._stall_from is not None or not self._times or t <= self._times[-1]:
            return False  # (no time passed since the last sample: a virtual clock's reads; no evidence)
        if power_w is None or power_w >= _ZERO_POWER_W:
            self._open_stall()
            return False
        if len(self._times) >= 2 and self._energies_mj[-2] == self._energies_mj[-1]:
            self._times[-1] = t  # extend the flat stretch rather than adding a sample per poll
            self._brackets[-1] = (t, t)
        else:
            self._times.append(t)
            self._energies_mj.append(self._energies_mj[-1])
            self._brackets.append((t, t))
        self._changed.notify_all()
        return True

    def _unchanged_stepped(self, t: float) -> bool:
        """A stepped counter read unchanged at ``t`` (lock held): between updates, or stalled
        once it stood still ``stall_after_s`` while the GPU drew power. Never recorded."""
        self._last_read_s = max(t, self._last_read_s or t)
        self._unchanged_since_sample = True
        flat_s = t - (self._last_change_s if self._last_change_s is not None else t)
        if self._stall_from is None and self._times and flat_s > self.stall_after_s:
            power_w = self._power_w()
            if power_w is None or power_w >= _ZERO_POWER_W:
                self._open_stall()
        return False

    def _open_stall(self) -> None:
        self._stall_from = self._times[-1]
        self.stalls += 1
        self._changed.notify_all()

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

    def gaps(self) -> tuple[tuple[float, float, str], ...]:
        """``(from, to, reason)`` of every stretch the trace cannot answer for (an open
        stall ends at ``inf``)."""
        with self._lock:
            return self._gaps_locked()

    def _gaps_locked(self) -> tuple[tuple[float, float, str], ...]:
        open_ = [(self._stall_from, math.inf, STALLED)] if self._stall_from is not None else []
        return tuple(self._gaps) + tuple(open_)

    def gap_in(self, t0: float, t1: float) -> str | None:
        """The reason ``[t0, t1]`` overlaps a gap of the trace, or None."""
        with self._lock:
            return next((why for a, b, why in self._gaps_locked() if a < t1 and b > t0), None)

    def check_window(self, t0: float, t1: float) -> None:
        """Raise the :class:`EnergyMonitorError` of a gap that ``[t0, t1]`` overlaps."""
        why = self.gap_in(t0, t1)
        if why is not None:
            raise _GAP_ERRORS[why](
                f"the energy of [{t0:.6f}, {t1:.6f}] s on {self.device.info().label()} is unknown: {why}")

    def wait_covered(self, t: float, timeout_s: float = 1.0) -> None:
        """Block until a sample at or after ``t`` exists (the counter updated after ``t``).

        NVML's counter updates every ~100 ms (A100), so a window that just ended
        is answerable only after the next update. Raises at once for a stalled or
        failing counter, and on timeout, naming why.
        """
        if self._thread is None and self._virtual is not None:
            # Virtual time moves only when slept on: the device waits (idles) for its counter's next
            # update, as a host would wait on a real GPU, up to a few update periods.
            limit = self._virtual.now() + max(1.0, 5 * (self.counter_period_s or _STEPPED_COUNTER_PERIOD_S))
            while self.covered_until() is None or self.covered_until() < t - self.edge_tolerance_s:
                if self._stall_from is not None or self._virtual.now() >= limit:
                    break
                self._virtual.sleep(self.poll_interval_s)
        if self._thread is None:
            with self._lock:
                if self._times and self._times[-1] >= t - self.edge_tolerance_s:
                    return
            raise EnergyMonitorError(
                f"energy trace ends at {self.covered_until()} s, before {t:.6f} s, and the monitor is not "
                "running: start() it before the window (or call sample())"
            )
        deadline = time.monotonic() + timeout_s
        label = self.device.info().label()
        with self._changed:
            while not self._times or self._times[-1] < t:
                if self._stall_from is not None:
                    raise CounterStalledError(f"the energy counter of {label} stalled at {self._stall_from:.6f} s")
                if self._failing is not None:
                    raise CounterReadError(f"reading the energy counter of {label} fails: {self._failing!r}")
                left = deadline - time.monotonic()
                if left <= 0:
                    newest = self._times[-1] if self._times else None
                    raise EnergyMonitorError(
                        f"the energy counter of {label} did not change after {t:.6f} s "
                        f"within {timeout_s:g} s (newest sample at {newest}): is the GPU's counter frozen?"
                    )
                self._changed.wait(left)

    def trim(self, before_t: float) -> None:
        """Forget samples before ``before_t``, keeping one at or before it so windows from ``before_t`` work."""
        with self._lock:
            i = bisect.bisect_right(self._times, before_t) - 1
            if i > 0:
                del self._times[:i]
                del self._energies_mj[:i]
                del self._brackets[:i]
            self._gaps = [g for g in self._gaps if g[1] > before_t]

    # -- queries -------------------------------------------------------------------------
    def energy_mj_at(self, t: float) -> float:
        """Cumulative energy at ``t`` (mJ), interpolated linearly between samples."""
        with self._lock:
            return self._interpolate(t)

    def energy_j(self, t0: float, t1: float) -> float:
        """Energy in joules between ``t0`` and ``t1`` (``t0 <= t1``) on the monitor's clock;
        raises an :class:`EnergyMonitorError` if the window overlaps a gap of the trace."""
        if t1 < t0:
            raise ValueError(f"window ends before it starts: [{t0}, {t1}]")
        self.check_window(t0, t1)
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


