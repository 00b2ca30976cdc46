#!/usr/bin/env python3
"""Profile parsing time against row count: it must grow linearly.

Builds, in memory, a Merak-style profile of one stage whose rows differ only in their
TP/DP rank columns (the worst case of a duplicate-row check that scans the rows seen so far,
which made a 50 MB profile never finish), and times ``Profile.from_csv_text`` on it.

    python bench/profile_parse.py [--rows 25000,50000,100000,200000]

Prints a Markdown table: rows, seconds, microseconds per row (flat when linear).
"""

from __future__ import annotations

import argparse
import time

from megatron_envpipe.core.profile import Profile


def merak_profile(rows: int) -> str:
    """``rows`` rows (even): forward and backward of stage 0 at one clock, one pair per rank."""
    header = "rank,dp_rank,pp_rank,tp_rank,stage,instruction,frequency,time,energy\n"
    return header + "".join(f"{r},{r},0,0,0,{ins},1740,0.1,30.0\n" for r in range(rows // 2)
                            for ins in ("forward", "backward"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default="25000,50000,100000,200000", help="row counts, comma-separated")
    args = parser.parse_args()
    print("| rows | parse s | µs per row |")
    print("|---:|---:|---:|")
    for rows in (int(n) for n in args.rows.split(",")):
        text = merak_profile(rows)
        start = time.perf_counter()
        Profile.from_csv_text(text, source="bench")
        took = time.perf_counter() - start
        print(f"| {rows} | {took:.3f} | {1e6 * took / rows:.1f} |")


if __name__ == "__main__":
    main()
