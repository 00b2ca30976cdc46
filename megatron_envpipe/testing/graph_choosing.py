"""Graph walks whose node durations depend on when a node starts or finishes: references for tests and
benches (the planners fix durations first and call core.graph's ``earliest_times`` / ``latest_times``).
Both relax edges through core.graph's kernel (``ready_s``, ``due_s``)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from megatron_envpipe.core.graph import Edges, due_s, ready_s

__all__ = ["earliest_times_choosing", "latest_times_choosing"]


def earliest_times_choosing(
    order: Sequence[int], preds: Edges, duration_at: Callable[[int, float], float]
) -> tuple[list[float], list[float]]:
    """Like core.graph's ``earliest_times``, each node's duration being ``duration_at(v, start_s)``, in
    ``order``."""
    n = len(preds)
    start = [0.0] * n
    end = [0.0] * n
    for v in order:
        start[v] = t = ready_s(preds[v], end)
        end[v] = t + duration_at(v, t)
    return start, end


def latest_times_choosing(
    order: Sequence[int], succs: Edges, deadline_s: float, duration_at: Callable[[int, float], float]
) -> tuple[list[float], list[float]]:
    """Like core.graph's ``latest_times``, each node's duration being ``duration_at(v, finish_s)``, in
    reverse ``order``."""
    n = len(succs)
    latest_start = [deadline_s] * n
    latest_finish = [deadline_s] * n
    for v in reversed(order):
        latest_finish[v] = t = due_s(succs[v], latest_start, deadline_s)
        latest_start[v] = t - duration_at(v, t)
    return latest_start, latest_finish
