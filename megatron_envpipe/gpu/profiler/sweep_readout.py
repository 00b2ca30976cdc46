"""What a clock sweep measured: the read side of :class:`~megatron_envpipe.gpu.profiler.sweep.ClockSweep`.

:class:`SweepReadout` turns the samples the sweep recorded into results (forward/backward ratio
prior, heat-drift correction), the valley, the profile, and the summary line; ClockSweep (the
driving side: which clock next, when to stop) inherits it and keeps the state it reads.
Split from gpu/profiler/sweep.py by job.
"""

from __future__ import annotations

import logging

from megatron_envpipe.core.profile import Profile, ProfilePoint
from megatron_envpipe.core.vocabulary import INSTRUCTIONS
from megatron_envpipe.gpu.profiler.attribution import (
    BlockingSample,
)
from megatron_envpipe.gpu.profiler.heat_drift import UNSEEN_HEAT_DRIFT, HeatDrift, fit_pipeline_heat_drift
from megatron_envpipe.gpu.profiler.sweep_corrections import with_heat_drift, with_ratio_prior
from megatron_envpipe.gpu.profiler.sweep_estimates import counter_updates_note
from megatron_envpipe.gpu.profiler.sweep_lengths import sized_profile
from megatron_envpipe.gpu.profiler.sweep_results import ClockResult, ProfileRow
from megatron_envpipe.gpu.profiler.sweep_stats import blocking_power_w

__all__ = ["ENVPIPE_ITERATIONS_PER_CLOCK", "SweepReadout"]

log = logging.getLogger("megatron_envpipe")

# EnvPipe's profiler: PROFILE_ITER_LIMIT 5 -> 6 iterations per clock (envpipe.md §5).
ENVPIPE_ITERATIONS_PER_CLOCK = 6


class SweepReadout:
    """Results of the sweep so far; the state is ClockSweep's (set in its ``__init__``)."""

    candidates_mhz: tuple[int, ...]
    p2p_aware: bool
    results: list[ClockResult]
    iterations_used: int
    unmeasured_iterations: int
    unsteady_events: list[str]
    stop_reason: str
    length_fit: str
    _p2p_given: float | None
    _num_stages: int | None
    _blocking: list[BlockingSample]
    _updates: list[int]
    _heat: list[list[tuple[int, float, float | None]]]
    _drift_cache: tuple[int, tuple[HeatDrift | None, ...]] | None
    _sizes_seen: bool

    def stop_p2p_power_w(self) -> float:
        """P_p2p used by the stop metric: given, measured, or 0."""
        if not self.p2p_aware:
            return 0.0
        if self._p2p_given is not None:
            return self._p2p_given
        return self.p2p_power_w() or 0.0

    def heat_drift(self) -> tuple[HeatDrift | None, ...]:
        """Per stage: the power drift its blocking windows showed as the GPU heated (None: none to
        correct); see :mod:`megatron_envpipe.gpu.profiler.heat_drift`."""
        key = sum(len(h) for h in self._heat)
        if self._drift_cache is None or self._drift_cache[0] != key:
            self._drift_cache = (key, fit_pipeline_heat_drift(self._heat))
        return self._drift_cache[1]

    def ratio_results(self) -> list[ClockResult]:
        """:attr:`results` with forwards and backwards told apart by each stage's pooled power ratio
        (:func:`~megatron_envpipe.gpu.profiler.sweep_corrections.with_ratio_prior`)."""
        return with_ratio_prior(self.results, self._num_stages or 0)

    def measured_results(self) -> list[ClockResult]:
        """:meth:`ratio_results` with each stage's energies brought to the hot state (divided by the
        fitted heat drift at the time they were measured); as measured where no drift was seen."""
        return with_heat_drift(self.ratio_results(), self.heat_drift())

    def row_uncertainties(self) -> dict[tuple[int, str, int, int], float]:
        """``(stage, instruction, MHz, chunk) -> standard error (J)`` of each row's energy: the
        attribution's (counter step and stamps, regression residual, after the forward/backward ratio
        prior), the units' spread and, where the heat drift was corrected, half the correction. Where no
        drift was seen, :meth:`heat_headroom` says how much a hot GPU may draw beyond the row."""
        return {(row.stage, row.instruction, row.freq_mhz, row.chunk): se
                for r in self.measured_results() for row, se in zip(r.rows, r.energy_se_j)}

    def heat_headroom(self) -> tuple[float, ...]:
        """Per stage: how much higher than its rows a hot GPU's energy may be (a fraction):
        :data:`~megatron_envpipe.gpu.profiler.heat_drift.UNSEEN_HEAT_DRIFT` where no drift was seen (the sweep may
        have run on a cold GPU), less the drift that was corrected where one was (a sweep shorter than the
        GPU's heating sees the drift's slope better than its size: 1.4 % fitted where the GPU started 2.9 %
        cold, over a 25 s sweep of a GPU heating with a 60 s time constant)."""
        return tuple(UNSEEN_HEAT_DRIFT if d is None else max(0.0, UNSEEN_HEAT_DRIFT - abs(d.amplitude))
                     for d in self.heat_drift())

    def coarse_results(self) -> list[ClockResult]:
        return [r for r in self.measured_results() if not r.refined]

    def metrics_j(self) -> list[float]:
        """Stop metric per coarse clock (fastest first), with the current P_p2p."""
        p = self.stop_p2p_power_w()
        return [r.energy_j() - p * r.time_s() for r in self.coarse_results()]

    def valley_clock_mhz(self) -> int | None:
        """The measured clock (coarse or refined) with the lowest stop metric (ties: the faster)."""
        if not self.results:
            return None
        p = self.stop_p2p_power_w()
        return min(self.measured_results(), key=lambda r: (r.energy_j() - p * r.time_s(), -r.freq_mhz)).freq_mhz

    def p2p_power_w(self) -> float | None:
        """Measured P2P blocking power (None: no blocking windows recorded); see :func:`blocking_power_w`."""
        return blocking_power_w(self._blocking)

    def measured_clocks_mhz(self) -> tuple[int, ...]:
        """Every measured clock, fastest first."""
        return tuple(sorted((r.freq_mhz for r in self.results), reverse=True))

    def refined_clocks_mhz(self) -> tuple[int, ...]:
        return tuple(sorted((r.freq_mhz for r in self.results if r.refined), reverse=True))

    def rows(self, averaged: bool = False) -> list[ProfileRow]:
        """Perseus rows of every measured clock, by stage, instruction, clock (fastest first);
        ``averaged``: with sizes, every size averaged into one row (the fixed-length rows)."""
        order = {ins: i for i, ins in enumerate(INSTRUCTIONS)}
        rows = [row for r in self.measured_results() for row in (r.averaged or r.rows if averaged else r.rows)]
        return sorted(rows, key=lambda r: (r.stage, r.chunk, order[r.instruction], -r.freq_mhz))

    def profile(self) -> Profile:
        """The measured profile; with micro-batch sizes, at the reference size with every other size's
        samples (the length fit), or, where fewer than 2 sizes were measured, the fixed-length rows (logged)."""
        if not self.results:
            raise ValueError("no clock has been measured yet")
        source = f"<start-up profiler: {len(self.results)} clocks, {self.iterations_used} iterations>"
        measured = self.measured_results()
        samples = [x for r in measured for x in r.samples]
        if self._sizes_seen:
            unsized = [r.freq_mhz for r in measured if not r.samples]  # an iteration's sizes were unknown
            profile, why = (None, f"no sizes in some iterations at {unsized} MHz") if unsized else \
                sized_profile(samples, source)
            if profile is not None:
                self.length_fit = f"length fit from {len({x.size for x in samples})} sizes"
                return profile
            if not self.length_fit.endswith(why):
                log.warning("EnvPipe profiler: no length fit, keeping fixed-length rows (every micro-batch size "
                            "averaged) as without sizes: %s", why)
            self.length_fit = f"no length fit: {why}"
        points: dict[tuple[int, str, int], list[ProfilePoint]] = {}
        for row in self.rows(averaged=True):
            point = ProfilePoint(row.freq_mhz, row.time_s, row.energy_j)
            points.setdefault((row.stage, row.instruction, row.chunk), []).append(point)
        return Profile(points, source=source)

    def envpipe_iterations(self) -> int:
        """What EnvPipe's profiler spends on the same coarse clocks: 6 iterations each (envpipe.md §5),
        no warm-up, no early stop. Refinement clocks are ours alone and not counted here."""
        return ENVPIPE_ITERATIONS_PER_CLOCK * len(self.candidates_mhz)

    def cost_share(self) -> float:
        """Iterations used as a share of :meth:`envpipe_iterations`."""
        return self.iterations_used / self.envpipe_iterations()

    def summary(self) -> str:
        measured = self.measured_clocks_mhz()
        span = f"{measured[0]}..{measured[-1]} MHz" if measured else "none"
        refined = self.refined_clocks_mhz()
        p2p = self.p2p_power_w()
        repeated = sum(1 for r in self.results if r.iterations > 1)
        return (
            f"start-up profiler: {len(self.coarse_results())}/{len(self.candidates_mhz)} clocks ({span}"
            + (f", and {len(refined)} near the valley: {', '.join(map(str, refined))} MHz" if refined else "")
            + f") in {self.iterations_used} iterations (EnvPipe: {self.envpipe_iterations()}, "
            f"{100 * self.cost_share():.0f} %); {repeated} clock(s) needed more than one iteration; "
            f"valley {self.valley_clock_mhz()} MHz; P2P power "
            f"{'not measured' if p2p is None else f'{p2p:.1f} W'}; "
            + (f"{self.unmeasured_iterations} iteration(s) unmeasured; " if self.unmeasured_iterations else "")
            + (f"unsteady: {'; '.join(self.unsteady_events[:3])}; " if self.unsteady_events else "")
            + (self.stop_reason or "running") + (f"; {self.length_fit}" if self.length_fit else "")
            + counter_updates_note(self._updates)
        )
