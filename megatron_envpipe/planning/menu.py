"""A menu of time and energy: every schedule we run, at 1F1B's iteration time and at its own fastest.

For one profile and M, :func:`build_menu` plans (``--type optimal``, the planner's public entry point)
1F1B, ``ours`` within the activation budget and interleaved V = 2 where Megatron allows M, each to 1F1B's
iteration time at f_max and to its own fastest time (its own f_max iteration). 1F1B and ``ours`` are scored
against 1F1B at f_max already, so their two deadlines are one; interleaved is faster at f_max, so it has two
rows. Every row states its iteration time, energy, saving against 1F1B at f_max, peak activations per stage
against 1F1B's, and the ``envpipe plan`` flags that give the same numbers. Pure Python.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from megatron_envpipe.core.interleaved import check_interleaved_sizes
from megatron_envpipe.core.kinds import scheduling_kind
from megatron_envpipe.core.memory import show_budget
from megatron_envpipe.core.profile import Profile
from megatron_envpipe.core.schedule import ScheduleError
from megatron_envpipe.core.vocabulary import PlanType, ReconfigPolicy, Scheduling
from megatron_envpipe.planning.basis import PlannerConfig, PlannerError, PlanResult
from megatron_envpipe.planning.deadline import (
    Reference,
    deadline_from_1f1b,
    interleaved_budget_problem,
    one_f_one_b_reference,
    peak_ratio,
    reword_warnings,
    saving_against,
    stage_equivalents,
)
from megatron_envpipe.planning.planner import plan_envpipe

MENU_SCHEDULES = ("1f1b", "ours", "interleaved")
AT_1F1B = "1F1B's time"
_AT_OWN = "own fastest"


@dataclass(frozen=True)
class MenuRow:
    schedule: str  # "1F1B at f_max" (the reference), "1f1b", "ours", "interleaved V=2"
    deadline: str  # "f_max", AT_1F1B (for 1f1b and ours also their own fastest), _AT_OWN
    iteration_time_s: float
    energy_j: float
    saving: float  # against 1F1B at f_max
    peak_inflight: tuple[float, ...]  # per stage, in whole-stage micro-batch activations
    peak_ratio: float  # the most any stage holds, against 1F1B's most
    plan_flags: str  # the `envpipe plan` flags that give this row
    result: PlanResult | None = field(default=None, compare=False, repr=False)


@dataclass(frozen=True)
class Menu:
    profile_source: str
    num_stages: int
    num_microbatches: int
    reference: Reference
    rows: tuple[MenuRow, ...]
    notes: tuple[str, ...]  # rows left out, and why


def _row(label: str, deadline: str, result: PlanResult, reference: Reference, flags: str) -> MenuRow:
    peaks = stage_equivalents(result.schedule)
    return MenuRow(label, deadline, result.score.iteration_time_s, result.energy_j, saving_against(result, reference),
                   peaks, peak_ratio(peaks, reference), flags, result)


def build_menu(profile: Profile, num_microbatches: int, config: PlannerConfig, num_stages: int | None = None,
               schedules: tuple[str, ...] = MENU_SCHEDULES, virtual_stages: int = 2) -> Menu:
    """The menu for ``profile`` and M. ``config`` holds what every row shares (GPU, P2P power and latency,
    switch cost, clock-change budget) and the activation budget ``max_inflight`` (``ours`` plans within it;
    interleaved must fit it: PlannerError otherwise, checked before any plan is made)."""
    unknown = [s for s in schedules if s not in MENU_SCHEDULES]
    if unknown or not schedules:
        raise PlannerError(f"menu schedules {', '.join(unknown) or '(none)'}: choose among {', '.join(MENU_SCHEDULES)}")
    base = dataclasses.replace(config, plan_type=PlanType.OPTIMAL, reconfig=ReconfigPolicy.DEFAULT, max_slowdown=0.0,
                               target_time_s=None, extra_warmup=None, virtual_stages=1, microbatch_group_size=None)
    budget = config.max_inflight
    reference = one_f_one_b_reference(profile, num_microbatches, base, num_stages)
    p = profile.num_stages if num_stages is None else num_stages
    notes: list[str] = []
    interleaved = "interleaved" in schedules
    if interleaved:
        try:
            check_interleaved_sizes(p, num_microbatches, virtual_stages)
        except ScheduleError as exc:
            interleaved = False
            notes.append(f"interleaved V={virtual_stages} left out: {exc}")
    if interleaved:
        problem = interleaved_budget_problem(p, num_microbatches, virtual_stages, budget)
        if problem:
            raise PlannerError(f"--max-inflight {problem}; or leave interleaved out of the menu")
    fmax = MenuRow("1F1B at f_max", "f_max", reference.iteration_time_s, reference.energy_j, 0.0,
                   tuple(float(n) for n in reference.peak_inflight), 1.0, "--type baseline --scheduling 1f1b")
    rows = [fmax]
    shown_budget = f" --max-inflight {show_budget(budget)}" if budget is not None else ""
    for name in (n for n in MENU_SCHEDULES if not scheduling_kind(n).model_chunks):  # interleaved: below
        if name in schedules:
            warmup = scheduling_kind(name).extra_warmup  # the activation budget limits the extra warm-up
            cfg = dataclasses.replace(base, scheduling=name, max_inflight=budget if warmup else None)
            result = plan_envpipe(profile, num_microbatches, cfg, num_stages)
            flags = f"--type optimal --scheduling {name}" + (shown_budget if warmup else "")
            rows.append(_row(name, AT_1F1B, result, reference, flags))
    if interleaved:
        cfg = dataclasses.replace(base, scheduling=Scheduling.INTERLEAVED, virtual_stages=virtual_stages,
                                  max_inflight=None)
        flags = f"--type optimal --scheduling interleaved --virtual-stages {virtual_stages}"
        label = f"interleaved V={virtual_stages}"
        deadline = deadline_from_1f1b(profile, num_microbatches, cfg, num_stages)
        at_1f1b = reword_warnings(plan_envpipe(profile, num_microbatches, deadline.config, num_stages))
        rows.append(_row(label, AT_1F1B, at_1f1b, reference, flags + " --deadline-from 1f1b"))
        own = plan_envpipe(profile, num_microbatches, cfg, num_stages)
        rows.append(_row(label, _AT_OWN, own, reference, flags))
    return Menu(profile.source, p, num_microbatches, reference, tuple(rows), tuple(notes))
