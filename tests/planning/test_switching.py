"""The clock-change pass (planning/switching.py): fewer changes, deadline kept, little energy given up."""

from __future__ import annotations

import math
import random

import pytest

pytest.importorskip("numpy")

from megatron_envpipe.core.gpu_specs import get_gpu_spec  # noqa: E402
from megatron_envpipe.core.kinds import build_schedule
from megatron_envpipe.core.plan import FrequencyPlan  # noqa: E402
from megatron_envpipe.core.profile import Profile, ProfilePoint  # noqa: E402
from megatron_envpipe.core.schedule import clamp_extra_warmup  # noqa: E402
from megatron_envpipe.core.timeline import PlanEvaluator  # noqa: E402
from megatron_envpipe.errors import UsageError  # noqa: E402
from megatron_envpipe.planning.basis import PlannerConfig  # noqa: E402
from megatron_envpipe.planning.planner import plan_envpipe  # noqa: E402
from megatron_envpipe.planning.switching import (  # noqa: E402
    DEFAULT_SWITCH_LATENCY_S,
    SwitchingError,
    default_switch_cost_j,
    reduce_clock_changes,
    steady_clock_changes,
)

A40 = get_gpu_spec("a40")
P2P = A40.p2p_power_w
TIGHT = 1 + 1e-9


def runs_of(row):
    """(start, end, clock) of each stretch of equal clocks."""
    out, i = [], 0
    while i < len(row):
        j = i
        while j < len(row) and row[j] == row[i]:
            j += 1
        out.append((i, j, row[i]))
        i = j
    return out


def effective(evaluator, freqs):
    """Per unit E(f) - P_p2p t(f): what a merge changes at a fixed iteration time."""
    return [e - evaluator.p2p_power_w * t for e, t in zip(evaluator.unit_energies(freqs), evaluator.durations(freqs))]


def worthwhile_feasible_merges(plan, evaluator, deadline, cost, steady=True):
    """Brute force: every (stage, run, clock) merge that gives up less than ``cost`` per change removed and
    still meets the deadline. After the pass there must be none. ``steady``: changes of a repeating iteration
    (what the cost pass counts, the change into the next iteration included); else the first lock counted
    (what a budget counts)."""
    flat = plan.flat()
    base = effective(evaluator, flat)
    found = []
    k = 0
    for s, row in enumerate(plan.freqs_mhz):
        runs = runs_of(row)
        for r, (a, b, f) in enumerate(runs):
            nbrs = [runs[x][2] for x in (r - 1, r + 1) if 0 <= x < len(runs)]
            for g in set(nbrs):
                trial = list(flat)
                trial[k + a:k + b] = [g] * (b - a)
                loss = sum(effective(evaluator, trial)[k + a:k + b]) - sum(base[k + a:k + b])
                if steady:
                    merged = FrequencyPlan.from_flat(plan.schedule, trial)
                    removed = steady_clock_changes(plan)[s] - steady_clock_changes(merged)[s]
                else:
                    removed = nbrs.count(g)
                if loss < removed * cost and evaluator.simulate(trial).iteration_time_s <= deadline * TIGHT:
                    found.append((s, a, b, f, g, loss))
        k += len(row)
    return found


@pytest.mark.parametrize("scheduling", ["1f1b", "ours"])
@pytest.mark.parametrize("name", ["gpt3", "bloom"])
def test_cost_pass_removes_changes_that_buy_little(name, scheduling, gpt3_profile, bloom_profile):
    profile = gpt3_profile if name == "gpt3" else bloom_profile
    res = plan_envpipe(profile, 12, PlannerConfig("optimal", scheduling, "default", gpu=A40))
    assert "clock_switching" not in res.details  # the library default: no pass
    ev = PlanEvaluator(res.schedule, profile, P2P)
    cost = 1.5
    sw = reduce_clock_changes(res.plan, ev, None, cost)
    before, after = sum(sw.changes_before), sum(sw.changes_after)
    assert sw.changes_before == res.plan.clock_changes() and sw.changes_after == sw.plan.clock_changes()
    assert after < before and all(a <= b for a, b in zip(sw.changes_after, sw.changes_before))
    # never slower; what was given up stays below the switch cost of the changes removed
    assert sw.score.iteration_time_s <= res.score.iteration_time_s * TIGHT
    assert sw.score.energy_j - res.score.energy_j < cost * (sum(sw.charged_before) - sum(sw.charged_after))
    assert sw.score == ev.score(sw.plan.flat())  # the evaluator's own numbers
    assert set(sw.plan.flat()) <= set(res.plan.flat())  # only clocks the plan had
    # nothing worthwhile and feasible is left (the incremental timeline rejected nothing it should have taken)
    assert worthwhile_feasible_merges(sw.plan, ev, res.score.iteration_time_s, cost) == []


@pytest.mark.parametrize("name", ["gpt3", "bloom"])
def test_budget_is_met_or_reported(name, gpt3_profile, bloom_profile):
    profile = gpt3_profile if name == "gpt3" else bloom_profile
    res = plan_envpipe(profile, 12, PlannerConfig("optimal", "ours", "default", gpu=A40))
    ev = PlanEvaluator(res.schedule, profile, P2P)
    assert max(res.plan.clock_changes()) > 6
    energies = []
    for budget in (6, 3, 1):
        sw = reduce_clock_changes(res.plan, ev, None, 0.0, budget)
        assert sw.score.iteration_time_s <= res.score.iteration_time_s * TIGHT
        over = tuple(s for s, c in enumerate(sw.changes_after) if c > budget)
        assert over == sw.budget_unmet
        # a rank over budget has no merge left that meets the deadline (at any energy)
        mergeable = {s for s, *_ in worthwhile_feasible_merges(sw.plan, ev, res.score.iteration_time_s, 1e18,
                                                                 steady=False)}
        assert not mergeable & set(over)
        energies.append(sw.score.energy_j)
        if budget == 6:
            assert over == ()
    assert energies == sorted(energies)  # a tighter budget costs energy


def test_unreachable_budget_is_reported_not_made_slower():
    """A clock that is not faster for every unit: forwards are fastest at 1500 MHz, backwards at 1400 MHz
    (measured profiles do this: Bloom's stage 0 forward is slower at 1740 than at 1560 MHz). With every
    unit at its fastest clock every unit is critical, so no rank can lose a single change."""
    points = {}
    for s in range(2):
        points[(s, "forward")] = [ProfilePoint(1500, 1.0, 100.0), ProfilePoint(1400, 1.2, 90.0)]
        points[(s, "backward")] = [ProfilePoint(1500, 2.2, 200.0), ProfilePoint(1400, 2.0, 190.0)]
    profile = Profile(points, source="<crossing clocks>")
    schedule = build_schedule("1f1b", 2, 3)
    fastest = {"F": 1500, "B": 1400}
    plan = FrequencyPlan(schedule, tuple(tuple(fastest[u.kind] for u in order) for order in schedule.orders))
    ev = PlanEvaluator(schedule, profile, 50.0)
    sw = reduce_clock_changes(plan, ev, None, 0.0, 2)
    assert sw.score.iteration_time_s <= ev.simulate(plan.flat()).iteration_time_s * TIGHT
    # every unit is critical: no merge fits, the plan stays as it was and both ranks are reported
    assert worthwhile_feasible_merges(plan, ev, sw.deadline_s, 1e18, steady=False) == []
    assert sw.plan == plan and sw.merges == 0
    assert sw.budget_unmet == (0, 1) and sw.summary()["budget_unmet_ranks"] == [0, 1]


@pytest.mark.parametrize("seed", range(4))
def test_random_plans_keep_their_deadline(seed, gpt3_profile):
    """Random clocks on random 'ours' schedules: the pass keeps the deadline and lowers energy + cost x changes."""
    rng = random.Random(seed)
    p, m = 4 + seed % 3, 5 + 3 * seed
    profile = gpt3_profile.for_pipeline(p)
    r = clamp_extra_warmup(p, m, [rng.randint(0, 3) for _ in range(p)])
    schedule = build_schedule("ours", p, m, r)
    clocks = profile.common_frequencies()
    plan = FrequencyPlan(schedule, tuple(tuple(rng.choice(clocks) for _ in order) for order in schedule.orders))
    ev = PlanEvaluator(schedule, profile, P2P)
    own = ev.simulate(plan.flat()).iteration_time_s
    deadline = own * rng.choice([1.0, 1.02])
    cost = rng.uniform(0.1, 5.0)
    sw = reduce_clock_changes(plan, ev, deadline, cost)
    assert sw.score.iteration_time_s <= deadline * TIGHT

    def objective(score, changes):  # energy until the deadline (slack at blocking power) + cost x steady changes
        return score.energy_j + P2P * p * (deadline - score.iteration_time_s) + cost * sum(changes)

    assert objective(sw.score, sw.charged_after) <= objective(ev.score(plan.flat()), sw.charged_before) + 1e-9
    assert sw.merges > 0
    assert worthwhile_feasible_merges(sw.plan, ev, deadline, cost) == []


def test_planner_applies_the_configured_pass(gpt3_profile):
    # None: the derived default for optimal plans...
    res = plan_envpipe(gpt3_profile, 24, PlannerConfig("optimal", "1f1b", "default", gpu=A40, switch_cost_j=None))
    sw = res.details["clock_switching"]
    assert sw["switch_cost_j"] == pytest.approx(DEFAULT_SWITCH_LATENCY_S * P2P) == default_switch_cost_j(P2P)
    assert sw["clock_changes_after"] == list(res.plan.clock_changes())
    assert sum(sw["clock_changes_after"]) < sum(sw["clock_changes_before"])
    assert res.score.iteration_time_s <= res.deadline_s * TIGHT
    # what the plan is worth counts the clock changes it keeps (tests/planning/test_switch_accounting.py)
    assert res.details["gap_to_lp_bound"] == pytest.approx(res.energy_j / res.lower_bound_j - 1)
    assert sw["merges"] > 0 and sw["energy_given_up_j"] == pytest.approx(res.score.energy_j - sw["energy_before_j"])
    # ... and no pass for EnvPipe's own plan types (they stay EnvPipe's plans)
    env = plan_envpipe(gpt3_profile, 24, PlannerConfig("envelope", "ours", "balanced", gpu=A40, switch_cost_j=None))
    assert "clock_switching" not in env.details
    # a budget applies to any plan type
    env = plan_envpipe(gpt3_profile, 24, PlannerConfig("envelope", "ours", "balanced", gpu=A40, max_clock_changes=3))
    assert max(env.plan.clock_changes()) <= 3 and env.details["clock_switching"]["max_clock_changes"] == 3
    # a target-time plan keeps its energy-until-the-target bookkeeping
    target = res.baseline.iteration_time_s * 1.1
    tgt = plan_envpipe(gpt3_profile, 12, PlannerConfig("optimal", "ours", "default", gpu=A40, target_time_s=target,
                                                        switch_cost_j=2.0))
    d = tgt.details
    assert tgt.score.iteration_time_s <= target * TIGHT and d["clock_switching"]["merges"] > 0
    assert d["energy_at_deadline_j"] == pytest.approx(
        tgt.energy_j + P2P * 8 * (target - tgt.score.iteration_time_s), rel=1e-12)


@pytest.mark.parametrize("cost, budget", [(-1.0, None), (math.nan, None), (math.inf, None), (True, None),
                                          (0.0, 0), (0.0, 2.5), (None, -3)])
def test_bad_knobs_are_usage_errors(cost, budget):
    with pytest.raises(SwitchingError) as err:
        PlannerConfig("optimal", switch_cost_j=cost, max_clock_changes=budget).validate()
    assert isinstance(err.value, UsageError)
    assert ("--switch-cost-j" in str(err.value)) != ("--max-clock-changes" in str(err.value))
