"""`--type optimal`: minimum-energy per-unit clocks for a deadline (LP over convex hulls + rounding)."""

from __future__ import annotations

import pytest

from megatron_envpipe.core.gpu_specs import get_gpu_spec
from megatron_envpipe.planning.basis import PlannerConfig, PlannerError
from megatron_envpipe.planning.planner import plan_envpipe

A40 = get_gpu_spec("a40")

# Issue 5's goals: savings at zero slowdown a prototype reached (Perseus formula, P2P 70.38 W).
GOALS = {
    ("gpt3", "1f1b"): {12: 0.120, 24: 0.103},
    ("gpt3", "ours"): {12: 0.185, 24: 0.199},
    ("bloom", "1f1b"): {12: 0.105, 24: 0.075},
    ("bloom", "ours"): {12: 0.185, 24: 0.193},
}


@pytest.mark.parametrize("key", sorted(GOALS))
def test_meets_deadline_and_the_goal_savings(key, gpt3_profile, bloom_profile):
    prof = gpt3_profile if key[0] == "gpt3" else bloom_profile
    for m, goal in GOALS[key].items():
        res = plan_envpipe(prof, m, PlannerConfig("optimal", key[1], "default", gpu=A40))
        # Feasible: the simulated plan meets the deadline (zero slowdown, up to float noise).
        assert res.score.iteration_time_s <= res.baseline.iteration_time_s * (1 + 1e-9)
        assert res.energy_saving >= goal - 0.001, (key, m, res.energy_saving)
        # The LP optimum bounds every plan from below; the rounded plan is close to it.
        assert res.lower_bound_j is not None  # the optimal planner always reports its LP bound
        assert res.lower_bound_j <= res.score.energy_j * (1 + 1e-9)
        assert res.score.energy_j <= res.lower_bound_j * 1.02  # continuous bound, not the discrete optimum
        assert set(res.plan.flat()) <= set(prof.common_frequencies())


@pytest.mark.parametrize("slowdown", [0.0, 0.02, 0.10])
def test_slack_buys_energy_monotonically(slowdown, gpt3_profile):
    tight = plan_envpipe(gpt3_profile, 12, PlannerConfig("optimal", "1f1b", "default", gpu=A40))
    loose = plan_envpipe(gpt3_profile, 12, PlannerConfig("optimal", "1f1b", "default", gpu=A40, max_slowdown=slowdown))
    assert loose.score.iteration_time_s <= tight.baseline.iteration_time_s * (1 + slowdown) * (1 + 1e-9)
    assert loose.score.energy_j <= tight.score.energy_j * (1 + 1e-9)


def test_optimal_beats_envpipe_balanced(gpt3_profile, bloom_profile):
    for prof in (gpt3_profile, bloom_profile):
        for sched in ("1f1b", "ours"):
            env = plan_envpipe(prof, 12, PlannerConfig("envelope", sched, "balanced", gpu=A40))
            opt = plan_envpipe(prof, 12, PlannerConfig("optimal", sched, "default", gpu=A40))
            assert opt.energy_saving >= env.energy_saving - 1e-9


def test_impossible_deadline_is_a_clear_error(gpt3_profile):
    base = plan_envpipe(gpt3_profile, 12, PlannerConfig("baseline", "1f1b", "default", gpu=A40))
    with pytest.raises(PlannerError, match="infeasible: even with every unit at its fastest clock"):
        plan_envpipe(gpt3_profile, 12, PlannerConfig("optimal", "1f1b", "default", gpu=A40,
                                                    target_time_s=0.5 * base.baseline.iteration_time_s))
    with pytest.raises(PlannerError, match="needs plan type 'optimal'"):
        PlannerConfig("envelope", max_slowdown=0.1).validate()
