"""The start-up profiler's decisions, driven by real training iterations.

EnvPipe profiled 6 iterations per clock over every candidate, measured each
whole iteration's energy, and kept only per-stage argmin clocks (envpipe.md
§5). Here, as in Perseus/Merak (perseus.md §5.4), every forward and backward
unit gets its own time and energy (energy from the background counter poller,
:mod:`megatron_envpipe.gpu.energy.monitor`), so the result is a full Perseus profile
``(stage, instruction, clock) -> (time, energy)`` that any planner can use.

:class:`ClockSweep` is pure bookkeeping: all stages lock the same clock each
iteration (lockstep, highest first), feed back their unit samples, and the sweep
stops early once it is clearly below the energy valley (merak-zeus rule). It
spends one iteration per clock once two iterations at one clock have agreed
(the per-iteration regression of :mod:`megatron_envpipe.gpu.profiler.attribution` is
then as good as their mean), and fills the gaps next to the valley with a few
more clocks, within a third of EnvPipe's cost on the same clocks.
Deterministic, so every rank fed the same gathered samples decides the same.
Units with micro-batch sizes (variable lengths): :mod:`megatron_envpipe.gpu.profiler.sweep_lengths`.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence

from megatron_envpipe.core.length_costs import MicrobatchSize
from megatron_envpipe.core.profile import instruction_of
from megatron_envpipe.errors import InvalidValueError, OutOfOrderError
from megatron_envpipe.gpu.profiler.attribution import (
    ATTRIBUTION_METHODS,
    BlockingSample,
    StageSamples,
    UnitSample,
    UnitWindow,
    attribute_blocking,
    attribute_units,
    stage_samples,
)
from megatron_envpipe.gpu.profiler.heat_drift import HeatDrift
from megatron_envpipe.gpu.profiler.sweep_clocks import refinement_clocks, sweep_candidates
from megatron_envpipe.gpu.profiler.sweep_estimates import stage_estimates
from megatron_envpipe.gpu.profiler.sweep_lengths import rows_at, size_means
from megatron_envpipe.gpu.profiler.sweep_readout import ENVPIPE_ITERATIONS_PER_CLOCK, SweepReadout
from megatron_envpipe.gpu.profiler.sweep_results import ClockResult, ProfileRow
from megatron_envpipe.gpu.profiler.sweep_stats import blocking_power_w, robust_mean, robust_mean_se

__all__ = [
    "ATTRIBUTION_METHODS", "BlockingSample", "ClockResult", "ClockSweep", "ProfileRow", "StageSamples", "UnitSample",
    "UnitWindow", "attribute_blocking", "attribute_units", "blocking_power_w", "refinement_clocks", "robust_mean",
    "stage_samples", "startup_sweep", "sweep_candidates", "ENVPIPE_ITERATIONS_PER_CLOCK",
]

log = logging.getLogger("megatron_envpipe")

# The profiler's cost goal (issue 13): at most this share of EnvPipe's iterations over the same clocks.
# Refinement clocks are only measured while the total stays within it.
_COST_SHARE_OF_ENVPIPE = 1 / 3
# Clocks added near the valley by default: on the A40 profiles, 4 at 30 MHz fill the two 90 MHz gaps
# next to the valley and bring optimal plans within 0.3 points of plans from every clock (bench/profiler_cost.py).
_REFINE_CLOCKS = 4


# -- candidates ---------------------------------------------------------------------
def startup_sweep(
    supported_mhz: Sequence[int],
    step_mhz: float,
    refine_step_mhz: float,
    iterations_per_clock: int = 2,
    p2p_power_w: float | None = None,
) -> "ClockSweep":
    """The sweep training runs at start-up (the runtime's, and the benchmark's): every ``step_mhz``
    down from the true maximum, refined near the valley at ``refine_step_mhz`` (the reconfiguration step).

    ``iterations_per_clock=1`` asks for the shortest profile: one iteration per coarse clock, no
    agreement check and no refinement.
    """
    return ClockSweep(sweep_candidates(supported_mhz, step_mhz), iterations_per_clock=iterations_per_clock,
                      p2p_power_w=p2p_power_w, supported_mhz=supported_mhz, refine_step_mhz=refine_step_mhz,
                      refine_clocks=_REFINE_CLOCKS if iterations_per_clock > 1 else 0)


def _mean_or_none(values: Sequence[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return math.fsum(known) / len(known) if known else None


# -- the sweep -------------------------------------------------------------------------
class ClockSweep(SweepReadout):
    """Lockstep clock sweep from the maximum down, with early stop below the valley,
    then a few clocks that refine the sweep near the valley.

    Per iteration: lock :meth:`next_clock` on every stage, run the iteration,
    then :meth:`record` every stage's samples. The first ``warmup_iterations``
    (at the maximum clock) are discarded.

    **Iterations per clock.** A stage is *unsteady* until two iterations at one
    clock agree: every estimate (time per kind; energy of a forward plus a
    backward where the power fit gives their covariance, else per kind) within
    ``stable_tolerance`` (relative) plus three standard errors, and the two
    iterations' mean within the tolerance. The split between forwards and
    backwards is not judged here: on units shorter than the counter's period
    more iterations at one clock hardly sharpen it, the stage's pooled power
    ratio does (gpu/profiler/power_ratio.py). Until steady, a clock runs
    ``iterations_per_clock`` iterations, up to ``max_iterations_per_clock``
    while they disagree, and never more than leaves one iteration for each
    coarse clock still to come within :meth:`budget_iterations`. Once every
    stage is steady (``adaptive``), each clock runs one iteration; no later
    check second-guesses a steady stage (real profiles are not monotone in
    time). ``iterations_per_clock=1`` always runs one.

    **Early stop.** After each coarse clock the stop metric ``sum over stages
    of E_F + E_B - P_p2p * (t_F + t_B)`` is computed; the coarse sweep ends once
    it has risen for ``stop_after_rising`` consecutive clocks (``0``: never
    early) from a valley that lies more than ``valley_margin`` (relative to the
    maximum clock's value) below the maximum clock's value, ending more than
    that margin above the valley. The P2P term (``p2p_aware``): at fixed
    iteration time a slower unit turns blocking time into busy time, so the
    clock that matters is the valley of ``E - P_p2p t`` (what the planner
    minimises), which lies at or below the raw-energy valley (A40 GPT-3: 945
    raw, 870 MHz P2P-aware). ``p2p_power_w`` fixes P_p2p; otherwise the
    measured blocking power is used.

    **Refinement.** Given the GPU's ``supported_mhz``, up to ``refine_clocks``
    more clocks split the measured gaps next to the pipeline's and every
    stage's valley into ``refine_step_mhz`` steps (:func:`refinement_clocks`),
    one each, only while the total stays within a third of what EnvPipe's
    profiler spends on the coarse clocks. Every clock in the profile, coarse or
    refined, is measured on every stage: the planner never uses an
    interpolated one.

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
        adaptive: bool = True,
        stable_tolerance: float = 0.02,
        max_iterations_per_clock: int | None = None,
        supported_mhz: Sequence[int] = (),
        refine_step_mhz: float = 30.0,
        refine_clocks: int = _REFINE_CLOCKS,
    ) -> None:
        cands = tuple(int(f) for f in candidates_mhz)
        if not cands:
            raise InvalidValueError("ClockSweep needs at least one candidate clock")
        if list(cands) != sorted(set(cands), reverse=True):
            raise InvalidValueError(f"candidates must be distinct and fastest first, got {list(cands)}")
        if iterations_per_clock < 1:
            raise InvalidValueError(f"iterations_per_clock must be >= 1, got {iterations_per_clock}")
        cap = 2 * iterations_per_clock if max_iterations_per_clock is None else max_iterations_per_clock
        if cap < iterations_per_clock:
            raise InvalidValueError(f"max_iterations_per_clock ({cap}) must be >= iterations_per_clock "
                             f"({iterations_per_clock})")
        if warmup_iterations < 0 or stop_after_rising < 0:
            raise InvalidValueError("warmup_iterations and stop_after_rising must be >= 0")
        if not 0 <= trim_fraction < 0.5:
            raise InvalidValueError(f"trim_fraction must be in [0, 0.5), got {trim_fraction}")
        if max_unmeasured < 1:
            raise InvalidValueError(f"max_unmeasured must be >= 1, got {max_unmeasured}")
        if not 0 <= valley_margin < math.inf:
            raise InvalidValueError(f"valley_margin must be a finite number >= 0, got {valley_margin}")
        if p2p_power_w is not None and not 0 <= p2p_power_w < math.inf:
            raise InvalidValueError(f"p2p_power_w must be a finite number >= 0, got {p2p_power_w}")
        if not 0 < stable_tolerance < 1:
            raise InvalidValueError(f"stable_tolerance must be in (0, 1), got {stable_tolerance}")
        if not 0 < refine_step_mhz < math.inf:
            raise InvalidValueError(f"refine_step_mhz must be a finite number > 0, got {refine_step_mhz}")
        if refine_clocks < 0:
            raise InvalidValueError(f"refine_clocks must be >= 0, got {refine_clocks}")
        self.candidates_mhz = cands
        self.iterations_per_clock = iterations_per_clock
        self.max_iterations_per_clock = cap
        self.warmup_iterations = warmup_iterations
        self.stop_after_rising = stop_after_rising
        self.trim_fraction = trim_fraction
        self.p2p_aware = p2p_aware
        self.valley_margin = valley_margin
        self.max_unmeasured = max_unmeasured
        self.adaptive = adaptive and iterations_per_clock > 1
        self.stable_tolerance = stable_tolerance
        self.supported_mhz = tuple(sorted({int(f) for f in supported_mhz}, reverse=True))
        self.refine_step_mhz = refine_step_mhz
        self.refine_clocks = refine_clocks
        self.unmeasured_iterations = 0
        self._unmeasured_in_a_row = 0
        self._p2p_given = p2p_power_w
        self.iterations_used = 0
        self.results: list[ClockResult] = []
        self.stop_reason = ""
        self.coarse_stop_reason = ""
        self.unsteady_events: list[str] = []  # why a stage needed more than one iteration at a clock
        self._queue: list[int] = list(cands)  # clocks to measure, in order; refinement is appended
        self._index = 0
        self._num_stages: int | None = None
        self._steady: list[bool] = []
        self._pending: list[tuple[StageSamples, ...]] = []
        self._blocking: list[BlockingSample] = []
        self._updates: list[int] = []  # counter increments each stage's iteration fit saw (stepped counters)
        self._heat: list[list[tuple[int, float, float | None]]] = []  # per stage: (iteration, time, blocking W)
        self._drift_cache: tuple[int, tuple[HeatDrift | None, ...]] | None = None
        # Sized units: every clock's rows at this size (the first clock's largest); the length fit's outcome.
        self.reference_size: MicrobatchSize | None = None
        self.length_fit = ""
        self._sizes_seen = False  # some unit had a size

    # -- driving ---------------------------------------------------------------------------
    @property
    def done(self) -> bool:
        return bool(self.stop_reason)

    @property
    def stopped_early(self) -> bool:
        """The coarse sweep ended before its lowest candidate (below the valley, or unmeasured)."""
        return self.done and len(self.coarse_results()) < len(self.candidates_mhz)

    @property
    def in_warmup(self) -> bool:
        return self.iterations_used < self.warmup_iterations

    @property
    def refining(self) -> bool:
        """The coarse sweep is over; clocks now fill gaps near the valley."""
        return bool(self.coarse_stop_reason)

    def next_clock(self) -> int | None:
        """The clock every stage locks for the next iteration; None when done."""
        if self.done:
            return None
        return self.candidates_mhz[0] if self.in_warmup else self._queue[self._index]

    def record(self, freq_mhz: int,
               stage_samples: Sequence[StageSamples | tuple[Sequence, Sequence] | None]) -> None:
        """One iteration's samples, one entry per stage (stage 0 first): a
        :class:`StageSamples`, a ``(units, blocking)`` pair of plain tuples, or
        None for a stage whose samples were not measured."""
        expected = self.next_clock()
        if expected is None:
            raise OutOfOrderError("the clock sweep is done; nothing more to record")
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
            for kind in ("F", "B"):
                if not any(u.kind == kind for u in s.units):
                    raise ValueError(f"no {instruction_of(kind)} samples for stage {stage} at {freq_mhz} MHz")
        if self._num_stages is None:
            self._num_stages = len(samples)
            self._steady = [False] * len(samples)
            self._heat = [[] for _ in samples]
        was_warmup = self.in_warmup
        for stage, s in enumerate(samples if not was_warmup else ()):  # warm-up: discarded, edge effects
            blocked_s = math.fsum(b.time_s for b in s.blocking)
            if s.at_s is not None:  # a stage without P2P waits still gets the pipeline's drift, on its clock
                self._heat[stage].append((self.iterations_used, s.at_s, math.fsum(b.energy_j for b in s.blocking)
                                          / blocked_s if blocked_s > 0 else None))
        self.iterations_used += 1
        self._unmeasured_in_a_row = 0
        if was_warmup:
            return
        self._pending.append(samples)
        self._blocking.extend(b for s in samples for b in s.blocking)
        self._updates.extend(s.counter_updates for s in samples if s.counter_updates is not None)
        if self._clock_complete(int(freq_mhz)):
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
            self.stop_reason = self.coarse_stop_reason = (
                f"stopped: {self._unmeasured_in_a_row} iterations in a row at {freq_mhz} MHz were not measured "
                f"on every stage; keeping the {len(self.results)} clock(s) measured before"
            )

    # -- iterations per clock --------------------------------------------------------------
    def _disagreement(self, a: StageSamples, b: StageSamples) -> str:
        """Why two iterations' estimates of one stage are not steady ('' when they are)."""
        tol = self.stable_tolerance
        sizes = [u.size for u in (*a.units, *b.units)]
        reference = (self.reference_size or max(sizes)) if None not in sizes else None  # both sized: compare there
        combine = a.kind_powers is not None and b.kind_powers is not None
        ea, eb = (stage_estimates(x, reference, self.trim_fraction, combine) for x in (a, b))
        for key, (ma, sa) in ea.items():
            mb, sb = eb[key]
            mean = (abs(ma) + abs(mb)) / 2
            what = f"{'forward + backward' if key[0] == 'F+B' else instruction_of(key[0])} {key[1]}"
            if abs(ma - mb) > tol * mean + 3 * math.hypot(sa, sb):
                return f"{what} differs by {100 * abs(ma - mb) / mean:.2f} % between iterations"
            # What a third iteration could still improve: the two iterations' mean (short units on a
            # stepped counter give every single iteration a few % of error; their mean is what is kept).
            if 0.5 * math.hypot(sa, sb) > tol * mean:
                return (f"{what} varies by {100 * max(sa, sb) / mean:.2f} % (standard error) within an iteration, "
                        f"{50 * math.hypot(sa, sb) / mean:.2f} % over both")
        return ""

    def _clock_complete(self, freq_mhz: int) -> bool:
        """Whether every stage has what it needs at this clock (and mark stages steady or not)."""
        k = len(self._pending)
        if not self.adaptive:
            return k >= self.iterations_per_clock
        complete, unsteady = True, []
        for stage in range(self._num_stages or 0):
            if self._steady[stage]:
                continue
            if k < max(2, self.iterations_per_clock):
                complete = False
                continue
            why = self._disagreement(self._pending[-2][stage], self._pending[-1][stage])
            if not why:
                self._steady[stage] = True
            else:
                complete = complete and k >= self.max_iterations_per_clock
                unsteady.append((stage, why))
        out_of_budget = self._budget_left() <= 0
        if unsteady and (k >= self.max_iterations_per_clock or out_of_budget):
            cut = "" if k >= self.max_iterations_per_clock else \
                f" (the budget of {self.budget_iterations()} iterations leaves no more for it)"
            self.unsteady_events += [f"stage {stage} at {freq_mhz} MHz after {k} iterations{cut}: {why}"
                                     for stage, why in unsteady]
        return complete or k >= self.max_iterations_per_clock or out_of_budget

    def budget_iterations(self) -> int:
        """The most iterations the sweep may use: a third of EnvPipe's on the same coarse clocks, but
        never fewer than one per coarse clock after the warm-up."""
        share = math.floor(_COST_SHARE_OF_ENVPIPE * self.envpipe_iterations() + 1e-9)
        return max(share, self.warmup_iterations + len(self.candidates_mhz))

    def _budget_left(self) -> int:
        """Iterations left for repeating the current clock once every coarse clock still to come has one."""
        to_come = 0 if self.refining else len(self.candidates_mhz) - self._index - 1
        return self.budget_iterations() - self.iterations_used - to_come

    @property
    def steady(self) -> tuple[bool, ...]:
        """Per stage: whether one iteration per clock is enough for it now."""
        return tuple(self._steady)

    # -- clocks ----------------------------------------------------------------------------
    def _finish_clock(self) -> None:
        freq = self._queue[self._index]
        rows, ses, by_type = [], [], {}
        for stage in range(self._num_stages or 0):
            # Model chunks (Megatron's interleaved pipeline): one row per chunk, from that chunk's units.
            chunks = 1 + max(u.chunk for it in self._pending for u in it[stage].units)
            for kind, instruction in (("F", "forward"), ("B", "backward")):
                for chunk in range(chunks):
                    units = [u for it in self._pending for u in it[stage].units if u.kind == kind and u.chunk == chunk]
                    if not units:
                        raise ValueError(f"stage {stage} at {freq} MHz: no {instruction} samples of model chunk {chunk}")
                    by_type[(stage, chunk, instruction)] = units
                    energy, spread_se = robust_mean_se([u.energy_j for u in units], self.trim_fraction)
                    rows.append(ProfileRow(stage, instruction, freq,
                                           robust_mean([u.time_s for u in units], self.trim_fraction), energy, chunk))
                    # Units of one iteration share its fitted power (their errors move together): the
                    # attribution's error shrinks with iterations only, the units' spread with units.
                    fit_se = math.fsum(u.energy_se_j for u in units) / len(units) / math.sqrt(len(self._pending))
                    ses.append(math.hypot(fit_se, spread_se))
        at_s = tuple(_mean_or_none([it[s].at_s for it in self._pending]) for s in range(self._num_stages or 0))
        samples, averaged = (), ()
        self._sizes_seen |= any(u.size is not None for units in by_type.values() for u in units)
        if all(u.size is not None for units in by_type.values() for u in units):
            # Units of different sizes are never averaged into one row: rows at one size, every clock alike.
            samples = size_means(by_type, freq, self.trim_fraction)
            self.reference_size = self.reference_size or max(x.size for x in samples)
            at_ref = rows_at(samples, self.reference_size)
            if at_ref is not None:
                averaged = tuple(rows)
                rows = [r._replace(time_s=at_ref[(r.stage, r.chunk, r.instruction, freq)][0],
                                   energy_j=at_ref[(r.stage, r.chunk, r.instruction, freq)][1]) for r in rows]
        kind_powers = tuple(tuple(it[s].kind_powers for it in self._pending) for s in range(self._num_stages or 0))
        self.results.append(ClockResult(freq, len(self._pending), tuple(rows), refined=self.refining,
                                        energy_se_j=tuple(ses), at_s=at_s, samples=samples,
                                        averaged=averaged, kind_powers=kind_powers))
        self._pending = []
        self._index += 1
        if not self.refining:
            if self._should_stop():
                tail = -self.stop_after_rising - 1
                trail = ", ".join(f"{r.freq_mhz}: {m:.4g} J"
                                  for r, m in zip(self.results[tail:], self.metrics_j()[tail:]))
                self.coarse_stop_reason = (
                    f"stopped below the energy valley: the stop metric rose for {self.stop_after_rising} "
                    f"consecutive clocks after its minimum at {self.valley_clock_mhz()} MHz ({trail})"
                )
            elif self._index >= len(self.candidates_mhz):
                self.coarse_stop_reason = f"swept all {len(self.candidates_mhz)} candidate clocks"
            else:
                return
            self._queue = self._queue[: self._index] + list(self._refinement())
        self._trim_to_budget()
        if self._index >= len(self._queue):
            refined = len(self.refined_clocks_mhz())
            self.stop_reason = self.coarse_stop_reason + (
                f"; then refined {refined} clock(s) near the valley" if refined else "")

    def _refinement(self) -> tuple[int, ...]:
        if not self.supported_mhz or not self.refine_clocks:
            return ()
        p = self.stop_p2p_power_w()
        valleys = {self.valley_clock_mhz()}
        measured = self.measured_results()  # corrected once (ratio prior, heat drift), not once per stage
        for stage in range(self._num_stages or 0):
            valleys.add(min(measured, key=lambda r: (
                math.fsum(x.energy_j - p * x.time_s for x in r.rows if x.stage == stage), -r.freq_mhz)).freq_mhz)
        return refinement_clocks(self.measured_clocks_mhz(), valleys, self.supported_mhz, self.refine_step_mhz,
                                 self.refine_clocks)

    def _trim_to_budget(self) -> None:
        """Drop the refinement clocks the cost goal cannot afford (one iteration each when every stage is
        steady, else ``iterations_per_clock``)."""
        each = 1 if self.adaptive and all(self._steady) else self.iterations_per_clock
        left = self.budget_iterations() - self.iterations_used
        affordable = max(0, left // each)
        del self._queue[self._index + affordable:]

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
