"""Every log window: the pipeline's energy and time against its baseline and plan, in the log,
TensorBoard, W&B and (``--envpipe-energy-csv``) a per-GPU CSV; at exit, a summary.

Each GPU adds up its own iterations between log points (no collective per
iteration): the window's iterations under the plan, or before it; the 1F1B
iterations at the maximum clock before the plan (the measured baseline,
:class:`~megatron_envpipe.core.energy_report.Baseline`); and its energy counter
read at every log point (J/iter/GPU and W/GPU as Megatron's ``--log-energy``
computes them: docs/energy-measurement.md). At each log point (Megatron's
``--log-interval`` unless ``--envpipe-log-interval`` is given) the windows are
summed over each stage's tensor/context-parallel GPUs, gathered over the
pipeline and turned into an :class:`~megatron_envpipe.core.energy_report.EnergyReport`
by the energy ledger (:mod:`~megatron_envpipe.megatron.energy_ledger`, which owns the sums, the
measured baseline and the reports); the last rank (where Megatron prints training progress) logs it,
warns when the window ran more than 1 % slower than planned, and writes it to
Megatron's TensorBoard and W&B writers when ``megatron.training`` set them up.
Intervals whose energy was not measured (:mod:`megatron_envpipe.gpu.hooks`) are
counted in every line, by reason.
"""

from __future__ import annotations

import atexit
import logging
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from megatron_envpipe.config.groups import ReportSettings
from megatron_envpipe.core.energy_csv import append_report
from megatron_envpipe.core.energy_report import SLOWER_THAN_PLANNED, EnergyReport, GpuFigure, summary_line
from megatron_envpipe.core.hooks import ExecutionHooks
from megatron_envpipe.gpu.hooks import DEVICE_ERRORS, EnergyStatus, GpuHooks
from megatron_envpipe.megatron.energy_ledger import Local, StageWindow, Sums
from megatron_envpipe.megatron.groups import StageGroups
from megatron_envpipe.megatron.run_parts import IterationStep, RunView
from megatron_envpipe.megatron.stragglers import StragglerFollow

__all__ = ["EnergyReporting", "Local", "log_interval", "summarize"]

log = logging.getLogger("megatron_envpipe")


@dataclass(frozen=True)
class _GpuWindow:
    """What one GPU sends at a log point."""

    status: EnergyStatus | None
    window: tuple[float, float] | None  # mean (energy J, time s) per measured iteration
    iterations: int
    baseline: tuple[float, float, int] | None  # mean energy, mean time, measured iterations
    figure: GpuFigure | None


_WARNED: set[str] = set()


def log_interval(config: ReportSettings) -> int:
    """Iterations per energy line: --envpipe-log-interval, else Megatron's --log-interval (as parsed in
    this process), else 1."""
    if config.log_interval is not None:
        return config.log_interval
    megatron = getattr(_megatron_args(), "log_interval", None)
    return megatron if isinstance(megatron, int) and megatron >= 1 else config.energy_log_interval


def _megatron_args() -> Any:
    global_vars = sys.modules.get("megatron.training.global_vars")  # looked up: never imported here
    try:
        return global_vars.get_args() if global_vars is not None else None
    except Exception:  # noqa: BLE001 - Megatron has not parsed its arguments
        return None


def _report_energy(run: RunView, hooks: ExecutionHooks, groups: StageGroups, iteration: int) -> EnergyReport | None:
    """After iteration ``iteration`` (0-based), on every rank: add it up; at a log point, a collective
    over the pipeline that reports the window.

    A stage whose energy was not measured in the window gets no pipeline sum: the
    line names it and why. Every line ends with how many intervals (one GPU's
    iteration) went unmeasured so far, by reason, and which GPUs lost clock control.
    """
    runtime, ledger = run.phases, run.energy
    if not runtime.measures_energy:
        return None
    status = hooks.energy_status() if isinstance(hooks, GpuHooks) else None
    local = ledger.local
    ledger.add_iteration(status.energy if status is not None else None, iteration)
    if (iteration + 1) % log_interval(runtime.config.group(ReportSettings)):
        return None
    local.replica = groups.replicas.rank() if groups.replicas is not None else 0
    window = ledger.take_window()
    mine = _GpuWindow(status, window.mean(), window.iterations, _baseline_of(local.baseline),
                      _counter_figure(local, getattr(hooks, "monitor", None), groups.stage, dist.get_rank(),
                                     iteration + 1))
    parts = _gather_pipeline(groups, mine)
    if any(p is None for p in parts):  # a GPU without energy hooks: nothing to report
        return None
    stages = [_stage_window(stage) for stage in parts]
    ledger.update_baseline(stages)
    everyone = [s.status for s in stages]
    measured = all(s.window is not None for s in stages)
    report = None
    if measured:
        figures = [g.figure for stage in parts for g in stage]
        follow = run.stragglers
        report = ledger.report(
            iteration + 1, [_Mean(*s.window) for s in stages], max(s.iterations for s in stages),
            tuple(f for f in figures if f is not None) if all(f is not None for f in figures) else (),
            pace_time_s=follow.pace_time_s if follow is not None else None, plans=run.iteration_plans)
    # Megatron prints training progress on the last rank (print_rank_last); with data parallelism every
    # pipeline's last stage prints its own line too (replicas differ when one follows a straggler).
    replica = f" | replica {groups.replicas.rank()}" if groups.replicas is not None else ""
    note = run.stragglers.pace_note if run.stragglers is not None else None
    follows = f" | {note}" if note and report is not None else ""
    measured_follow = _note_follow_window(run, groups, report)
    if dist.get_rank() != dist.get_world_size() - 1:
        if report is not None and groups.last and groups.replicas is not None:
            log.info("%s%s%s", report.line(), replica, follows)
            if measured_follow:
                log.info("%s", measured_follow)
        return report
    local.num_gpus = sum(len(stage) for stage in parts)
    local.replicas = max(1, dist.get_world_size() // local.num_gpus)
    if not local.last_rank:
        local.last_rank = True
        atexit.register(summarize, run)  # a run that never uninstalls still gets its summary
    if report is not None:
        line = report.line() + replica + follows
    else:
        label = " (simulated)" if runtime.device.modelled else ""
        missing = ", ".join(f"{s} ({st.status.reason if st.status else 'no hooks'})"
                            for s, st in enumerate(stages) if st.window is None)
        line = f"EnvPipe energy{label} | iteration {iteration + 1} | not measured on stage {missing}"
    log.info("%s%s", line, _unmeasured_summary([e for e in everyone if e is not None]))
    if measured_follow:
        log.info("%s", measured_follow)
    if report is not None:
        told = _slower_than_planned(run.stragglers, report, local)
        if told is not None:
            log.log(*told)
        _write_outputs(runtime.config.group(ReportSettings), report, everyone)
    return report


def _note_follow_window(run: RunView, groups: StageGroups, report: EnergyReport | None) -> str | None:
    """A pipeline's last stage with data parallelism: the window goes to the straggler ledger; the measured
    saving of following vs waiting, the first time it is known (stragglers._FollowLedger)."""
    follow = run.stragglers
    if report is None or follow is None or not groups.last or groups.replicas is None:
        return None
    told = follow.note_window(groups, report, groups.replicas.rank())
    if follow.ledger.claim_exit_summary():
        atexit.register(_summarize_following, follow, run.phases.device.modelled, groups.replicas.rank())
    label = " (simulated)" if report.simulated else ""
    return f"EnvPipe stragglers{label} | {told}" if told else None


def _summarize_following(follow: StragglerFollow | None, modelled: bool, replica: int) -> str | None:
    """At the run's end, once, on a pipeline that followed a straggler: the measured saving vs waiting."""
    line = follow.ledger.summary(modelled, replica) if follow is not None else None
    if line is None:
        return None
    label = " (simulated)" if modelled else ""
    line = f"EnvPipe summary{label} | {line}"
    log.info("%s", line)
    return line


def _waits_for_straggler(follow: StragglerFollow | None, report: EnergyReport) -> bool:
    """Whether a window's extra time over the plan is the wait for a slower data-parallel pipeline: the last
    agreement found one (``follow.dp_wait``) and the window lasted no longer than its pace (plus the
    warning's tolerance): anything beyond that is this pipeline's own and still warns."""
    wait = follow.dp_wait if follow is not None else None
    return wait is not None and report.time_s <= wait[1] * (1 + SLOWER_THAN_PLANNED)


def _slower_than_planned(follow: StragglerFollow | None, report: EnergyReport,
                        local: Local) -> tuple[int, str] | None:
    """(log level, line) for a window slower than planned, or None: a warning, unless the extra time is
    the wait for a data-parallel straggler (:func:`_waits_for_straggler`), which is said once, at INFO."""
    warning = report.slower_than_planned()
    if not warning:
        return None
    if follow is not None:  # data parallelism: the slowest replica sets every replica's pace
        explained, line = follow.explains_slow_window(report, local.replica)
        if explained:
            return (logging.INFO, line) if line else None
    if not _waits_for_straggler(follow, report):
        return logging.WARNING, warning
    if local.told_dp_wait:
        return None
    local.told_dp_wait = True
    replica, pace_s = follow.dp_wait
    label = " (simulated)" if report.simulated else ""
    return logging.INFO, (f"EnvPipe{label}: {report.span()} lasted {report.time_s:.3f} s, not the planned "
                          f"{report.planned_time_s:.3f} s: this pipeline waits at the data-parallel gradient sync "
                          f"for replica {replica} (its pace {pace_s:.3f} s); said once, not every line")


@dataclass(frozen=True)
class _Mean:
    energy_j: float
    time_s: float


def _baseline_of(sums: Sums) -> tuple[float, float, int] | None:
    mean = sums.mean()
    return None if mean is None else (mean[0], mean[1], sums.measured)


def _counter_figure(local: Local, monitor: Any, stage: int, rank: int, done: int) -> GpuFigure | None:
    """This GPU's energy counter since the last log point (read after ``done`` iterations), per
    iteration: Megatron's --log-energy figure for this GPU (None at the first log point, or unread)."""
    if monitor is None:
        return None
    try:
        now = monitor.read()
    except DEVICE_ERRORS:  # counted by the hooks' own reads; this window has no counter figure
        local.counter = None
        return None
    before, at = local.counter, local.counter_at
    local.counter, local.counter_at = now, done
    if before is None or at is None or done <= at:
        return None
    n = done - at
    return GpuFigure(stage, rank, (now[1] - before[1]) / 1000.0 / n, (now[0] - before[0]) / n)


def _gather_pipeline(groups: StageGroups, mine: _GpuWindow) -> list[Any]:
    """Every GPU's window, per stage (its TP/CP GPUs), in stage order; None for a stage lacking one."""
    gpus: list[Any] = [mine]
    for group in groups.model_parallel:  # TP, then CP: each rank ends up with its stage's GPUs
        parts: list[Any] = [None] * group.size()
        dist.all_gather_object(parts, gpus, group=group)
        gpus = [g for part in parts for g in part]
    stages = groups.gather_stages(gpus)
    return [None if any(g.status is None for g in stage) else stage for stage in stages]


def _stage_window(gpus: Sequence[_GpuWindow]) -> StageWindow:
    """A stage's window is that of all its GPUs: energy summed, time the slowest's (unmeasured if any is)."""
    statuses = [g.status for g in gpus]
    status = EnergyStatus(
        energy=statuses[0].energy, reason=next((st.reason for st in statuses if st.reason), None),
        intervals=sum(st.intervals for st in statuses), unmeasured=tuple(sorted(_unmeasured_counts(statuses).items())),
        clock_control_lost=next((st.clock_control_lost for st in statuses if st.clock_control_lost), None))
    window = None
    if all(g.window is not None for g in gpus):
        window = (sum(g.window[0] for g in gpus), max(g.window[1] for g in gpus))
    base = None
    if all(g.baseline is not None for g in gpus):
        base = (sum(g.baseline[0] for g in gpus), max(g.baseline[1] for g in gpus),
                min(g.baseline[2] for g in gpus))
    return StageWindow(status, window, max(g.iterations for g in gpus), base)


def summarize(run: RunView | None) -> str | None:
    """At the run's end, once, on the last rank: the planned windows' energy and time against the
    baseline, and kWh saved per day at this pace (logged and returned)."""
    if run is None:
        return None
    ledger, local = run.energy, run.energy.local
    if run.stragglers is not None and run.stragglers.ledger.at_exit:  # it followed a straggler: its summary
        _summarize_following(run.stragglers, run.phases.device.modelled, local.replica)
    if local.summarized or not local.last_rank:
        return None
    local.summarized = True
    planned = [r for r in ledger.energy_log if r.planned_time_s is not None]
    base = ledger.baseline
    if base is not None and base.last_iteration is not None:  # measured again: the windows after it, same GPU age
        planned = [r for r in planned if r.first_iteration > base.last_iteration] or planned
    line = summary_line(planned, ledger.baseline, run.phases.device.modelled, local.num_gpus, local.replicas)
    if line is not None:
        log.info("%s", line)
    plans = run.iteration_plans  # variable-length micro-batches: what the per-iteration plans did
    told = plans.summary() if plans is not None else None
    if told is not None:
        log.info("%s", told)
    return line


def _write_outputs(config: ReportSettings, report: EnergyReport, everyone: Sequence[EnergyStatus | None]) -> None:
    """TensorBoard, W&B and the CSV; a failure (a full disk, a dead W&B connection) never stops training."""
    outputs = [("tensorboard", _tensorboard_writer(), _write_tensorboard), ("wandb", _wandb_writer(), _write_wandb)]
    for name, writer, write in outputs:
        if writer is None:
            continue
        try:
            write(writer, report, report.iteration, [e for e in everyone if e is not None])
        except Exception as exc:  # noqa: BLE001 - any writer error: warn once, keep training
            _warn_once(name, f"writing the energy to {name} failed: {exc}")
    if config.energy_csv:
        try:
            append_report(config.energy_csv, report)
        except OSError as exc:
            _warn_once("csv", f"writing --envpipe-energy-csv {config.energy_csv} failed: {exc}")


def _warn_once(key: str, message: str) -> None:
    if key not in _WARNED:
        _WARNED.add(key)
        log.warning("EnvPipe: %s", message)


def _unmeasured_counts(statuses: Sequence[EnergyStatus]) -> dict[str, int]:
    """Unmeasured intervals by reason, added up over ``statuses``."""
    counts: dict[str, int] = {}
    for st in statuses:
        for why, n in st.unmeasured:
            counts[why] = counts.get(why, 0) + n
    return counts


def _unmeasured_summary(everyone: Sequence[EnergyStatus]) -> str:
    """`` | N of M intervals unmeasured (reason: n, ...)`` and lost clock control; '' when all is well."""
    total = sum(e.intervals for e in everyone)
    counts = _unmeasured_counts(everyone)
    parts = []
    if counts:
        reasons = ", ".join(f"{why}: {n}" for why, n in sorted(counts.items()))
        parts.append(f"{sum(counts.values())} of {total} intervals unmeasured ({reasons})")
    lost = [f"{s} ({e.clock_control_lost})" for s, e in enumerate(everyone) if e.clock_control_lost]
    if lost:
        parts.append(f"clock control lost on stage {', '.join(lost)}: monitor-only")
    return "".join(f" | {p}" for p in parts)


def _scalars(report: EnergyReport, everyone: Sequence[EnergyStatus] = ()) -> dict[str, float]:
    """The report's figures by name: pipeline, per stage and per GPU (rank)."""
    out = {"envpipe/iteration-energy-J": report.energy_j, "envpipe/iteration-time-s": report.time_s}
    if report.saving is not None:
        out["envpipe/energy-saving"] = report.saving
    if report.slowdown_vs_baseline is not None:
        out["envpipe/time-vs-baseline"] = report.slowdown_vs_baseline
    if report.slowdown_vs_plan is not None:
        out["envpipe/time-vs-plan"] = report.slowdown_vs_plan
    for s, p in enumerate(report.stage_power_w):
        out[f"envpipe/stage{s}-power-W"] = p
    for g in report.gpus:  # Megatron's --log-energy names: iter-energy/gpu, power/gpu
        out[f"envpipe/iter-energy/gpu{g.rank}"] = g.energy_j
        out[f"envpipe/power/gpu{g.rank}"] = g.power_w
    if everyone:
        out["envpipe/unmeasured-intervals"] = sum(n for e in everyone for _, n in e.unmeasured)
    return out


def _write_tensorboard(writer: Any, report: EnergyReport, step: int,
                      everyone: Sequence[EnergyStatus] = ()) -> None:
    for name, value in _scalars(report, everyone).items():
        writer.add_scalar(name, value, step)


def _write_wandb(writer: Any, report: EnergyReport, step: int, everyone: Sequence[EnergyStatus] = ()) -> None:
    writer.log(_scalars(report, everyone), step)


def _tensorboard_writer() -> Any:
    """Megatron's TensorBoard writer when megatron.training set one up."""
    return _megatron_writer("get_tensorboard_writer")


def _wandb_writer() -> Any:
    """Megatron's W&B writer when megatron.training set one up."""
    return _megatron_writer("get_wandb_writer")


def _megatron_writer(getter: str) -> Any:
    global_vars = sys.modules.get("megatron.training.global_vars")  # set up by Megatron's pretrain() only
    get = getattr(global_vars, getter, None)
    if get is None:
        return None
    try:
        return get()
    except Exception:  # noqa: BLE001 - not initialised
        return None


class EnergyReporting:
    """The energy log as a part of the run (megatron/training_run.py): at every iteration's end, the
    ledger's sums and, at a log point, the window's line (:func:`_report_energy`)."""

    def __init__(self, run: RunView) -> None:
        self.run = run

    def begin_iteration(self, step: IterationStep) -> None:
        pass

    def end_iteration(self, step: IterationStep) -> None:
        _report_energy(self.run, step.hooks, step.groups, step.iteration)
