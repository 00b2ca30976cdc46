"""The programs a stage runs, proved deadlock-free; with Megatron's ``variable_seq_lengths``, shape messages.

With variable sequence lengths a receiver does not know a message's size, so
the executor runs the plan's programs with a shape message ahead of every
data message (``core.instructions.with_shape_messages``), on shape channels of
their own (``PipelineChannels(shapes=True)``). Fixed-length runs run the
plan's programs unchanged: the same messages as without this module.

Either way the programs, with the channels' warm-up and NCCL's lazy
communicator creation, are proved deadlock-free by ``check_deadlock`` once
per schedule: their messages depend on the schedule only (clock plans add
``SetFrequency``). The shape variant of the current plan's programs is kept, so
an iteration with the same plan rebuilds nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from megatron_envpipe.core import instructions as ins
from megatron_envpipe.core.communicators import warmup_programs
from megatron_envpipe.core.deadlock import check_deadlock
from megatron_envpipe.core.schedule import Schedule

__all__ = ["ProvedPrograms", "uses_shape_messages"]


def uses_shape_messages(config: Any) -> bool:
    """Megatron exchanges shapes before each transfer (its ``_communicate_shapes``): so does EnvPipe."""
    return bool(getattr(config, "variable_seq_lengths", False))


@dataclass
class ProvedPrograms:
    """The programs to run for a plan, proved once per (schedule, shapes, chunks)."""

    proved: tuple[Schedule, bool, bool] | None = None
    source: tuple[ins.StageProgram, ...] | None = None  # the plan's programs the shaped ones were made from
    shaped: tuple[ins.StageProgram, ...] = ()

    def programs(self, plan: Any, shapes: bool, wrap: bool) -> tuple[ins.StageProgram, ...]:
        """``plan.programs``, with shape messages if ``shapes``; raises DeadlockError if they can hang.

        ``wrap``: model chunks (the wrap-around channels are warmed up too).
        """
        programs = plan.programs
        if shapes:
            if self.source is not programs:
                self.shaped = tuple(ins.with_shape_messages(p) for p in programs)
                self.source = programs  # held, so its identity cannot be reused by another tuple
            programs = self.shaped
        key = (plan.schedule, shapes, wrap)
        if self.proved is None or self.proved[0] is not key[0] or self.proved[1:] != key[1:]:
            check_deadlock(programs, lazy_communicators=True,
                               warmup=warmup_programs(len(programs), wrap=wrap, shapes=shapes))
            self.proved = key
        return programs
