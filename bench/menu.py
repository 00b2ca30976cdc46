#!/usr/bin/env python3
"""The menu of time and energy (``envpipe menu``) for the shipped A40 profiles, M = 16/24/48/96.

Prints one Markdown table (docs/menu.md's): per profile and M, the saving against 1F1B at f_max of optimal
1F1B, optimal ``ours`` (peak activations on the first stage against 1F1B's), and interleaved V = 2 at 1F1B's
iteration time and at its own fastest (its peak against 1F1B's). With ``--check`` every row is also run by
hand as ``envpipe plan <its flags> --json`` and must give the same iteration time and energy, the interleaved
row at 1F1B's time must equal ``--max-slowdown`` computed by hand from the two baselines' JSON, and save at
least what that slowdown rounded down to 4 decimals gives, to 0.01 points (the planner is not monotone in the
deadline to the last digit): about a minute on 2 cores.

    python3 bench/menu.py [--microbatches 16,24,48,96] [--profiles gpt3-175b,bloom-176b] [--check]
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import math
import sys
import time

from megatron_envpipe.apps.cli import main as envpipe


def run(argv: list[str]) -> dict:
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        code = envpipe([*argv, "--json"])
    if code != 0:
        raise SystemExit(f"envpipe {' '.join(argv)} exited {code}")
    return json.loads(buf.getvalue())


def check(profile: str, m: int, menu: dict) -> list[str]:
    """Each row run by hand; the problems found (none: empty)."""
    problems = []
    where = ["--profile", profile, "--microbatches", str(m)]
    e_1f1b = menu["reference"]["energy_j"]
    for row in menu["rows"]:
        plan = run(["plan", *where, *row["plan_flags"].split()])
        got = (plan["plan"]["iteration_time_s"], plan["plan"]["energy_j"]) if row["deadline"] != "f_max" else (
            plan["baseline"]["iteration_time_s"], plan["baseline"]["energy_j"])
        if got != (row["iteration_time_s"], row["energy_j"]):
            problems.append(f"{profile} M={m} {row['schedule']} {row['deadline']}: menu "
                            f"{row['iteration_time_s']}, {row['energy_j']} but envpipe plan {got}")
        if row["deadline"] == "1F1B's time" and row["schedule"].startswith("interleaved"):
            fast = run(["plan", *where, "--type", "baseline", "--scheduling", "interleaved", "--virtual-stages", "2"])
            slowdown = menu["reference"]["iteration_time_s"] / fast["baseline"]["iteration_time_s"] - 1
            flags = ["plan", *where, "--type", "optimal", "--scheduling", "interleaved", "--virtual-stages", "2"]
            exact = run([*flags, "--max-slowdown", repr(slowdown)])  # computed by hand from the two JSONs
            if exact["plan"]["energy_j"] != row["energy_j"]:
                problems.append(f"{profile} M={m}: --max-slowdown {slowdown!r} by hand gives "
                                f"{exact['plan']['energy_j']} J, the menu {row['energy_j']} J")
            typed = run([*flags, "--max-slowdown", str(math.floor(slowdown * 1e4) / 1e4)])  # typed, rounded down
            short = (1 - typed["plan"]["energy_j"] / e_1f1b) - row["saving_vs_1f1b_at_f_max"]
            SHORTFALLS.append(short)
            if short > TOLERANCE:
                problems.append(f"{profile} M={m}: interleaved at 1F1B's time saves {row['saving_vs_1f1b_at_f_max']} "
                                f"< {row['saving_vs_1f1b_at_f_max'] + short} with --max-slowdown rounded down")
    return problems


def cell(rows: dict, key: tuple[str, str], peak: bool = False) -> str:
    r = rows.get(key)
    if r is None:
        return "—"
    return f"{100 * r['saving_vs_1f1b_at_f_max']:.1f} %" + (f" ({r['peak_vs_1f1b']:.2f}x)" if peak else "")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--microbatches", default="16,24,48,96")
    ap.add_argument("--profiles", default="gpt3-175b,bloom-176b")
    ap.add_argument("--check", action="store_true", help="run every row by hand with envpipe plan and compare")
    args = ap.parse_args()
    t0 = time.perf_counter()
    lines, problems = [], []
    for name in args.profiles.split(","):
        for m in (int(x) for x in args.microbatches.split(",")):
            profile = f"a40/{name}"
            menu = run(["menu", "--profile", profile, "--microbatches", str(m)])
            rows = {(r["schedule"], r["deadline"]): r for r in menu["rows"]}

            ref = menu["reference"]
            lines.append(f"| {name} | {m} | {ref['iteration_time_s']:.2f} s | {cell(rows, ('1f1b', AT))} "
                         f"| {cell(rows, ('ours', AT), True)} | {cell(rows, ('interleaved V=2', AT), True)} "
                         f"| {cell(rows, ('interleaved V=2', 'own fastest'))} "
                         f"| {rows[('interleaved V=2', 'own fastest')]['iteration_time_s']:.2f} s |")
            if args.check:
                problems += check(profile, m, menu)
    print("Savings against 1F1B at f_max (optimal clocks, clock changes charged as envpipe plan --type optimal "
          "does); in parentheses the peak activations against 1F1B's\n")
    print("| profile | M | 1F1B at f_max | 1f1b | ours (peak) | interleaved V=2 at 1F1B's time (peak) "
          "| interleaved V=2 at its own fastest | its time |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    print("\n".join(lines))
    if args.check:
        print(f"\nevery row equals envpipe plan run by hand (and --max-slowdown computed by hand at full precision); "
              f"with --max-slowdown rounded down to 4 decimals the menu saves at most "
              f"{100 * max([0.0, *SHORTFALLS]):.4f} points less (tolerance {100 * TOLERANCE:g}): "
              f"{'yes' if not problems else 'NO'}" + "".join(f"\n  {p}" for p in problems))
    print(f"({time.perf_counter() - t0:.0f} s in all)")
    return 1 if problems else 0


AT = "1F1B's time"
# The optimal planner (LP + rounding) is not monotone in the deadline to the last digit: a deadline rounded
# down may round to a plan a few thousandths of a point cheaper. More than this is a problem.
TOLERANCE = 1e-4
SHORTFALLS: list[float] = []

if __name__ == "__main__":
    sys.exit(main())
