"""Timeline: exact simulation against a brute-force reference, critical path, energy."""

from __future__ import annotations

import random

import pytest

from megatron_envpipe.core.interleaved import interleaved_schedule
from megatron_envpipe.core.profile import Profile, ProfilePoint
from megatron_envpipe.core.schedule import (
    B,
    F,
    Schedule,
    ScheduleError,
    Unit,
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
            # Virtual stage g = chunk * P + s receives from g - 1 (forward) or g + 1 (backward).
            g = u.chunk * p + s
            if u.is_forward and g > 0:
                src = g - 1
                needs.append(((src % p, type(u)(u.kind, u.microbatch, src // p)), latency))
            if not u.is_forward and g < p * schedule.num_chunks - 1:
                src = g + 1
                needs.append(((src % p, type(u)(u.kind, u.microbatch, src // p)), latency))
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


def random_case(rng, interleaved=False):
    p = rng.randint(1, 6)
    m = rng.randint(1, 3 * p + 2)
    if interleaved:
        p = max(p, 2)
        v = rng.randint(1, 4)
        n = rng.randint(p, p + 2)
        m = n * rng.randint(1, 3) + rng.choice([0, *range(p, n)])  # a last group of 0 or >= P
        sched = interleaved_schedule(p, m, v, n)
    elif rng.random() < 0.5:
        sched = one_f_one_b(p, m)
    else:
        sched = envpipe_schedule(p, m, clamp_extra_warmup(p, m, [rng.randint(0, m) for _ in range(p)]))
    dur = {(s, u): rng.uniform(0.1, 2.0) for s, o in enumerate(sched.orders) for u in o}
    return sched, dur


@pytest.mark.parametrize("interleaved", [False, True])
def test_simulation_matches_brute_force(interleaved):
    rng = random.Random(3)
    for _ in range(300 if not interleaved else 120):
        sched, dur = random_case(rng, interleaved)
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


@pytest.mark.parametrize("interleaved", [False, True])
def test_critical_path_is_tight_and_spans_the_iteration(interleaved):
    rng = random.Random(11)
    for _ in range(200 if not interleaved else 80):
        sched, dur = random_case(rng, interleaved)
        graph = PipelineGraph(sched)
        tl = graph.simulate([dur[n] for n in graph.nodes])
        path = tl.critical_path()
        # With zero latency a tight path is gap-free: its durations add up to T.
        assert sum(tl.duration_s[v] for v in path) == pytest.approx(tl.iteration_time_s)
        assert tl.start_s[path[-1]] == 0.0
        assert graph.nodes[path[0]] == (0, sched.orders[0][-1])
        if not interleaved:
            assert sched.orders[0][-1] == B(sched.num_microbatches - 1)


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


# -- model chunks (Megatron's interleaved pipeline) -------------------------------------


def chunk_profile(p: int, v: int) -> Profile:
    """Every (stage, chunk, instruction) with its own time and energy at two clocks."""
    pts = {}
    for s in range(p):
        for c in range(v):
            for i, ins in enumerate(("forward", "backward")):
                t = 0.01 * (1 + s) + 0.1 * (1 + c) + 0.5 * i
                pts[(s, ins, c)] = [ProfilePoint(1400, t, 100 * t), ProfilePoint(1000, 1.5 * t, 80 * t)]
    return Profile(pts, source="<chunks>")


def test_graph_has_chunks_and_wrap_around_edges():
    p, v, m = 3, 2, 3
    graph = PipelineGraph(interleaved_schedule(p, m, v))
    assert graph.chunk_of == [u.chunk for _, u in graph.nodes]
    assert set(graph.chunk_of) == {0, 1}
    senders = {graph.nodes[v_]: [graph.nodes[u] for u, _ in graph.cross_preds[v_]] for v_ in range(len(graph.nodes))}
    for mb in range(m):
        assert senders[(0, F(mb, 1))] == [(2, F(mb, 0))]  # wrap-around activation
        assert senders[(2, B(mb, 0))] == [(0, B(mb, 1))]  # wrap-around gradient
        assert senders[(1, F(mb, 1))] == [(0, F(mb, 1))]
        assert senders[(1, B(mb, 0))] == [(2, B(mb, 0))]
        assert senders[(0, F(mb, 0))] == [] and senders[(2, B(mb, 1))] == []


def test_cost_keys_and_costs_per_stage_chunk_instruction():
    p, v = 3, 2
    sched = interleaved_schedule(p, 6, v)
    prof = chunk_profile(p, v)
    ev = PlanEvaluator(sched, prof)
    assert ev.cost_keys == [(s, u.chunk, "forward" if u.is_forward else "backward") for s, u in ev.graph.nodes]
    freqs = [1000 if i % 3 else 1400 for i in range(len(ev.graph.nodes))]
    want_t = [prof.time_s(s, ins, f, c) for (s, c, ins), f in zip(ev.cost_keys, freqs)]
    want_e = [prof.energy_j(s, ins, f, c) for (s, c, ins), f in zip(ev.cost_keys, freqs)]
    assert ev.durations(freqs) == want_t
    assert ev.unit_energies(freqs) == want_e
    assert len(set(want_t)) > 2 * p  # chunks really cost differently
    with pytest.raises(Exception, match="chunk 1 backward was not profiled at 1200 MHz"):
        ev.durations([1200 if (s, u) == (1, B(0, 1)) else 1400 for s, u in ev.graph.nodes])


def test_one_chunk_profile_is_split_evenly_over_chunks(gpt3_profile):
    prof = gpt3_profile.for_pipeline(4)
    v = 2
    sched = interleaved_schedule(4, 8, v)
    ev = PlanEvaluator(sched, prof)
    assert ev.profile.num_chunks == v and prof.num_chunks == 1
    f = prof.max_frequency()
    for (s, _chunk, ins), t in zip(ev.cost_keys, ev.durations([f] * len(ev.cost_keys))):
        assert t == prof.time_s(s, ins, f) / v
    # A one-chunk schedule keeps the profile as it is.
    assert PlanEvaluator(one_f_one_b(4, 8), prof).profile is prof
    with pytest.raises(Exception, match="profiled with 2 model chunks per stage but the pipeline has 3"):
        PlanEvaluator(interleaved_schedule(3, 6, 3), chunk_profile(3, 2))


@pytest.mark.parametrize("p,v,m", [(2, 2, 4), (4, 2, 8), (4, 3, 8), (4, 2, 16), (8, 2, 16), (8, 4, 24), (3, 4, 9)])
def test_interleaved_iteration_time_is_the_papers_bubble(p, v, m):
    """Narayanan et al. (SC'21): with equal stages, the interleaved bubble is (P-1)(t_f+t_b)/V (M a multiple of P)."""
    t_f, t_b = 2.0, 4.0  # a whole stage's forward and backward; a chunk takes 1/V of it
    sched = interleaved_schedule(p, m, v)
    graph = PipelineGraph(sched)
    tl = graph.simulate([(t_f if u.is_forward else t_b) / v for _, u in graph.nodes])
    assert tl.iteration_time_s == pytest.approx(m * (t_f + t_b) + (p - 1) * (t_f + t_b) / v)
    one = PipelineGraph(one_f_one_b(p, m))
    tl1 = one.simulate([t_f if u.is_forward else t_b for _, u in one.nodes])
    assert tl1.iteration_time_s - tl.iteration_time_s == pytest.approx((p - 1) * (t_f + t_b) * (1 - 1 / v))


def envelope_cases():
    for p in (2, 3, 4, 6, 8):
        for v in (2, 3, 4):
            for m in sorted({p, 2 * p, 2 * p + 1, 3 * p, 4 * p, 5 * p - 1}):
                for n in sorted({p, p + 1, m}):
                    if p <= n <= m and not 0 < m % n < p:
                        yield p, v, m, n


def ideal_path(sched):
    last, drain = sched.num_stages - 1, B(sched.num_microbatches - 1, sched.num_chunks - 1)
    path = {(s, F(0)) for s in range(sched.num_stages)} | {(s, drain) for s in range(sched.num_stages)}
    path |= {(last, u) for u in sched.orders[last][: sched.orders[last].index(drain) + 1]}
    return path | {(0, u) for u in sched.orders[0][sched.orders[0].index(drain):]}


def test_chunked_envelope_has_zero_slack_in_the_ideal_pipeline():
    from megatron_envpipe.core.graph import latest_times, successors

    checked = 0
    for p, v, m, n in envelope_cases():
        sched = interleaved_schedule(p, m, v, n)
        graph = PipelineGraph(sched)
        env = outer_envelope(sched)
        index = [graph.node(s, u) for s, u in env]
        for t_f, t_b in ((1.0, 2.0), (1.0, 3.0), (1.0, 1.0), (2.0, 3.0)):
            dur = [t_f if u.is_forward else t_b for _, u in graph.nodes]
            tl = graph.simulate(dur)
            latest, _ = latest_times(graph.order, successors(graph.preds), dur, tl.iteration_time_s)
            assert all(latest[i] - tl.start_s[i] <= 1e-9 for i in index), (p, v, m, n, t_f, t_b)
            # ... and it holds one path through the iteration: fill of chunk 0, the last stage up to the drain
            # of chunk V-1, that drain, the first stage's cool-down; its units add up to T.
            path = [graph.node(s, u) for s, u in ideal_path(sched)]
            assert set(path) <= set(index)
            assert sum(dur[i] for i in path) == pytest.approx(tl.iteration_time_s), (p, v, m, n, t_f, t_b)
            checked += 1
    assert checked > 300


def test_chunked_envelope_by_hand_and_one_chunk_envelope_unchanged():
    sched = interleaved_schedule(2, 2, 2)
    # S0: F0 F1 F0v1 F1v1 B0v1 B1v1 B0 B1; S1: F0 F1 F0v1 B0v1 F1v1 B1v1 B0 B1
    assert sched.orders == Schedule.parse("S0: F0 F1 F0v1 F1v1 B0v1 B1v1 B0 B1\nS1: F0 F1 F0v1 B0v1 F1v1 B1v1 B0 B1").orders
    assert outer_envelope(sched) == {
        (0, F(0)), (1, F(0)), (1, F(1)), (1, F(0, 1)), (1, B(0, 1)), (1, F(1, 1)), (1, B(1, 1)),
        (0, B(1, 1)), (0, B(0)), (0, B(1)),
        # the last stage's cool-down and every chunk's fill and drain
        (1, B(0)), (1, B(1)), (0, F(0, 1)), (0, B(1, 1)), (1, B(1)),
    }
    for base in (one_f_one_b(4, 8), envpipe_schedule(4, 8, [3, 2, 1, 0])):
        old = {(3, u) for u in base.orders[3]} | {(s, F(0)) for s in range(4)} | {(s, B(7)) for s in range(4)}
        assert outer_envelope(base) == old


def test_wrap_around_cycles_are_deadlocks():
    from megatron_envpipe.core.graph import topological_order
    from megatron_envpipe.core.schedule import unit_dag

    forward_wrap = "S0: F0 F0v1 B0v1 B0\nS1: F0v1 F0 B0v1 B0"  # S1 F0 -> S0 F0v1 -> S1 F0v1 -> S1 F0
    backward_wrap = "S0: F0 F0v1 B0 B0v1\nS1: F0 F0v1 B0v1 B0"  # S0 B0v1 -> S1 B0 -> S0 B0 -> S0 B0v1
    for text in (forward_wrap, backward_wrap):
        with pytest.raises(ScheduleError, match="deadlock"):
            Schedule.parse(text)
        # Without the wrap-around edges (messages between different chunks) there is no cycle.
        rows = [tuple(Unit.parse(t) for t in line.split(":")[1].split()) for line in text.splitlines()]
        dag = unit_dag(Schedule(1, tuple(rows), num_chunks=2))
        preds = [
            [(u, lat) for u, lat in ps if dag.nodes[u][1].chunk == dag.nodes[v][1].chunk or dag.nodes[u][0] == dag.nodes[v][0]]
            for v, ps in enumerate(dag.preds())
        ]
        assert len(topological_order(preds)) == len(dag.nodes)
        assert len(topological_order(dag.preds())) < len(dag.nodes)
