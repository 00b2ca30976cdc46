"""`--type optimal`: feasibility, optimality against the exact MILP, errors, CLI, online use."""

from __future__ import annotations

import json
import random
import re
import sys

import pytest

pytest.importorskip("numpy")

from megatron_envpipe.apps.cli import main  # noqa: E402
from megatron_envpipe.config import EnvPipeConfig, EnvPipeConfigError  # noqa: E402
from megatron_envpipe.core.gpu_specs import get_gpu_spec  # noqa: E402
from megatron_envpipe.core.instructions import paired_hold_dependencies  # noqa: E402
from megatron_envpipe.core.kinds import build_schedule
from megatron_envpipe.core.measurement import IterationMeasurement
from megatron_envpipe.core.profile import Profile, ProfilePoint  # noqa: E402
from megatron_envpipe.core.schedule import clamp_extra_warmup, one_f_one_b  # noqa: E402
from megatron_envpipe.core.timeline import PipelineGraph, PlanEvaluator  # noqa: E402
from megatron_envpipe.planning.basis import PlannerConfig, PlannerError
from megatron_envpipe.planning.optimal import (  # noqa: E402
    InfeasibleDeadline,
    TimeEnergyModel,
    clock_options,
    lower_hull,
    plan_optimal,
)
from megatron_envpipe.planning.planner import plan_envpipe
from megatron_envpipe.planning.reconfig import ClockLadder, Reconfigurer
from megatron_envpipe.testing.milp import solve_milp  # noqa: E402

A40 = get_gpu_spec("a40")
P2P = A40.p2p_power_w
TIGHT = 1 + 1e-9  # float noise allowed on a deadline


def synthetic_profile(num_stages: int, seed: int, clocks: int = 8) -> Profile:
    """A plausible GPU: time ~ memory-bound share + compute share / f, power ~ static + dynamic f^3."""
    rng = random.Random(seed)
    freqs = [1740 - 105 * i for i in range(clocks)]
    points = {}
    for s in range(num_stages):
        for ins, mult in (("forward", 1.0), ("backward", 2.0 + rng.random())):
            t0, mem = rng.uniform(0.05, 0.2) * mult, rng.uniform(0.1, 0.5)
            static, dynamic = rng.uniform(70, 130), rng.uniform(120, 260)
            pts = []
            for f in freqs:
                t = t0 * (mem + (1 - mem) * 1740 / f) * (1 + rng.uniform(-0.01, 0.01))
                pts.append(ProfilePoint(f, t, (static + dynamic * (f / 1740) ** 3) * t))
            points[(s, ins)] = pts
    return Profile(points, source=f"<synthetic seed {seed}>")


def check_plan(res, deadline=None):
    """The plan is real (profiled clocks), meets its deadline in simulation, and respects the LP bound."""
    deadline = deadline if deadline is not None else res.deadline_s
    assert res.score.iteration_time_s <= deadline * TIGHT
    assert set(res.plan.flat()) <= set(res.candidates_mhz)
    assert res.lower_bound_j <= res.score.energy_j * TIGHT


# -- options and hulls -------------------------------------------------------------------
def test_options_are_pareto_in_effective_energy_and_hull_is_convex(gpt3_profile):
    opts = clock_options(gpt3_profile.points(0, "backward"), P2P)
    assert len(opts) >= 3 and opts[0].freq_mhz == 1740  # the fastest clock is first
    for a, b in zip(opts, opts[1:]):
        assert b.time_s > a.time_s and b.cost_j < a.cost_j
    cheapest = min(p.energy_j - P2P * p.time_s for p in gpt3_profile.points(0, "backward"))
    assert opts[-1].cost_j == pytest.approx(cheapest)
    hull = lower_hull(opts)
    assert len(hull) >= 3 and hull[0] == 0 and hull[-1] == len(opts) - 1
    slopes = [(opts[j].cost_j - opts[i].cost_j) / (opts[j].time_s - opts[i].time_s) for i, j in zip(hull, hull[1:])]
    assert all(s1 < s2 for s1, s2 in zip(slopes, slopes[1:]))  # convex: slopes increase


# -- feasibility ---------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["gpt3", "bloom"])
@pytest.mark.parametrize("scheduling", ["1f1b", "ours"])
def test_every_plan_meets_its_deadline(name, scheduling, gpt3_profile, bloom_profile):
    prof = gpt3_profile if name == "gpt3" else bloom_profile
    for m, slowdown in ((4, 0.0), (12, 0.0), (12, 0.03), (12, 0.10), (24, 0.01)):
        res = plan_envpipe(prof, m, PlannerConfig("optimal", scheduling, "default", gpu=A40, max_slowdown=slowdown))
        assert res.deadline_s == pytest.approx(res.baseline.iteration_time_s * (1 + slowdown), rel=1e-12)
        check_plan(res)
        # Re-scoring the plan with the evaluator everybody uses gives the same numbers.
        ev = PlanEvaluator(res.schedule, prof, P2P)
        again = ev.score(res.plan.flat())
        assert again.energy_j == pytest.approx(res.score.energy_j, rel=1e-12)
        assert again.iteration_time_s == pytest.approx(res.score.iteration_time_s, rel=1e-12)
        assert res.energy_saving > 0.02 and res.converged and res.stop_reason.startswith("optimal plan")


@pytest.mark.parametrize("seed", range(6))
def test_random_synthetic_profiles_are_feasible(seed):
    rng = random.Random(100 + seed)
    p, m = rng.randint(2, 6), rng.randint(1, 10)
    prof = synthetic_profile(p, seed, clocks=rng.randint(1, 12))
    for scheduling in ("1f1b", "ours"):
        for slowdown in (0.0, rng.uniform(0.0, 0.2)):
            res = plan_envpipe(prof, m, PlannerConfig("optimal", scheduling, "default", p2p_power_w=rng.uniform(0, 100),
                                                      max_slowdown=slowdown))
            check_plan(res)
            assert res.score.energy_j <= res.baseline.energy_j * TIGHT


def test_plans_are_reproducible(bloom_profile):
    cfg = PlannerConfig("optimal", "ours", "balanced", gpu=A40, max_slowdown=0.02)
    a, b = plan_envpipe(bloom_profile, 24, cfg), plan_envpipe(bloom_profile, 24, cfg)
    assert a.plan == b.plan and a.score == b.score


def test_slack_buys_energy(gpt3_profile):
    energies = []
    for slowdown in (0.0, 0.01, 0.03, 0.06):
        res = plan_envpipe(gpt3_profile, 12, PlannerConfig("optimal", "ours", "default", gpu=A40, max_slowdown=slowdown))
        energies.append(res.score.energy_j)
    assert all(b <= a * TIGHT for a, b in zip(energies, energies[1:]))
    assert energies[-1] < energies[0] * 0.97


def test_paired_communication_is_scored_with_its_dependencies(gpt3_profile):
    res = plan_envpipe(gpt3_profile, 12, PlannerConfig("optimal", "ours", "default", gpu=A40, comm="paired"))
    ev = PlanEvaluator(res.schedule, gpt3_profile, P2P, extra_dependencies=paired_hold_dependencies(res.schedule))
    sc = ev.score(res.plan.flat())
    assert sc.iteration_time_s <= res.deadline_s * TIGHT
    assert sc.energy_j == pytest.approx(res.score.energy_j, rel=1e-12)
    free = plan_envpipe(gpt3_profile, 12, PlannerConfig("optimal", "ours", "default", gpu=A40))
    assert free.energy_saving >= res.energy_saving - 1e-9  # holding activations can only cost energy


def test_memory_budget_clamps_ours_and_stays_visible(gpt3_profile, capsys):
    res = plan_envpipe(gpt3_profile, 24, PlannerConfig("optimal", "ours", "default", gpu=A40, max_inflight=10))
    assert max(res.schedule.peak_inflight()) <= 10
    check_plan(res)
    free = plan_envpipe(gpt3_profile, 24, PlannerConfig("optimal", "ours", "default", gpu=A40))
    assert max(free.schedule.peak_inflight()) > 10 and free.energy_saving > res.energy_saving
    assert main(["plan", "--profile", "a40/gpt3-175b", "-m", "24", "--type", "optimal", "--max-inflight", "10"]) == 0
    assert "peak in-flight activations [10," in capsys.readouterr().out


# -- optimality ------------------------------------------------------------------------
MILP_CASES = [
    # (profile, stages, micro-batches, clock stride, scheduling, slowdown)
    ("gpt3", 4, 6, 4, "1f1b", 0.0),
    ("gpt3", 4, 6, 4, "ours", 0.03),
    ("bloom", 4, 6, 4, "1f1b", 0.02),
    ("bloom", 4, 6, 4, "ours", 0.0),
] + [(f"synthetic{seed}", 3 + seed % 2, 4 + seed % 2, 1, sched, sd)
     for seed in range(4) for sched, sd in (("1f1b", 0.0), ("ours", 0.04))]


@pytest.mark.parametrize("case", MILP_CASES, ids=lambda c: "-".join(map(str, c)))
def test_within_half_a_percent_of_the_milp_optimum(case, gpt3_profile, bloom_profile):
    name, p, m, stride, scheduling, slowdown = case
    if name.startswith("synthetic"):
        prof = synthetic_profile(p, int(name[-1]))
    else:
        full = gpt3_profile if name == "gpt3" else bloom_profile
        prof = full.for_pipeline(p).restricted(full.common_frequencies()[::stride])
    r = clamp_extra_warmup(p, m, [2 * (p - s - 1) for s in range(p)])
    sched = build_schedule(scheduling, p, m, r if scheduling == "ours" else None)
    base = PlanEvaluator(one_f_one_b(p, m), prof, P2P).score([prof.max_frequency()] * (2 * p * m))
    deadline = base.iteration_time_s * (1 + slowdown)
    model = TimeEnergyModel(sched, prof, prof.common_frequencies(), P2P)
    ours = model.solve(deadline)
    # The MILP builds its own options and rows (testing/milp.py): no code shared with `model`'s LP.
    exact = solve_milp(model, deadline, time_limit_s=120, candidates_mhz=prof.common_frequencies())
    assert exact.optimal, exact.status  # these instances are chosen small enough to be proven optimal
    assert exact.energy_j == pytest.approx(exact.objective_j, rel=1e-6)  # the MILP's arithmetic is the evaluator's
    assert exact.score.iteration_time_s <= deadline * TIGHT
    assert ours.score.iteration_time_s <= deadline * TIGHT
    assert ours.lp_bound_j <= exact.energy_j * TIGHT  # the LP bounds the optimum from below
    assert exact.energy_j <= ours.score.energy_j * TIGHT  # nothing beats the optimum
    assert ours.score.energy_j <= exact.energy_j * 1.005, (ours.score.energy_j, exact.energy_j)


def test_target_time_plan_counts_energy_until_the_target(gpt3_profile):
    base = plan_envpipe(gpt3_profile, 12, PlannerConfig("baseline", "1f1b", "default", gpu=A40)).baseline
    target = base.iteration_time_s * 1.2
    res = plan_envpipe(gpt3_profile, 12, PlannerConfig("optimal", "ours", "default", gpu=A40, target_time_s=target))
    assert res.score.iteration_time_s <= target * TIGHT and res.deadline_s == target
    d = res.details
    pad = P2P * 8 * (target - res.score.iteration_time_s)
    assert d["energy_at_deadline_j"] == pytest.approx(res.score.energy_j + pad, rel=1e-12)
    assert d["baseline_energy_at_deadline_j"] == pytest.approx(base.energy_j + P2P * 8 * (target - base.iteration_time_s))
    zero = plan_envpipe(gpt3_profile, 12, PlannerConfig("optimal", "ours", "default", gpu=A40))
    assert d["energy_saving_at_deadline"] > zero.energy_saving  # slack is worth energy


def test_scipy_backend_gives_the_same_plan(monkeypatch, gpt3_profile):
    pytest.importorskip("scipy")
    prof = gpt3_profile.for_pipeline(4)
    cfg = PlannerConfig("optimal", "ours", "default", gpu=A40, max_slowdown=0.02)
    with_highs = plan_optimal(prof, 8, cfg)
    monkeypatch.setitem(sys.modules, "highspy", None)  # import highspy -> ImportError
    with_scipy = plan_optimal(prof, 8, cfg)
    assert with_scipy.lower_bound_j == pytest.approx(with_highs.lower_bound_j, rel=1e-6)
    assert with_scipy.score.energy_j == pytest.approx(with_highs.score.energy_j, rel=2e-3)
    assert with_scipy.score.iteration_time_s <= with_scipy.deadline_s * TIGHT


# -- errors ------------------------------------------------------------------------------
def test_infeasible_deadlines_are_clear_errors(gpt3_profile, capsys):
    base_t = one_f_one_b(8, 12)
    t_base = PlanEvaluator(base_t, gpt3_profile, P2P).simulate([1740] * 192).iteration_time_s
    for sched in ("1f1b", "ours"):
        with pytest.raises(InfeasibleDeadline, match=r"infeasible: even with every unit at its fastest clock"):
            plan_envpipe(gpt3_profile, 12, PlannerConfig("optimal", sched, "default", gpu=A40, target_time_s=0.9 * t_base))
    assert issubclass(InfeasibleDeadline, PlannerError)
    model = TimeEnergyModel(base_t, gpt3_profile, gpt3_profile.common_frequencies(), P2P)
    with pytest.raises(InfeasibleDeadline, match="fastest clock"):
        model.solve(0.99 * t_base)
    code = main(["plan", "--profile", "a40/gpt3-175b", "-m", "12", "--type", "optimal", "--target-time", "1"])
    err = capsys.readouterr().err
    assert code == 2 and "infeasible" in err and err.count("\n") == 1
    for bad in (["--max-slowdown", "5%"], ["--target-time", "9"]):
        assert main(["plan", "--profile", "a40/gpt3-175b", "-m", "12", "--type", "envelope", *bad]) == 2
        err = capsys.readouterr().err
        assert re.search(r"needs (plan type 'optimal'|--type optimal)", err), err
    with pytest.raises(PlannerError, match="max_slowdown must be (a finite number )?>= 0"):
        PlannerConfig("optimal", max_slowdown=-0.1).validate()


# -- CLI -------------------------------------------------------------------------------
def test_cli_plan_optimal_json(capsys, tmp_path):
    out = tmp_path / "plan.json"
    code = main(["plan", "--profile", "a40/bloom-176b", "-m", "12", "--type", "optimal", "--scheduling", "ours",
                 "--max-slowdown", "2%", "--json", "--out", str(out)])
    assert code == 0
    data = json.loads(capsys.readouterr().out)
    assert data["plan"]["type"] == "optimal" and data["slowdown"] <= 0.02 + 1e-9
    assert data["deadline_s"] == pytest.approx(data["baseline"]["iteration_time_s"] * 1.02)
    assert data["lower_bound_j"] <= data["plan"]["energy_j"]
    assert data["optimal"]["method"] == "lp+rounding" and data["optimal"]["extra_warmup_chosen"]
    assert len(data["plan"]["peak_inflight_activations"]) == 8 and data["energy_saving"] > 0.185
    # The saved plan re-simulates to the planner's numbers.
    assert main(["simulate", "--profile", "a40/bloom-176b", "--plan", str(out), "--json"]) == 0
    sim = json.loads(capsys.readouterr().out)
    assert sim["energy_j"] == pytest.approx(data["plan"]["simulated_energy_j"], rel=1e-12)  # no switch cost


def test_cli_plan_optimal_text_with_target(capsys):
    assert main(["plan", "--profile", "a40/gpt3-175b", "-m", "12", "--type", "optimal", "--target-time", "8.3"]) == 0
    out = capsys.readouterr().out
    assert "optimal     deadline 8.3000 s" in out and "at target" in out and "Stage 7 |" in out


# -- online use ------------------------------------------------------------------------
def measured(schedule, durations):
    graph = PipelineGraph(schedule)
    return graph.simulate([durations(s, u) for s, u in graph.nodes]).measurement()


def test_online_corrections_start_from_the_optimal_plan(gpt3_profile):
    res = plan_envpipe(gpt3_profile, 12, PlannerConfig("optimal", "1f1b", "balanced", gpu=A40))
    ladder = ClockLadder(res.candidates_mhz, 30)
    ev = PlanEvaluator(res.schedule, gpt3_profile, P2P)
    for policy in ("greedy", "balanced"):
        rc = Reconfigurer(res.plan, policy, ladder, finish_limit=2, target_time_s=res.deadline_s)
        # Units run as profiled: on time, nothing changes, and the reconfigurer settles.
        on_time = measured(res.schedule, lambda s, u: ev.durations(rc.plan.flat())[ev.graph.node(s, u)])
        for _ in range(3):
            assert rc.observe(on_time) == res.plan
        assert rc.finished
        # Stage 3 runs 4 % slower than profiled: the iteration is late, clocks go up on the measured path.
        rc = Reconfigurer(res.plan, policy, ladder, finish_limit=2, target_time_s=res.deadline_s, window=1)
        late = measured(res.schedule, lambda s, u: ev.durations(rc.plan.flat())[ev.graph.node(s, u)] * (1.04 if s == 3 else 1))
        after = rc.observe(late)
        assert after != res.plan
        assert all(a >= b for a, b in zip(after.flat(), res.plan.flat()))


def test_runtime_runs_optimal_and_corrects_online(tmp_path):
    from megatron_envpipe.megatron.runtime import EnvPipeRuntime

    rt = EnvPipeRuntime(EnvPipeConfig(plan_type="optimal", scheduling="ours", reconfig="balanced",
                                      profile="a40/gpt3-175b", gpu="a40", max_slowdown=0.01, finish_limit=1))
    it = rt.prepare(8, 12)
    assert rt.last_result.config.plan_type == "optimal" and rt.last_result.slowdown <= 0.01 + 1e-9
    assert it.plan == rt.last_result.plan and it.measure
    rc = rt._by_m[(8, 12)].reconfigurer
    assert rc.target_time_s == pytest.approx(rt.last_result.deadline_s)
    ev = PlanEvaluator(it.schedule, rt.profile, P2P)
    d = ev.durations(it.plan.flat())
    for _ in range(2):
        m = measured(it.schedule, lambda s, u: d[ev.graph.node(s, u)])
        rt.finish(8, 12, [IterationMeasurement((stage,)) for stage in m.stages])  # one per stage
        it = rt.prepare(8, 12)
    assert it.phase == "steady" and it.plan == rt.last_result.plan


def test_config_flags():
    import argparse

    from megatron_envpipe.config import add_envpipe_args

    parser = add_envpipe_args(argparse.ArgumentParser())
    cfg = EnvPipeConfig.from_args(parser.parse_args(["--envpipe-type", "optimal", "--envpipe-max-slowdown", "0.05"]))
    assert cfg.plan_type == "optimal" and cfg.max_slowdown == 0.05 and cfg.target_time_s is None
    cfg = EnvPipeConfig.from_args(parser.parse_args(["--envpipe-type", "optimal", "--envpipe-target-time", "12.5"]))
    assert cfg.plan_type == "optimal" and cfg.target_time_s == 12.5
    with pytest.raises(EnvPipeConfigError, match="need --envpipe-type optimal"):
        EnvPipeConfig(plan_type="envelope", max_slowdown=0.1).validate()
    with pytest.raises(EnvPipeConfigError, match="target-time (0: )?must be > 0"):
        EnvPipeConfig(plan_type="optimal", target_time_s=0.0).validate()
