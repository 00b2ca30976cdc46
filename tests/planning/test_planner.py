"""EnvPipe planner: plan types, policies, termination on real profiles, online step."""

from __future__ import annotations

import itertools

import pytest

from megatron_envpipe.core.gpu_specs import get_gpu_spec
from megatron_envpipe.core.measurement import IterationMeasurement, UnitTiming
from megatron_envpipe.core.schedule import B, F, one_f_one_b
from megatron_envpipe.core.timeline import PipelineGraph, outer_envelope
from megatron_envpipe.core.vocabulary import PLAN_TYPES, RECONFIG_POLICIES
from megatron_envpipe.planning.basis import PlannerConfig, PlannerError
from megatron_envpipe.planning.envpipe import initial_plan
from megatron_envpipe.planning.planner import plan_envpipe
from megatron_envpipe.planning.reconfig import ClockLadder, Reconfigurer

A40 = get_gpu_spec("a40")


@pytest.mark.parametrize("name", ["gpt3", "bloom"])
def test_every_combination_terminates_and_reports_slowdown(name, gpt3_profile, bloom_profile):
    prof = gpt3_profile if name == "gpt3" else bloom_profile
    candidates = set(prof.common_frequencies())
    slow = baselines = 0
    for plan_type, sched, policy in itertools.product(PLAN_TYPES, ("1f1b", "ours"), RECONFIG_POLICIES):
        res = plan_envpipe(prof, 12, PlannerConfig(plan_type, sched, policy, gpu=A40))
        assert res.stop_reason
        assert set(res.plan.flat()) <= candidates
        # Slower than baseline by more than 1 %: said so; otherwise: no such warning.
        warned = any("slower than the baseline" in w for w in res.warnings)
        assert warned == (res.slowdown > 0.01), (plan_type, sched, policy, res.slowdown, res.warnings)
        slow += res.slowdown > 0.01
        if plan_type == "baseline" and sched == "1f1b":
            baselines += 1
            assert res.energy_saving == pytest.approx(0.0, abs=1e-12)
            assert res.slowdown == pytest.approx(0.0, abs=1e-12)
    # Both branches ran: uniform clocks (and EnvPipe's default policy) are slower than the baseline.
    assert slow >= 3 and baselines == len(RECONFIG_POLICIES), (slow, baselines)


@pytest.mark.parametrize("m", [12, 24, 48, 96])
def test_gpt3_balanced_reaches_envelope_at_zero_slowdown(gpt3_profile, m):
    for sched in ("1f1b", "ours"):
        res = plan_envpipe(gpt3_profile, m, PlannerConfig("envelope", sched, "balanced", gpu=A40))
        assert res.converged and "outer envelope" in res.stop_reason
        assert abs(res.slowdown) < 1e-9
        assert res.energy_saving > 0.08
        assert set(res.timeline.critical_units()) <= outer_envelope(res.schedule)


def test_ours_saves_more_than_1f1b_on_gpt3(gpt3_profile):
    for m in (12, 24):
        ours = plan_envpipe(gpt3_profile, m, PlannerConfig("envelope", "ours", "balanced", gpu=A40))
        base = plan_envpipe(gpt3_profile, m, PlannerConfig("envelope", "1f1b", "balanced", gpu=A40))
        assert ours.energy_saving > base.energy_saving + 0.03
        assert max(ours.schedule.peak_inflight()) > max(base.schedule.peak_inflight())


def test_bloom_stalls_and_says_why(bloom_profile):
    # Bloom's last stage is the lightest: EnvPipe's stopping rule can never be met.
    res = plan_envpipe(bloom_profile, 24, PlannerConfig("envelope", "1f1b", "balanced", gpu=A40))
    assert not res.converged
    assert res.stop_reason.startswith("stalled") and "last stage is not the heaviest" in res.stop_reason
    assert res.slowdown <= 1e-9


def test_memory_budget_clamps_ours(gpt3_profile):
    res = plan_envpipe(gpt3_profile, 24, PlannerConfig("envelope", "ours", "balanced", gpu=A40, max_inflight=10))
    assert max(res.schedule.peak_inflight()) <= 10
    with pytest.raises(PlannerError, match="below the 8 in-flight"):
        plan_envpipe(gpt3_profile, 24, PlannerConfig("envelope", "ours", "balanced", gpu=A40, max_inflight=4))


def test_bad_config_is_rejected(gpt3_profile):
    with pytest.raises(PlannerError, match="unknown plan type 'fast'"):
        plan_envpipe(gpt3_profile, 12, PlannerConfig("fast"))
    with pytest.raises(PlannerError, match="does not match the profile's 8 stages"):
        plan_envpipe(gpt3_profile, 12, PlannerConfig(), num_stages=4)


def test_initial_plans():
    sched = one_f_one_b(3, 4)
    env = initial_plan(sched, "envelope", 1740, [900, 1000, 1100])
    assert env.freq(0, F(0)) == 1740 and env.freq(0, B(3)) == 1740 and env.freq(0, F(1)) == 900
    assert set(env.freqs_mhz[2]) == {1740}  # whole last stage
    assert set(initial_plan(sched, "uniform", 1740, [900, 1000, 1100]).freqs_mhz[1]) == {1000}
    assert set(initial_plan(sched, "baseline", 1740, [900] * 3).flat()) == {1740}


def test_ladder_steps_land_on_candidates_and_cap_at_max():
    ladder = ClockLadder([1740, 1725, 1710, 1050, 1035, 1020], 30)
    assert ladder.raised(1020) == 1050
    assert ladder.raised(1050) == 1710  # nothing profiled in between: next one up
    assert ladder.raised(1725) == 1740
    assert ladder.raised(1020, steps=3) == 1710


def test_online_step_from_measurements_and_finish_limit():
    sched = one_f_one_b(3, 4)
    plan = initial_plan(sched, "envelope", 1500, [900] * 3)
    # window=1: EnvPipe's one-iteration rule (the default decides on a median of 3, test_robust_plans.py)
    rc = Reconfigurer(plan, "balanced", ClockLadder(range(900, 1501, 30), 30), finish_limit=2, window=1)
    graph = PipelineGraph(sched)
    # "Measured" iteration: slow inner units on stage 1 put it on the critical path.
    dur = [3.0 if (s == 1 and u.is_forward and u.microbatch in (1, 2)) else 1.0 for s, u in graph.nodes]
    tl = graph.simulate(dur)
    measurement = tl.measurement()
    path = rc.measured_critical_path(measurement.recv_wait_s())
    assert path[0] == (0, B(3)) and path[-1] == (0, F(0))
    assert not rc.on_envelope(path)
    # With perfect measurements and a near-zero threshold, EnvPipe's walk is the exact path.
    exact_walker = Reconfigurer(plan, "balanced", ClockLadder(range(900, 1501, 30), 30), threshold_scale=1e-9)
    assert exact_walker.measured_critical_path(measurement.recv_wait_s()) == tl.critical_units()
    new = rc.observe(measurement)
    raised = [(s, u) for s, o in enumerate(sched.orders) for u in o if new.freq(s, u) != plan.freq(s, u)]
    assert raised and all(new.freq(s, u) == 930 for s, u in raised)
    # On-envelope (or no-progress) iterations count towards the finish limit.
    env_path = sorted(outer_envelope(sched))
    for _ in range(3):
        rc.step(env_path)
    assert rc.finished
    assert rc.step(path) == rc.plan  # finished: the plan no longer changes


def test_greedy_raises_one_unit_by_three_steps():
    sched = one_f_one_b(2, 2)
    plan = initial_plan(sched, "envelope", 1500, [900, 900])
    rc = Reconfigurer(plan, "greedy", ClockLadder(range(900, 1501, 30), 30))
    # S0's order is F0 F1 B0 B1; F1 and B0 are inner units at 900.
    path = [(0, B(1)), (0, B(0)), (0, F(1)), (0, F(0))]
    assert rc.apply(path)
    assert rc.plan.freq(0, B(0)) == 990 and rc.plan.freq(0, F(1)) == 900


def test_observe_rejects_a_measurement_in_another_order():
    sched = one_f_one_b(2, 2)
    rc = Reconfigurer(initial_plan(sched, "envelope", 1500, [900, 900]), "balanced", ClockLadder([900, 1500], 30))
    wrong = IterationMeasurement(
        (tuple(UnitTiming(u, 0, 1, 0) for u in reversed(sched.orders[0])), tuple(UnitTiming(u, 0, 1, 0) for u in sched.orders[1]))
    )
    with pytest.raises(PlannerError, match="do not follow the planned order"):
        rc.observe(wrong)
