"""Exact reference for small instances: the clock-plan problem as a MILP (HiGHS).

One binary per (unit, clock option) — the same options as the optimal planner
(:func:`~megatron_envpipe.planning.optimal.options.clock_options`: Pareto-optimal in time and
effective energy, which loses no optimal plan) — exactly one per unit, one end
time per unit, precedence rows of the iteration DAG, ``end_v <= T <= deadline``:

    min  sum_v sum_k x_vk (E_vk - P_p2p t_vk) + P_p2p * P * T      (T free up to the deadline)
    s.t. end_v - sum_k x_vk t_vk - end_u >= latency(u, v)           for every edge u -> v
         end_v - sum_k x_vk t_vk >= 0,   end_v <= T,   sum_k x_vk = 1

With ``padded=True`` the ``T`` term is dropped (energy counted until the
deadline). Solved with HiGHS through ``highspy`` or ``scipy.optimize.milp``
under a time limit; the result says whether optimality was proven and the
MIP gap. Used by the tests as the optimum the LP planner is compared with;
it takes seconds at P = 4, M = 8 and minutes beyond P = 8, M = 12.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

from megatron_envpipe.core.timeline import PlanScore, Timeline
from megatron_envpipe.planning.optimal.lp import lp_backend
from megatron_envpipe.planning.optimal.model import TimeEnergyModel
from megatron_envpipe.planning.optimal.rows import ConstraintRows


@dataclass
class MilpResult:
    freqs_mhz: list[int]
    score: PlanScore
    timeline: Timeline
    energy_j: float  # objective value: energy at the plan's makespan (or padded to the deadline)
    optimal: bool  # proven optimal within mip_rel_gap
    mip_gap: float | None
    dual_bound_j: float | None  # no plan is cheaper than this
    status: str
    seconds: float


def solve_milp(
    model: TimeEnergyModel,
    deadline_s: float,
    padded: bool = False,
    time_limit_s: float = 60.0,
    mip_rel_gap: float = 1e-6,
) -> MilpResult:
    """Minimum-energy plan of ``model``'s schedule meeting ``deadline_s``, exactly (up to the gap)."""
    import numpy as np

    t0 = time.perf_counter()
    model.check_deadline(deadline_s)
    n = model.n
    weight = 0.0 if padded else model.p2p_power_w * model.num_stages
    cost = [0.0] * n + [weight]
    col_lo = [0.0] * (n + 1)
    col_up = [math.inf] * n + [deadline_s]
    integer = [0] * (n + 1)
    xcols: list[range] = []
    for v in range(n):
        first = len(cost)
        for o in model.options[v]:
            cost.append(o.cost_j)
            col_lo.append(0.0)
            col_up.append(1.0)
            integer.append(1)
        xcols.append(range(first, len(cost)))
    # Duration: the chosen option's time; then exactly one option per unit.
    rows = ConstraintRows()
    rows.add_schedule(model.preds, n, lambda v: (list(zip(xcols[v], model.times[v])), 0.0),
                      unit_rows=lambda v: rows.add([(j, 1.0) for j in xcols[v]], 1.0, 1.0))
    start, index, value = rows.csc(np, len(cost))
    backend = lp_backend(
        np.asarray(cost, float), start, index, value, np.asarray(rows.lo, float), np.asarray(rows.up, float),
        np.asarray(col_lo, float), np.asarray(col_up, float), integer=integer,
        time_limit_s=time_limit_s, mip_rel_gap=mip_rel_gap,
    )
    ok, x, _obj = backend.solve()
    if not ok:
        raise RuntimeError(f"MILP found no plan within {time_limit_s:g} s ({backend.status})")
    idx = [max(range(len(xc)), key=lambda k: (x[xc[k]], -k)) for xc in xcols]
    freqs = model.freqs(idx)
    timeline = model.evaluator.simulate(freqs)
    score = model.evaluator.score(freqs, timeline)
    energy = score.energy_j
    if padded:
        energy += model.p2p_power_w * model.num_stages * max(0.0, deadline_s - score.iteration_time_s)
    const = model.p2p_power_w * model.num_stages * deadline_s if padded else 0.0
    bound = getattr(backend, "mip_dual_bound", None)
    return MilpResult(
        freqs_mhz=freqs,
        score=score,
        timeline=timeline,
        energy_j=energy,
        optimal=bool(backend.optimal),
        mip_gap=backend.mip_gap,
        dual_bound_j=(bound + const) if bound is not None and math.isfinite(bound) else None,
        status=str(backend.status),
        seconds=time.perf_counter() - t0,
    )
