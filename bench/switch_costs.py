#!/usr/bin/env python3
"""Optimal plans with their clock changes counted, against EnvPipe's envelope plan of the same schedule and memory.

Issue 34's acceptance grid: the shipped A40 profiles (GPT-3 175B, BLOOM 176B, P = 8, P2P power
from the GPU table) and the same profiles with every unit's time and energy x 0.5 and x 0.25
(``Profile.scaled``: same power, shorter units, so a clock change weighs more), M = 12/24/48/96,
zero slowdown, the default switch cost (A40: 10 ms x 70.38 W = 0.70 J per change), cells:

* ``1f1b``; ``ours`` unbounded, at 1F1B's memory (``--max-inflight P``, what 1F1B's first stage
  holds) and at 1.5x it (``ceil(1.5 P)``); interleaved V = 2 (M a multiple of P only: M = 12 is
  skipped, Megatron-core refuses a last group shorter than P).

Per cell, all from ``plan_envpipe`` (what ``envpipe plan`` runs):

* ``optimal``: the saving with every clock change counted (``PlanResult.energy_saving``);
* ``free``: the switch-free saving (the same plan type with ``--switch-cost-j 0``);
* ``envelope``: EnvPipe's plan (``--type envelope``, balanced reconfiguration) of the same schedule
  and memory, with the same switch cost given (its changes counted, its own switching pass run);
* loss = free - optimal (points given up to clock changes) and, with ``--reference``, the share of
  the reference's loss recovered, ``(optimal - ref optimal) / (ref free - ref optimal)``, and the
  planning-time ratio (optimal plan with the cost, this run / reference run).

    python3 bench/switch_costs.py [--profiles gpt3-175b,bloom-176b] [--scales 1,0.5,0.25]
        [--microbatches 12,24,48,96] [--cells 1f1b,ours,ours@1f1b,ours@1.5x,interleaved2]
        [--json out.json] [--reference before.json] [--from-json out.json]

``--json`` writes the cells (for a later ``--reference``). To measure "today's code", run this file
with ``PYTHONPATH`` pointing at a checkout of the old package (e.g. a ``git worktree``) and ``--json``.
Planning times: the table shows wall seconds; the ratio to the reference compares the planner's CPU
seconds (``time.process_time``, every thread of the process) when the reference recorded them, as wall
time on a shared machine measures the other load too. Run the reference and this run side by side (same
load), each with ``--json``, then ``--from-json this.json --reference ref.json`` prints the comparison.
"""

from __future__ import annotations

import argparse
import json
import math
import time

from megatron_envpipe.core.atomic import write_json_atomic
from megatron_envpipe.core.gpu_specs import get_gpu_spec
from megatron_envpipe.core.profile import Profile
from megatron_envpipe.core.resources import shipped_profile
from megatron_envpipe.planning.basis import PlannerConfig, PlanResult
from megatron_envpipe.planning.planner import plan_envpipe
from megatron_envpipe.planning.switching import default_switch_cost_j

CELLS = ("1f1b", "ours", "ours@1f1b", "ours@1.5x", "interleaved2")


def cell_config(cell: str, p: int, plan_type: str, cost: float) -> PlannerConfig:
    """The planner config of one cell (bench docstring)."""
    kw: dict = {}
    scheduling = cell
    if cell == "interleaved2":
        scheduling, kw["virtual_stages"] = "interleaved", 2
    elif cell.startswith("ours@"):
        scheduling = "ours"
        kw["max_inflight"] = p if cell == "ours@1f1b" else int(math.ceil(1.5 * p))
    reconfig = "default" if plan_type == "optimal" else "balanced"
    return PlannerConfig(plan_type, scheduling, reconfig, gpu=get_gpu_spec("a40"), switch_cost_j=cost, **kw)


def run_cell(profile: Profile, m: int, cell: str, cost: float) -> dict:
    p = profile.num_stages
    t0, c0 = time.perf_counter(), time.process_time()
    opt: PlanResult = plan_envpipe(profile, m, cell_config(cell, p, "optimal", cost))
    seconds, cpu_s = time.perf_counter() - t0, time.process_time() - c0
    free = plan_envpipe(profile, m, cell_config(cell, p, "optimal", 0.0))
    env = plan_envpipe(profile, m, cell_config(cell, p, "envelope", cost))
    return {
        "optimal": 100 * opt.energy_saving,
        "free": 100 * free.energy_saving,
        "envelope": 100 * env.energy_saving,
        "changes": sum(opt.charged_clock_changes),
        "envelope_changes": sum(env.charged_clock_changes),
        "seconds": seconds,
        "cpu_s": cpu_s,
        "kept": opt.details.get("kept_plan", "optimal"),
        "late_dropped": opt.details.get("clock_changes_removed_by_latency"),
    }


def bench_switch_cost_j() -> float:
    """The default switch cost on the A40 (the shipped profiles' GPU): what every cell charges per change."""
    a40 = get_gpu_spec("a40")
    return default_switch_cost_j(a40.known_p2p_power_w(), a40.clock_latency)


def read_cells(path: str | None) -> dict:
    """Cells written by ``--json`` (this bench's, or the pre-issue code's run of it); {} without a path."""
    if not path:
        return {}
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def walk_cells(profiles: str, scales: str, microbatches: str, cells: list[str]):
    """Every (key, profile name, scale, M, cell, profile) of the grid, in table order; interleaved only where
    Megatron-core runs it (M a multiple of P, groups of P)."""
    for name in profiles.split(","):
        base = Profile.from_csv(shipped_profile(f"a40/{name}"))
        for scale in [float(x) for x in scales.split(",")]:
            profile = base if scale == 1 else base.scaled(scale, scale)
            for m in [int(x) for x in microbatches.split(",")]:
                for cell in cells:
                    if cell == "interleaved2" and m % profile.num_stages:
                        continue
                    yield f"{name}|{scale:g}|{m}|{cell}", name, scale, m, cell, profile


def timer(cell: dict) -> str:
    """The time compared with a reference: CPU seconds of this process where the reference has them (the
    machine may be shared: wall time then measures the other load as much as the planner), else wall."""
    return "cpu_s" if "cpu_s" in cell else "seconds"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--profiles", default="gpt3-175b,bloom-176b")
    ap.add_argument("--scales", default="1,0.5,0.25")
    ap.add_argument("--microbatches", default="12,24,48,96")
    ap.add_argument("--cells", default=",".join(CELLS))
    ap.add_argument("--json", help="write the cells here (atomically)")
    ap.add_argument("--reference", help="cells of an earlier run (--json) to compare with")
    ap.add_argument("--from-json", help="print the table of a run written by --json instead of planning (e.g. this "
                    "code and the reference run side by side, under the same load, then compared)")
    args = ap.parse_args()
    cells = args.cells.split(",")
    if any(c not in CELLS for c in cells):
        ap.error(f"--cells: choose from {','.join(CELLS)}")
    ref = read_cells(args.reference)
    cost = bench_switch_cost_j()
    out: dict[str, dict] = {}
    recorded = read_cells(args.from_json) if args.from_json else None
    t_start = time.perf_counter()
    print(f"switch cost {cost:.3f} J per change, zero slowdown; savings vs the schedule's f_max baseline (%)\n")
    print("| profile | x | M | cell | optimal (counted) | envelope | opt - env | switch-free | loss | "
          "recovered | changes (env) | kept | time s (ratio) |")
    print("|---|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---|---:|")
    for key, name, scale, m, cell, profile in walk_cells(args.profiles, args.scales, args.microbatches, cells):
        if recorded is not None and key not in recorded:
            continue
        r = out[key] = recorded[key] if recorded is not None else run_cell(profile, m, cell, cost)
        old = ref.get(key)
        recovered = ratio = "—"
        if old is not None:
            old_loss = old["free"] - old["optimal"]
            if old_loss > 1e-9:
                recovered = f"{100 * (r['optimal'] - old['optimal']) / old_loss:.0f} %"
            ratio = f"{r[timer(old)] / old[timer(old)]:.2f}"
        print(f"| {name} | {scale:g} | {m} | {cell} | {r['optimal']:.2f} | {r['envelope']:.2f} "
              f"| {r['optimal'] - r['envelope']:+.2f} | {r['free']:.2f} | {r['free'] - r['optimal']:.2f} "
              f"| {recovered} | {r['changes']} ({r['envelope_changes']}) | {r['kept']} "
              f"| {r['seconds']:.2f} ({ratio}) |", flush=True)
    worse = [k for k, r in out.items() if r["optimal"] < r["envelope"] - 1e-9]
    print(f"\ncells: {len(out)}; optimal below envelope in {len(worse)}" + "".join(f"\n  {k}" for k in worse))
    loss = sum(r["free"] - r["optimal"] for r in out.values()) / max(1, len(out))
    print(f"mean switching loss (switch-free - counted): {loss:.3f} points")
    common = [k for k in out if k in ref]
    if common:
        old_loss = sum(ref[k]["free"] - ref[k]["optimal"] for k in common)
        gained = sum(out[k]["optimal"] - ref[k]["optimal"] for k in common)
        free_moved = min(out[k]["free"] - ref[k]["free"] for k in common)
        clock = timer(ref[common[0]])
        t_new = sum(out[k][clock] for k in common)
        t_old = sum(ref[k][clock] for k in common)
        worst = max(out[k][clock] / ref[k][clock] for k in common)
        print(f"against the reference ({len(common)} cells): switching loss {old_loss / len(common):.3f} -> "
              f"{(old_loss - gained) / len(common):.3f} points, {100 * gained / old_loss if old_loss else 0:.0f} % "
              f"recovered; switch-free saving moved by at least {free_moved:+.3f} points; "
              f"planning time ({'CPU' if clock == 'cpu_s' else 'wall'}) {t_new:.1f} s vs {t_old:.1f} s ({t_new / t_old:.2f}x, worst cell {worst:.2f}x)")
    print(f"(cells read from {args.from_json})" if recorded is not None
          else f"({time.perf_counter() - t_start:.0f} s in all)")
    if args.json:
        write_json_atomic(args.json, out, sort_keys=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
