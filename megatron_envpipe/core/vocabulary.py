"""The project's vocabulary: one ``str`` Enum per closed set of names.

Each member *is* its string (``PlanType.ENVELOPE == "envelope"``, same hash,
prints and serialises to JSON as ``envelope``), so flags, JSON keys and plan
files keep their spelling while code compares against one definition.
"""

from __future__ import annotations

from enum import StrEnum


def coerce_enum(enum: type[StrEnum], value: object) -> object:
    """``value`` as a member of the str Enum ``enum`` if it names one; anything else unchanged
    (left for ``validate()`` to report in its own words)."""
    if isinstance(value, enum):
        return value
    try:
        return enum(value)
    except (ValueError, TypeError):
        return value


class UnitKind(StrEnum):
    """A pipeline unit: one micro-batch's forward or backward on one stage."""

    FORWARD = "F"
    BACKWARD = "B"

    @property
    def instruction(self) -> str:
        """The name a Perseus-format profile uses: ``forward`` / ``backward``."""
        return "forward" if self is UnitKind.FORWARD else "backward"


class PlanType(StrEnum):
    """The initial clock plan (EnvPipe §3), or the optimal per-unit plan."""

    BASELINE = "baseline"  # every unit at f_max
    UNIFORM = "uniform"  # each stage at its energy-valley clock
    ENVELOPE = "envelope"  # the outer envelope at f_max, the rest at the valley
    OPTIMAL = "optimal"  # minimum energy per unit under an iteration-time deadline


class Scheduling(StrEnum):
    """The per-stage unit order."""

    ONE_F_ONE_B = "1f1b"  # Megatron's non-interleaved 1F1B
    OURS = "ours"  # EnvPipe: r_s extra warm-up forwards per stage
    INTERLEAVED = "interleaved"  # Megatron's interleaved 1F1B: V model chunks (virtual stages) per stage


class ReconfigPolicy(StrEnum):
    """How clocks on the critical path are raised (EnvPipe §4)."""

    DEFAULT = "default"  # none
    GREEDY = "greedy"  # the first non-max unit from the path's end, 3 steps
    BALANCED = "balanced"  # every path unit at the path's minimum clock, one step


class CommModel(StrEnum):
    """How neighbouring stages exchange messages."""

    PER_DIRECTION = "per-direction"  # one channel per direction (our executor)
    PAIRED = "paired"  # EnvPipe-KISTI / §8.5: an activation waits for a gradient


PLAN_TYPES = tuple(PlanType)
SCHEDULINGS = tuple(Scheduling)
RECONFIG_POLICIES = tuple(ReconfigPolicy)
INSTRUCTIONS = tuple(k.instruction for k in UnitKind)  # ("forward", "backward")

# Plain strings for argparse ``choices``: it lists choices with repr() in "invalid choice" errors.
RECONFIG_NAMES = tuple(r.value for r in ReconfigPolicy)
COMM_NAMES = tuple(c.value for c in CommModel)
