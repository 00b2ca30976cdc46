"""The menu of time and energy (planning/menu.py) as text and JSON: ``envpipe menu`` and ``envpipe demo`` print it."""

from __future__ import annotations

import sys
from typing import Any, TextIO

from megatron_envpipe.planning.menu import AT_1F1B, Menu, MenuRow


def _row_dict(row: MenuRow) -> dict[str, Any]:
    return {"schedule": row.schedule, "deadline": row.deadline, "iteration_time_s": row.iteration_time_s,
            "energy_j": row.energy_j, "saving_vs_1f1b_at_f_max": row.saving,
            "peak_inflight_activations": list(row.peak_inflight), "peak_vs_1f1b": row.peak_ratio,
            "plan_flags": row.plan_flags,
            "clock_changes_per_rank_per_iteration": list(row.result.plan.clock_changes()) if row.result else None}


def menu_dict(menu: Menu, budget: Any) -> dict[str, Any]:
    ref = menu.reference
    return {"profile": menu.profile_source, "num_stages": menu.num_stages, "num_microbatches": menu.num_microbatches,
            "max_inflight": budget if not isinstance(budget, tuple) else list(budget),
            "reference": {"name": "1F1B at f_max", "iteration_time_s": ref.iteration_time_s, "energy_j": ref.energy_j,
                          "peak_inflight_activations": list(ref.peak_inflight)},
            "rows": [_row_dict(r) for r in menu.rows], "notes": list(menu.notes)}


def print_menu(menu: Menu, out: TextIO | None = None) -> None:
    out = out or sys.stdout
    print(f"menu        {menu.profile_source}: {menu.num_stages} stages x {menu.num_microbatches} micro-batches; "
          "optimal clocks (envpipe plan --type optimal); savings against 1F1B at f_max", file=out)
    print(f"\n{'schedule':<18}{'deadline':<14}{'iteration time':>16}{'energy':>13}{'saving':>9}"
          f"{'peak act.':>11}{'vs 1F1B':>9}", file=out)
    for r in menu.rows:
        deadline = "1F1B's (=own)" if r.deadline == AT_1F1B and not r.schedule.startswith("inter") else r.deadline
        print(f"{r.schedule:<18}{deadline:<14}{r.iteration_time_s:>14.4f} s{r.energy_j:>11.1f} J"
              f"{100 * r.saving:>8.2f}%{max(r.peak_inflight):>11g}{r.peak_ratio:>8.2f}x", file=out)
    print("\npeak act.: the most micro-batch activations any stage holds (a chunk's counts 1/V; per stage in --json)",
          file=out)
    print("each row is `envpipe plan --profile ... --microbatches ...` with:", file=out)
    for r in menu.rows:
        print(f"  {r.schedule + ', ' + r.deadline + ':':<34}{r.plan_flags}", file=out)
    for n in menu.notes:
        print(f"note: {n}", file=out)


