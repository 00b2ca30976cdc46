"""The registries of plan types and schedulings, with their capabilities (the built-in ones are registered
by :mod:`megatron_envpipe.core.kinds`, the module the rest of the package asks). Pure Python.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from megatron_envpipe.core.plan import FrequencyPlan
from megatron_envpipe.core.schedule import Schedule
from megatron_envpipe.errors import EnvPipeError

__all__ = ["KindError", "PlanTypeKind", "SchedulingKind", "plan_kind", "plan_type_names", "register_plan_type",
           "register_scheduling", "scheduling_kind", "scheduling_names"]

# (schedule, f_max_mhz, the stages' energy-valley clocks) -> the plan before any reconfiguration
_InitialPlan = Callable[[Schedule, int, Sequence[int]], FrequencyPlan]
# (num_stages, num_microbatches, clamped extra warm-up or None, model chunks, micro-batch group size) -> Schedule
_BuildSchedule = Callable[[int, int, "Sequence[int] | None", int, "int | None"], Schedule]


class KindError(EnvPipeError, ValueError):
    """An unknown plan type or scheduling, or one registered twice with other capabilities."""


@dataclass(frozen=True)
class PlanTypeKind:
    """A clock plan type (``--envpipe-type`` / ``envpipe plan --type``) and what it can do."""

    name: str
    help: str
    initial_plan: _InitialPlan | None = None  # None: the optimal planner plans it (planning/optimal)
    sets_clocks: bool = True  # some unit runs below f_max (baseline: none)
    has_deadline: bool = False  # planned to an iteration-time deadline (--max-slowdown, --target-time, ...)
    per_iteration_plans: bool = False  # can plan each iteration for its micro-batches' sizes
    follows_stragglers: bool = False  # data-parallel pipelines switch to the slowest one's pace (a frontier)
    reconfigurable: bool = True  # the online correction (--reconfig greedy/balanced) may run on it

    @property
    def optimized(self) -> bool:
        """Planned by the optimal planner (an LP over every unit's clock), not from an initial plan."""
        return self.initial_plan is None


@dataclass(frozen=True)
class SchedulingKind:
    """A per-stage unit order (``--envpipe-scheduling``) and what it can do."""

    name: str
    help: str
    build: _BuildSchedule
    replaces: str  # the Megatron-core schedule function it takes the place of
    extra_warmup: bool = False  # EnvPipe's extra warm-up forwards: warm-up candidates, an activation budget
    model_chunks: bool = False  # runs V model chunks per rank (a virtual pipeline)
    own_baseline: bool = False  # scored against its own order at f_max, not 1F1B at f_max (it shortens
    # 1F1B's bubble itself, and 1F1B cannot run its model chunks)


_PLAN_TYPES: dict[str, PlanTypeKind] = {}
_SCHEDULINGS: dict[str, SchedulingKind] = {}


def _register(table: dict, kind: PlanTypeKind | SchedulingKind, what: str) -> None:
    known = table.get(kind.name)
    if known is not None and known != kind:
        raise KindError(f"{what} {kind.name!r} is registered already, with other capabilities")
    table[kind.name] = kind


def register_plan_type(kind: PlanTypeKind) -> PlanTypeKind:
    """Make ``kind.name`` a plan type of every flag surface (idempotent for an equal kind)."""
    _register(_PLAN_TYPES, kind, "plan type")
    return kind


def register_scheduling(kind: SchedulingKind) -> SchedulingKind:
    """Make ``kind.name`` a scheduling of every flag surface (idempotent for an equal kind)."""
    _register(_SCHEDULINGS, kind, "scheduling")
    return kind


def plan_kind(name: object) -> PlanTypeKind:
    kind = _PLAN_TYPES.get(str(name))
    if kind is None:
        raise KindError(f"unknown plan type {name!r}; choose one of {', '.join(_PLAN_TYPES)}")
    return kind


def scheduling_kind(name: object) -> SchedulingKind:
    kind = _SCHEDULINGS.get(str(name))
    if kind is None:
        raise KindError(f"unknown scheduling {name!r}; choose one of {', '.join(_SCHEDULINGS)}")
    return kind


def plan_type_names() -> tuple[str, ...]:
    """The registered plan types' names, as plain strings (argparse ``choices``)."""
    return tuple(str(name) for name in _PLAN_TYPES)


def scheduling_names() -> tuple[str, ...]:
    return tuple(str(name) for name in _SCHEDULINGS)
