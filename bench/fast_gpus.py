#!/usr/bin/env python3
"""Faster GPUs: does the start-up profile keep the saving when units are shorter than the energy counter's period?

The shipped A40 profiles (forwards ~110 ms, backwards ~280 ms) with every unit's time and energy
scaled by 1, 0.5 (A100 class), 0.25 and 0.15 (H100 class and faster: units of 17-42 ms, shorter
than the 100 ms counter period and barely longer than a 15 ms clock change), on 4 and 8 stages,
``ours`` and ``1f1b``, on simulated GPUs with realistic dynamics (configs/realistic-gpu.toml:
100 ms counter, 15 ms clock latency, 3 % colder at start), in virtual time: the figures do not
depend on the host's speed or load. Per case (megatron_envpipe/testing/fast_gpu_runs.py):

* ``offline``: the optimal plan from the true profile (what a perfect profiler would give);
* ``start-up``: the plan from the start-up profile, scored on the true profile (goal: within 2
  points of offline), and ``promised``: what that plan predicts for itself;
* ``measured``: the run's last 10 iterations against a baseline run of the same length (1F1B at
  the maximum clock, fresh GPUs), and ``time``: the run's iteration time against the plan's;
* the profiler: iterations (goal: at most a third of EnvPipe's, 22 on 11 coarse clocks), clocks
  measured, and how honest its rows are: rows more than 2 stated standard errors from the truth
  (goal: at most 5 %, none beyond 3).

    python3 bench/fast_gpus.py [--profiles gpt3,bloom] [--scales 1,0.5,0.25,0.15] [--stages 4,8]
                               [--schedulings ours,1f1b] [--dynamics realistic] [--check]

``--check`` exits 1 if a goal is missed on a scaled case (< 1). The gap between ``start-up`` and
``measured`` is clock changes landing late and switching around short units (the issue "Clock changes
as costs"), which this bench prints so that one run shows where a gap comes from.
"""

from __future__ import annotations

import argparse
import sys
import time

from megatron_envpipe.core.device_dynamics import load_dynamics
from megatron_envpipe.core.gpu_specs import get_gpu_spec
from megatron_envpipe.core.profile import Profile
from megatron_envpipe.core.resources import configs_dir, shipped_profile
from megatron_envpipe.testing.fast_gpu_runs import run_fast_gpu_case

PROFILES = {"gpt3": "a40/gpt3-175b", "bloom": "a40/bloom-176b"}
MICROBATCHES = {4: 8, 8: 16}  # 2 P: the tiny GPT's 8 on 4 stages


def _list(text: str, kind: type, name: str) -> list:
    try:
        values = [kind(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise SystemExit(f"fast_gpus.py: {name} must be a comma-separated list, got {text!r}") from None
    if not values:
        raise SystemExit(f"fast_gpus.py: {name} is empty")
    return values


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--profiles", default="gpt3,bloom")
    ap.add_argument("--scales", default="1,0.5,0.25,0.15")
    ap.add_argument("--stages", default="4,8")
    ap.add_argument("--schedulings", default="ours,1f1b")
    ap.add_argument("--dynamics", default="realistic", help="simulated-GPU dynamics: realistic, exact or a TOML file")
    ap.add_argument("--check", action="store_true", help="exit 1 if a goal is missed on a scaled case")
    args = ap.parse_args()
    profiles = _list(args.profiles, str, "--profiles")
    scales = _list(args.scales, float, "--scales")
    stages = _list(args.stages, int, "--stages")
    schedulings = _list(args.schedulings, str, "--schedulings")
    if bad := [p for p in profiles if p not in PROFILES]:
        raise SystemExit(f"fast_gpus.py: unknown profiles {bad}; choose from {', '.join(PROFILES)}")
    if bad := [s for s in scales if not 0 < s <= 1]:
        raise SystemExit(f"fast_gpus.py: scales must be in (0, 1], got {bad}")
    if bad := [p for p in stages if p not in MICROBATCHES]:
        raise SystemExit(f"fast_gpus.py: stages must be among {sorted(MICROBATCHES)}, got {bad}")
    if bad := [s for s in schedulings if s not in ("ours", "1f1b")]:
        raise SystemExit(f"fast_gpus.py: schedulings are ours and 1f1b, got {bad}")
    dynamics = load_dynamics(args.dynamics, configs_dir())
    a40 = get_gpu_spec("a40")
    p2p = a40.known_p2p_power_w()
    print(f"dynamics: {dynamics.source}; optimal plans, zero slowdown, default switch cost; simulated, virtual time")
    print(f"{'case':<24} {'F/B ms':>9} {'offline':>8} {'start-up':>8} {'promised':>8} {'measured':>8} "
          f"{'time':>7} {'iters':>7} {'clocks':>6} {'rows >2se':>10} {'worst':>12}")
    failures = []
    started = time.monotonic()
    for name in profiles:
        full = Profile.from_csv(shipped_profile(PROFILES[name]))
        for scale in scales:
            for p in stages:
                truth = full.scaled(scale, scale).for_pipeline(p)
                f_max = truth.max_frequency()
                unit_ms = f"{1e3 * truth.time_s(0, 'forward', f_max):.0f}/{1e3 * truth.time_s(0, 'backward', f_max):.0f}"
                for sched in schedulings:
                    case = run_fast_gpu_case(truth, MICROBATCHES[p], sched, a40, p2p, dynamics)
                    label = f"{name} x{scale:g} P{p} M{MICROBATCHES[p]} {sched}"
                    print(f"{label:<24} {unit_ms:>9} {100 * case.offline_saving:7.2f}% {100 * case.startup_saving:7.2f}% "
                          f"{100 * case.startup_predicted:7.2f}% {100 * case.measured_saving:7.2f}% "
                          f"{100 * case.time_vs_plan:+6.2f}% {case.profiling_iterations:>3}/{case.budget_iterations:<3} "
                          f"{case.clocks_swept:>6} {case.rows_outside_2se:>4}/{case.rows:<5} "
                          f"{case.worst_z:4.1f}se {100 * case.worst_row_error:4.1f}%", flush=True)
                    if scale < 1:
                        gap = 100 * (case.offline_saving - case.startup_saving)
                        if gap > 2:
                            failures.append(f"{label}: start-up plan {gap:.2f} points below offline")
                        if case.profiling_iterations > case.budget_iterations:
                            failures.append(f"{label}: {case.profiling_iterations} profiling iterations")
                        if case.rows_outside_2se > 0.05 * case.rows or case.worst_z > 3:
                            failures.append(f"{label}: rows outside their uncertainty "
                                            f"({case.rows_outside_2se}/{case.rows} beyond 2 se, worst {case.worst_z:.1f})")
    print(f"({time.monotonic() - started:.0f} s wall; every figure simulated)")
    for f in failures:
        print("GOAL MISSED:", f)
    return 1 if args.check and failures else 0


if __name__ == "__main__":
    sys.exit(main())
