#!/usr/bin/env python3
"""How much of the switching loss can be recovered at all: the planner against the exact optimum with its
clock changes counted, on pipelines small enough for a MILP.

Issue 34 measures the loss of counting clock changes as the switch-free saving minus the counted saving
(bench/switch_costs.py). The switch-free saving is not reachable once changes cost something: this bench
asks the MILP oracle (``megatron_envpipe.testing.milp.solve_milp`` with ``switch_cost_j``: every change a
repeating iteration makes charged, exact up to the MIP gap) for the best counted plan of each cell at the
planner's deadline, and prints which share of the loss that optimum recovers.

A miniature of bench/switch_costs.py's grid: the shipped A40 profiles cut to P = 4 (``Profile.for_pipeline``),
unit times x 1, 0.5 and 0.25, M = 8, its cells (``1f1b``; ``ours`` unbounded, at 1F1B's memory and at 1.5x;
interleaved V = 2), the profile restricted to ``--clocks`` clocks (f_max included), the A40's default switch
cost, zero slowdown. The exact optimum of a cell is the best over its schedules: for ``ours`` cells every
warm-up candidate the planner considers (``optimal_setup``) and the one its plan runs, one MILP each; other
cells have one schedule. A MILP stopped by ``--time-limit-s`` gives the range [its plan, its dual bound]; the
averages then give both ends (the recoverable share at most: the bound). Simulated figures (the planner's
evaluator), not measurements.

    python3 bench/switch_costs_exact.py [--json out.json] [--reference before.json] [--planner-only]
        [--time-limit-s 60] [--scales 1,0.5,0.25] [--cells 1f1b,ours,...]

``--planner-only`` (for a checkout without the oracle's switch cost, e.g. the code before issue 34 on
``PYTHONPATH``) records the planner's figures only; ``--reference`` then says which share of that run's loss
this planner and the exact optimum recover: ``(saving - ref counted) / (ref free - ref counted)``, per cell
and summed over cells (sum of gains / sum of losses, as bench/switch_costs.py).
"""

from __future__ import annotations

import argparse
import json
import math
import time

from switch_costs import CELLS, bench_switch_cost_j, cell_config  # bench/ is the script's directory

from megatron_envpipe.core.atomic import write_json_atomic
from megatron_envpipe.core.profile import Profile
from megatron_envpipe.core.resources import shipped_profile
from megatron_envpipe.planning.planner import plan_envpipe

PROFILES = ("gpt3-175b", "bloom-176b")
P, M = 4, 8


def instance_profile(name: str, scale: float, clocks: int) -> Profile:
    base = Profile.from_csv(shipped_profile(f"a40/{name}")).for_pipeline(P)
    if scale != 1:
        base = base.scaled(scale, scale)
    freqs = sorted({p.freq_mhz for p in base.points(0, "forward")}, reverse=True)
    keep = freqs[::max(1, len(freqs) // clocks)][:clocks]
    return base.restricted(keep if freqs[0] in keep else [freqs[0], *keep[:-1]])


def cell_schedules(profile: Profile, cell: str, cost: float, counted) -> list:
    """The schedules a plan of the cell may run: the planner's candidates (``ours``: its warm-ups) and the one
    its plan runs (the envelope rival's, where that was kept), each once."""
    from megatron_envpipe.planning.basis import planning_profile
    from megatron_envpipe.planning.optimal.entry import optimal_setup

    cfg = cell_config(cell, P, "optimal", cost)
    out = {counted.schedule.orders: counted.schedule}
    for _, schedule in optimal_setup(planning_profile(profile, cfg), M, cfg).schedules:
        out.setdefault(schedule.orders, schedule)
    return list(out.values())


def exact_cell(profile: Profile, cell: str, cost: float, counted, time_limit_s: float) -> dict:
    """The MILP's best counted plan over the cell's schedules: saving of its plan, of its dual bound (None where
    a MILP gave none), whether every MILP proved its optimum, CPU seconds."""
    from megatron_envpipe.planning.optimal import TimeEnergyModel
    from megatron_envpipe.planning.optimal.deadline import InfeasibleDeadline
    from megatron_envpipe.testing.milp import solve_milp

    p2p = cell_config(cell, P, "optimal", 0.0).effective_p2p_power_w
    base = counted.baseline_energy_j
    plan_j, bound_j, proven, runs = math.inf, math.inf, True, []
    c0 = time.process_time()
    for schedule in cell_schedules(profile, cell, cost, counted):
        model = TimeEnergyModel(schedule, profile, counted.candidates_mhz, p2p)
        try:
            sol = solve_milp(model, counted.deadline_s, time_limit_s=time_limit_s, mip_rel_gap=1e-4,
                             switch_cost_j=cost)
        except InfeasibleDeadline:
            continue  # this warm-up cannot meet the deadline at all: no plan of it counts
        plan_j = min(plan_j, sol.energy_j)
        bound_j = min(bound_j, sol.dual_bound_j if sol.dual_bound_j is not None else -math.inf)
        proven &= sol.optimal
        runs.append({"warmup": list(schedule.extra_warmup or ()), "optimal": sol.optimal,
                     "saving": 100 * (1 - sol.energy_j / base), "seconds": sol.seconds})
    return {
        "exact": 100 * (1 - plan_j / base),
        "exact_bound": 100 * (1 - bound_j / base) if math.isfinite(bound_j) else None,
        "proven": proven,
        "milp_cpu_s": time.process_time() - c0,
        "milps": runs,
    }


def share(value: float | None, base: dict) -> str:
    lost = base["free"] - base["optimal"]
    return "—" if value is None or lost <= 1e-9 else f"{100 * (value - base['optimal']) / lost:.0f} %"


def summary(label: str, keys: list[str], out: dict, ref: dict) -> str:
    """Shares of the reference's summed loss recovered by this planner and by the exact optimum (its plans;
    its dual bounds where a MILP stopped), and of this planner's loss by the exact optimum."""
    lost = sum(ref[k]["free"] - ref[k]["optimal"] for k in keys)
    mine = sum(out[k]["free"] - out[k]["optimal"] for k in keys)

    def pct(gain: float, loss: float) -> str:
        return "—" if loss <= 1e-9 else f"{100 * gain / loss:.0f} %"

    planner = sum(out[k]["optimal"] - ref[k]["optimal"] for k in keys)
    exact = sum(out[k]["exact"] - ref[k]["optimal"] for k in keys)
    upper = sum((out[k]["exact_bound"] if out[k]["exact_bound"] is not None else out[k]["free"])
                - ref[k]["optimal"] for k in keys)
    stopped = sum(not out[k]["proven"] for k in keys)
    exact_txt = pct(exact, lost) + (f" (at most {pct(upper, lost)}: {stopped} MILP cell(s) stopped)" if stopped else "")
    return (f"| {label} | {len(keys)} | {lost / len(keys):.2f} | {mine / len(keys):.2f} | {pct(planner, lost)} | "
            f"{exact_txt} | {pct(exact - planner, mine)} |")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clocks", type=int, default=6)
    ap.add_argument("--scales", default="1,0.5,0.25")
    ap.add_argument("--cells", default=",".join(CELLS))
    ap.add_argument("--time-limit-s", type=float, default=60.0, help="per MILP (wall seconds, HiGHS)")
    ap.add_argument("--planner-only", action="store_true")
    ap.add_argument("--json")
    ap.add_argument("--reference")
    args = ap.parse_args()
    cells = args.cells.split(",")
    if any(c not in CELLS for c in cells):
        ap.error(f"--cells: choose from {','.join(CELLS)}")
    if not 0 < args.time_limit_s < 1e5:
        ap.error(f"--time-limit-s must be a positive number of seconds, got {args.time_limit_s}")
    if not 2 <= args.clocks <= 64:
        ap.error(f"--clocks must be 2..64, got {args.clocks}")
    try:
        scales = [float(x) for x in args.scales.split(",")]
    except ValueError:
        ap.error(f"--scales: comma-separated numbers, got {args.scales!r}")
    if not all(0 < s <= 10 for s in scales):
        ap.error(f"--scales must lie in (0, 10], got {args.scales}")
    ref = {}
    if args.reference:
        with open(args.reference, encoding="utf-8") as f:
            ref = json.load(f)
    cost = bench_switch_cost_j()
    print(f"P = {P}, M = {M}, {args.clocks} clocks, switch cost {cost:.3f} J, zero slowdown; savings in % (simulated)\n")
    print("| profile | x | cell | switch-free | counted (planner) | exact counted [bound] | loss | "
          "exact recovers | ref counted | planner vs ref | exact vs ref | MILP CPU s |")
    print("|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    out: dict[str, dict] = {}
    c_start = time.process_time()
    for name in PROFILES:
        for scale in scales:
            profile = instance_profile(name, scale, args.clocks)
            for cell in cells:
                key = f"{name}|{scale:g}|{cell}"
                free = plan_envpipe(profile, M, cell_config(cell, P, "optimal", 0.0))
                counted = plan_envpipe(profile, M, cell_config(cell, P, "optimal", cost))
                r = out[key] = {"free": 100 * free.energy_saving, "optimal": 100 * counted.energy_saving}
                if not args.planner_only:
                    r.update(exact_cell(profile, cell, cost, counted, args.time_limit_s))
                exact, bound = r.get("exact"), r.get("exact_bound")
                old = ref.get(key)
                span = "—" if exact is None else f"{exact:.2f}" + (
                    "" if r["proven"] else f" [{bound:.2f}]" if bound is not None else " [no bound]")
                ref_txt = "—" if old is None else f"{old['optimal']:.2f}"
                cpu_txt = "—" if exact is None else f"{r['milp_cpu_s']:.0f}"
                print(f"| {name} | {scale:g} | {cell} | {r['free']:.2f} | {r['optimal']:.2f} | {span} | "
                      f"{r['free'] - r['optimal']:.2f} | {share(exact, r)} | {ref_txt} | "
                      f"{share(r['optimal'], old) if old else '—'} | "
                      f"{share(exact, old) if old and exact is not None else '—'} | {cpu_txt} |", flush=True)
    common = [k for k in out if k in ref and "exact" in out[k]]
    if common:
        print("\nShares of the summed loss (sum of gains / sum of losses):\n")
        print("| cells | n | ref loss | this loss | planner recovers (of ref) | exact recovers (of ref) | "
              "exact recovers (of this) |")
        print("|---|---:|---:|---:|---:|---:|---:|")
        for cell in cells:
            print(summary(cell, [k for k in common if k.endswith(f"|{cell}")], out, ref))
        for scale in scales:
            print(summary(f"x {scale:g}", [k for k in common if k.split("|")[1] == f"{scale:g}"], out, ref))
        print(summary("all", common, out, ref))
    print(f"\n({time.process_time() - c_start:.0f} CPU s in all)")
    if args.json:
        write_json_atomic(args.json, out, sort_keys=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
