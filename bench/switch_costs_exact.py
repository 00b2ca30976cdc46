#!/usr/bin/env python3
"""How much of the switching loss can be recovered at all: the planner against the exact optimum with its
clock changes counted, on pipelines small enough for a MILP.

Issue 34 measures the loss of counting clock changes as the switch-free saving minus the counted saving
(bench/switch_costs.py). The switch-free saving is not reachable once changes cost something: this bench
asks the MILP oracle (``megatron_envpipe.testing.milp.solve_milp`` with ``switch_cost_j``: every change a
repeating iteration makes charged, exact up to the MIP gap) for the best counted plan of the planner's own
schedule and deadline, and prints which share of the loss that optimum recovers; a MILP stopped by its time
limit gives the range [its plan, its dual bound].

Instances: the shipped A40 profiles cut to P = 4 (``Profile.for_pipeline``), unit times x 1 and x 0.25, M = 8,
``1f1b`` and ``ours``, the profile restricted to ``--clocks`` clocks (f_max included), the A40's default switch
cost, zero slowdown. Simulated figures (the planner's evaluator), not measurements.

    python3 bench/switch_costs_exact.py [--json out.json] [--reference before.json] [--planner-only]
        [--time-limit-s 120]

``--planner-only`` (for a checkout without the oracle's switch cost, e.g. the code before issue 34 on
``PYTHONPATH``) records the planner's figures only; ``--reference`` then says which share of that run's loss
this planner and the exact optimum recover.
"""

from __future__ import annotations

import argparse
import json
import time

from megatron_envpipe.core.atomic import write_json_atomic
from megatron_envpipe.core.gpu_specs import get_gpu_spec
from megatron_envpipe.core.profile import Profile
from megatron_envpipe.core.resources import shipped_profile
from megatron_envpipe.planning.basis import PlannerConfig
from megatron_envpipe.planning.planner import plan_envpipe
from megatron_envpipe.planning.switching import default_switch_cost_j

INSTANCES = [(name, scale, sched) for name in ("gpt3-175b", "bloom-176b") for scale in (1.0, 0.25)
             for sched in ("1f1b", "ours")]
P, M = 4, 8


def instance_profile(name: str, scale: float, clocks: int) -> Profile:
    base = Profile.from_csv(shipped_profile(f"a40/{name}")).for_pipeline(P)
    if scale != 1:
        base = base.scaled(scale, scale)
    freqs = sorted({p.freq_mhz for p in base.points(0, "forward")}, reverse=True)
    keep = freqs[::max(1, len(freqs) // clocks)][:clocks]
    return base.restricted(keep if freqs[0] in keep else [freqs[0], *keep[:-1]])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clocks", type=int, default=6)
    ap.add_argument("--time-limit-s", type=float, default=120.0)
    ap.add_argument("--planner-only", action="store_true")
    ap.add_argument("--json")
    ap.add_argument("--reference")
    args = ap.parse_args()
    ref = {}
    if args.reference:
        with open(args.reference, encoding="utf-8") as f:
            ref = json.load(f)
    a40 = get_gpu_spec("a40")
    cost = default_switch_cost_j(a40.known_p2p_power_w(), a40.clock_latency)
    print(f"P = {P}, M = {M}, {args.clocks} clocks, switch cost {cost:.3f} J, zero slowdown; savings in % (simulated)\n")
    print("| profile | x | schedule | switch-free | counted (planner) | exact counted [bound] | loss | "
          "exact recovers | planner vs ref | exact vs ref | MILP s |")
    print("|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    out: dict[str, dict] = {}
    for name, scale, sched in INSTANCES:
        profile = instance_profile(name, scale, args.clocks)

        def cfg(c: float, sched: str = sched) -> PlannerConfig:
            return PlannerConfig("optimal", sched, "default", gpu=a40, switch_cost_j=c)

        free = plan_envpipe(profile, M, cfg(0.0))
        counted = plan_envpipe(profile, M, cfg(cost))
        r = out[f"{name}|{scale:g}|{sched}"] = {"free": 100 * free.energy_saving,
                                                  "optimal": 100 * counted.energy_saving}
        exact = bound = seconds = None
        if not args.planner_only:
            from megatron_envpipe.planning.optimal import TimeEnergyModel
            from megatron_envpipe.testing.milp import solve_milp

            model = TimeEnergyModel(counted.schedule, profile, counted.candidates_mhz, cfg(0).effective_p2p_power_w)
            t0 = time.perf_counter()
            sol = solve_milp(model, counted.deadline_s, time_limit_s=args.time_limit_s, mip_rel_gap=1e-4,
                             switch_cost_j=cost)
            seconds = time.perf_counter() - t0
            base = counted.baseline_energy_j
            exact = r["exact"] = 100 * (1 - sol.energy_j / base)
            bound = r["exact_bound"] = 100 * (1 - sol.dual_bound_j / base) if sol.dual_bound_j else None
        loss = r["free"] - r["optimal"]

        def share(value: float | None, base: dict) -> str:
            lost = base["free"] - base["optimal"]
            return "—" if value is None or lost <= 1e-9 else f"{100 * (value - base['optimal']) / lost:.0f} %"

        old = ref.get(f"{name}|{scale:g}|{sched}")
        span = "—" if exact is None else f"{exact:.2f}" + (f" [{bound:.2f}]" if bound is not None else "")
        print(f"| {name} | {scale:g} | {sched} | {r['free']:.2f} | {r['optimal']:.2f} | {span} | {loss:.2f} | "
              f"{share(exact, r)} | {share(r['optimal'], old) if old else '—'} | "
              f"{share(exact, old) if old and exact is not None else '—'} | "
              f"{'—' if seconds is None else f'{seconds:.0f}'} |", flush=True)
    if args.json:
        write_json_atomic(args.json, out, sort_keys=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
