"""The checks of ``--envpipe-deadline-from`` (planning/deadline.py): alone, and against the pipeline's sizes.
Pure Python."""

from __future__ import annotations

from typing import Any

from megatron_envpipe.core.kinds import plan_kind, scheduling_kind
from megatron_envpipe.core.memory import AUTO
from megatron_envpipe.flag_types import EnvPipeConfigError, is_whole
from megatron_envpipe.planning.deadline import DEADLINE_FROM_NAMES, interleaved_budget_problem


def check_deadline_from(config: Any) -> None:
    """``--envpipe-deadline-from 1f1b``: a known schedule, an optimal plan, and no other deadline
    (``config``: an EnvPipeConfig)."""
    if config.deadline_from is None:
        return
    flag = f"--envpipe-deadline-from {config.deadline_from}"
    if config.deadline_from not in DEADLINE_FROM_NAMES:
        raise EnvPipeConfigError(f"{flag}: choose {', '.join(DEADLINE_FROM_NAMES)} (the schedule whose iteration "
                                 "time at the maximum clock is the deadline)")
    if not plan_kind(config.plan_type).has_deadline:
        raise EnvPipeConfigError(f"{flag} plans to 1F1B's iteration time, which needs --envpipe-type optimal (this "
                                 f"run has --envpipe-type {config.plan_type}): add --envpipe-type optimal")
    for other, given in (("--envpipe-max-slowdown", bool(config.max_slowdown)),
                         ("--envpipe-target-time", config.target_time_s is not None)):
        if given:
            raise EnvPipeConfigError(f"{flag} and {other} both set the optimal plan's deadline: give only one")
    if config.per_iteration_plans:
        raise EnvPipeConfigError(f"{flag} plans one deadline for the run, --envpipe-per-iteration-plans each "
                                 "iteration for the stock time at its sizes: drop one of them")


def check_interleaved_budget(config: Any, num_stages: int, num_microbatches: int | None, virtual_stages: int,
                             args: Any) -> None:
    """With a deadline from 1F1B, an interleaved run's peak activations (Megatron's order: known at start-up)
    fit a numeric ``--envpipe-max-inflight``; ``auto`` is not measured for interleaved runs (the plan logs
    what it needs). ``args``: Megatron's namespace (its micro-batch group size)."""
    budget = config.max_inflight
    if (not scheduling_kind(config.scheduling).model_chunks or config.deadline_from is None or budget == AUTO
            or budget is None or not is_whole(num_microbatches)):
        return
    group = getattr(args, "microbatch_group_size_per_vp_stage", None)
    problem = interleaved_budget_problem(num_stages, num_microbatches, virtual_stages, budget,
                                         group if is_whole(group) else None)
    if problem:
        raise EnvPipeConfigError(f"--envpipe-max-inflight {problem}")
