#!/usr/bin/env python3
"""Compare EnvPipe plan types, schedulings and policies on a profile.

    python examples/compare_plans.py [--profile a40/bloom-176b] [--microbatches 24]

Prints one row per (type, scheduling, policy): energy saving and slowdown
against Megatron's 1F1B at the maximum clock, peak in-flight activations and
planning time. Works on any Perseus-format profile.
"""

from __future__ import annotations

import argparse
import itertools

from megatron_envpipe.core.gpu_specs import get_gpu_spec
from megatron_envpipe.core.profile import Profile
from megatron_envpipe.core.resources import shipped_profile
from megatron_envpipe.core.vocabulary import PLAN_TYPES, RECONFIG_POLICIES
from megatron_envpipe.planning.basis import PlannerConfig
from megatron_envpipe.planning.planner import plan_envpipe


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--profile", default="a40/gpt3-175b")
    ap.add_argument("--microbatches", type=int, default=12)
    ap.add_argument("--gpu", default="a40")
    args = ap.parse_args()
    profile = Profile.from_csv(shipped_profile(args.profile))
    gpu = get_gpu_spec(args.gpu)
    print(f"{profile.source}: {profile.num_stages} stages x {args.microbatches} micro-batches on {gpu.key}")
    print(f"{'type':9}{'sched':6}{'policy':9}{'saving':>8}{'slowdown':>9}{'peak act':>9}{'plan s':>8}  stop")
    for plan_type, sched, policy in itertools.product(PLAN_TYPES, ("1f1b", "ours"), RECONFIG_POLICIES):
        r = plan_envpipe(profile, args.microbatches, PlannerConfig(plan_type, sched, policy, gpu=gpu))
        print(f"{plan_type:9}{sched:6}{policy:9}{100 * r.energy_saving:7.2f}%{100 * r.slowdown:8.2f}%"
              f"{max(r.schedule.peak_inflight()):>9}{r.planner_seconds:8.3f}  {r.stop_reason[:40]}")


if __name__ == "__main__":
    main()
