"""Re-simulating a timeline after a few units' durations changed (EnvPipe's reconfiguration loop raises a
handful of clocks per iteration, hundreds of iterations per plan): the same times as a full simulation."""

from __future__ import annotations

from collections.abc import Sequence

from megatron_envpipe.core.graph import EdgeLists, earliest_pairs_from, earliest_steps_from
from megatron_envpipe.core.timeline import PipelineGraph, Timeline


class Resimulator:
    """``graph.simulate(durations)`` after a few units' durations changed: the walk resumes at the first changed
    unit in the graph's topological order (the units before it keep their times: none of their inputs changed),
    with :func:`~megatron_envpipe.core.graph.earliest_times`' own steps and walk (``earliest_steps_from``, or
    ``earliest_pairs_from`` where every latency is 0), so the times are the same to the bit."""

    def __init__(self, graph: PipelineGraph) -> None:
        self.graph = graph
        preds = graph.preds
        steps = preds.steps() if isinstance(preds, EdgeLists) and preds.walks(graph.order, backward=False) else None
        self.steps = steps
        self.pairs = preds.pairs() if steps is not None and isinstance(preds, EdgeLists) else None
        self.position = [0] * len(graph.nodes)
        for k, step in enumerate(steps or ()):
            self.position[step[0]] = k

    def simulate(self, before: Timeline, durations_s: Sequence[float], changed: Sequence[int]) -> Timeline:
        """The timeline with ``durations_s``, which differ from ``before``'s at the units ``changed`` only."""
        if self.steps is None or not changed:
            return self.graph.simulate(durations_s)
        return self._resume(list(before.start_s), list(before.end_s), durations_s, changed)

    def advance(self, before: Timeline, durations_s: Sequence[float], changed: Sequence[int]) -> Timeline:
        """:meth:`simulate`, reusing ``before``'s time lists: ``before`` is spent (a loop that keeps only its
        latest timeline saves two copies of every unit's times per step)."""
        if self.steps is None or not changed:
            return self.graph.simulate(durations_s)
        return self._resume(before.start_s, before.end_s, durations_s, changed)

    def _resume(self, start: list[float], end: list[float], durations_s: Sequence[float],
                changed: Sequence[int]) -> Timeline:
        first = min([self.position[v] for v in changed])
        end.append(0.0)  # the absent edge's slot (core/graph.py's flat steps)
        if self.pairs is not None:
            earliest_pairs_from(self.pairs, first, start, end, durations_s)
        else:
            earliest_steps_from(self.steps or (), first, start, end, durations_s)
        end.pop()
        return Timeline(self.graph, start, end, list(durations_s))
