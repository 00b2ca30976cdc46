"""Following a straggler: the start-up frontier's plan for a pace, computed in a background thread (issue 24)."""

from __future__ import annotations

import threading

import pytest

pytest.importorskip("numpy")

from megatron_envpipe.core.gpu_specs import get_gpu_spec  # noqa: E402
from megatron_envpipe.core.timeline import PlanEvaluator  # noqa: E402
from megatron_envpipe.planning.basis import PlannerConfig  # noqa: E402
from megatron_envpipe.planning.straggler import (  # noqa: E402
    FrontierPlans,
    StragglerError,
    _compute_frontier_plans,
    _replan_for_pace,
    _run_in_background,
    start_background,
)

A40 = get_gpu_spec("a40")
CONFIG = PlannerConfig("optimal", "ours", "default", gpu=A40)
M = 4


@pytest.fixture(scope="module")
def pp4(gpt3_profile):
    return gpt3_profile.for_pipeline(4)


@pytest.fixture(scope="module")
def plans(pp4) -> FrontierPlans:
    return _compute_frontier_plans(pp4, M, CONFIG, points=6)


def test_plan_for_a_pace_is_the_frontier_minimum_and_never_slower(plans, pp4):
    fr = plans.frontier
    p2p, p = fr.p2p_power_w, fr.num_stages
    ev = PlanEvaluator(fr.schedule, pp4, p2p)
    for k in (1.0, 1.03, 1.07, 1.15, 1.5):
        target = fr.points[0].time_s * k
        plan, time_s, energy_j = plans.plan_for(target)
        assert time_s <= target * (1 + 1e-12)  # never slower than the pace it follows
        sc = ev.score(plan.flat())  # a real plan, scored by the timeline simulation
        assert sc.iteration_time_s == pytest.approx(time_s, rel=1e-12)
        stretched = [pt.energy_j + p2p * p * (target - pt.time_s) for pt in fr.points if pt.time_s <= target]
        assert energy_j == pytest.approx(min(stretched), rel=1e-12)
        # Following beats running the fastest plan and waiting (the DP all-reduce wait at P2P power).
        fastest = fr.points[0]
        wait_j = fastest.energy_j + p2p * p * (target - fastest.time_s)
        assert energy_j <= wait_j * (1 + 1e-12)
        if k >= 1.03:
            assert energy_j < wait_j


def test_a_target_faster_than_every_plan_gets_the_fastest(plans):
    first = plans.frontier.points[0]
    plan, time_s, _ = plans.plan_for(first.time_s * 0.5)
    assert time_s == first.time_s and plan == first.plan
    with pytest.raises(StragglerError, match="target iteration time"):
        plans.plan_for(float("nan"))


def test_background_handle_returns_at_once_and_hands_over_the_result(plans):
    gate = threading.Event()

    def compute():
        gate.wait(10)
        return plans

    handle = _run_in_background(compute)
    assert not handle.ready()  # the caller (training) did not wait for the frontier
    with pytest.raises(StragglerError, match="not ready"):
        handle.result(timeout_s=0)
    gate.set()
    assert handle.result(timeout_s=60) is plans and handle.ready()


def test_background_errors_reach_the_caller():
    def compute():
        raise StragglerError("boom: a bad profile")

    handle = _run_in_background(compute)
    with pytest.raises(StragglerError, match="boom"):
        handle.result(timeout_s=60)


def test_start_background_computes_the_same_frontier(plans, pp4):
    got = start_background(pp4, M, CONFIG, points=6).result(timeout_s=300)
    assert [(pt.time_s, pt.energy_j) for pt in got.frontier.points] == \
        [(pt.time_s, pt.energy_j) for pt in plans.frontier.points]


def test_replan_for_a_pace_beyond_the_frontier_saves_more(plans, pp4):
    fr = plans.frontier
    target = fr.points[-1].time_s * 1.08  # past the frontier's last point (the LP valley)
    rep = _replan_for_pace(pp4, M, target, CONFIG)
    ev = PlanEvaluator(rep.plan.schedule, pp4, fr.p2p_power_w)
    sc = ev.score(rep.plan.flat())
    assert rep.predicted_time_s == pytest.approx(sc.iteration_time_s, rel=1e-12) and sc.iteration_time_s <= target
    assert rep.predicted_energy_j <= plans.plan_for(target).predicted_energy_j * (1 + 1e-9)
