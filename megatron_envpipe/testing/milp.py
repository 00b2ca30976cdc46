"""Exact reference for small instances: the clock-plan problem as a MILP (HiGHS).

The oracle the LP planner is tested against, so it is built independently of
the planner: its clock options are every profiled clock of each unit, read
straight from the :class:`~megatron_envpipe.core.profile.Profile` (no Pareto
filter, no convex hull), and its precedence rows are written here from the
schedule itself (same-stage order, activations ``F(s, m) -> F(s+1, m)``,
gradients ``B(s+1, m) -> B(s, m)``, plus the graph's P2P latency and extra
dependencies). A bug in the planner's option lists, hulls or LP rows therefore
cannot hide in its own reference. Only the solver adapter is shared
(:func:`~megatron_envpipe.planning.optimal.lp.lp_backend`: ``highspy``, or
``scipy.optimize.milp``), and the result is scored by the same
:class:`~megatron_envpipe.core.timeline.PlanEvaluator` as every plan.

One binary ``x_vk`` per (unit, clock), exactly one per unit, one end time per
unit and the makespan ``T``. Iteration energy is ``sum E + P_p2p * sum_stages
(T - busy)``, i.e. per unit ``E - P_p2p * t`` plus ``P_p2p * P * T``:

    min  sum_v sum_k x_vk (E_vk - P_p2p t_vk) + P_p2p * P * T
    s.t. end_v - sum_k t_vk x_vk - end_u >= latency(u, v)     for every edge u -> v
         end_v - sum_k t_vk x_vk >= 0,   end_v <= T <= deadline,   sum_k x_vk = 1

With ``padded=True`` the ``T`` term is dropped (energy counted until the
deadline). Solved under a time limit; the result says whether optimality was
proven and the MIP gap. It takes seconds at P = 4, M = 8 and minutes beyond
P = 8, M = 12.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass

from megatron_envpipe.core.profile import Profile, instruction_of
from megatron_envpipe.core.schedule import B, F, Schedule
from megatron_envpipe.core.timeline import PipelineGraph, PlanScore, Timeline
from megatron_envpipe.planning.optimal.deadline import FEASIBILITY_RTOL, InfeasibleDeadline
from megatron_envpipe.planning.optimal.lp import lp_backend
from megatron_envpipe.planning.optimal.model import TimeEnergyModel


@dataclass
class MilpResult:
    freqs_mhz: list[int]
    score: PlanScore
    timeline: Timeline
    energy_j: float  # the plan's energy (evaluator) at its makespan, or padded to the deadline
    optimal: bool  # proven optimal within mip_rel_gap
    mip_gap: float | None
    dual_bound_j: float | None  # no plan is cheaper than this
    status: str
    seconds: float
    objective_j: float = math.nan  # the MILP's own objective (same quantity as energy_j, its arithmetic)


def unit_clocks(
    profile: Profile, graph: PipelineGraph, candidates_mhz: Sequence[int] | None = None
) -> list[list[tuple[int, float, float]]]:
    """Per unit (aligned with ``graph.nodes``): every allowed profiled clock as (MHz, seconds, joules),
    from the unit's model chunk's rows (a profile of whole stages is split evenly over the chunks)."""
    keep = None if candidates_mhz is None else set(candidates_mhz)
    chunks = 1 + max((unit.chunk for _, unit in graph.nodes), default=0)
    profile = profile.for_chunks(chunks) if chunks > 1 else profile
    out = []
    for s, unit in graph.nodes:
        ins = instruction_of(unit.kind)
        clocks = [(p.freq_mhz, p.time_s, p.energy_j) for p in profile.points(s, ins, unit.chunk)
                  if keep is None or p.freq_mhz in keep]
        if not clocks:
            raise ValueError(f"{profile.source}: stage {s} {ins} has no clock among the candidates")
        out.append(clocks)
    return out


def schedule_edges(schedule: Schedule, graph: PipelineGraph) -> list[tuple[int, int, float]]:
    """Every precedence ``(u, v, latency_s)`` of one iteration, from the schedule (node indices of ``graph``);
    model chunks (interleaved schedules) included."""
    idx = graph.index
    last, top = schedule.num_stages - 1, schedule.num_chunks - 1
    lat = graph.p2p_latency_s
    edges = []
    for s, order in enumerate(schedule.orders):
        for a, b in zip(order, order[1:]):  # one unit at a time, in schedule order
            edges.append((idx[(s, a)], idx[(s, b)], 0.0))
        for unit in order:
            m, v = unit.microbatch, unit.chunk
            # Model chunk v of stage s is virtual stage v * P + s: the last stage's chunk v sends its
            # activation to the first stage's chunk v + 1, which sends the gradient back.
            if unit.is_forward and s < last:  # activation to the next stage
                edges.append((idx[(s, unit)], idx[(s + 1, F(m, v))], lat))
            elif unit.is_forward and v < top:  # ... or, from the last stage, to the next chunk
                edges.append((idx[(s, unit)], idx[(0, F(m, v + 1))], lat))
            if not unit.is_forward and s > 0:  # gradient to the previous stage
                edges.append((idx[(s, unit)], idx[(s - 1, B(m, v))], lat))
            elif not unit.is_forward and v > 0:  # ... or, from the first stage, to the previous chunk
                edges.append((idx[(s, unit)], idx[(last, B(m, v - 1))], lat))
    for dep in graph.extra_dependencies:
        edges.append((idx[(dep.src_stage, dep.src)], idx[(dep.dst_stage, dep.dst)], dep.latency_s))
    return edges


def solve_milp(
    model: TimeEnergyModel,
    deadline_s: float,
    padded: bool = False,
    time_limit_s: float = 60.0,
    mip_rel_gap: float = 1e-6,
    candidates_mhz: Sequence[int] | None = None,
    switch_cost_j: float = 0.0,
) -> MilpResult:
    """Minimum-energy plan of ``model``'s schedule meeting ``deadline_s``, exactly (up to the gap).

    Only the model's schedule, profile, P2P power, graph and evaluator are used;
    ``candidates_mhz`` restricts the clocks (default: every profiled clock).
    ``switch_cost_j`` > 0 (issue 34): every clock change a repeating iteration makes is charged that much
    (planning/switching.steady_clock_changes: consecutive units of a rank, and its last unit to its first),
    one variable ``y >= x_uk - x_vk`` (every clock k) per consecutive pair; ``energy_j`` and
    ``objective_j`` then include the changes.
    """
    import numpy as np

    t0 = time.perf_counter()
    graph, evaluator = model.graph, model.evaluator
    clocks = unit_clocks(model.profile, graph, candidates_mhz)
    n = len(clocks)
    p2p, stages = model.p2p_power_w, model.schedule.num_stages
    fastest = graph.simulate([min(t for _, t, _ in c) for c in clocks]).iteration_time_s
    if not deadline_s >= fastest * (1 - FEASIBILITY_RTOL):
        raise InfeasibleDeadline(f"MILP: an iteration time of {deadline_s:.6g} s is infeasible: "
                                 f"every unit at its fastest clock takes {fastest:.6g} s")
    deadline_s = max(deadline_s, fastest)

    # Columns: end_v (0..n-1), T (n), then x_vk.
    t_col = n
    cost = [0.0] * n + [0.0 if padded else p2p * stages]
    col_lo = [0.0] * (n + 1)
    col_up = [math.inf] * n + [deadline_s]
    integer = [0] * (n + 1)
    xcols: list[list[int]] = []
    for c in clocks:
        xcols.append(list(range(len(cost), len(cost) + len(c))))
        for _, t, e in c:
            cost.append(e - p2p * t)
            col_lo.append(0.0)
            col_up.append(1.0)
            integer.append(1)

    trip_r: list[int] = []
    trip_c: list[int] = []
    trip_v: list[float] = []
    row_lo: list[float] = []
    row_up: list[float] = []

    def row(terms: list[tuple[int, float]], lo: float, up: float) -> None:
        for col, val in terms:
            trip_r.append(len(row_lo))
            trip_c.append(col)
            trip_v.append(val)
        row_lo.append(lo)
        row_up.append(up)

    def minus_duration(v: int) -> list[tuple[int, float]]:
        return [(j, -t) for j, (_, t, _) in zip(xcols[v], clocks[v])]

    for v in range(n):
        row([(j, 1.0) for j in xcols[v]], 1.0, 1.0)  # exactly one clock
        row([(v, 1.0), *minus_duration(v)], 0.0, math.inf)  # starts at 0 or later
        row([(v, 1.0), (t_col, -1.0)], -math.inf, 0.0)  # ends by T
    for u, v, lat in schedule_edges(model.schedule, graph):
        row([(v, 1.0), (u, -1.0), *minus_duration(v)], lat, math.inf)
    if switch_cost_j > 0:
        rank_units: dict[int, list[int]] = {}
        for v, (s, _) in enumerate(graph.nodes):  # stage by stage, in execution order
            rank_units.setdefault(s, []).append(v)
        for units in rank_units.values():
            for a, b in zip(units, units[1:] + units[:1]) if len(units) > 1 else ():
                y = len(cost)
                cost.append(switch_cost_j)
                col_lo.append(0.0)
                col_up.append(1.0)
                integer.append(0)  # y = max_k (x_ak - x_bk), 0 or 1 at an integer x
                col_b = {f: j for j, (f, _, _) in zip(xcols[b], clocks[b])}
                for j, (f, _, _) in zip(xcols[a], clocks[a]):
                    row([(y, 1.0), (j, -1.0), *([(col_b[f], 1.0)] if f in col_b else [])], 0.0, math.inf)

    num_cols = len(cost)
    r = np.asarray(trip_r, dtype=np.int32)
    c = np.asarray(trip_c, dtype=np.int32)
    vals = np.asarray(trip_v, dtype=float)
    order = np.lexsort((r, c))
    start = np.zeros(num_cols + 1, dtype=np.int32)
    np.cumsum(np.bincount(c, minlength=num_cols), out=start[1:])
    backend = lp_backend(
        np.asarray(cost, float), start, r[order], vals[order], np.asarray(row_lo, float), np.asarray(row_up, float),
        np.asarray(col_lo, float), np.asarray(col_up, float), integer=integer,
        time_limit_s=time_limit_s, mip_rel_gap=mip_rel_gap,
    )
    ok, x, obj = backend.solve()
    if not ok:
        raise RuntimeError(f"MILP found no plan within {time_limit_s:g} s ({backend.status})")
    freqs = [clocks[v][max(range(len(xc)), key=lambda k: (x[xc[k]], -k))][0] for v, xc in enumerate(xcols)]
    timeline = evaluator.simulate(freqs)
    score = evaluator.score(freqs, timeline)
    const = p2p * stages * deadline_s if padded else 0.0
    energy = score.energy_j + (p2p * stages * max(0.0, deadline_s - score.iteration_time_s) if padded else 0.0)
    if switch_cost_j > 0:
        changes = 0
        for s in range(stages):
            row_mhz = [f for f, (st, _) in zip(freqs, graph.nodes) if st == s]
            changes += sum(1 for a, b in zip(row_mhz, row_mhz[1:] + row_mhz[:1]) if a != b)
        energy += switch_cost_j * changes
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
        objective_j=float(obj) + const,
    )
