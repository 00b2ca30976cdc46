#!/usr/bin/env python3
"""Planner wall time on the shipped A40 profiles, P = 8, M in {12, 24, 48, 96}.

Goal (issue 2): under 1 s per plan for the default EnvPipe planner
(envelope / ours / balanced). Each row also prints the ratio of planning time
to one simulation of the same iteration, measured in the same run, so the
figure is comparable across machines.

    python bench/plan_speed.py [--policies balanced,greedy] [--repeat 3] [--types envelope,optimal]

``--types`` also times other plan types; ``optimal`` (the LP planner, issue 5)
has no offline reconfiguration, so it is timed once per scheduling (policy "-").
"""

from __future__ import annotations

import argparse
import time

from megatron_envpipe.core.gpu_specs import get_gpu_spec
from megatron_envpipe.core.profile import Profile
from megatron_envpipe.core.resources import shipped_profiles
from megatron_envpipe.core.schedule import one_f_one_b
from megatron_envpipe.core.timeline import PlanEvaluator
from megatron_envpipe.planning.basis import PlannerConfig
from megatron_envpipe.planning.planner import plan_envpipe

GOAL_S = 1.0


def best_of(repeat: int, fn):
    best, out = float("inf"), None
    for _ in range(repeat):
        t0 = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t0)
    return best, out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--policies", default="balanced,greedy", help="comma-separated reconfiguration policies")
    ap.add_argument("--schedulings", default="ours,1f1b")
    ap.add_argument("--microbatches", default="12,24,48,96")
    ap.add_argument("--repeat", type=int, default=3, help="best of N runs")
    ap.add_argument("--types", default="envelope", help="comma-separated plan types, e.g. envelope,optimal")
    args = ap.parse_args()
    gpu = get_gpu_spec("a40")
    print(f"{'profile':16}{'sched':>6}{'policy':>10}{'M':>4}{'iters':>7}{'plan s':>9}"
          f"{'x goal':>8}{'sim ms':>8}{'plan/sim':>9}{'saving':>8}{'slowdown':>9}")
    worst_default = 0.0
    worst_by_type: dict[str, float] = {}
    for name, path in shipped_profiles().items():
        prof = Profile.from_csv(path)
        for m in [int(x) for x in args.microbatches.split(",")]:
            sched = one_f_one_b(prof.num_stages, m)
            ev = PlanEvaluator(sched, prof, gpu.p2p_power_w)
            freqs = [1740] * sum(len(o) for o in sched.orders)
            sim_s, _ = best_of(max(5, args.repeat), lambda: ev.score(freqs))
            combos = [(plan_type, scheduling, policy) for plan_type in args.types.split(",")
                      for scheduling in args.schedulings.split(",")
                      for policy in (args.policies.split(",") if plan_type != "optimal" else ["-"])]
            for plan_type, scheduling, policy in combos:
                cfg = PlannerConfig(plan_type, scheduling, policy if policy != "-" else "default", gpu=gpu)
                t, res = best_of(args.repeat, lambda: plan_envpipe(prof, m, cfg))
                if plan_type == "envelope" and scheduling == "ours" and policy == "balanced":
                    worst_default = max(worst_default, t)
                if plan_type != "envelope":
                    worst_by_type[plan_type] = max(worst_by_type.get(plan_type, 0.0), t)
                label = policy if plan_type == "envelope" else f"{plan_type[:4]}/{policy}"
                print(f"{name:16}{scheduling:>6}{label:>10}{m:>4}{res.iterations:>7}{t:>9.3f}"
                      f"{t / GOAL_S:>8.2f}{1000 * sim_s:>8.2f}{t / sim_s:>9.0f}"
                      f"{100 * res.energy_saving:>7.2f}%{100 * res.slowdown:>8.2f}%")
    if "envelope" in args.types.split(","):
        print(f"\ndefault planner (envelope/ours/balanced): worst {worst_default:.3f} s = "
              f"{worst_default / GOAL_S:.2f}x the 1 s goal -> {'MET' if worst_default < GOAL_S else 'MISSED'}")
    for plan_type, worst in worst_by_type.items():
        print(f"{plan_type}: worst {worst:.3f} s = {worst / GOAL_S:.2f}x the 1 s goal -> "
              f"{'MET' if worst < GOAL_S else 'MISSED'}")


if __name__ == "__main__":
    main()
