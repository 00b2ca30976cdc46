"""What a training log's energy line says: did EnvPipe save, and did it slow the run down?

Pure values, made by the run-time (:mod:`megatron_envpipe.megatron.runtime`) from
measured windows (:mod:`megatron_envpipe.megatron.reporting`):

* :class:`Baseline`: the run's own 1F1B iterations at the maximum clock, measured
  before the plan took over (the profiler's and memory measurement's, or
  ``--envpipe-baseline-iterations`` of their own); where none ran, the planner's
  prediction, labelled so. Windows run under per-iteration plans (variable-length
  micro-batches) compare with the stock run predicted for their own micro-batch sizes
  (:meth:`Baseline.same_sizes`): a baseline of other sizes would not compare like with like.
* :class:`EnergyReport`: one log window's means per iteration over the pipeline
  (energy summed over its GPUs, time the slowest stage's), against the baseline and
  the plan, plus each GPU's counter figures (J/iter and W, defined as Megatron's
  ``--log-energy``: docs/energy-measurement.md).
* :func:`summary_line`: the run's mean under the plan against the baseline (under
  per-iteration plans: their windows against the stock run for the same sizes), and
  the kWh that pace saves per day.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["SLOWER_THAN_PLANNED", "Baseline", "EnergyReport", "GpuFigure", "summary_line"]

# Iterations more than this much slower than the plan's time get a warning (a fraction).
SLOWER_THAN_PLANNED = 0.01
_SECONDS_PER_DAY = 86_400.0
_JOULES_PER_KWH = 3.6e6


@dataclass(frozen=True)
class Baseline:
    """Mean per iteration of the iterations compared with: pipeline energy (J, summed over its GPUs) and time."""

    energy_j: float
    time_s: float | None  # None: not known (the predicted baseline's time is not printed against)
    iterations: int  # measured iterations averaged; 0: the planner's prediction
    clock_mhz: int | None = None
    generation: int = 0  # 0: measured before the plan; k: its k-th repeat once the plan ran
    last_iteration: int | None = None  # a repeat's last iteration (1-based)
    for_sizes: bool = False  # predicted for the window's own micro-batch sizes (per-iteration plans)

    @property
    def measured(self) -> bool:
        return self.iterations > 0

    @classmethod
    def same_sizes(cls, energy_j: float, time_s: float) -> "Baseline":
        """Stock Megatron (1F1B at f_max) as the per-iteration plans predict it for the same micro-batch sizes."""
        return cls(energy_j, time_s, 0, for_sizes=True)

    def describe(self) -> str:
        if self.for_sizes:
            return (f"stock 1F1B at f_max predicted for the same micro-batch sizes, {self.energy_j:.1f} J in "
                    f"{self.time_s:.3f} s")
        if not self.measured:
            return f"the predicted baseline's {self.energy_j:.1f} J (baseline: predicted)"
        clock = f"{self.clock_mhz} MHz" if self.clock_mhz else "the maximum clock"
        time = f" in {self.time_s:.3f} s" if self.time_s is not None else ""
        when = (f" measured again up to iteration {self.last_iteration}, at the plan's GPU age"
                if self.last_iteration is not None else "")
        return (f"the measured baseline's {self.energy_j:.1f} J{time} (1F1B at {clock}, "
                f"{self.iterations} iteration{'s' if self.iterations != 1 else ''}{when})")


@dataclass(frozen=True)
class GpuFigure:
    """One GPU's energy counter over a log window, per iteration (Megatron's --log-energy figure)."""

    stage: int
    rank: int
    energy_j: float  # counter delta over the window / iterations
    time_s: float  # the window's time on the counter's clock / iterations

    @property
    def power_w(self) -> float:
        return self.energy_j / self.time_s if self.time_s > 0 else 0.0


@dataclass(frozen=True)
class EnergyReport:
    """One logged window's means per iteration, summed over the pipeline, against the baseline and the plan."""

    iteration: int  # the window's last iteration (1-based)
    time_s: float  # per iteration: the slowest stage's
    energy_j: float  # per iteration: the sum over the pipeline's GPUs
    stage_power_w: tuple[float, ...]
    predicted_baseline_j: float | None
    simulated: bool
    planned_time_s: float | None = None  # the plan's iteration time (its deadline for 'optimal')
    planned_saving: float | None = None  # what the plan predicted it saves
    baseline: Baseline | None = None  # measured; None: compare with predicted_baseline_j
    iterations: int = 1  # iterations the means are over
    gpus: tuple[GpuFigure, ...] = ()  # per GPU, from its counter between log points (empty: first window)
    # Variable-length micro-batches: the plan figures are the per-iteration plans', and the baseline is
    # the stock run they predict for the same sizes (Baseline.same_sizes).
    per_iteration_plans: bool = False

    @property
    def compared_with(self) -> Baseline | None:
        if self.baseline is not None and (self.baseline.measured or self.baseline.for_sizes):
            return self.baseline
        if self.predicted_baseline_j:
            return Baseline(self.predicted_baseline_j, None, 0)
        return None

    @property
    def saving(self) -> float | None:
        base = self.compared_with
        return None if base is None else 1.0 - self.energy_j / base.energy_j

    @property
    def slowdown_vs_baseline(self) -> float | None:
        base = self.compared_with
        if base is None or not base.time_s:
            return None
        return self.time_s / base.time_s - 1.0

    @property
    def slowdown_vs_plan(self) -> float | None:
        return self.time_s / self.planned_time_s - 1.0 if self.planned_time_s else None

    @property
    def first_iteration(self) -> int:
        return self.iteration - self.iterations + 1

    def span(self) -> str:
        if self.iterations == 1:
            return f"iteration {self.iteration}"
        return f"iterations {self.first_iteration}-{self.iteration}"

    def gpu_mean(self) -> GpuFigure | None:
        """The pipeline's mean GPU (J/iter/GPU, W/GPU), as Megatron's --log-energy averages its GPUs."""
        if not self.gpus:
            return None
        n = len(self.gpus)
        return GpuFigure(-1, -1, sum(g.energy_j for g in self.gpus) / n, sum(g.time_s for g in self.gpus) / n)

    def line(self) -> str:
        label = " (simulated)" if self.simulated else ""
        per = " per iteration" if self.iterations > 1 else ""
        parts = [
            f"EnvPipe energy{label} | {self.span()} | {self.energy_j:.1f} J over the pipeline "
            f"in {self.time_s:.3f} s{per}",
            "avg power per stage [" + ", ".join(f"{p:.0f}" for p in self.stage_power_w) + "] W",
        ]
        base = self.compared_with
        if base is not None:
            planned = f" (planned {100 * self.planned_saving:.2f}%)" if self.planned_saving is not None else ""
            slower = self.slowdown_vs_baseline
            time = f", time {100 * slower:+.2f}%" if slower is not None else ""
            parts.append(f"saving {100 * self.saving:.2f}%{planned}{time} vs {base.describe()}")
        if self.planned_time_s:
            whose = "the per-iteration plans'" if self.per_iteration_plans else "the plan's"
            parts.append(f"time {100 * self.slowdown_vs_plan:+.2f}% vs {whose} {self.planned_time_s:.3f} s")
        gpu = self.gpu_mean()
        if gpu is not None:
            parts.append(f"per GPU {gpu.energy_j:.1f} J/iter, {gpu.power_w:.1f} W")
        return " | ".join(parts)

    def slower_than_planned(self, threshold: float = SLOWER_THAN_PLANNED) -> str | None:
        """The warning for a window more than ``threshold`` slower than the plan, or None."""
        slower = self.slowdown_vs_plan
        if slower is None or slower <= threshold:
            return None
        label = " (simulated)" if self.simulated else ""
        return (f"EnvPipe{label}: {self.span()} ran slower than planned: {self.time_s:.3f} s per iteration "
                f"measured vs {self.planned_time_s:.3f} s planned ({100 * slower:+.2f}%, more than "
                f"{100 * threshold:g}%); the clocks may be held back (thermal or power capping, other jobs) or "
                "the profile is from a faster GPU: re-profile (--envpipe-profile-cache off) or use "
                "--envpipe-reconfig balanced")


def _kwh_saved_per_day(baseline_energy_j: float, energy_j: float, time_s: float) -> float:
    """kWh a day of training at this pace saves: (baseline - measured) J per iteration x iterations per day."""
    if time_s <= 0:
        return 0.0
    return (baseline_energy_j - energy_j) / time_s * _SECONDS_PER_DAY / _JOULES_PER_KWH


def summary_line(reports: Sequence[EnergyReport], baseline: Baseline | None, simulated: bool,
                 num_gpus: int, replicas: int = 1) -> str | None:
    """At exit: the planned windows' mean against the baseline, and kWh saved per day at this pace.

    ``reports``: the windows logged under the plan; ``num_gpus``: the pipeline's GPUs; ``replicas``:
    data-parallel copies of the pipeline (assumed to draw alike), which the kWh figure is summed over.
    Where windows ran under per-iteration plans (variable-length micro-batches), only those count, against
    the stock run predicted for the same sizes (:func:`_per_iteration_summary`).
    """
    own = [r for r in reports if r.per_iteration_plans and r.baseline is not None and r.baseline.for_sizes]
    if own:
        return _per_iteration_summary(own, simulated, num_gpus, replicas)
    if not reports:
        return None
    n = sum(r.iterations for r in reports)
    energy_j = sum(r.energy_j * r.iterations for r in reports) / n
    time_s = sum(r.time_s * r.iterations for r in reports) / n
    label = " (simulated)" if simulated else ""
    head = (f"EnvPipe summary{label} | iterations {reports[0].first_iteration}-{reports[-1].iteration} "
            f"({n} iterations): {energy_j:.1f} J over the pipeline in {time_s:.3f} s per iteration")
    base = baseline if baseline is not None and baseline.measured else None
    if base is None and reports[-1].predicted_baseline_j:
        base = Baseline(reports[-1].predicted_baseline_j, None, 0)
    if base is None:
        return head + " | no baseline to compare with"
    parts = [head, f"energy {100 * (energy_j / base.energy_j - 1):+.2f}%"
             + (f", time {100 * (time_s / base.time_s - 1):+.2f}%" if base.time_s else "")
             + f" vs {base.describe()}"]
    kwh = _kwh_saved_per_day(base.energy_j, energy_j, time_s) * replicas
    gpus = num_gpus * replicas
    parts.append(f"at this pace {kwh:.3f} kWh saved per day over {gpus} GPU{'s' if gpus != 1 else ''}{label}")
    return " | ".join(parts)


def _per_iteration_summary(reports: Sequence[EnergyReport], simulated: bool, num_gpus: int,
                          replicas: int = 1) -> str:
    """At exit, for windows run under per-iteration plans: their measured mean against the stock run the
    plans predict for the same micro-batch sizes (like with like), next to the plans' own predicted saving."""
    n = sum(r.iterations for r in reports)
    energy_j = sum(r.energy_j * r.iterations for r in reports) / n
    time_s = sum(r.time_s * r.iterations for r in reports) / n
    stock_j = sum(r.baseline.energy_j * r.iterations for r in reports) / n
    stock_s = sum(r.baseline.time_s * r.iterations for r in reports) / n
    planned_j = sum(r.baseline.energy_j * (1 - (r.planned_saving or 0.0)) * r.iterations for r in reports) / n
    label = " (simulated)" if simulated else ""
    kwh = _kwh_saved_per_day(stock_j, energy_j, time_s) * replicas
    gpus = num_gpus * replicas
    return " | ".join([
        f"EnvPipe summary{label} | {n} iterations under per-iteration plans (of iterations "
        f"{reports[0].first_iteration}-{reports[-1].iteration}): {energy_j:.1f} J over the pipeline in {time_s:.3f} s "
        "per iteration",
        f"energy {100 * (energy_j / stock_j - 1):+.2f}% (planned {100 * (planned_j / stock_j - 1):+.2f}%), time "
        f"{100 * (time_s / stock_s - 1):+.2f}% vs {Baseline.same_sizes(stock_j, stock_s).describe()}",
        f"at this pace {kwh:.3f} kWh saved per day over {gpus} GPU{'s' if gpus != 1 else ''}{label}"])
