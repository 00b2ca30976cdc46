#!/usr/bin/env python3
"""Do plans hold under unit-time jitter? Measured saving vs planned, EnvPipe's online rule vs ours.

Offline (seconds): 50-iteration noisy runs on the planner's simulator
(``megatron_envpipe.testing.noisy_run``): every unit's time and energy times a seeded
normal factor (sd = the jitter), the baseline (1F1B at f_max) under the same noise, each
iteration fed to the online reconfigurer exactly as training feeds it. Figures are medians
of the last 20 iterations; worst case over ``--seeds`` seeds. Two ways to run a plan:

* ``envpipe``: EnvPipe's online rule: one iteration decides, clocks only go up, plain
  ladder steps, no timing margin;
* ``robust``: what training runs now: a 1 % timing margin in the plan, the median of 3
  iterations decides, two-way (an on-time window undoes the newest raise; a raise after a
  lowering pins), raises skip clocks the profile says are no faster.

Then the margin sweep the default (1 %) was chosen from: mean and worst |measured - planned|
and slowdown over every case, per margin.

``--demo`` also runs ``envpipe demo`` (4 simulated GPUs, tiny GPT, ~1 min) and the 50-iteration
demo with 3 % jitter (``configs/demo-jitter.toml``, ~3-4 min) and prints their planned and
measured figures (the issue's acceptance: within 1.5 points, iteration time <= +0.5 %).

    python3 bench/robust_plans.py [--jitter 0.03,0.05] [--seeds 3] [--demo]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from megatron_envpipe.core.gpu_specs import get_gpu_spec
from megatron_envpipe.core.profile import Profile
from megatron_envpipe.core.resources import configs_dir, shipped_profile
from megatron_envpipe.planning.basis import PlannerConfig
from megatron_envpipe.planning.planner import plan_envpipe
from megatron_envpipe.testing.noisy_run import run_noisy

A40 = get_gpu_spec("a40")
CASES = [("a40/gpt3-175b", 4, 8), ("a40/bloom-176b", 4, 8), ("a40/gpt3-175b", 8, 16), ("a40/bloom-176b", 8, 16)]
ITERATIONS, TAIL = 50, 20
TOLERANCE_POINTS, MAX_SLOWDOWN = 1.5, 0.005  # the acceptance


def _run(profile: Profile, m: int, plan_type: str, jitter: float, seeds: int, robust: bool, margin: float):
    res = plan_envpipe(profile, m, PlannerConfig(plan_type, "ours", "balanced", gpu=A40,
                                                 timing_margin=margin if robust else 0.0))
    gaps, slows, changes, ok = [], [], [], True
    for seed in range(seeds):
        if robust:
            run = run_noisy(res, profile, ITERATIONS, jitter, seed)
        else:  # EnvPipe: one iteration decides, raise only, plain ladder steps
            run = run_noisy(res, profile, ITERATIONS, jitter, seed, window=1, two_way=False, plain_steps=True)
        gaps.append(100 * (run.saving(TAIL) - res.energy_saving))
        slows.append(100 * run.slowdown(TAIL))
        changes.append(run.raises + run.lowers)
        ok &= run.changes_ok()
    return res, gaps, slows, changes, ok


def offline(jitters: list[float], seeds: int) -> bool:
    print(f"## Offline: {ITERATIONS} noisy iterations, medians of the last {TAIL}, worst of {seeds} seeds\n")
    print("| profile | P x M | plan | jitter | rule | planned % | measured % | gap (points) | time | changes |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    all_ok = True
    for name, p, m in CASES:
        profile = Profile.from_csv(shipped_profile(name)).for_pipeline(p)
        for plan_type in ("envelope", "optimal"):
            for jitter in jitters:
                for robust in (False, True):
                    res, gaps, slows, changes, bounded = _run(profile, m, plan_type, jitter, seeds, robust, 0.01)
                    worst = min(gaps, key=lambda g: -abs(g))
                    measured = 100 * res.energy_saving + worst
                    held = abs(worst) <= TOLERANCE_POINTS and max(slows) <= 100 * MAX_SLOWDOWN
                    if robust:
                        all_ok &= held and bounded
                    print(f"| {name.split('/')[1]} | {p} x {m} | {plan_type} | {100 * jitter:g} % | "
                          f"{'robust' if robust else 'envpipe'} | {100 * res.energy_saving:.2f} | {measured:.2f} | "
                          f"{worst:+.2f}{'' if held else ' MISS'} | {max(slows):+.2f} % | {max(changes)} |")
    return all_ok


def margin_sweep(jitters: list[float], seeds: int) -> None:
    print("\n## Margin sweep (robust rule): the default is the smallest margin that holds everywhere\n")
    print("| margin | mean planned % | mean gap | worst gap | worst time | cases held |")
    print("|---|---|---|---|---|---|")
    profiles = {name: Profile.from_csv(shipped_profile(name)) for name, _, _ in CASES}
    for margin in (0.0, 0.005, 0.01, 0.02, 0.03):
        planned, gaps, slows, held, total = [], [], [], 0, 0
        for name, p, m in CASES:
            for plan_type in ("envelope", "optimal"):
                for jitter in jitters:
                    res, g, s, _, _ = _run(profiles[name].for_pipeline(p), m, plan_type, jitter, seeds, True, margin)
                    planned.append(100 * res.energy_saving)
                    gaps += g
                    slows += s
                    total += 1
                    held += all(abs(x) <= TOLERANCE_POINTS for x in g) and max(s) <= 100 * MAX_SLOWDOWN
        print(f"| {100 * margin:g} % | {statistics.mean(planned):.2f} | {statistics.mean(gaps):+.2f} | "
              f"{min(gaps, key=lambda x: -abs(x)):+.2f} | {max(slows):+.2f} % | {held}/{total} |")


def demo() -> bool:
    print("\n## envpipe demo (simulated A40s, tiny GPT, 4 stages x 8 micro-batches)\n")
    print("| config | jitter | planned % | measured % | gap (points) | time | iterations |")
    print("|---|---|---|---|---|---|---|")
    ok = True
    for config in ("demo.toml", "demo-jitter.toml"):
        with tempfile.TemporaryDirectory() as out:
            proc = subprocess.run([sys.executable, "-m", "megatron_envpipe.apps.cli", "demo", "--out", out,
                                   "--config", str(configs_dir() / config)], capture_output=True, text=True)
            if proc.returncode != 0:
                print(f"| {config} | demo failed (exit {proc.returncode}): {proc.stdout[-300:]} {proc.stderr[-300:]} |")
                ok = False
                continue
            summary = json.loads((Path(out) / "summary.json").read_text())
        gap = 100 * (summary["saving"] - summary["planned_saving"])
        held = abs(gap) <= TOLERANCE_POINTS and summary["slowdown"] <= MAX_SLOWDOWN
        ok &= held
        line = [text for text in proc.stdout.splitlines() if "median of" in text]
        print(f"| {config} | {100 * summary['sim_jitter']:g} % | {100 * summary['planned_saving']:.2f} | "
              f"{100 * summary['saving']:.2f} | {gap:+.2f}{'' if held else ' MISS'} | "
              f"{100 * summary['slowdown']:+.2f} % | {line[0].split('(')[-1].rstrip(')') if line else '?'} |")
    return ok


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--jitter", default="0.03,0.05", help="unit-time jitter fractions (default 0.03,0.05)")
    ap.add_argument("--seeds", type=int, default=3, help="noise seeds per case (default 3)")
    ap.add_argument("--demo", action="store_true", help="also run envpipe demo with and without jitter (~5 min)")
    args = ap.parse_args()
    jitters = [float(x) for x in args.jitter.split(",")]
    ok = offline(jitters, args.seeds)
    margin_sweep(jitters, args.seeds)
    if args.demo:
        ok &= demo()
    print(f"\nrobust rule holds measured = planned within {TOLERANCE_POINTS} points at <= "
          f"+{100 * MAX_SLOWDOWN:g} % time in every case: {'yes' if ok else 'NO'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
