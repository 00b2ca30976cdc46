#!/usr/bin/env python3
"""Iteration time of EnvPipe's executor (1F1B order) vs Megatron's own 1F1B, CPU/gloo.

Both schedules run alternately in the same rank processes on the same tiny
GPT, so the ratio is measured against a baseline from the same run.
Goal (issue 3): ratio <= 1.03.

    python bench/executor_overhead.py [--stages 4] [--microbatches 8] [--iterations 20]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

from megatron_envpipe.config import EnvPipeConfig
from megatron_envpipe.testing import PipelineRun, run_pipeline
from megatron_envpipe.testing.envpipe_runs import bench_schedule

GOAL = 1.03


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--stages", type=int, default=4)
    ap.add_argument("--microbatches", type=int, nargs="+", default=[8, 16])
    ap.add_argument("--iterations", type=int, default=20)
    args = ap.parse_args()
    print(f"{'P':>2}{'M':>4}{'native ms':>11}{'envpipe ms':>12}{'ratio':>8}  (median of {args.iterations}, CPU/gloo)")
    worst = 0.0
    for m in args.microbatches:
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "times.json"
            cfg = EnvPipeConfig()  # baseline / 1f1b / default: Megatron's order through our executor
            run_pipeline(args.stages, [PipelineRun(m, bench_schedule(cfg, args.iterations, str(out)))], timeout_s=900)
            times = json.loads(out.read_text())
        native = statistics.median(times["native"])
        ours = statistics.median(times["envpipe"])
        ratio = ours / native
        worst = max(worst, ratio)
        print(f"{args.stages:>2}{m:>4}{1000 * native:>11.2f}{1000 * ours:>12.2f}{ratio:>8.3f}")
    print(f"\nworst ratio {worst:.3f} (goal <= {GOAL}) -> {'MET' if worst <= GOAL else 'MISSED'}")


if __name__ == "__main__":
    main()
