"""Record, in a rank, when a schedule enters and leaves no-sync and launches grad / param syncs.

Megatron's schedules drive data-parallel communication through three config
hooks: ``no_sync_func`` (a context during which gradients only accumulate),
``grad_sync_func`` and ``param_sync_func`` (per model chunk in the interleaved
schedule). On CPU the tiny GPT has no DDP wrapper to need them, so
:func:`install_recorders` sets recording stand-ins on the model's config and
wraps the forward step to record each forward's chunk; a same-math test then
compares the event sequence of stock Megatron with EnvPipe's executor's.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

__all__ = ["EVENTS", "install_recorders"]

# This rank's events of the current run, in order.
EVENTS: list[tuple[Any, ...]] = []


def install_recorders(config: Any, models: list[Any],
                      forward_step_func: Callable[..., Any]) -> Callable[..., Any]:
    """Set recording sync hooks on ``config``; return ``forward_step_func`` wrapped to record forwards.

    A sync hook is named by the chunk whose parameters it was given (found by
    the first parameter's identity).
    """
    EVENTS.clear()
    chunk_of = {id(p): v for v, model in enumerate(models) for p in model.parameters()}

    def chunk(params: Any) -> int:
        first = next(iter(params), None)
        return chunk_of.get(id(first), -1)

    @contextlib.contextmanager
    def no_sync() -> Iterator[None]:
        EVENTS.append(("no_sync",))
        yield
        EVENTS.append(("sync",))

    def grad_sync(params: Any) -> None:
        EVENTS.append(("grad_sync", chunk(params)))

    def param_sync(params: Any) -> None:
        EVENTS.append(("param_sync", chunk(params)))

    config.no_sync_func, config.grad_sync_func, config.param_sync_func = no_sync, grad_sync, param_sync
    forward_chunk = {id(model): v for v, model in enumerate(models)}

    def forward_step(data_iterator: Any, model: Any) -> Any:
        EVENTS.append(("forward", forward_chunk.get(id(model), -1)))
        return forward_step_func(data_iterator, model)

    return forward_step
