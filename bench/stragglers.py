#!/usr/bin/env python3
"""Following a straggler (issue 24): the fast replica's energy with and without following, simulated.

Data parallelism DP = 2 x pipeline PP = 4 on the shipped A40 profiles (gpt3-175b, bloom-176b; the first
three stages and the last, :meth:`Profile.for_pipeline`), M = 8 and 16, scheduling ``ours`` (or
``--scheduling``), ``--type optimal`` plans with the derived switch cost (what training runs). Replica 1
is a straggler: every unit takes ``factor`` x its profiled time at the same clocks (1.05, 1.1, 1.2). It
keeps its own plan, so the iteration lasts ``factor`` x the own plan's time, with or without following.

Replica 0 (the fast one):

* **without following** runs its own plan, then blocks at P2P power until the straggler's iteration
  ends (the wait at the data-parallel gradient all-reduce);
* **with following** runs the start-up frontier's plan for the straggler's pace
  (:meth:`megatron_envpipe.planning.straggler.FrontierPlans.plan_for`), blocking only for what is left.

Every energy is scored by the timeline simulation (:class:`~megatron_envpipe.core.timeline.PlanEvaluator`,
the planner's own model) plus the clock changes each plan keeps, stretched to the straggler's iteration
time. The follower aims 0.5 % below the straggler's pace (``FollowSettings.headroom``). ``replan`` is the
direct re-plan for that target (``megatron_envpipe.planning.straggler._replan_for_pace``, as
``--envpipe-target-time``), which the 20-point frontier approximates up to its last point (the energy
valley); ``front/rep`` = frontier plan's energy / re-plan's. Simulated figures, not measurements.

Then the decision trace of :class:`~megatron_envpipe.planning.straggler.StragglerFollower` over noisy window
measurements (seeded, so the run is reproducible): switches happen only when the straggler starts,
changes pace or recovers, never on noise.

    python bench/stragglers.py [--factors 1.05,1.1,1.2] [--microbatches 8,16] [--scheduling ours]
"""

from __future__ import annotations

import argparse
import random
import time

from megatron_envpipe.core.gpu_specs import get_gpu_spec
from megatron_envpipe.core.plan import FrequencyPlan
from megatron_envpipe.core.profile import Profile
from megatron_envpipe.core.resources import shipped_profile
from megatron_envpipe.core.timeline import PlanEvaluator
from megatron_envpipe.planning.basis import PlannerConfig
from megatron_envpipe.planning.planner import plan_envpipe
from megatron_envpipe.planning.straggler import (
    FollowSettings,
    StragglerFollower,
    _compute_frontier_plans,
    _replan_for_pace,
)
from megatron_envpipe.planning.switching import steady_clock_changes

PP = 4
PROFILES = ("a40/gpt3-175b", "a40/bloom-176b")


def scored(plan: FrequencyPlan, profile: Profile, p2p_w: float, cost_j: float) -> tuple[float, float]:
    """(iteration time, energy incl. the clock changes the plan keeps) by the timeline simulation."""
    sc = PlanEvaluator(plan.schedule, profile, p2p_w).score(plan.flat())
    return sc.iteration_time_s, sc.energy_j + cost_j * sum(steady_clock_changes(plan))


def stretched(time_s: float, energy_j: float, until_s: float, p2p_w: float, stages: int) -> float:
    """Energy of an iteration that blocks at P2P power from ``time_s`` until ``until_s``."""
    return energy_j + p2p_w * stages * max(0.0, until_s - time_s)


def energy_table(factors: list[float], microbatches: list[int], scheduling: str, points: int) -> list[dict]:
    gpu = get_gpu_spec("a40")
    config = PlannerConfig("optimal", scheduling, "default", gpu=gpu, switch_cost_j=None)
    p2p, cost = config.effective_p2p_power_w, config.effective_switch_cost_j
    rows = []
    print(f"DP = 2 x PP = {PP}, A40, --type optimal --scheduling {scheduling}, switch cost {cost:.3g} J/change; "
          f"frontier of {points} points")
    print(f"{'profile':<15}{'M':>3}{'factor':>7}{'iter s':>9}{'own s':>8}{'follow s':>9}"
          f"{'E wait J':>10}{'E follow J':>11}{'saving':>8}{'replan J':>10}{'front/rep':>10}{'front s':>9}{'replan s':>10}{'front/sim':>11}")
    for name in PROFILES:
        prof = Profile.from_csv(shipped_profile(name)).for_pipeline(PP)
        for m in microbatches:
            own = plan_envpipe(prof, m, config)
            own_t, own_e = scored(own.plan, prof, p2p, cost)
            t0 = time.process_time()  # CPU seconds: this shared machine's load does not count
            plans = _compute_frontier_plans(prof, m, config, points=points)
            frontier_s = time.process_time() - t0
            t0 = time.process_time()
            for _ in range(20):
                scored(own.plan, prof, p2p, cost)
            sim_s = (time.process_time() - t0) / 20  # the same-run yardstick: one simulation of the iteration
            for factor in factors:
                slow = prof.scaled(factor, factor)  # same clocks, every unit factor x longer (same power)
                strag_t, _ = scored(own.plan, slow, p2p, cost)  # the straggler keeps its own plan
                wait_e = stretched(own_t, own_e, strag_t, p2p, PP)
                # The follower's target: its own plan's predicted time x the agreed pace ratio.
                ratio = StragglerFollower(FollowSettings(), own_t).update(own_t, strag_t).pace_ratio
                follow = plans.plan_for(own_t * ratio)
                fol_t, fol_e = scored(follow.plan, prof, p2p, cost)
                follow_e = stretched(fol_t, fol_e, strag_t, p2p, PP)
                t1 = time.process_time()
                replan = _replan_for_pace(prof, m, own_t * ratio, config)
                replan_s = time.process_time() - t1
                rep_t, rep_e = scored(replan.plan, prof, p2p, cost)
                assert rep_t <= strag_t and abs(rep_e + p2p * PP * (own_t * ratio - rep_t) - replan.predicted_energy_j) \
                    <= 1e-9 * rep_e
                replan_e = stretched(rep_t, rep_e, strag_t, p2p, PP)
                iter_with = max(fol_t, strag_t)
                assert iter_with == strag_t, "following must never make the iteration slower"
                row = dict(profile=name, m=m, factor=factor, iteration_s=strag_t, own_s=own_t, follow_s=fol_t,
                           wait_energy_j=wait_e, follow_energy_j=follow_e, saving=1 - follow_e / wait_e,
                           replan_energy_j=replan_e, frontier_s=frontier_s, replan_s=replan_s,
                           sim_s=sim_s)
                rows.append(row)
                print(f"{name.split('/')[1]:<15}{m:>3}{factor:>7.2f}{strag_t:>9.4f}{own_t:>8.4f}{fol_t:>9.4f}"
                      f"{wait_e:>10.1f}{follow_e:>11.1f}{100 * row['saving']:>7.2f}%{replan_e:>10.1f}"
                      f"{follow_e / replan_e:>10.4f}{frontier_s:>9.2f}{replan_s:>10.2f}{frontier_s / sim_s:>11.0f}")
    savings = [r["saving"] for r in rows]
    replans = [1 - r["replan_energy_j"] / r["wait_energy_j"] for r in rows]
    print("front s, replan s: CPU seconds of the frontier (once per profile and M) and of the direct re-plan; "
          "front/sim: frontier CPU time / one simulation of the iteration, measured in the same run")
    print(f"fast replica's energy saved by following: frontier plan {100 * min(savings):.2f} % .. "
          f"{100 * max(savings):.2f} %, re-plan {100 * min(replans):.2f} % .. {100 * max(replans):.2f} %; "
          "iteration time = the straggler's in every row (follow s <= iter s)")
    return rows


def noisy_trace(seed: int = 24, noise: float = 0.006) -> int:
    """StragglerFollower over 60 noisy windows: straggler at 1.0, throttled to 1.1 x, 1.15 x, back; then
    hovering at the threshold. Returns the number of plan switches."""
    rng = random.Random(seed)
    phases = [(1.0, 10), (1.10, 15), (1.15, 10), (1.0, 10), (1.02, 15)]  # (straggler's true pace ratio, windows)
    follower = StragglerFollower(FollowSettings(), 1.0)
    switches, w = 0, 0
    print(f"\nStragglerFollower trace (own pace 1.0 s, +-{100 * noise:g} % noise per window, threshold 2 %, "
          "release 1 %): windows where the plan changes")
    for ratio, n in phases:
        for _ in range(n):
            own = 1.0 * (1 + rng.uniform(-noise, noise))
            slowest = ratio * (1 + rng.uniform(-noise, noise))
            d = follower.update(own, slowest)
            assert d.target_time_s is None or d.target_time_s <= max(own, slowest), "slower than the slowest"
            if d.changed:
                switches += 1
                print(f"  window {w:>2} (straggler x{ratio:.2f}): {d.reason}")
            w += 1
    print(f"{switches} plan switches in {w} windows (phases: {', '.join(f'x{r:g} for {n}' for r, n in phases)})")
    return switches


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--factors", default="1.05,1.1,1.2")
    ap.add_argument("--microbatches", default="8,16")
    ap.add_argument("--scheduling", default="ours", choices=("ours", "1f1b"))
    ap.add_argument("--points", type=int, default=20, help="frontier points (training's default: 20)")
    args = ap.parse_args()
    energy_table([float(x) for x in args.factors.split(",")], [int(x) for x in args.microbatches.split(",")],
                 args.scheduling, args.points)
    noisy_trace()


if __name__ == "__main__":
    main()
