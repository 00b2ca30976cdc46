"""Work the planner reuses instead of redoing (issue 34's planning time): each shortcut gives exactly what the
long way gives: the reconfiguration loop's resumed simulation and node-index raises (planning/envpipe.py,
planning/reconfig.py), the merge pass's memo (planning/switching.py)."""

from __future__ import annotations

import random

import pytest

from megatron_envpipe.core.gpu_specs import get_gpu_spec
from megatron_envpipe.core.kinds import build_schedule
from megatron_envpipe.core.plan import FrequencyPlan
from megatron_envpipe.core.schedule import clamp_extra_warmup, one_f_one_b
from megatron_envpipe.core.timeline import PipelineGraph, PlanEvaluator
from megatron_envpipe.planning.basis import PlannerConfig, planning_basis
from megatron_envpipe.planning.envpipe import initial_plan, plan_reconfigured
from megatron_envpipe.planning.reconfig import ClockLadder, Reconfigurer
from megatron_envpipe.planning.resimulation import Resimulator
from megatron_envpipe.planning.switching import reduce_clock_changes, reduce_clock_changes_remembered

A40 = get_gpu_spec("a40")


@pytest.mark.parametrize("scheduling", ["1f1b", "ours"])
def test_resumed_simulation_is_the_full_one_to_the_bit(gpt3_profile, scheduling):
    p = gpt3_profile.num_stages
    schedule = (build_schedule("ours", p, 8, clamp_extra_warmup(p, 8, [1] * p, None)) if scheduling == "ours"
                else one_f_one_b(p, 8))
    evaluator = PlanEvaluator(schedule, gpt3_profile, A40.p2p_power_w)
    clocks = sorted(gpt3_profile.common_frequencies())
    rng = random.Random(7)
    freqs = [rng.choice(clocks) for _ in range(len(evaluator.graph.nodes))]
    timeline = evaluator.simulate(freqs)
    resim = Resimulator(evaluator.graph)
    assert resim.steps is not None  # the flat walk: otherwise the test would only check the fallback
    for _ in range(30):
        changed = rng.sample(range(len(freqs)), rng.randint(1, 3))
        for v in changed:
            freqs[v] = rng.choice(clocks)
        durations = evaluator.durations(freqs)
        fast = resim.simulate(timeline, durations, changed)
        full = evaluator.simulate(freqs)
        assert fast.start_s == full.start_s and fast.end_s == full.end_s
        timeline = fast


def reconfigured_the_long_way(profile, m, config, schedule=None):
    """plan_reconfigured's loop as it was: units looked up by (stage, Unit), raised by Reconfigurer.apply, every
    iteration simulated in full (``schedule``: the one plan_reconfigured built, 1F1B by default)."""
    basis = planning_basis(profile, m, config)
    schedule = schedule or one_f_one_b(basis.num_stages, m)
    evaluator = PlanEvaluator(schedule, profile, basis.p2p_power_w)
    reconf = Reconfigurer(initial_plan(schedule, config.plan_type, basis.f_max_mhz, basis.valley_mhz),
                          config.reconfig, ClockLadder(basis.candidates_mhz, config.effective_reconfig_step_mhz))
    timeline, iterations = evaluator.simulate(reconf.freqs_flat()), 0
    while not reconf.on_envelope(timeline.critical_units()) and iterations < config.max_iterations:
        if not reconf.apply(timeline.critical_units()):
            break
        iterations += 1
        timeline = evaluator.simulate(reconf.freqs_flat())
    return reconf.plan, iterations, timeline


@pytest.mark.parametrize("policy", ["balanced", "greedy"])
def test_reconfiguration_loop_matches_the_long_way(bloom_profile, policy):
    config = PlannerConfig("envelope", "1f1b", policy, gpu=A40)
    plan, iterations, timeline = reconfigured_the_long_way(bloom_profile, 16, config)
    result = plan_reconfigured(bloom_profile, 16, config)
    assert iterations > 5  # the loop did run
    assert result.plan.freqs_mhz == plan.freqs_mhz and result.iterations == iterations
    assert result.timeline.end_s == timeline.end_s


@pytest.mark.parametrize("scheduling", ["ours", "interleaved"])
@pytest.mark.parametrize("scale", [1.0, 0.25])
def test_reconfiguration_loop_matches_the_long_way_on_other_schedules(gpt3_profile, scheduling, scale):
    """The balanced raise in node indices, its cached unit times and the timelines that reuse the last one's
    lists (planning/envpipe.py, Resimulator.advance): the same plan, iterations and times as the long way."""
    profile = gpt3_profile if scale == 1.0 else gpt3_profile.scaled(scale, scale)
    extra = {"virtual_stages": 2} if scheduling == "interleaved" else {}
    config = PlannerConfig("envelope", scheduling, "balanced", gpu=A40, **extra)
    result = plan_reconfigured(profile, 16, config)
    plan, iterations, timeline = reconfigured_the_long_way(profile, 16, config, result.schedule)
    assert iterations > 5  # the loop did run
    assert result.plan.freqs_mhz == plan.freqs_mhz and result.iterations == iterations
    assert result.timeline.start_s == timeline.start_s and result.timeline.end_s == timeline.end_s
    assert result.timeline.duration_s == timeline.duration_s


@pytest.mark.parametrize("latency", [0.0, 1e-4])
def test_advancing_resimulation_is_the_full_one_to_the_bit(gpt3_profile, latency):
    schedule = one_f_one_b(gpt3_profile.num_stages, 8)
    evaluator = PlanEvaluator(schedule, gpt3_profile, A40.p2p_power_w, p2p_latency_s=latency)
    clocks = sorted(gpt3_profile.common_frequencies())
    rng = random.Random(5)
    freqs = [rng.choice(clocks) for _ in range(len(evaluator.graph.nodes))]
    timeline = evaluator.simulate(freqs)
    resim = Resimulator(evaluator.graph)
    assert resim.steps is not None and (resim.pairs is not None) is (latency == 0.0)  # both walks are checked
    for _ in range(30):
        changed = rng.sample(range(len(freqs)), rng.randint(1, 3))
        for v in changed:
            freqs[v] = rng.choice(clocks)
        nxt = resim.advance(timeline, evaluator.durations(freqs), changed)
        full = evaluator.simulate(freqs)
        assert nxt.start_s == full.start_s and nxt.end_s == full.end_s and nxt.duration_s == full.duration_s
        timeline = nxt


def test_balanced_raise_without_a_profile_moves_the_lowest_units_one_ladder_step(gpt3_profile):
    """The offline balanced raise computes the path's one target clock once (no profile: it depends on the clock
    only); it must still give every unit at the path's lowest clock that step, and leave the others alone."""
    schedule = one_f_one_b(gpt3_profile.num_stages, 8)
    clocks = sorted(gpt3_profile.common_frequencies())
    ladder = ClockLadder(clocks, 30)
    rng = random.Random(3)
    rows = [[rng.choice(clocks[:4]) for _ in order] for order in schedule.orders]
    reconf = Reconfigurer(FrequencyPlan(schedule, tuple(tuple(r) for r in rows)), "balanced", ladder)
    path = [(s, i) for s in range(len(rows)) for i in range(0, len(rows[s]), 3)]
    f_min = min(rows[s][i] for s, i in path)
    expected = [list(r) for r in rows]
    for s, i in path:
        if rows[s][i] == f_min:
            expected[s][i] = ladder.raised(f_min)
    changes = reconf.raise_off_envelope(path)
    assert reconf.freqs == expected and expected != rows
    assert changes == tuple((s, i, f_min, ladder.raised(f_min)) for s, i in path if rows[s][i] == f_min)


def test_merge_pass_memo_gives_the_pass_result(gpt3_profile):
    result = plan_reconfigured(gpt3_profile, 12, PlannerConfig("envelope", "1f1b", "balanced", gpu=A40))
    evaluator = PlanEvaluator(result.schedule, gpt3_profile, A40.p2p_power_w, graph=result.timeline.graph)
    first = reduce_clock_changes_remembered(result.plan, evaluator, None, 0.7)
    again = reduce_clock_changes_remembered(FrequencyPlan(result.schedule, result.plan.freqs_mhz), evaluator, None, 0.7)
    assert again is first  # same inputs: the memo's
    fresh = reduce_clock_changes(result.plan, evaluator, None, 0.7)  # the pass itself, done afresh: the same plan
    assert fresh is not first and fresh.plan.freqs_mhz == first.plan.freqs_mhz and fresh.merges == first.merges > 0
    assert fresh.score == first.score
    cheaper = reduce_clock_changes_remembered(result.plan, evaluator, None, 0.35)  # another cost: not the memo's
    assert cheaper is not first and cheaper.switch_cost_j == 0.35
    later = reduce_clock_changes_remembered(result.plan, evaluator, first.deadline_s * 1.01, 0.7)  # another deadline
    assert later is not first and later.deadline_s > first.deadline_s
    own = PlanEvaluator(result.schedule, gpt3_profile, A40.p2p_power_w, graph=PipelineGraph(result.schedule))
    assert reduce_clock_changes_remembered(result.plan, own, None, 0.7) is not first  # another graph: not the memo's
