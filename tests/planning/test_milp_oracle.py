"""The MILP oracle against brute force: every clock assignment of tiny pipelines, scored by PlanEvaluator.

testing/milp.py is what the LP planner is checked against (test_optimal.py), so it
must be right on its own: here its optimum must equal the minimum energy over all
clock assignments that meet the deadline, for both schedules, several deadlines,
P2P latency, extra (paired-hold) dependencies and model chunks (interleaved), at the plan's makespan and padded.
"""

from __future__ import annotations

import itertools
import random

import pytest

pytest.importorskip("numpy")

from megatron_envpipe.core.gpu_specs import get_gpu_spec  # noqa: E402
from megatron_envpipe.core.instructions import paired_hold_dependencies  # noqa: E402
from megatron_envpipe.core.profile import Profile, ProfilePoint  # noqa: E402
from megatron_envpipe.core.schedule import envpipe_schedule, interleaved_schedule, one_f_one_b  # noqa: E402
from megatron_envpipe.core.timeline import PlanEvaluator  # noqa: E402
from megatron_envpipe.testing import milp  # noqa: E402
from megatron_envpipe.planning.optimal import TimeEnergyModel  # noqa: E402
from megatron_envpipe.planning.optimal import options as options_mod  # noqa: E402
from megatron_envpipe.planning.optimal import rows as rows_mod  # noqa: E402

P2P = get_gpu_spec("a40").p2p_power_w
TIGHT = 1 + 1e-9
SLACKS = (0.0, 0.03, 0.10)  # deadlines: fastest plan x (1 + slack), and "anything goes"

# (name, schedule, clocks used, P2P latency s, paired-hold dependencies)
INSTANCES = [
    ("1f1b-P2M2", one_f_one_b(2, 2), 3, 0.0, False),  # 3^8 = 6561 assignments
    ("1f1b-P2M3", one_f_one_b(2, 3), 2, 0.004, False),  # 2^12 = 4096
    ("ours-P2M3", envpipe_schedule(2, 3, [1, 0]), 2, 0.0, False),  # stage 0 warms up with 3 forwards
    ("ours-P2M3-paired", envpipe_schedule(2, 3, [1, 0]), 2, 0.004, True),
    # Two model chunks: the wrap-around messages (last stage's chunk 0 -> first stage's chunk 1 and back)
    ("interleaved-P2M2V2", interleaved_schedule(2, 2, 2), 2, 0.004, False),  # 2^16 = 65536
]


def synthetic_profile(seed: int, freqs: tuple[int, ...]) -> Profile:
    """Two stages; the slowest clock can cost more energy than the middle one (a valley)."""
    rng = random.Random(seed)
    points = {}
    for s in range(2):
        for ins, mult in (("forward", 1.0), ("backward", 2.0 + rng.random())):
            t0, mem = rng.uniform(0.05, 0.2) * mult, rng.uniform(0.1, 0.5)
            static, dynamic = rng.uniform(70, 130), rng.uniform(120, 260)
            pts = []
            for f in freqs:
                t = t0 * (mem + (1 - mem) * freqs[0] / f)
                pts.append(ProfilePoint(f, t, (static + dynamic * (f / freqs[0]) ** 3) * t))
            points[(s, ins)] = pts
    return Profile(points, source=f"<2-stage synthetic seed {seed}>")


def profiles(gpt3: Profile) -> dict[str, dict[int, Profile]]:
    """name -> {number of clocks: profile with exactly those clocks}."""
    real = gpt3.for_pipeline(2)
    return {
        "synthetic": {3: synthetic_profile(5, (1740, 1200, 600)), 2: synthetic_profile(5, (1740, 1050))},
        "gpt3": {3: real.restricted([1740, 1350, 900]), 2: real.restricted([1740, 1200])},
    }


def brute_force(sched, prof: Profile, latency: float, deps) -> tuple[PlanEvaluator, list[tuple[float, float, tuple]]]:
    """(evaluator, [(iteration time, energy, freqs)] for every clock assignment)."""
    ev = PlanEvaluator(sched, prof, P2P, p2p_latency_s=latency, extra_dependencies=deps)
    choices = [prof.frequencies(s, "forward" if u.is_forward else "backward") for s, u in ev.graph.nodes]
    scored = []
    for freqs in itertools.product(*choices):
        sc = ev.score(freqs)
        scored.append((sc.iteration_time_s, sc.energy_j, freqs))
    return ev, scored


@pytest.mark.parametrize("which", ["synthetic", "gpt3"])
@pytest.mark.parametrize("instance", INSTANCES, ids=lambda i: i[0])
def test_milp_optimum_equals_brute_force(instance, which, gpt3_profile):
    name, sched, n_clocks, latency, paired = instance
    prof = profiles(gpt3_profile)[which][n_clocks]
    assert len(prof.common_frequencies()) == n_clocks
    deps = paired_hold_dependencies(sched) if paired else ()
    assert bool(deps) == paired
    ev, scored = brute_force(sched, prof, latency, deps)
    assert len(scored) == n_clocks ** len(ev.graph.nodes)
    fastest = min(t for t, _, _ in scored)
    slowest = max(t for t, _, _ in scored)
    model = TimeEnergyModel(sched, prof, prof.common_frequencies(), P2P, latency, deps)
    deadlines = [fastest * (1 + x) for x in SLACKS] + [slowest]
    minima = []
    for deadline in deadlines:
        for padded in (False, True):
            pad_w = P2P * sched.num_stages if padded else 0.0  # padded: blocking power until the deadline
            best = min(e + pad_w * (deadline - t) for t, e, _ in scored if t <= deadline * TIGHT)
            exact = milp.solve_milp(model, deadline, padded=padded, time_limit_s=60)
            label = (name, which, deadline / fastest, padded)
            assert exact.optimal, (label, exact.status)
            assert exact.score.iteration_time_s <= deadline * TIGHT, label
            assert exact.energy_j == pytest.approx(best, rel=1e-6), label
            assert exact.objective_j == pytest.approx(best, rel=1e-6), label
            assert exact.dual_bound_j is not None and exact.dual_bound_j <= best * (1 + 1e-6), label
            again = ev.score(exact.freqs_mhz)  # the plan is what the result says it is
            assert (again.iteration_time_s, again.energy_j) == (exact.score.iteration_time_s, exact.score.energy_j)
            if not padded:
                minima.append(best)
    # The deadline binds: the tightest one costs strictly more than the loosest.
    assert minima[0] > minima[-1] * (1 + 1e-6), (name, which, minima)


def test_oracle_shares_nothing_with_the_planners_model(gpt3_profile, monkeypatch):
    """Break the planner's option lists, hulls, LP rows and the model's derived data: the oracle is unaffected."""
    sched = envpipe_schedule(2, 3, [1, 0])
    prof = profiles(gpt3_profile)["gpt3"][2]
    _, scored = brute_force(sched, prof, 0.0, ())
    deadline = min(t for t, _, _ in scored) * 1.03
    best = min(e for t, e, _ in scored if t <= deadline * TIGHT)
    model = TimeEnergyModel(sched, prof, prof.common_frequencies(), P2P)

    def broken(*args, **kwargs):
        raise AssertionError("the MILP oracle used the planner's own builders")

    for mod, attr in ((options_mod, "clock_options"), (options_mod, "lower_hull"), (rows_mod, "ConstraintRows"),
                      (rows_mod, "_csc_arrays")):
        monkeypatch.setattr(mod, attr, broken)
    for attr in ("options", "options_by_key", "times", "costs", "hulls", "preds", "keys"):
        monkeypatch.setattr(model, attr, None)
    monkeypatch.setattr(model, "check_deadline", broken)
    monkeypatch.setattr(model, "fastest_time_s", broken)
    exact = milp.solve_milp(model, deadline)
    assert exact.optimal and exact.energy_j == pytest.approx(best, rel=1e-6)


@pytest.mark.parametrize(("instance", "share"), [(INSTANCES[1], 0.5), (INSTANCES[-1], 0.2)],
                         ids=["1f1b-P2M3", "interleaved-P2M2V2"])
def test_milp_with_switch_cost_equals_brute_force(instance, share, gpt3_profile):
    """With a switch cost the oracle's optimum is the least energy plus cost x the changes a repeating iteration
    makes (each rank's consecutive units and its last unit back to its first), over every assignment."""
    name, sched, n_clocks, latency, _ = instance
    prof = profiles(gpt3_profile)["gpt3"][n_clocks]
    ev, scored = brute_force(sched, prof, latency, ())
    stage_of = [s for s, _ in ev.graph.nodes]
    cost = share * min(e for _, e, _ in scored) / len(stage_of)  # a share of a unit's energy per change

    def changes(freqs: tuple) -> int:
        rows = [[f for f, s in zip(freqs, stage_of) if s == st] for st in range(sched.num_stages)]
        return sum(a != b for row in rows for a, b in zip(row, row[1:] + row[:1]))

    deadline = min(t for t, _, _ in scored) * 1.03
    feasible = [(e + cost * changes(f), e) for t, e, f in scored if t <= deadline * TIGHT]
    best = min(feasible)
    free_best = min(feasible, key=lambda x: x[1])
    assert best[0] < free_best[0] * (1 - 1e-6)  # the cost moves the optimum: the switch-free best is not it
    model = TimeEnergyModel(sched, prof, prof.common_frequencies(), P2P, latency)
    exact = milp.solve_milp(model, deadline, time_limit_s=60, mip_rel_gap=1e-9, switch_cost_j=cost)
    assert exact.optimal, (name, exact.status)
    assert exact.energy_j == pytest.approx(best[0], rel=1e-6), name
    assert exact.energy_j == pytest.approx(exact.score.energy_j + cost * changes(tuple(exact.freqs_mhz)), rel=1e-9)
