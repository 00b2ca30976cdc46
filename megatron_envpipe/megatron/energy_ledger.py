"""The energy ledger of a run: what each GPU adds up between log points, the measured baseline, the reports.

One :class:`EnergyLedger` per process (megatron/training_run.py) owns everything the energy lines are
made of: this GPU's sums between log points (:class:`Local`: iterations under the plan, before it, and
of those the 1F1B ones at the maximum clock the baseline is measured from), the measured
:class:`~megatron_envpipe.core.energy_report.Baseline` once every stage's iterations are in (and again
at the plan's GPU age, megatron/baseline_refresh.py), and every window's
:class:`~megatron_envpipe.core.energy_report.EnergyReport`. It reads the phase machine (which iterations
ran under the plan) and never writes it: a measured repeat of the baseline is told through
:meth:`~megatron_envpipe.megatron.runtime.EnvPipeRuntime.baseline_measured`. The collectives and the log
lines are :mod:`~megatron_envpipe.megatron.reporting`'s.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from megatron_envpipe.core.energy_report import Baseline, EnergyReport
from megatron_envpipe.megatron.runtime import EnvPipeRuntime

__all__ = ["EnergyLedger", "Local", "StageWindow", "Sums"]


@dataclass
class Sums:
    """One GPU's iterations added up: measured ones' energy and time, and all of them."""

    iterations: int = 0
    measured: int = 0
    energy_j: float = 0.0
    time_s: float = 0.0

    def add(self, energy: Any) -> None:
        self.iterations += 1
        if energy is not None:
            self.measured += 1
            self.energy_j += energy.energy_j
            self.time_s += energy.time_s

    def mean(self) -> tuple[float, float] | None:
        return (self.energy_j / self.measured, self.time_s / self.measured) if self.measured else None


@dataclass
class Local:
    """This process's bookkeeping between log points (one per energy ledger)."""

    planned: Sums = field(default_factory=Sums)
    before: Sums = field(default_factory=Sums)  # iterations before the plan
    baseline: Sums = field(default_factory=Sums)  # of those, 1F1B at the maximum clock (or its repeat)
    baseline_generation: int = 0  # the repeat the baseline sums belong to (megatron/baseline_refresh.py)
    baseline_last: int = 0  # the last iteration (1-based) in them
    counter: tuple[float, float] | None = None  # (time, cumulative mJ) at the last log point
    counter_at: int | None = None  # the iteration count it was read after
    num_gpus: int = 1
    replicas: int = 1
    last_rank: bool = False  # this process prints the lines (and the summary)
    summarized: bool = False
    told_dp_wait: bool = False  # said once that the extra time is the wait for a data-parallel straggler
    replica: int = 0  # this pipeline's data-parallel replica


@dataclass(frozen=True)
class StageWindow:
    """A stage's window at a log point: its GPUs' status, mean (energy, time), iterations, baseline sums."""

    status: Any  # gpu.hooks.EnergyStatus, or None
    window: tuple[float, float] | None
    iterations: int
    baseline: tuple[float, float, int] | None


class EnergyLedger:
    """The run's energy sums, measured baseline and reports (module docstring)."""

    def __init__(self, phases: EnvPipeRuntime) -> None:
        self.phases = phases  # read only: which iterations ran under the plan, the device facts
        self.local = Local()
        self.baseline: Baseline | None = None  # measured: 1F1B at the maximum clock (core.energy_report)
        self.energy_log: list[EnergyReport] = []

    def add_iteration(self, energy: Any, iteration: int) -> None:
        """This GPU's energy of iteration ``iteration`` (0-based; None: unmeasured) into the window's sums."""
        phases, local = self.phases, self.local
        if phases.is_planned_iteration(iteration):
            local.planned.add(energy)
            return
        local.before.add(energy)
        if phases.is_baseline_iteration(iteration):
            if local.baseline_generation != phases.baselines.refresh.generation:  # measured again: a fresh mean
                local.baseline, local.baseline_generation = Sums(), phases.baselines.refresh.generation
            local.baseline.add(energy)
            local.baseline_last = iteration + 1

    def take_window(self) -> Sums:
        """The window's sums (planned iterations if any ran, else those before the plan); a new window."""
        local = self.local
        window = local.planned if local.planned.iterations else local.before
        local.planned, local.before = Sums(), Sums()
        return window

    def update_baseline(self, stages: Sequence[StageWindow]) -> None:
        """The measured baseline, from every stage's 1F1B iterations at f_max: before the plan (kept once it
        runs), then each time it is measured again at the plan's GPU age (megatron/baseline_refresh.py), once
        every one of that measurement's iterations is in."""
        phases, local = self.phases, self.local
        if phases.config.baseline_iterations == 0:  # asked for the predicted baseline
            return
        if not stages or any(s.baseline is None for s in stages):
            return
        generation = local.baseline_generation
        repeat = generation > 0
        if self.baseline is not None and phases.planned_at is not None and (
                not repeat or self.baseline.generation >= generation):
            return
        done = min(s.baseline[2] for s in stages)
        if repeat and done < phases.baselines.refresh.span:
            return  # the repeat is still under way (or an iteration of it went unmeasured)
        scale = phases.device.time_scale
        energy_j = sum(s.baseline[0] for s in stages)
        self.baseline = Baseline(energy_j, max(s.baseline[1] for s in stages) / scale, done,
                                 phases.device.clocks_mhz[0], generation=generation,
                                 last_iteration=local.baseline_last if repeat else None)
        if repeat:
            phases.baseline_measured(energy_j, local.baseline_last - 1)

    def report(self, iteration: int, stage_energy: Sequence[Any], iterations: int = 1, gpus: Sequence[Any] = (),
               *, pace_time_s: float | None = None, plans: Any = None) -> EnergyReport | None:
        """Per-stage means per iteration (``time_s``, ``energy_j``) of a window of ``iterations`` ending
        at ``iteration`` (1-based) -> a report against :attr:`baseline` and the plan, logged in
        :attr:`energy_log`; ``gpus``: each GPU's :class:`~megatron_envpipe.core.energy_report.GpuFigure`;
        ``pace_time_s``: the straggler's pace followed (megatron/stragglers.py); ``plans``: the run's
        per-iteration plans (megatron/iteration_plans.py), if any."""
        phases = self.phases
        if not stage_energy or not phases.measures_energy:
            return None
        scale = phases.device.time_scale  # the device's, not the flag's: 1 in virtual time
        time_s = max(e.time_s for e in stage_energy) / scale
        energy = sum(e.energy_j for e in stage_energy)
        power = tuple(e.energy_j / (e.time_s / scale) if e.time_s > 0 else 0.0 for e in stage_energy)
        result = phases.last_result if phases.is_planned_iteration(iteration - 1) else None
        predicted = result.baseline_energy_j if result is not None else None
        planned_time = None
        if result is not None and phases.last_plan_predicts_time:  # no stand-in profile's times
            planned_time = result.deadline_s if result.deadline_s is not None else result.score.iteration_time_s
            if pace_time_s is not None:  # following a straggler: its pace's plan
                planned_time = pace_time_s
        saving = result.energy_saving if result is not None else None
        # Variable-length micro-batches: a window run wholly under per-iteration plans is held to their figures
        # and compared with the stock run they predict for the same sizes (like with like).
        own = (plans.window_prediction(iterations)
               if result is not None and pace_time_s is None and plans is not None else None)
        base = self.baseline if result is not None else None
        if own is not None:
            planned_time, saving, base = own
        report = EnergyReport(iteration, time_s, energy, power, predicted, phases.device.modelled,
                              planned_time, saving, base, iterations, tuple(gpus), per_iteration_plans=own is not None)
        self.energy_log.append(report)
        return report
