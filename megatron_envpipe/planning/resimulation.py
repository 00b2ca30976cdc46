"""Re-simulating a timeline after a few units' durations changed (EnvPipe's reconfiguration loop raises a
handful of clocks per iteration, hundreds of iterations per plan): the same times as a full simulation."""

from __future__ import annotations

from collections.abc import Sequence

from megatron_envpipe.core.graph import EdgeLists, earliest_steps_from
from megatron_envpipe.core.timeline import PipelineGraph, Timeline


class Resimulator:
    """``graph.simulate(durations)`` after a few units' durations changed: the walk resumes at the first changed
    unit in the graph's topological order (the units before it keep their times: none of their inputs changed),
    with :func:`~megatron_envpipe.core.graph.earliest_times`' own steps and walk (``earliest_steps_from``), so the times
    are the same to the bit."""

    def __init__(self, graph: PipelineGraph) -> None:
        self.graph = graph
        preds = graph.preds
        steps = preds.steps() if isinstance(preds, EdgeLists) and preds.walks(graph.order, backward=False) else None
        self.steps = steps
        self.position = [0] * len(graph.nodes)
        for k, step in enumerate(steps or ()):
            self.position[step[0]] = k

    def simulate(self, before: Timeline, durations_s: Sequence[float], changed: Sequence[int]) -> Timeline:
        """The timeline with ``durations_s``, which differ from ``before``'s at the units ``changed`` only."""
        steps = self.steps
        if steps is None or not changed:
            return self.graph.simulate(durations_s)
        start = list(before.start_s)
        end = list(before.end_s)
        end.append(0.0)  # the absent edge's slot (core/graph.py's flat steps)
        earliest_steps_from(steps, min(self.position[v] for v in changed), start, end, durations_s)
        end.pop()
        return Timeline(self.graph, start, end, list(durations_s))
