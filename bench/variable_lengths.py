#!/usr/bin/env python3
"""Variable-length micro-batches (issue 25): what clock plans per iteration add over one plan, simulated.

On the shipped A40 profiles (gpt3-175b, bloom-176b; P = 8) with the documented default length model
(:func:`megatron_envpipe.core.length_costs.default_length_model_for`: flop counts, an assumption, not
measured), each iteration's M micro-batches are drawn from a realistic length distribution:
documents of log-normal length (median ``--doc-median`` tokens, ``--doc-sigma``; longer than the maximum
sequence length: truncated to it) packed in order into micro-batches of one ``--max-seq-length`` sequence
each, a document that does not fit starting the next micro-batch (documents are not split; attention is
per document, so a micro-batch's ``attention_tokens2`` is the sum of its documents' squared lengths).
Seeded: every run prints the same figures.

Per iteration, energy (clock changes charged at the derived switch cost) and time of

* **stock**: Megatron's order at the maximum clock, for the iteration's sizes (the deadline: zero slowdown);
* **single**: one ``--type optimal`` plan made once for the average micro-batch (the mean size of 4,096
  micro-batches drawn with another seed), run on the iteration's actual sizes: it may be late;
* **per-iter**: :meth:`megatron_envpipe.planning.per_iteration.IterationPlanner.plan` for the actual sizes.

``late``: iterations the single plan ends after the stock run (and its worst lateness); ``+saving``:
``1 - E(per-iter) / E(single)``; ``plan/iter``: the per-iteration planner's wall time (median) over the
stock iteration's simulated time, measured in this run on this host. Every energy and time is the
timeline simulation's (the planner's own model): simulated figures, not measurements.

    python3 bench/variable_lengths.py [--microbatches 32,64] [--iterations 20] [--scheduling ours]
"""

from __future__ import annotations

import argparse
import math
import random
import statistics
import time

from megatron_envpipe.core.gpu_specs import get_gpu_spec
from megatron_envpipe.core.length_costs import MicrobatchSize, default_length_model_for
from megatron_envpipe.core.profile import Profile
from megatron_envpipe.core.resources import shipped_profile
from megatron_envpipe.planning.basis import PlannerConfig
from megatron_envpipe.planning.per_iteration import IterationPlanner
from megatron_envpipe.testing.microbatch_sizes import average_size

PROFILES = ("a40/gpt3-175b", "a40/bloom-176b")
AVERAGE_SAMPLE = 4096  # micro-batches drawn (another seed) to find the average micro-batch
LATE_RTOL = 1e-9  # a single plan ending later than the stock run by more than this is late


def packed_microbatches(rng: random.Random, count: int, max_seq_length: int, doc_median: float, doc_sigma: float
                        ) -> list[MicrobatchSize]:
    """``count`` micro-batches of documents with log-normal lengths, packed in order (module docstring)."""
    out: list[MicrobatchSize] = []
    docs: list[int] = []
    carry: int | None = None
    while len(out) < count:
        doc = carry if carry is not None else min(max_seq_length,
                                                  max(1, round(rng.lognormvariate(math.log(doc_median), doc_sigma))))
        carry = None
        if sum(docs) + doc <= max_seq_length:
            docs.append(doc)
            continue
        out.append(MicrobatchSize.from_lengths(docs))
        docs, carry = [], doc
    return out


def run(profile_name: str, m: int, args: argparse.Namespace) -> dict:
    profile = Profile.from_csv(shipped_profile(profile_name))
    model = default_length_model_for(profile.source)
    config = PlannerConfig("optimal", args.scheduling, "default", gpu=get_gpu_spec("a40"), switch_cost_j=None,
                           max_slowdown=args.max_slowdown)
    planner = IterationPlanner(profile, model, m, config)
    draw = lambda rng, n: packed_microbatches(rng, n, args.max_seq_length, args.doc_median, args.doc_sigma)  # noqa: E731
    avg = average_size(draw(random.Random(args.seed + 1), AVERAGE_SAMPLE))
    single = planner.plan([avg] * m).plan
    rng = random.Random(args.seed)
    rows = []
    for _ in range(args.iterations):
        sizes = draw(rng, m)
        _, stock = planner.stock(sizes)
        single_score = planner.score(single, sizes)
        t0 = time.perf_counter()
        per = planner.plan(sizes)
        wall_s = time.perf_counter() - t0
        rows.append({
            "stock_s": stock.iteration_time_s, "stock_j": per.baseline_energy_j,
            "single_s": single_score.iteration_time_s, "single_j": planner.energy_j(single, single_score),
            "per_s": per.iteration_time_s, "per_j": per.energy_j, "per_late": per.slowdown,
            "plan_ratio": wall_s / stock.iteration_time_s, "fallback": bool(per.fallback),
            "tokens": statistics.mean(s.tokens for s in sizes),
        })
    mean = {k: statistics.mean(r[k] for r in rows) for k in rows[0] if k != "fallback"}
    late = [r["single_s"] / r["stock_s"] - 1 for r in rows if r["single_s"] > r["stock_s"] * (1 + LATE_RTOL)]
    return {
        "profile": profile_name.split("/")[1], "m": m, "avg": avg, **mean,
        "late": len(late), "worst_late": max(late, default=0.0),
        "per_worst_slowdown": max(r["per_late"] for r in rows),
        "fallbacks": sum(r["fallback"] for r in rows),
        "plan_ratio_median": statistics.median(r["plan_ratio"] for r in rows),
        "plan_ratio_max": max(r["plan_ratio"] for r in rows),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--microbatches", default="32,64", help="M values, comma-separated (P = 8)")
    ap.add_argument("--iterations", type=int, default=20)
    ap.add_argument("--scheduling", default="ours", choices=("ours", "1f1b"))
    ap.add_argument("--max-slowdown", type=float, default=0.0, help="as --max-slowdown (0: zero slowdown)")
    ap.add_argument("--max-seq-length", type=int, default=2048, help="tokens per micro-batch (one sequence)")
    ap.add_argument("--doc-median", type=float, default=512.0, help="median document length, tokens")
    ap.add_argument("--doc-sigma", type=float, default=1.0, help="log-normal sigma of document lengths")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--profiles", default=",".join(PROFILES))
    args = ap.parse_args(argv)
    print(f"P = 8, A40, --type optimal --scheduling {args.scheduling}, {args.iterations} iterations, documents "
          f"log-normal (median {args.doc_median:g}, sigma {args.doc_sigma:g}) packed to {args.max_seq_length} "
          f"tokens, seed {args.seed}; default length model (flop counts, assumed)")
    print("| profile | M | tokens/mb | stock s | stock J | single s | single J | late | worst | per-iter s | "
          "per-iter J | single saving | per-iter saving | +saving | plan/iter (median, max) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for name in args.profiles.split(","):
        for m in (int(x) for x in args.microbatches.split(",")):
            r = run(name, m, args)
            print(f"| {r['profile']} | {m} | {r['tokens']:.0f} | {r['stock_s']:.3f} | {r['stock_j']:.0f} | "
                  f"{r['single_s']:.3f} | {r['single_j']:.0f} | {r['late']}/{args.iterations} | "
                  f"{100 * r['worst_late']:+.2f} % | {r['per_s']:.3f} | {r['per_j']:.0f} | "
                  f"{100 * (1 - r['single_j'] / r['stock_j']):.2f} % | {100 * (1 - r['per_j'] / r['stock_j']):.2f} % | "
                  f"{100 * (1 - r['per_j'] / r['single_j']):+.2f} % | "
                  f"{100 * r['plan_ratio_median']:.2f} %, {100 * r['plan_ratio_max']:.2f} % |")
            if r["per_worst_slowdown"] > LATE_RTOL or r["fallbacks"]:
                print(f"  per-iteration plans: worst slowdown {100 * r['per_worst_slowdown']:+.4f} %, "
                      f"{r['fallbacks']} fell back to the stock run")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
