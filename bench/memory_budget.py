#!/usr/bin/env python3
"""Energy saving of EnvPipe's ``ours`` order as a function of the activation budget.

For the shipped A40 profiles (GPT-3 175B and BLOOM 176B, P = 8), ``--type envelope`` and
``--type optimal`` (zero slowdown), M in {12, 24, 48, 96}: the predicted saving against
1F1B at f_max with a per-stage activation budget of 1F1B's own peak ``min(M, P-s)``, +25 %,
+50 %, +100 % (``b_s = n_s + floor(x n_s)``, what ``envpipe plan --max-inflight b0,...,b7``
takes), and no budget. The last column is the unlimited plan's peak in-flight activations
per stage: the memory it would need.

Savings are what ``envpipe plan`` reports: ``optimal`` plans go through the switching pass and
count the default switch cost (the GPU's settle time x P2P power, 0.70 J on A40) per clock change
they keep; EnvPipe's plan types keep their clocks and count none. ``--switch-cost-j J`` gives every
plan type the cost ``J`` (``0``: every plan switch-free, the figures before switch accounting).

    python bench/memory_budget.py [--microbatches 12,24,48,96] [--types envelope,optimal] [--switch-cost-j J]

Prints a Markdown table (the README's).
"""

from __future__ import annotations

import argparse
import math

from megatron_envpipe.core.gpu_specs import get_gpu_spec
from megatron_envpipe.core.memory import _one_f_one_b_need
from megatron_envpipe.core.profile import Profile
from megatron_envpipe.core.resources import shipped_profiles
from megatron_envpipe.planning.basis import PlannerConfig
from megatron_envpipe.planning.planner import plan_envpipe

FACTORS = (0.0, 0.25, 0.5, 1.0, None)  # None: no budget
HEADERS = ("1F1B's peak", "+25 %", "+50 %", "+100 %", "unlimited")


def budget(need: tuple[int, ...], factor: float | None) -> tuple[int, ...] | None:
    """1F1B's per-stage peak raised by ``factor`` (rounded down), or None for no budget."""
    if factor is None:
        return None
    return tuple(n + math.floor(factor * n) for n in need)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--microbatches", default="12,24,48,96")
    ap.add_argument("--types", default="envelope,optimal", help="comma-separated plan types")
    ap.add_argument("--switch-cost-j", type=float, default=None,
                    help="joules per clock change for every plan type (default: envpipe plan's; 0: switch-free)")
    args = ap.parse_args()
    gpu = get_gpu_spec("a40")
    print("| profile | type | M | " + " | ".join(HEADERS) + " | unlimited plan's peak in-flight |")
    print("|---|---|---:|" + "---:|" * len(HEADERS) + "---|")
    for name, path in shipped_profiles().items():
        profile = Profile.from_csv(path)
        for plan_type in args.types.split(","):
            for m in [int(x) for x in args.microbatches.split(",")]:
                need = _one_f_one_b_need(profile.num_stages, m)
                cells, peaks = [], []
                for factor in FACTORS:
                    cfg = PlannerConfig(plan_type, "ours", "balanced", gpu=gpu, max_inflight=budget(need, factor),
                                         switch_cost_j=args.switch_cost_j)
                    result = plan_envpipe(profile, m, cfg)
                    cells.append(f"{100 * result.energy_saving:.2f} %")
                    peaks = list(result.schedule.peak_inflight())
                print(f"| {name} | {plan_type} | {m} | " + " | ".join(cells) + f" | {peaks} |")
    need = _one_f_one_b_need(8, 12)  # the same for every M >= P = 8
    print("\nBudgets per stage (P = 8, M >= 8): " + "; ".join(
        f"{header} {list(budget(need, factor))}" for header, factor in zip(HEADERS[:-1], FACTORS[:-1], strict=True))
        + ". Savings vs 1F1B at f_max, zero slowdown, " + switch_note(args.switch_cost_j, gpu) + ".")


def switch_note(switch_cost_j: float | None, gpu) -> str:
    """How the table counts clock changes, in words."""
    if switch_cost_j is None:
        cost = PlannerConfig("optimal", "ours", "default", gpu=gpu, switch_cost_j=None).effective_switch_cost_j
        return f"optimal plans count {cost:.2f} J per clock change kept (envpipe plan's default), EnvPipe's none"
    if switch_cost_j == 0:
        return "clock changes free (--switch-cost-j 0)"
    return f"every plan counts {switch_cost_j:g} J per clock change kept"


if __name__ == "__main__":
    main()
