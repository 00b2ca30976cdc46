"""The start-up profiler's decisions, driven by real training iterations.

EnvPipe profiled 6 iterations per clock over every candidate, measured each
whole iteration's energy, and kept only per-stage argmin clocks (envpipe.md
§5). Here, as in Perseus/Merak (perseus.md §5.4), every forward and backward
unit gets its own time and energy (energy from the background counter poller,
:mod:`megatron_envpipe.gpu.energy`), so the result is a full Perseus profile
``(stage, instruction, clock) -> (time, energy)`` that any planner can use.

:class:`ClockSweep` is pure bookkeeping: all stages lock the same clock each
iteration (lockstep, highest first), feed back their unit samples, and the sweep
stops early once it is clearly below the energy valley (merak-zeus rule).
Deterministic, so every rank fed the same gathered samples decides the same.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from megatron_envpipe.core.profile import Profile, ProfilePoint, instruction_of
from megatron_envpipe.core.vocabulary import INSTRUCTIONS
from megatron_envpipe.gpu.attribution import InseparablePowersError, attribute_windows, fit_window_powers
from megatron_envpipe.gpu.energy import EnergyMonitor

# EnvPipe's profiler: PROFILE_ITER_LIMIT 5 -> 6 iterations per clock (envpipe.md §5).
ENVPIPE_ITERATIONS_PER_CLOCK = 6


# -- samples -----------------------------------------------------------------------------
@dataclass(frozen=True)
class UnitSample:
    """One forward (``F``) or backward (``B``) unit: device seconds and joules."""

    kind: str
    time_s: float
    energy_j: float


@dataclass(frozen=True)
class BlockingSample:
    """A window in which the GPU waited for a P2P transfer (no compute)."""

    time_s: float
    energy_j: float


@dataclass(frozen=True)
class StageSamples:
    """One stage's samples of one iteration."""

    units: tuple[UnitSample, ...]
    blocking: tuple[BlockingSample, ...] = ()

    @classmethod
    def of(
        cls,
        units: Iterable[UnitSample | tuple[str, float, float]],
        blocking: Iterable[BlockingSample | tuple[float, float]] = (),
    ) -> "StageSamples":
        """From dataclasses or plain ``(kind, time_s, energy_j)`` / ``(time_s, energy_j)`` tuples."""
        return cls(
            tuple(u if isinstance(u, UnitSample) else UnitSample(*u) for u in units),
            tuple(b if isinstance(b, BlockingSample) else BlockingSample(*b) for b in blocking),
        )


class ProfileRow(NamedTuple):
    """A Perseus CSV row."""

    stage: int
    instruction: str
    freq_mhz: int
    time_s: float
    energy_j: float


@dataclass(frozen=True)
class UnitWindow:
    """A unit's compute window on the monitor's clock (after CUDA synchronisation)."""

    kind: str
    start_s: float
    end_s: float


# -- attribution -------------------------------------------------------------------------
def attribute_units(
    monitor: EnergyMonitor,
    windows: Sequence[UnitWindow | tuple[str, float, float]],
    time_scale: float = 1.0,
    wait_timeout_s: float = 1.0,
) -> list[UnitSample]:
    """Time and energy of each unit window from the monitor's interpolated trace.

    ``time_scale`` converts wall to device seconds (a :class:`SimulatedGpu`'s
    ``time_scale``; 1 on real GPUs). Energy needs no scaling.
    """
    ws = [w if isinstance(w, UnitWindow) else UnitWindow(*w) for w in windows]
    energies = attribute_windows(monitor, [(w.start_s, w.end_s) for w in ws], wait_timeout_s)
    return [UnitSample(w.kind, (w.end_s - w.start_s) / time_scale, e) for w, e in zip(ws, energies)]


def attribute_blocking(
    monitor: EnergyMonitor,
    windows: Sequence[tuple[float, float]],
    time_scale: float = 1.0,
    min_time_s: float = 0.0,
    wait_timeout_s: float = 1.0,
) -> list[BlockingSample]:
    """Blocking windows at least ``min_time_s`` wall seconds long.

    Short windows are dominated by interpolation error at their edges (compute
    power on both sides), so keep ones several counter periods long (NVML: ~10 ms).
    """
    kept = [(t0, t1) for t0, t1 in windows if t1 - t0 >= min_time_s and t1 > t0]
    energies = attribute_windows(monitor, kept, wait_timeout_s)
    return [BlockingSample((t1 - t0) / time_scale, e) for (t0, t1), e in zip(kept, energies)]


ATTRIBUTION_METHODS = ("regress", "interpolate")
_BLOCKING = "blocking"  # label of P2P blocking windows in the power fit


def stage_samples(
    monitor: EnergyMonitor,
    units: Sequence[UnitWindow | tuple[str, float, float]],
    blocking: Sequence[tuple[float, float]] = (),
    time_scale: float = 1.0,
    min_blocking_s: float = 0.0,
    wait_timeout_s: float = 1.0,
    method: str = "regress",
) -> StageSamples:
    """One stage's :class:`StageSamples` of one iteration, from its windows.

    ``method="interpolate"``: each window's energy from the interpolated trace
    (Perseus/Merak; biased towards the neighbours' power where a window's edges
    fall between counter samples). ``"regress"`` (default): one power per kind
    (F, B, blocking, the rest) fitted to all counter increments of the
    iteration (:func:`~megatron_envpipe.gpu.attribution.fit_window_powers`), exact for a
    constant power per kind, which holds within a profiling iteration (one
    clock); falls back to interpolation if the kinds cannot be separated.
    """
    if method not in ATTRIBUTION_METHODS:
        raise ValueError(f"method {method!r}: choose one of {', '.join(ATTRIBUTION_METHODS)}")
    ws = [w if isinstance(w, UnitWindow) else UnitWindow(*w) for w in units]
    kept = [(t0, t1) for t0, t1 in blocking if t1 > t0 and t1 - t0 >= min_blocking_s]
    if method == "regress":
        labelled = [(w.kind, w.start_s, w.end_s) for w in ws]
        # All blocking windows (not only the long ones) get their own label, so
        # their power does not leak into "the rest".
        labelled += [(_BLOCKING, t0, t1) for t0, t1 in blocking if t1 > t0]
        try:
            powers = fit_window_powers(monitor, labelled, wait_timeout_s=wait_timeout_s)
        except InseparablePowersError:
            powers = {}
        needed = {w.kind for w in ws} | ({_BLOCKING} if kept else set())
        # A label the fit could not see, or a negative/absurd power (noise on a label
        # with little time), falls back to interpolation for this iteration.
        if all(math.isfinite(powers.get(k, math.nan)) and powers[k] >= 0 for k in needed):
            return StageSamples(
                tuple(
                    UnitSample(w.kind, (w.end_s - w.start_s) / time_scale, powers[w.kind] * (w.end_s - w.start_s))
                    for w in ws
                ),
                tuple(BlockingSample((t1 - t0) / time_scale, powers[_BLOCKING] * (t1 - t0)) for t0, t1 in kept),
            )
    return StageSamples(
        tuple(attribute_units(monitor, ws, time_scale, wait_timeout_s)),
        tuple(attribute_blocking(monitor, kept, time_scale, 0.0, wait_timeout_s)),
    )


# -- candidates and statistics ---------------------------------------------------------
def sweep_candidates(supported_mhz: Iterable[int], step_mhz: float, min_mhz: int | None = None) -> tuple[int, ...]:
    """Clocks to profile, fastest first: the supported clock nearest each ``max - k*step``.

    The true maximum is always first (never EnvPipe's ``% 90`` filter, which made
    A100's "maximum" 1350 MHz). Ladders off the grid (V100's 7.5 MHz) snap to
    the nearest supported clock.
    """
    supported = sorted({int(f) for f in supported_mhz}, reverse=True)
    if not supported:
        raise ValueError("no supported clocks to sweep")
    if not step_mhz > 0:
        raise ValueError(f"step_mhz must be > 0, got {step_mhz}")
    floor = supported[-1] if min_mhz is None else min_mhz
    top = supported[0]
    chosen: list[int] = []
    k = 0
    while True:
        target = top - k * step_mhz
        if target < floor - step_mhz / 2:
            break
        nearest = min(supported, key=lambda f: (abs(f - target), -f))
        if nearest >= floor and nearest not in chosen:
            chosen.append(nearest)
        k += 1
    return tuple(sorted(chosen, reverse=True))


def robust_mean(values: Sequence[float], trim_fraction: float = 0.2) -> float:
    """Mean after dropping ``floor(n * trim_fraction)`` values at each end.

    Drops the odd unit out (the first micro-batch's data loading, the last
    backward's gradient all-reduce, a clock-switch transient) without needing
    many samples.
    """
    if not values:
        raise ValueError("no values")
    ordered = sorted(values)
    k = int(math.floor(len(ordered) * trim_fraction))
    kept = ordered[k : len(ordered) - k] or ordered
    return math.fsum(kept) / len(kept)


def blocking_power_w(windows: Sequence[BlockingSample]) -> float | None:
    """P2P blocking power from blocking windows, free of the edge bias when it can be.

    Interpolating the counter across a window's edges, where power jumps from
    compute to blocking and back, adds about the same energy to every window
    regardless of its length (jump x sample spacing / 3). With windows of
    varied lengths, the slope of a least-squares line ``E = P t + c`` is P
    without that bias; otherwise (or if the fit is not sane) total energy over
    total time.
    """
    ws = [w for w in windows if w.time_s > 0]
    if not ws:
        return None
    total_t = math.fsum(w.time_s for w in ws)
    ratio = math.fsum(w.energy_j for w in ws) / total_t
    n = len(ws)
    if n >= 3:
        mean_t = total_t / n
        mean_e = math.fsum(w.energy_j for w in ws) / n
        var_t = math.fsum((w.time_s - mean_t) ** 2 for w in ws) / n
        if var_t > (0.25 * mean_t) ** 2:  # lengths spread enough for a slope
            cov = math.fsum((w.time_s - mean_t) * (w.energy_j - mean_e) for w in ws) / n
            slope = cov / var_t
            if 0 < slope <= ratio * 1.5:
                return slope
    return ratio


# -- the sweep -------------------------------------------------------------------------
@dataclass(frozen=True)
class ClockResult:
    """What one clock's iterations gave: robust per-(stage, instruction) rows."""

    freq_mhz: int
    iterations: int
    rows: tuple[ProfileRow, ...]

    def energy_j(self) -> float:
        """Per-micro-batch F+B energy summed over stages."""
        return math.fsum(r.energy_j for r in self.rows)

    def time_s(self) -> float:
        return math.fsum(r.time_s for r in self.rows)


class ClockSweep:
    """Lockstep clock sweep from the maximum down, with early stop below the valley.

    Per iteration: lock :meth:`next_clock` on every stage, run the iteration,
    then :meth:`record` every stage's samples. The first ``warmup_iterations``
    (at the maximum clock) are discarded; then each candidate runs
    ``iterations_per_clock`` iterations. After each clock, the stop metric
    ``sum over stages of E_F + E_B - P_p2p * (t_F + t_B)`` is computed; the
    sweep stops once it has risen for ``stop_after_rising`` consecutive clocks
    (``0``: never stop early) from a valley that lies more than
    ``valley_margin`` (relative to the maximum clock's value) below the maximum
    clock's value, ending more than that margin above the valley.

    The P2P term (``p2p_aware``): at fixed iteration time a slower unit turns
    blocking time into busy time, so the clock that matters is the valley of
    ``E - P_p2p t`` (what the planner minimises, README), which lies at or below
    the raw-energy valley; stopping on raw energy could cut it off (on the A40
    GPT-3 profile raw energy bottoms at 945 MHz, the P2P-aware metric at 870).
    ``p2p_power_w`` fixes P_p2p; otherwise the measured blocking power is used.

    An iteration whose samples are missing on some stage (``None``: its energy
    was not measured, or its clock not held) counts as used but not as
    measured: the clock is repeated. After ``max_unmeasured`` such iterations
    in a row the sweep stops with what it measured so far (possibly nothing:
    then :meth:`profile` raises and the caller plans without one).
    """

    def __init__(
        self,
        candidates_mhz: Sequence[int],
        iterations_per_clock: int = 2,
        warmup_iterations: int = 1,
        stop_after_rising: int = 3,
        *,
        trim_fraction: float = 0.2,
        p2p_aware: bool = True,
        p2p_power_w: float | None = None,
        valley_margin: float = 0.01,
        max_unmeasured: int = 3,
    ) -> None:
        cands = tuple(int(f) for f in candidates_mhz)
        if not cands:
            raise ValueError("ClockSweep needs at least one candidate clock")
        if list(cands) != sorted(set(cands), reverse=True):
            raise ValueError(f"candidates must be distinct and fastest first, got {list(cands)}")
        if iterations_per_clock < 1:
            raise ValueError(f"iterations_per_clock must be >= 1, got {iterations_per_clock}")
        if warmup_iterations < 0 or stop_after_rising < 0:
            raise ValueError("warmup_iterations and stop_after_rising must be >= 0")
        if not 0 <= trim_fraction < 0.5:
            raise ValueError(f"trim_fraction must be in [0, 0.5), got {trim_fraction}")
        if max_unmeasured < 1:
            raise ValueError(f"max_unmeasured must be >= 1, got {max_unmeasured}")
        if valley_margin < 0:
            raise ValueError(f"valley_margin must be >= 0, got {valley_margin}")
        if p2p_power_w is not None and p2p_power_w < 0:
            raise ValueError(f"p2p_power_w must be >= 0, got {p2p_power_w}")
        self.candidates_mhz = cands
        self.iterations_per_clock = iterations_per_clock
        self.warmup_iterations = warmup_iterations
        self.stop_after_rising = stop_after_rising
        self.trim_fraction = trim_fraction
        self.p2p_aware = p2p_aware
        self.valley_margin = valley_margin
        self.max_unmeasured = max_unmeasured
        self.unmeasured_iterations = 0
        self._unmeasured_in_a_row = 0
        self._p2p_given = p2p_power_w
        self.iterations_used = 0
        self.results: list[ClockResult] = []
        self.stop_reason = ""
        self._index = 0
        self._num_stages: int | None = None
        self._pending: list[tuple[StageSamples, ...]] = []
        self._blocking: list[BlockingSample] = []

    # -- driving ---------------------------------------------------------------------------
    @property
    def done(self) -> bool:
        return self._index >= len(self.candidates_mhz) or bool(self.stop_reason)

    @property
    def stopped_early(self) -> bool:
        return self.done and len(self.results) < len(self.candidates_mhz)

    @property
    def in_warmup(self) -> bool:
        return self.iterations_used < self.warmup_iterations

    def next_clock(self) -> int | None:
        """The clock every stage locks for the next iteration; None when done."""
        if self.done:
            return None
        return self.candidates_mhz[0] if self.in_warmup else self.candidates_mhz[self._index]

    def record(self, freq_mhz: int,
               stage_samples: Sequence[StageSamples | tuple[Sequence, Sequence] | None]) -> None:
        """One iteration's samples, one entry per stage (stage 0 first): a
        :class:`StageSamples`, a ``(units, blocking)`` pair of plain tuples, or
        None for a stage whose samples were not measured."""
        expected = self.next_clock()
        if expected is None:
            raise RuntimeError("the clock sweep is done; nothing more to record")
        if int(freq_mhz) != expected:
            raise ValueError(f"recorded an iteration at {freq_mhz} MHz, but the sweep asked for {expected} MHz")
        if not stage_samples:
            raise ValueError("no stages in the samples")
        if self._num_stages is not None and len(stage_samples) != self._num_stages:
            raise ValueError(f"got samples of {len(stage_samples)} stages, earlier iterations had {self._num_stages}")
        if any(s is None for s in stage_samples):
            self._record_unmeasured(int(freq_mhz))
            return
        samples = tuple(s if isinstance(s, StageSamples) else StageSamples.of(*s) for s in stage_samples)
        for stage, s in enumerate(samples):
            for u in s.units:
                instruction_of(u.kind)  # raises on a bad kind
                if not (u.time_s > 0 and math.isfinite(u.time_s) and u.energy_j >= 0 and math.isfinite(u.energy_j)):
                    raise ValueError(f"stage {stage}: invalid unit sample {u}")
        self._num_stages = len(samples)
        was_warmup = self.in_warmup
        self.iterations_used += 1
        self._unmeasured_in_a_row = 0
        if was_warmup:
            return
        self._pending.append(samples)
        self._blocking.extend(b for s in samples for b in s.blocking)
        if len(self._pending) >= self.iterations_per_clock:
            self._finish_clock()

    def _record_unmeasured(self, freq_mhz: int) -> None:
        was_warmup = self.in_warmup
        self.iterations_used += 1
        if was_warmup:  # warm-up samples are discarded anyway
            return
        self.unmeasured_iterations += 1
        self._unmeasured_in_a_row += 1
        if self._unmeasured_in_a_row >= self.max_unmeasured:
            self._pending = []
            self.stop_reason = (
                f"stopped: {self._unmeasured_in_a_row} iterations in a row at {freq_mhz} MHz were not measured "
                f"on every stage; keeping the {len(self.results)} clock(s) measured before"
            )

    def _finish_clock(self) -> None:
        freq = self.candidates_mhz[self._index]
        rows = []
        for stage in range(self._num_stages or 0):
            for kind, instruction in (("F", "forward"), ("B", "backward")):
                units = [u for it in self._pending for u in it[stage].units if u.kind == kind]
                if not units:
                    raise ValueError(f"no {instruction} samples for stage {stage} at {freq} MHz")
                rows.append(
                    ProfileRow(
                        stage, instruction, freq,
                        robust_mean([u.time_s for u in units], self.trim_fraction),
                        robust_mean([u.energy_j for u in units], self.trim_fraction),
                    )
                )
        self.results.append(ClockResult(freq, len(self._pending), tuple(rows)))
        self._pending = []
        self._index += 1
        if self._should_stop():
            tail = -self.stop_after_rising - 1
            trail = ", ".join(f"{r.freq_mhz}: {m:.4g} J" for r, m in zip(self.results[tail:], self.metrics_j()[tail:]))
            self.stop_reason = (
                f"stopped below the energy valley: the stop metric rose for {self.stop_after_rising} "
                f"consecutive clocks after its minimum at {self.valley_clock_mhz()} MHz ({trail})"
            )
        elif self._index >= len(self.candidates_mhz):
            self.stop_reason = f"swept all {len(self.candidates_mhz)} candidate clocks"

    def _should_stop(self) -> bool:
        n = self.stop_after_rising
        metrics = self.metrics_j()
        if n == 0 or len(metrics) < n + 1:
            return False
        rising = all(metrics[-i] > metrics[-i - 1] for i in range(1, n + 1))
        # A real valley: clearly below the maximum clock's value (near f_max the
        # metric can wobble up for a few clocks before falling, as on A40), and
        # clearly left behind, so noise alone does not end the sweep.
        margin = self.valley_margin * abs(metrics[0])
        lowest = min(metrics)
        return rising and lowest < metrics[0] - margin and metrics[-1] > lowest + margin

    # -- results ---------------------------------------------------------------------------
    def stop_p2p_power_w(self) -> float:
        """P_p2p used by the stop metric: given, measured, or 0."""
        if not self.p2p_aware:
            return 0.0
        if self._p2p_given is not None:
            return self._p2p_given
        return self.p2p_power_w() or 0.0

    def metrics_j(self) -> list[float]:
        """Stop metric per measured clock (fastest first), with the current P_p2p."""
        p = self.stop_p2p_power_w()
        return [r.energy_j() - p * r.time_s() for r in self.results]

    def valley_clock_mhz(self) -> int | None:
        """The measured clock with the lowest stop metric (ties: the faster)."""
        metrics = self.metrics_j()
        if not metrics:
            return None
        best = min(range(len(metrics)), key=lambda i: (metrics[i], i))
        return self.results[best].freq_mhz

    def p2p_power_w(self) -> float | None:
        """Measured P2P blocking power (None: no blocking windows recorded); see :func:`blocking_power_w`."""
        return blocking_power_w(self._blocking)

    def measured_clocks_mhz(self) -> tuple[int, ...]:
        return tuple(r.freq_mhz for r in self.results)

    def rows(self) -> list[ProfileRow]:
        """Perseus rows of every measured clock, by stage, instruction, clock (fastest first)."""
        order = {ins: i for i, ins in enumerate(INSTRUCTIONS)}
        rows = [row for r in self.results for row in r.rows]
        return sorted(rows, key=lambda r: (r.stage, order[r.instruction], -r.freq_mhz))

    def profile(self) -> Profile:
        if not self.results:
            raise ValueError("no clock has been measured yet")
        points: dict[tuple[int, str], list[ProfilePoint]] = {}
        for row in self.rows():
            point = ProfilePoint(row.freq_mhz, row.time_s, row.energy_j)
            points.setdefault((row.stage, row.instruction), []).append(point)
        source = f"<start-up profiler: {len(self.results)} clocks, {self.iterations_used} iterations>"
        return Profile(points, source=source)

    def envpipe_iterations(self) -> int:
        """What EnvPipe's profiler would spend on the same candidates (6 per clock)."""
        return ENVPIPE_ITERATIONS_PER_CLOCK * len(self.candidates_mhz)

    def summary(self) -> str:
        measured = self.measured_clocks_mhz()
        span = f"{measured[0]}..{measured[-1]} MHz" if measured else "none"
        p2p = self.p2p_power_w()
        return (
            f"start-up profiler: {len(measured)}/{len(self.candidates_mhz)} clocks ({span}) in "
            f"{self.iterations_used} iterations (EnvPipe: {self.envpipe_iterations()}); "
            f"valley {self.valley_clock_mhz()} MHz; P2P power "
            f"{'not measured' if p2p is None else f'{p2p:.1f} W'}; "
            + (f"{self.unmeasured_iterations} iteration(s) unmeasured; " if self.unmeasured_iterations else "")
            + (self.stop_reason or "running")
        )
