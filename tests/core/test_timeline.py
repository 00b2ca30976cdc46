"""Timeline: exact simulation against a brute-force reference, critical path, energy."""

from __future__ import annotations

import random

import pytest

from megatron_envpipe.core.profile import Profile, ProfilePoint
from megatron_envpipe.core.schedule import (
    B,
    F,
    Schedule,
    ScheduleError,
    clamp_extra_warmup,
    envpipe_schedule,
    one_f_one_b,
)
from megatron_envpipe.core.timeline import Dependency, PipelineGraph, PlanEvaluator, outer_envelope


def brute_force(schedule: Schedule, dur: dict, latency: float = 0.0, extra=()):
    """Step the pipeline like hardware would: repeatedly run any stage whose next
    unit has its input available. Independent of the DAG/topological code."""
    p = schedule.num_stages
    nxt = [0] * p
    free_at = [0.0] * p
    done: dict = {}
    total = sum(len(o) for o in schedule.orders)
    while len(done) < total:
        progressed = False
        for s in range(p):
            if nxt[s] == len(schedule.orders[s]):
                continue
            u = schedule.orders[s][nxt[s]]
            needs = []
            if u.is_forward and s > 0:
                needs.append(((s - 1, u), latency))
            if not u.is_forward and s < p - 1:
                needs.append(((s + 1, u), latency))
            needs += [((d.src_stage, d.src), d.latency_s) for d in extra if (d.dst_stage, d.dst) == (s, u)]
            if all(k in done for k, _ in needs):
                start = max([free_at[s]] + [done[k][1] + lat for k, lat in needs])
                done[(s, u)] = (start, start + dur[(s, u)])
                free_at[s] = start + dur[(s, u)]
                nxt[s] += 1
                progressed = True
        if not progressed:
            raise RuntimeError("brute force deadlocked")
    return done


def random_case(rng):
    p = rng.randint(1, 6)
    m = rng.randint(1, 3 * p + 2)
    if rng.random() < 0.5:
        sched = one_f_one_b(p, m)
    else:
        sched = envpipe_schedule(p, m, clamp_extra_warmup(p, m, [rng.randint(0, m) for _ in range(p)]))
    dur = {(s, u): rng.uniform(0.1, 2.0) for s, o in enumerate(sched.orders) for u in o}
    return sched, dur


def test_simulation_matches_brute_force():
    rng = random.Random(3)
    for _ in range(300):
        sched, dur = random_case(rng)
        latency = rng.choice([0.0, 0.05])
        graph = PipelineGraph(sched, p2p_latency_s=latency)
        tl = graph.simulate([dur[node] for node in graph.nodes])
        ref = brute_force(sched, dur, latency)
        for v, node in enumerate(graph.nodes):
            assert tl.start_s[v] == pytest.approx(ref[node][0], abs=1e-12)
            assert tl.end_s[v] == pytest.approx(ref[node][1], abs=1e-12)
        assert tl.iteration_time_s == pytest.approx(max(e for _, e in ref.values()))


def test_extra_dependencies_are_modelled():
    sched = one_f_one_b(3, 4)
    # Hold stage 0's F2 output until stage 0 has finished B0 (a §8.5-style hold).
    extra = [Dependency(0, B(0), 1, F(2), 0.0)]
    rng = random.Random(5)
    dur = {(s, u): rng.uniform(0.5, 1.5) for s, o in enumerate(sched.orders) for u in o}
    graph = PipelineGraph(sched, extra_dependencies=extra)
    tl = graph.simulate([dur[n] for n in graph.nodes])
    ref = brute_force(sched, dur, 0.0, extra)
    assert tl.start_s[graph.node(1, F(2))] == pytest.approx(ref[(1, F(2))][0])
    assert tl.start_s[graph.node(1, F(2))] >= tl.end_s[graph.node(0, B(0))]


def test_critical_path_is_tight_and_spans_the_iteration():
    rng = random.Random(11)
    for _ in range(200):
        sched, dur = random_case(rng)
        graph = PipelineGraph(sched)
        tl = graph.simulate([dur[n] for n in graph.nodes])
        path = tl.critical_path()
        # With zero latency a tight path is gap-free: its durations add up to T.
        assert sum(tl.duration_s[v] for v in path) == pytest.approx(tl.iteration_time_s)
        assert tl.start_s[path[-1]] == 0.0
        assert graph.nodes[path[0]] == (0, B(sched.num_microbatches - 1))


def test_uniform_pipeline_critical_path_is_the_envelope():
    # Identical stages: 1F1B's critical path is exactly EnvPipe's outer envelope.
    sched = one_f_one_b(4, 8)
    graph = PipelineGraph(sched)
    tl = graph.simulate([1.0 if u.is_forward else 2.0 for _, u in graph.nodes])
    assert set(tl.critical_units()) <= outer_envelope(sched)
    assert tl.iteration_time_s == pytest.approx((4 - 1) * 1.0 + 8 * 3.0 + (4 - 1) * 2.0)


def test_energy_formula_by_hand():
    # 2 stages, 1 micro-batch, one clock: F=1 s/10 J, B=2 s/20 J on both stages.
    pts_f = [ProfilePoint(1000, 1.0, 10.0)]
    pts_b = [ProfilePoint(1000, 2.0, 20.0)]
    prof = Profile({(s, i): (pts_f if i == "forward" else pts_b) for s in (0, 1) for i in ("forward", "backward")})
    ev = PlanEvaluator(one_f_one_b(2, 1), prof, p2p_power_w=5.0)
    score = ev.score([1000] * 4)
    # S0: F0 [0,1], B0 [4,6]; S1: F0 [1,2], B0 [2,4]. T=6, busy 3 each, idle 3 each.
    assert score.iteration_time_s == pytest.approx(6.0)
    assert score.compute_energy_j == pytest.approx(60.0)
    assert score.blocking_energy_j == pytest.approx(5.0 * (3 + 3))
    assert score.energy_j == pytest.approx(90.0)
    assert ev.simulate([1000] * 4).recv_wait_s(ev.graph.node(0, B(0))) == pytest.approx(3.0)


def test_cycle_detected():
    bad = Schedule(2, ((F(0), B(0), F(1), B(1)), (F(0), F(1), B(0), B(1))))
    with pytest.raises(ScheduleError, match="deadlock"):
        PipelineGraph(bad)


def test_profile_stage_mismatch(gpt3_profile):
    with pytest.raises(ScheduleError, match="8 stages but the schedule has 4"):
        PlanEvaluator(one_f_one_b(4, 4), gpt3_profile)
