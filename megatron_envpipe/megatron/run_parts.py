"""How the parts of a training run join each iteration: a small begin/end interface.

A part (the simulated straggler, the per-iteration plans' size exchange, the energy ledger's report,
straggler following) owns its own state and sees an iteration through :class:`IterationStep`; the
composition root (megatron/training_run.py) calls every part's ``begin_iteration`` before the phase
machine prepares the iteration and ``end_iteration`` after it finished, in a fixed order that is the
same on every rank (parts run collectives). :class:`RunView` is what a part may read of the run.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from megatron_envpipe.core.hooks import ExecutionHooks
from megatron_envpipe.megatron.groups import StageGroups

if TYPE_CHECKING:  # annotations only: the parts' modules import this one
    from megatron_envpipe.megatron.energy_ledger import EnergyLedger
    from megatron_envpipe.megatron.runtime import EnvPipeRuntime

__all__ = ["IterationStep", "RunPart", "RunView"]


@dataclass(frozen=True)
class IterationStep:
    """One iteration of one rank, as the parts see it."""

    groups: StageGroups
    hooks: ExecutionHooks
    iteration: int  # 0-based, the phase machine's count when the iteration began
    num_microbatches: int
    own_time_s: float | None = None  # at the end: the pipeline's own time, without the data-parallel wait


class RunPart(Protocol):
    """A part of a training run joined to every iteration."""

    def begin_iteration(self, step: IterationStep) -> None: ...

    def end_iteration(self, step: IterationStep) -> None: ...


class RunView(Protocol):
    """What the parts read of a run: the phase machine, the energy ledger, the optional parts."""

    @property
    def phases(self) -> EnvPipeRuntime: ...

    @property
    def energy(self) -> EnergyLedger: ...

    @property
    def stragglers(self) -> Any: ...  # megatron/stragglers.StragglerFollow, or None before the first end

    @property
    def iteration_plans(self) -> Any: ...  # megatron/iteration_plans.IterationPlans, or None
