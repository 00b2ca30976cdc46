"""Plan types and schedulings as registries of capabilities, asked instead of comparing names.

A plan type says what it can do (``sets_clocks``, ``has_deadline``, ``per_iteration_plans``,
``follows_stragglers``, ``reconfigurable``) and how its initial plan is made
(``initial_plan(schedule, f_max_mhz, inner_mhz)``; None: the optimal planner makes it). A
scheduling says how it is built (``build``), whether it has EnvPipe's extra warm-up
(``extra_warmup``: warm-up candidates per stage, an activation budget) or model chunks, and which
Megatron function it replaces. A new one is one ``register_plan_type`` / ``register_scheduling``
call (:mod:`~megatron_envpipe.core.kind_registry`) in its own module (docs/design.md shows a "fixed
clock per stage" plan type, registered in tests/core/test_kinds.py). This module registers the
built-in ones; ask it (``plan_kind``, ``scheduling_kind``, the names), so they are always there. Pure Python.
"""

from __future__ import annotations

from collections.abc import Sequence

from megatron_envpipe.core.interleaved import interleaved_schedule
from megatron_envpipe.core.kind_registry import (
    KindError,
    PlanTypeKind,
    SchedulingKind,
    plan_kind,
    plan_type_names,
    register_plan_type,
    register_scheduling,
    scheduling_kind,
    scheduling_names,
)
from megatron_envpipe.core.plan import FrequencyPlan
from megatron_envpipe.core.schedule import Schedule, ScheduleError, check_extra_warmup, envpipe_schedule, one_f_one_b
from megatron_envpipe.core.timeline import outer_envelope
from megatron_envpipe.core.vocabulary import PlanType, Scheduling

__all__ = ["KindError", "PlanTypeKind", "SchedulingKind", "build_schedule", "plan_kind", "plan_type_names", "register_plan_type",
           "register_scheduling", "scheduling_kind", "scheduling_names"]


# -- the built-in ones --------------------------------------------------------------------------------

def _baseline(schedule: Schedule, f_max: int, inner_mhz: Sequence[int]) -> FrequencyPlan:
    return FrequencyPlan.constant(schedule, [f_max] * schedule.num_stages)


def _uniform(schedule: Schedule, f_max: int, inner_mhz: Sequence[int]) -> FrequencyPlan:
    return FrequencyPlan.constant(schedule, inner_mhz)


def _envelope(schedule: Schedule, f_max: int, inner_mhz: Sequence[int]) -> FrequencyPlan:
    env = outer_envelope(schedule)
    return FrequencyPlan(schedule, tuple(tuple(f_max if (s, u) in env else int(inner_mhz[s]) for u in order)
                                         for s, order in enumerate(schedule.orders)))


def _ours(p: int, m: int, extra_warmup: Sequence[int] | None, chunks: int, group: int | None) -> Schedule:
    if extra_warmup is None:
        raise ScheduleError("scheduling 'ours' needs the extra warm-up per stage")
    return envpipe_schedule(p, m, extra_warmup)


_NON_INTERLEAVED = "forward_backward_pipelining_without_interleaving"

register_plan_type(PlanTypeKind(PlanType.BASELINE, "all at f_max", _baseline, sets_clocks=False))
register_plan_type(PlanTypeKind(PlanType.UNIFORM, "each stage at its energy-valley clock", _uniform))
register_plan_type(PlanTypeKind(PlanType.ENVELOPE, "outer envelope at f_max and the rest at the valley", _envelope))
register_plan_type(PlanTypeKind(PlanType.OPTIMAL, "the minimum-energy plan meeting a deadline", None,
                                has_deadline=True, per_iteration_plans=True, follows_stragglers=True))
register_scheduling(SchedulingKind(Scheduling.ONE_F_ONE_B, "Megatron's 1F1B", lambda p, m, r, v, g: one_f_one_b(p, m),
                                   _NON_INTERLEAVED))
register_scheduling(SchedulingKind(Scheduling.OURS, "EnvPipe's extended warm-up", _ours, _NON_INTERLEAVED,
                                   extra_warmup=True))
register_scheduling(SchedulingKind(Scheduling.INTERLEAVED, "Megatron's interleaved 1F1B (model chunks)",
                                   lambda p, m, r, v, g: interleaved_schedule(p, m, v, g),
                                   "forward_backward_pipelining_with_interleaving", model_chunks=True,
                                   own_baseline=True))


def build_schedule(
    scheduling: str,
    num_stages: int,
    num_microbatches: int,
    extra_warmup: Sequence[int] | None = None,
    num_chunks: int = 1,
    microbatch_group_size: int | None = None,
) -> Schedule:
    """Schedule by registered name: ``1f1b``, ``ours`` (needs clamped ``extra_warmup``, one per stage) or
    ``interleaved``; the scheduling's ``build`` makes it.

    ``num_chunks`` (Megatron's virtual pipeline size V) and ``microbatch_group_size``
    (its ``microbatch_group_size_per_vp_stage``, default P) apply to a scheduling with model chunks only;
    a non-zero ``extra_warmup`` to one with EnvPipe's extra warm-up only (silently dropping it would hide a
    mistake). ScheduleError otherwise, and for an unknown name.
    """
    kind = scheduling_kind(scheduling) if str(scheduling) in scheduling_names() else None
    if kind is None or not kind.model_chunks:
        if num_chunks != 1:
            raise ScheduleError(
                f"scheduling {str(scheduling)!r} runs one model chunk per stage (got {num_chunks} virtual stages): "
                "use scheduling 'interleaved' for a virtual pipeline"
            )
        if microbatch_group_size is not None:
            raise ScheduleError(
                f"a micro-batch group size applies to scheduling 'interleaved' only, not {str(scheduling)!r}"
            )
    if kind is None:
        raise ScheduleError(f"unknown scheduling {scheduling!r}; choose one of {', '.join(scheduling_names())}")
    if not kind.extra_warmup and extra_warmup is not None and any(check_extra_warmup(num_stages, extra_warmup)):
        raise ScheduleError(
            f"scheduling {str(scheduling)!r} has no extra warm-up (got {list(extra_warmup)}): "
            "use scheduling 'ours' or drop it"
        )
    return kind.build(num_stages, num_microbatches, extra_warmup, num_chunks, microbatch_group_size)
