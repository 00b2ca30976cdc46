#!/usr/bin/env python3
"""Time and peak memory of each planner and command at growing sizes: the data behind core/sizes.py.

Each case runs in a fresh interpreter (peak RSS from ``resource.getrusage``, interpreter
included) with the size limits lifted, under ``--timeout`` seconds (``>`` marks a case cut off).

    python3 bench/plan_limits.py [--cases optimal:8:1024:1,envelope:8:10000:1] [--timeout 150]

A case is ``what:P:M:V`` with ``what`` one of baseline, uniform, envelope, optimal, frontier
(20 points), schedule (build + print) and simulate (one 1F1B iteration at f_max). Deeper
pipelines than the shipped 8 stages come from testing.synthetic.deepened. The default
cases take several minutes.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

DEFAULT_CASES = ("optimal:8:256:1,optimal:8:1024:1,optimal:32:256:1,optimal:8:1536:1,frontier:8:512:1,"
                 "envelope:8:10000:1,envelope:1000:8:1,envelope:100:100:1,baseline:8:10000:1,"
                 "simulate:100:1000:1,schedule:100:1600:1")

CHILD = r"""
import json, resource, sys, time
import megatron_envpipe.core.sizes as sizes
for name in dir(sizes):
    if name.startswith("MAX_"):
        setattr(sizes, name, 10**12)  # measure beyond the limits
from megatron_envpipe.core.gpu_specs import get_gpu_spec
from megatron_envpipe.core.plan import FrequencyPlan
from megatron_envpipe.core.profile import Profile
from megatron_envpipe.core.resources import shipped_profiles
from megatron_envpipe.core.kinds import build_schedule
from megatron_envpipe.core.timeline import PlanEvaluator
from megatron_envpipe.planning.basis import PlannerConfig
from megatron_envpipe.planning.frontier import compute_frontier
from megatron_envpipe.planning.planner import plan_envpipe
from megatron_envpipe.testing.synthetic import deepened

what, p, m, v = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
gpu = get_gpu_spec("a40")
base = Profile.from_csv(shipped_profiles()["a40/gpt3-175b"])
prof = base if p == 8 else deepened(base, p)
sched_name = "interleaved" if v > 1 else "1f1b"
t0 = time.perf_counter()
if what == "frontier":
    compute_frontier(prof, m, PlannerConfig("optimal", "ours", "default", gpu=gpu), points=20)
elif what in ("schedule", "simulate"):
    s = build_schedule(sched_name, p, m, num_chunks=v).validate()
    if what == "schedule":
        str(s)
    else:
        ev = PlanEvaluator(s, prof if v == 1 else prof.for_chunks(v), 100.0)
        flat = FrequencyPlan.constant(s, [1740] * p).flat()
        ev.score(flat, ev.simulate(flat)).energy_j
else:
    sched = sched_name if v > 1 or what == "baseline" else "ours"
    reconfig = "default" if what in ("optimal", "baseline") else "balanced"
    plan_envpipe(prof, m, PlannerConfig(what, sched, reconfig, gpu=gpu, virtual_stages=v))
print(json.dumps([time.perf_counter() - t0, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024]))
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", default=DEFAULT_CASES)
    ap.add_argument("--timeout", type=float, default=150.0)
    args = ap.parse_args()
    print(f"{'case':10}{'P':>6}{'M':>7}{'V':>4}{'P x M x V':>12}{'time s':>9}{'peak MiB':>10}")
    for case in args.cases.split(","):
        what, p, m, v = case.split(":")
        size = int(p) * int(m) * int(v)
        try:
            out = subprocess.run([sys.executable, "-c", CHILD, what, p, m, v], capture_output=True, text=True,
                                 timeout=args.timeout, check=True).stdout
            seconds, mib = json.loads(out.splitlines()[-1])
            print(f"{what:10}{p:>6}{m:>7}{v:>4}{size:>12,}{seconds:>9.1f}{mib:>10}")
        except subprocess.TimeoutExpired:
            print(f"{what:10}{p:>6}{m:>7}{v:>4}{size:>12,}{'> ' + str(int(args.timeout)):>9}{'-':>10}")


if __name__ == "__main__":
    main()
