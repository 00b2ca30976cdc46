"""The lower bound that counts clock changes (testing/switch_bound.py) against exact optima and the planner.

The bound must be at most the exact optimum with every change charged (the MILP oracle, on small random
pipelines: several seeds, both schedules, a tight and a loose deadline), at most what the planner's plan is
worth with its changes counted, equal to the LP bound when changes are free, and above it when they are not
(a bound that dropped the switch cost would be the LP bound again).
"""

from __future__ import annotations

import random

import pytest

pytest.importorskip("numpy")
pytest.importorskip("highspy")

from megatron_envpipe.core.gpu_specs import get_gpu_spec  # noqa: E402
from megatron_envpipe.core.profile import Profile, ProfilePoint  # noqa: E402
from megatron_envpipe.core.resources import shipped_profile  # noqa: E402
from megatron_envpipe.core.schedule import envpipe_schedule, one_f_one_b  # noqa: E402
from megatron_envpipe.planning.basis import PlannerConfig  # noqa: E402
from megatron_envpipe.planning.optimal import TimeEnergyModel  # noqa: E402
from megatron_envpipe.planning.planner import plan_envpipe  # noqa: E402
from megatron_envpipe.testing.milp import solve_milp  # noqa: E402
from megatron_envpipe.testing.switch_bound import switch_bound  # noqa: E402

P2P = get_gpu_spec("a40").p2p_power_w
FREQS = (1740, 1500, 1260, 1020)
RTOL = 1e-7  # the LP solver's tolerances, relative to an iteration's energy


def random_profile(seed: int, stages: int = 3) -> Profile:
    """``stages`` stages with cubic dynamic power and a memory-bound share; the slowest clock may cost more."""
    rng = random.Random(seed)
    points = {}
    for s in range(stages):
        for ins, mult in (("forward", 1.0), ("backward", 2.0 + rng.random())):
            t0, mem = rng.uniform(0.05, 0.2) * mult, rng.uniform(0.1, 0.5)
            static, dynamic = rng.uniform(70, 130), rng.uniform(120, 260)
            points[(s, ins)] = [ProfilePoint(f, t0 * (mem + (1 - mem) * FREQS[0] / f),
                                             (static + dynamic * (f / FREQS[0]) ** 3) * t0 * (mem + (1 - mem)
                                                                                              * FREQS[0] / f))
                                for f in FREQS]
    return Profile(points, source=f"<{stages}-stage random seed {seed}>")


def model_of(profile: Profile, schedule) -> TimeEnergyModel:
    return TimeEnergyModel(schedule, profile, FREQS, P2P)


def lp_bound_j(model: TimeEnergyModel, deadline_s: float) -> float:
    return model.solve_lp(deadline_s, P2P * model.num_stages)[2]


SCHEDULES = {"1f1b": lambda: one_f_one_b(3, 4), "ours": lambda: envpipe_schedule(3, 4, [1, 1, 0])}


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
@pytest.mark.parametrize("slack", [0.0, 0.15])
def test_bound_is_at_most_the_exact_counted_optimum(seed, schedule, slack):
    model = model_of(random_profile(seed), SCHEDULES[schedule]())
    deadline = model.fastest_time_s() * (1 + slack)
    cost = 1.5  # J per change: about 2-5 % of a unit's energy, so changes matter
    exact = solve_milp(model, deadline, time_limit_s=60, mip_rel_gap=1e-9, switch_cost_j=cost)
    assert exact.optimal
    bound = switch_bound(model, deadline, cost, FREQS)
    assert bound.converged
    assert bound.lower_bound_j <= exact.energy_j * (1 + RTOL)
    # Converged, it is at least the LP bound (every column costs at least its units' hull costs).
    assert bound.lower_bound_j >= lp_bound_j(model, deadline) * (1 - RTOL)


def test_bound_without_switch_cost_is_the_lp_bound_and_grows_with_it():
    """Changes free: the relaxation is the planner's LP. Changes charged: strictly above it, where the
    switch-free optimum changes clocks (a bound that dropped the cost would stay at the LP bound)."""
    model = model_of(random_profile(7), SCHEDULES["1f1b"]())
    deadline = model.fastest_time_s() * 1.05
    lp = lp_bound_j(model, deadline)
    free = switch_bound(model, deadline, 0.0, FREQS)
    assert free.lower_bound_j == pytest.approx(lp, rel=RTOL)
    exact_free = solve_milp(model, deadline, time_limit_s=60, mip_rel_gap=1e-9)
    charged = [switch_bound(model, deadline, c, FREQS).lower_bound_j for c in (0.5, 1.5, 5.0)]
    assert charged[0] > lp * (1 + 1e-4)
    assert charged[0] < charged[1] < charged[2]
    # Above the switch-free optimum too at a high cost: the bound knows changes are not free.
    assert charged[2] > exact_free.energy_j


def test_bound_is_below_the_planners_counted_plan():
    """The planner's plan (LP, merge pass, segment DP, EnvPipe's rival), its changes counted, on the shipped
    GPT-3 profile cut to four stages, unit times x 0.25 (changes weigh more), both schedulings."""
    profile = Profile.from_csv(shipped_profile("a40/gpt3-175b")).for_pipeline(4).scaled(0.25, 0.25)
    a40 = get_gpu_spec("a40")
    for scheduling in ("1f1b", "ours"):
        cfg = PlannerConfig("optimal", scheduling, "default", gpu=a40, switch_cost_j=0.7)
        result = plan_envpipe(profile, 8, cfg)
        model = TimeEnergyModel(result.schedule, profile, result.candidates_mhz, cfg.effective_p2p_power_w)
        plan = [f for row in result.plan.freqs_mhz for f in row]
        bound = switch_bound(model, result.deadline_s, 0.7, result.candidates_mhz, seed_plans=[plan])
        assert bound.lower_bound_j <= result.energy_j * (1 + RTOL)
        assert bound.lower_bound_j > result.lower_bound_j  # tighter than the LP bound the plan reports


def test_one_rank_with_a_loose_deadline_is_solved_exactly():
    """One stage, no deadline that binds: the relaxation's optimum is one clock sequence, so the bound must
    equal the brute-force minimum over every assignment, the wrap into the next iteration counted (a pricing
    DP that missed sequences or the wrap would be off)."""
    import itertools

    model = model_of(random_profile(11, stages=1), one_f_one_b(1, 3))
    deadline = model.slowest_time_s() * 10
    cost = 2.0
    best = min(model.evaluator.score(list(freqs)).energy_j
               + cost * sum(a != b for a, b in zip(freqs, (*freqs[1:], freqs[0])))
               for freqs in itertools.product(FREQS, repeat=model.n))
    bound = switch_bound(model, deadline, cost, FREQS)
    assert bound.converged
    assert bound.lower_bound_j == pytest.approx(best, rel=RTOL)
