"""A plan's iteration as it runs when clock changes take time to land (latency-aware prediction).

The device dynamics (core/device_dynamics.py, the simulated GPU's model) say: a lock request at
time ``r`` is issued at ``max(r, driver free)`` (one NVML call at a time, ``nvml_call_s`` each) and
the SMs run at the new clock from ``issued + latency_s``; until then they keep the old one. A unit
running when a change lands continues its remaining work fraction at the new clock (fraction x
t(f_new)) and draws the new clock's power (E(f)/t(f)); outside units a stage draws the P2P power.

When each change is requested is the executor's (gpu/hooks.py), by :class:`ClockLead`:

* a change to unit k+1's clock is requested at unit k's end (the boundary: the executor's
  ``SetFrequency`` comes before the wait for k+1's input, so it may land during that wait);
* with the rule on, a raise is requested ``ClockLead.request_after_begin_s`` after unit k's begin
  (from unit k's *planned* time), and the boundary's request is skipped; the hooks wait for that
  moment inside unit k, so a stage is free again at ``max(unit end, request)``;
* the iteration's first clock is requested at t = 0 when the stage's SMs run another clock
  (``initial_mhz``: by default the stage's last planned clock, the previous iteration's).

One pass in the dependency graph's topological order is exact: a unit's start needs only its
producers' ends and its own stage's state (clock, pending changes, driver), all settled earlier in
that order. With zero latency this is :meth:`PlanEvaluator.score` exactly. Pure Python.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from megatron_envpipe.core.clock_lead import ClockLead, ClockLeadError
from megatron_envpipe.core.graph import ready_s
from megatron_envpipe.core.timeline import PlanEvaluator, PlanScore, Timeline, score_timeline
from megatron_envpipe.errors import InvalidValueError

__all__ = ["LatencyPrediction", "predict_with_latency"]


@dataclass(frozen=True)
class LatencyPrediction:
    """One iteration of a plan under clock latency: its timeline, score and what the changes did."""

    timeline: Timeline
    score: PlanScore
    requests: int  # lock requests made
    led: int  # raises requested ahead of their boundary (the lead rule)
    late_raises: int  # raises that had not landed when the unit they were for began
    lead: ClockLead
    nvml_call_s: float


class _Stage:
    """One stage's clock state as the prediction walks its units."""

    __slots__ = ("free_s", "sm_mhz", "pending", "driver_free_s", "requests")

    def __init__(self, sm_mhz: int) -> None:
        self.free_s = 0.0  # when the stage can start its next unit
        self.sm_mhz = sm_mhz  # what the SMs run at (changes landed so far)
        self.pending: deque[tuple[float, int]] = deque()  # (lands at, clock), in landing order
        self.driver_free_s = -math.inf  # when the next NVML call can be issued
        self.requests = 0

    def request(self, at_s: float, mhz: int, latency_s: float, call_s: float) -> float:
        """Ask for ``mhz`` at ``at_s``; return when the SMs reach it."""
        issued = max(at_s, self.driver_free_s)
        self.driver_free_s = issued + call_s
        lands = issued + latency_s
        self.pending.append((lands, mhz))
        self.requests += 1
        return lands


def predict_with_latency(
    evaluator: PlanEvaluator,
    freqs: Sequence[int],
    lead: ClockLead,
    *,
    nvml_call_s: float = 0.0,
    initial_mhz: Sequence[int] | None = None,
) -> LatencyPrediction:
    """The iteration of ``freqs`` (aligned with ``evaluator.graph.nodes``) when every clock change
    lands ``lead.latency_s`` after its request, requested as ``lead`` says (module docstring).

    ``nvml_call_s``: the part of the latency the call occupies on the stage's one clock worker
    (<= latency). ``initial_mhz``: per stage, the clock its SMs run at when the iteration starts
    (default: the stage's last planned clock, as when iterations repeat)."""
    graph = evaluator.graph
    n = len(graph.nodes)
    if len(freqs) != n:
        raise InvalidValueError(f"need {n} unit clocks, got {len(freqs)}")
    latency_s = lead.latency_s
    if not 0.0 <= nvml_call_s <= latency_s:
        raise ClockLeadError(f"nvml_call_s must be between 0 and the latency ({latency_s:g} s), got {nvml_call_s!r}")
    planned_s = evaluator.durations(freqs)  # raises on a clock the profile lacks
    num_stages = graph.schedule.num_stages
    # Per stage: its nodes in order (first/next unit lookups).
    stage_nodes: list[list[int]] = [[] for _ in range(num_stages)]
    for v in range(n):
        stage_nodes[graph.stage_of[v]].append(v)
    position = [0] * n
    for nodes in stage_nodes:
        for k, v in enumerate(nodes):
            position[v] = k
    if initial_mhz is None:
        initial_mhz = [freqs[nodes[-1]] if nodes else 0 for nodes in stage_nodes]
    elif len(initial_mhz) != num_stages:
        raise InvalidValueError(f"need one initial clock per stage ({num_stages}), got {len(initial_mhz)}")
    stages = [_Stage(int(m)) for m in initial_mhz]
    for s, nodes in enumerate(stage_nodes):
        if nodes and freqs[nodes[0]] != stages[s].sm_mhz:
            stages[s].request(0.0, freqs[nodes[0]], latency_s, nvml_call_s)

    start = [0.0] * n
    end = [0.0] * n
    energy = [0.0] * n
    duration = [0.0] * n
    led = late = 0
    for v in graph.order:
        s = graph.stage_of[v]
        st = stages[s]
        b = max(st.free_s, ready_s(graph.cross_preds[v], end))  # free_s >= 0: the same max as edge by edge
        # Changes that landed before the unit begins (while the stage waited for input).
        while st.pending and st.pending[0][0] <= b:
            st.sm_mhz = st.pending.popleft()[1]
        if st.pending and freqs[v] > st.sm_mhz:
            late += 1  # the raise this unit was meant to run at is still on its way
        nodes, k = stage_nodes[s], position[v]
        nxt = nodes[k + 1] if k + 1 < len(nodes) else None
        ahead_at = None
        if nxt is not None and freqs[nxt] != freqs[v]:
            offset = lead.request_after_begin_s(freqs[v], freqs[nxt], planned_s[v])
            if offset is not None:
                ahead_at = b + offset
                st.request(ahead_at, freqs[nxt], latency_s, nvml_call_s)
                led += 1
        # Run the unit through the changes that land while it runs.
        key = evaluator.cost_keys[v]
        cur, work, e = b, 1.0, 0.0
        point = evaluator.key_point(key, st.sm_mhz)
        while st.pending and st.pending[0][0] < cur + work * point.time_s:
            lands, mhz = st.pending.popleft()
            if lands > cur:
                done = (lands - cur) / point.time_s
                e += point.energy_j * done
                work -= done
                cur = lands
            st.sm_mhz = mhz
            point = evaluator.key_point(key, mhz)
        e += point.energy_j * work
        rest_s = work * point.time_s
        start[v], end[v], energy[v] = b, cur + rest_s, e
        duration[v] = (cur - b) + rest_s  # exactly the profile's time when no change landed
        st.free_s = end[v] if ahead_at is None else max(end[v], ahead_at)
        if nxt is not None and freqs[nxt] != freqs[v] and ahead_at is None:
            st.request(st.free_s, freqs[nxt], latency_s, nvml_call_s)

    timeline = Timeline(graph, start, end, duration)
    score = score_timeline(timeline, energy, evaluator.p2p_power_w)
    return LatencyPrediction(timeline, score, sum(st.requests for st in stages), led, late, lead, float(nvml_call_s))
