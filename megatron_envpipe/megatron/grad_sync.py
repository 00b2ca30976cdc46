"""Megatron's gradient and parameter synchronisation around the units, as its own schedules do it.

Megatron's schedules keep data-parallel gradient reduction off (``no_sync``)
while micro-batches accumulate and turn it on for the last backward of each
model; with a distributed optimizer that overlaps communication, they also
launch per-chunk reductions (``grad_sync_func``) and parameter all-gathers
(``param_sync_func``) at fixed points of the iteration. The executor runs
units in a planned order, so it asks one of these objects at each unit:

* :class:`OneChunkSync`: ``forward_backward_pipelining_without_interleaving``'s rules;
* :class:`InterleavedSync`: ``forward_backward_pipelining_with_interleaving``'s
  rules, keyed like Megatron's by the k-th forward / backward of the rank and
  its schedule table (``microbatch_group_size_per_vp_stage``). A chunk's
  gradient reduction is never launched before its last backward ran, so a
  planned order that differs from Megatron's stays correct.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

from megatron_envpipe.core.schedule import Unit

__all__ = ["GradSync", "InterleavedSync", "OneChunkSync"]


def _schedule_table(num_microbatches: int, num_chunks: int, group_size: int) -> list[tuple[int, int]]:
    """Megatron's ``get_schedule_table``: (micro-batch, chunk) of the k-th forward of every rank.

    Micro-batches in groups of ``group_size`` (the last group takes the rest);
    within a group all of chunk 0, then chunk 1, ...
    """
    table = []
    for low in range(0, num_microbatches, group_size):
        high = num_microbatches if low + group_size >= num_microbatches else low + group_size
        table.extend((mb, v) for v in range(num_chunks) for mb in range(low, high))
    return table


class GradSync:
    """The no-sync context of one iteration (Megatron's ``disable_grad_sync`` / ``enable_grad_sync``)."""

    def __init__(self, config: Any, no_sync_func: Callable[[], Any] | None) -> None:
        self.config = config
        self.no_sync_func = no_sync_func or contextlib.nullcontext
        self.context: Any = None

    def disable(self) -> None:
        if self.context is None:
            self.context = self.no_sync_func()
            self.context.__enter__()

    def enable(self) -> None:
        if self.context is not None:
            self.context.__exit__(None, None, None)
            self.context = None

    def begin(self) -> None:
        self.disable()

    def before_forward(self, unit: Unit) -> None:
        """Before the next forward (in program order)."""

    def before_backward(self, unit: Unit) -> None:
        """Before the next backward (in program order)."""

    def after_backward(self, unit: Unit) -> None:
        """After that backward."""

    def finish(self) -> None:
        """After the last unit: launch the remaining reductions."""
        self.enable()

    def abandon(self) -> None:
        """On error: leave no no-sync context open."""
        with contextlib.suppress(Exception):
            self.enable()


class OneChunkSync(GradSync):
    """Megatron's 1F1B: sync on for the last backward (on the first stage, or without grad_sync_func)."""

    def __init__(self, config: Any, model: Any, last_backward: int | None, first_stage: bool) -> None:
        super().__init__(config, config.no_sync_func)
        self.model = model
        self.last_backward = last_backward
        self.first_stage = first_stage

    def before_backward(self, unit: Unit) -> None:
        if unit.microbatch == self.last_backward and (self.config.grad_sync_func is None or self.first_stage):
            self.enable()

    def finish(self) -> None:
        if self.context is not None:
            self.enable()
            if self.config.grad_sync_func is not None:
                self.config.grad_sync_func(self.model.parameters())


class InterleavedSync(GradSync):
    """Megatron's interleaved schedule's rules, for ``models`` (one per chunk) on pipeline rank ``rank``.

    Like Megatron it turns ``config.grad_sync_func`` / ``param_sync_func`` into
    per-chunk lists (in place, as the stock schedule does) and combines a list
    of ``no_sync_func`` into one context.
    """

    def __init__(self, config: Any, models: list[Any], rank: int, num_microbatches: int, group_size: int) -> None:
        no_sync = config.no_sync_func
        if isinstance(no_sync, list):
            funcs = list(no_sync)

            def no_sync() -> Any:
                stack = contextlib.ExitStack()
                for func in funcs:
                    stack.enter_context(func())
                return stack

        super().__init__(config, no_sync)
        if config.grad_sync_func is not None and not isinstance(config.grad_sync_func, list):
            config.grad_sync_func = [config.grad_sync_func for _ in models]
        if config.param_sync_func is not None and not isinstance(config.param_sync_func, list):
            config.param_sync_func = [config.param_sync_func for _ in models]
        self.models = models
        self.rank = rank
        self.m = num_microbatches
        self.v = len(models)
        self.table = _schedule_table(num_microbatches, self.v, group_size)
        self.forwards = 0  # forwards run so far (Megatron's forward virtual micro-batch id)
        self.backwards = 0
        self.left = [num_microbatches] * self.v  # backwards still to run, per chunk
        self.due: list[int] = []  # chunks whose reduction is due but whose backwards are not all done
        self.synchronized: set[int] = set()

    def begin(self) -> None:
        super().begin()
        if self.config.param_sync_func is not None:  # the first two chunks' parameters, up front
            self.config.param_sync_func[0](self.models[0].parameters())
            self.config.param_sync_func[1](self.models[1].parameters())

    def before_forward(self, unit: Unit) -> None:
        k, total = self.forwards, len(self.table)
        self.forwards += 1
        if self.config.param_sync_func is None:
            return
        # Launched at the same moment on every rank: offset by the pipeline rank.
        j = k + self.rank
        if j < total and self.table[j][0] == 0:
            chunk = self.table[j][1] + 1
            if 1 < chunk < self.v:
                self.config.param_sync_func[chunk](self.models[chunk].parameters())

    def before_backward(self, unit: Unit) -> None:
        if self.config.grad_sync_func is None and unit.microbatch == self.m - 1:
            self.enable()  # the chunk's last micro-batch: its backward reduces
            self.synchronized.add(unit.chunk)

    def after_backward(self, unit: Unit) -> None:
        k = self.backwards
        self.backwards += 1
        self.left[unit.chunk] -= 1
        if self.config.grad_sync_func is not None:
            j = k - self.rank
            if j >= 0 and self.table[j][0] == self.m - 1:
                self.due.append(self.v - 1 - self.table[j][1])
            for chunk in [c for c in self.due if self.left[c] == 0]:
                self.due.remove(chunk)
                self.enable()
                self.config.grad_sync_func[chunk](self.models[chunk].parameters())
                self.synchronized.add(chunk)
        self.disable()

    def finish(self) -> None:
        self.enable()
        if self.config.grad_sync_func is not None:
            for chunk in range(self.v):
                if chunk not in self.synchronized:
                    self.config.grad_sync_func[chunk](self.models[chunk].parameters())
                    self.synchronized.add(chunk)
