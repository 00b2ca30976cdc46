"""A deadline taken from another schedule: plan any schedule to 1F1B's iteration time at the maximum clock.

``envpipe plan --deadline-from 1f1b``, ``envpipe menu`` and training's ``--envpipe-deadline-from 1f1b``
share this. 1F1B at f_max is predicted from the profile (a profile with model chunks is first summed back
into whole stages: the layers a stage runs in 1F1B are its chunks' layers). The deadline is handed to the
optimal planner as the ``max_slowdown`` that turns the schedule's own f_max time into 1F1B's, so the plan
is exactly ``envpipe plan --type optimal --max-slowdown X`` with X computed to full precision: interleaved
(faster at f_max) gets slack it may spend on lower clocks, 1F1B and ``ours`` (scored against 1F1B already)
get 0. Memory: an interleaved pipeline keeps Megatron's order, so its peak activations are known before
planning and are checked against an activation budget here (a chunk's activation is 1/V of a stage's).
Pure Python.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass

from megatron_envpipe.core.interleaved import interleaved_schedule
from megatron_envpipe.core.kinds import plan_kind, scheduling_kind
from megatron_envpipe.core.memory import Budget, show_budget
from megatron_envpipe.core.profile import Profile, ProfileError, ProfilePoint
from megatron_envpipe.core.schedule import Schedule, ScheduleError
from megatron_envpipe.core.vocabulary import PlanType, ReconfigPolicy, Scheduling
from megatron_envpipe.planning.basis import PlannerConfig, PlannerError, PlanResult, planning_basis, planning_profile
from megatron_envpipe.planning.switching import switch_energy_j

DEADLINE_FROM_NAMES = ("1f1b",)  # schedules whose f_max iteration time can be another schedule's deadline


@dataclass(frozen=True)
class Reference:
    """1F1B with every unit at f_max, predicted from the profile: the deadline and what savings compare with."""

    iteration_time_s: float
    energy_j: float
    peak_inflight: tuple[int, ...]  # micro-batch activations per stage (P - s)
    profile_source: str


@dataclass(frozen=True)
class DeadlineFrom:
    """A planner config whose deadline is 1F1B's f_max time, with the figures it was derived from."""

    config: PlannerConfig  # plan_type optimal, max_slowdown set
    reference: Reference
    own_fastest_s: float  # the schedule's own iteration time at f_max (its planner baseline)

    @property
    def deadline_s(self) -> float:
        return self.reference.iteration_time_s


def _whole_stages(profile: Profile) -> Profile:
    """``profile`` with one row per stage: a profile with model chunks summed over each stage's chunks
    (time and energy, at the clocks every chunk was profiled at); a profile of whole stages as it is."""
    if profile.num_chunks == 1:
        return profile
    points: dict[tuple[int, str], list[ProfilePoint]] = {}
    for s in range(profile.num_stages):
        for ins in ("forward", "backward"):
            chunks = range(profile.num_chunks)
            clocks = set.intersection(*(set(profile.frequencies(s, ins, c)) for c in chunks))
            if not clocks:
                raise PlannerError(f"{profile.source}: stage {s} {ins}: no clock is profiled for every model chunk, "
                                   "so 1F1B's time cannot be predicted: profile every chunk at the same clocks")
            points[(s, ins)] = [
                ProfilePoint(f, sum(profile.time_s(s, ins, f, c) for c in chunks),
                             sum(profile.energy_j(s, ins, f, c) for c in chunks))
                for f in sorted(clocks, reverse=True)
            ]
    try:
        return Profile(points, source=f"{profile.source} (chunks summed per stage)")
    except ProfileError as exc:
        raise PlannerError(str(exc)) from None


def _one_f_one_b_config(config: PlannerConfig) -> PlannerConfig:
    """``config`` for 1F1B at f_max: the same GPU, P2P power and latency, switch cost; no chunks, budget or deadline."""
    return dataclasses.replace(config, plan_type=PlanType.BASELINE, scheduling=Scheduling.ONE_F_ONE_B,
                               reconfig=ReconfigPolicy.DEFAULT, virtual_stages=1, microbatch_group_size=None,
                               max_inflight=None, extra_warmup=None, max_slowdown=0.0, target_time_s=None,
                               max_clock_changes=None)


def one_f_one_b_reference(profile: Profile, num_microbatches: int, config: PlannerConfig,
                          num_stages: int | None = None) -> Reference:
    """1F1B at f_max on ``profile`` (chunks summed per stage), scored as the planner scores its baseline."""
    cfg = _one_f_one_b_config(config).validate()
    basis = planning_basis(_whole_stages(profile), num_microbatches, cfg, num_stages)
    # As PlanResult.baseline_energy_j: simulated energy plus the clock changes' cost (none at one clock).
    energy = basis.baseline.energy_j + switch_energy_j(basis.baseline_plan, config.effective_switch_cost_j)
    return Reference(basis.baseline.iteration_time_s, energy, tuple(basis.baseline_plan.schedule.peak_inflight()),
                     profile.source)


def deadline_from_1f1b(profile: Profile, num_microbatches: int, config: PlannerConfig,
                       num_stages: int | None = None) -> DeadlineFrom:
    """``config`` (plan type optimal, any schedule we run) planned to 1F1B's iteration time at f_max.

    PlannerError (one line) where the schedule cannot run in 1F1B's time at f_max, where the config already
    sets a deadline, or for another plan type."""
    if not plan_kind(config.plan_type).has_deadline:
        raise PlannerError(f"a deadline from 1F1B needs plan type optimal (the minimum-energy plan for a deadline), "
                           f"not {config.plan_type}: use --type optimal")
    if config.max_slowdown or config.target_time_s is not None:
        raise PlannerError("a deadline from 1F1B sets the deadline itself: drop the maximum slowdown and the target "
                           "iteration time")
    config.validate()
    reference = one_f_one_b_reference(profile, num_microbatches, config, num_stages)
    if not scheduling_kind(config.scheduling).own_baseline:  # the planner's own baseline is 1F1B at f_max already
        return DeadlineFrom(config, reference, reference.iteration_time_s)
    own = planning_basis(planning_profile(profile, config), num_microbatches, config, num_stages).baseline
    if own.iteration_time_s > reference.iteration_time_s:
        raise PlannerError(
            f"interleaved V={config.virtual_stages} takes {own.iteration_time_s:.4f} s at f_max, longer than 1F1B's "
            f"{reference.iteration_time_s:.4f} s, so it cannot run in 1F1B's time: plan it for its own time (no "
            "deadline from 1F1B) or use --scheduling ours")
    slowdown = reference.iteration_time_s / own.iteration_time_s - 1.0
    return DeadlineFrom(dataclasses.replace(config, max_slowdown=slowdown), reference, own.iteration_time_s)


def reword_warnings(result: PlanResult) -> PlanResult:
    """``result`` with the planner's slowdown warning, which names --max-slowdown, in the deadline's terms
    (a plan to 1F1B's time is slower than interleaved's own f_max on purpose)."""
    result.warnings[:] = [w.replace("as --max-slowdown allows", "to 1F1B's iteration time (deadline from 1F1B)")
                          for w in result.warnings]
    return result


def saving_against(result: PlanResult, reference: Reference) -> float:
    """The plan's energy saving against 1F1B at f_max (clock changes counted, as ``energy_saving``)."""
    return 1.0 - result.energy_j / reference.energy_j if reference.energy_j > 0 else 0.0


def stage_equivalents(schedule: Schedule) -> tuple[float, ...]:
    """Peak in-flight activations per stage in whole-stage micro-batch activations (a chunk's is 1/V)."""
    return tuple(n / schedule.num_chunks for n in schedule.peak_inflight())


def peak_ratio(peaks: Sequence[float], reference: Reference) -> float:
    """The most activations any stage holds, against 1F1B's most (its first stage's)."""
    return max(peaks) / max(reference.peak_inflight)


def interleaved_budget_problem(num_stages: int, num_microbatches: int, virtual_stages: int, budget: Budget,
                               microbatch_group_size: int | None = None) -> str | None:
    """Why Megatron's interleaved order does not fit ``budget`` (micro-batch activations per stage), or None.

    The order is fixed, so its peak is too: the fix is a larger budget or another schedule."""
    if budget is None:
        return None
    try:
        schedule = interleaved_schedule(num_stages, num_microbatches, virtual_stages, microbatch_group_size)
    except ScheduleError as exc:
        return str(exc)
    peaks = stage_equivalents(schedule)
    limits = [budget] * num_stages if isinstance(budget, int) else list(budget)
    if len(limits) != num_stages:
        return (f"{show_budget(budget)} has {len(limits)} entries but the pipeline has {num_stages} stages: give "
                "one per stage")
    over = [s for s, (peak, limit) in enumerate(zip(peaks, limits)) if limit is not None and peak > limit]
    if not over:
        return None
    s = over[0]
    need = ",".join(str(math.ceil(p)) if lim is not None else "none" for p, lim in zip(peaks, limits))
    return (f"{show_budget(budget)}: interleaved V={virtual_stages} holds {peaks[s]:g} micro-batch activations on "
            f"stage {s} ({schedule.peak_inflight()[s]} chunk activations of 1/{virtual_stages} each) in Megatron's "
            f"order, above its budget of {limits[s]}"
            + (f" (stages {over} are over)" if len(over) > 1 else "")
            + f": give at least {need}, or choose a schedule that fits (ours or 1f1b)")


def deadline_summary(result: PlanResult, deadline: DeadlineFrom) -> str:
    """One line: the deadline, where it came from, and the plan against 1F1B at f_max (time, energy, memory)."""
    ref = deadline.reference
    peaks = stage_equivalents(result.schedule)
    cfg = result.config
    own = (f"; interleaved V={cfg.virtual_stages} at f_max {deadline.own_fastest_s:.4f} s, so planned to "
           f"+{100 * cfg.max_slowdown:.2f} % of it" if scheduling_kind(cfg.scheduling).own_baseline else "")
    return (f"deadline from 1F1B at f_max: {ref.iteration_time_s:.4f} s, {ref.energy_j:.1f} J (predicted from "
            f"{ref.profile_source}){own}; plan {result.score.iteration_time_s:.4f} s, {result.energy_j:.1f} J: energy "
            f"saving {100 * saving_against(result, ref):.2f} % against 1F1B at f_max; peak in-flight "
            f"{max(peaks):g} micro-batch activations (per stage {[float(f'{p:g}') for p in peaks]}), "
            f"{peak_ratio(peaks, ref):.2f}x 1F1B's {max(ref.peak_inflight)}")
