"""Issue 20: behaviours that could break unnoticed (each test was checked by breaking the code once).

* the online reconfigurer's hysteresis: an iteration late by less than the tolerance neither undoes a
  raise nor raises again (``Reconfigurer.observe``: ``late`` vs ``slack``);
* the optimal planner's rounding keeps the cheapest of its candidate roundings, wherever it comes
  (``ClockSearch.round``);
* the largest threshold scale the flags accept still lets the measured walk follow a real critical
  wait: the floor is capped at 1 % of the last stage's unit time (``measured_critical_path``).
  (``--envpipe-threshold-scale inf`` itself is refused by the flag.)
"""

from __future__ import annotations

import pytest

from megatron_envpipe.core.flag_ranges import RANGES
from megatron_envpipe.core.gpu_specs import get_gpu_spec
from megatron_envpipe.core.measurement import IterationMeasurement, UnitTiming
from megatron_envpipe.core.plan import FrequencyPlan
from megatron_envpipe.core.profile import Profile
from megatron_envpipe.core.resources import shipped_profile
from megatron_envpipe.core.schedule import one_f_one_b
from megatron_envpipe.core.timeline import PipelineGraph
from megatron_envpipe.planning.basis import PlannerConfig
from megatron_envpipe.planning.optimal.entry import optimal_setup
from megatron_envpipe.planning.reconfig import ClockLadder, Reconfigurer

LOW, HIGH = 900, 1500


def measurement(graph: PipelineGraph, durations: list[float]) -> IterationMeasurement:
    return graph.simulate(durations).measurement()


# -- 1. hysteresis -----------------------------------------------------------------------
def test_late_within_the_tolerance_neither_lowers_nor_raises():
    sched = one_f_one_b(2, 4)
    graph = PipelineGraph(sched)
    n = len(graph.nodes)
    on_time = measurement(graph, [1.0] * n)
    target = on_time.iteration_time_s()
    tol = 0.01
    ladder = ClockLadder(range(LOW, HIGH + 1, 30), 30)  # room for more raises than one
    rc = Reconfigurer(FrequencyPlan.constant(sched, [LOW, LOW]), "balanced", ladder,
                      target_time_s=target, time_tolerance=tol, window=1, finish_limit=100)
    rc.observe(measurement(graph, [1.05] * n))  # 5 % late: one raise
    assert rc.raises == 1 and rc.lowers == 0
    raised = rc.plan
    # Half the tolerance late (uniform stretch: the time scales exactly): inside the band, no change.
    within = measurement(graph, [1.0 + tol / 2] * n)
    assert target < within.iteration_time_s() <= target * (1 + tol)
    for _ in range(5):
        assert rc.observe(within) == raised
    assert rc.raises == 1 and rc.lowers == 0 and len(rc.stack) == 1
    # On time again: now the raise is undone (the band is what kept it).
    assert rc.observe(on_time) == FrequencyPlan.constant(sched, [LOW, LOW])
    assert rc.lowers == 1


# -- 2. rounding keeps the cheapest candidate ---------------------------------------------
def test_rounding_keeps_the_cheapest_candidate_not_the_first_or_last(monkeypatch):
    profile = Profile.from_csv(shipped_profile("a40/gpt3-175b")).for_pipeline(4)
    config = PlannerConfig("optimal", "1f1b", "default", gpu=get_gpu_spec("a40"))
    setup = optimal_setup(profile, 4, config)
    model = setup.model(setup.schedules[0][1], profile, config)
    search = model.search()
    n = model.n
    # Six distinct option vectors (one per rounding the search tries): every unit at option j.
    vectors = [[min(j, len(model.times[v]) - 1) for v in range(n)] for j in range(6)]
    costs = [model.cost(v) for v in vectors]
    assert len(set(costs)) == 6
    by_cost = sorted(range(6), key=costs.__getitem__)
    # The cheapest third, the dearest first and last: neither "first" nor "last" is the answer.
    order = [by_cost[5], by_cost[3], by_cost[0], by_cost[2], by_cost[1], by_cost[4]]
    handed = iter([vectors[i] for i in order])
    monkeypatch.setattr(search, "settle", lambda idx, deadline, first="f", max_passes=6: list(next(handed)))
    fastest = model.fastest_time_s()
    chosen = search.round(model.durations([0] * n), 1.5 * fastest)
    assert chosen == vectors[by_cost[0]]


# -- 3. the largest threshold scale -------------------------------------------------------
def test_largest_threshold_scale_still_follows_a_real_critical_wait():
    scale = RANGES["threshold_scale"].high  # the flag's upper bound (inf is refused)
    sched = one_f_one_b(2, 4)
    graph = PipelineGraph(sched)
    # Stage 1 (the last) 10 % slower: stage 0 waits ~0.1-0.2 s for its gradients.
    base = measurement(graph, [1.1 if s == 1 else 1.0 for s in graph.stage_of])
    noise = 0.002  # the last stage's quiet receives: scale x noise = 2 s would hide every real wait
    stages = list(base.stages)
    stages[1] = tuple(UnitTiming(t.unit, t.start_s, t.end_s, t.recv_wait_s if i == 0 else noise)
                      for i, t in enumerate(stages[1]))
    late = IterationMeasurement(tuple(stages))
    waits = [t.recv_wait_s for t in late.stages[0] if t.recv_wait_s > 0]
    assert waits and max(waits) < scale * noise  # without the cap no wait would count
    rc = Reconfigurer(FrequencyPlan.constant(sched, [LOW, LOW]), "balanced", ClockLadder([LOW, HIGH], 30),
                      threshold_scale=scale, target_time_s=0.5 * late.iteration_time_s(), window=1)
    rc.observe(late)
    assert rc.threshold_s == pytest.approx(0.01 * 1.1)  # capped at 1 % of the last stage's unit time
    assert rc.raises == 1
    assert any(s == 1 for s, _i, _old, _new in rc.stack[-1].changes)  # the walk reached the slow stage
