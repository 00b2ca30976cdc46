"""A lower bound on a plan's energy that counts its clock changes (issue 34, item 4).

The LP bound of :mod:`~megatron_envpipe.planning.optimal.model` prices each unit alone (the convex hull of
its clocks), so it counts no clock change. This bound solves the same problem as the optimal planner (one
fixed schedule, its deadline, every unit at one candidate clock, iteration energy ``sum (E - P_p2p t) +
P_p2p P T`` at the plan's own makespan ``T``, or padded to the deadline) plus ``switch_cost_j`` x every
change a repeating iteration makes (:func:`~megatron_envpipe.planning.switching.steady_clock_changes`:
consecutive units of a rank, and its last unit to its first), as a Dantzig-Wolfe relaxation:

* a *column* is one rank's whole clock sequence ``p``: its effective energy plus the cost of its changes
  ``C_p``, and its units' durations ``t_vp``;
* the *master LP* picks, per rank, a convex combination of columns (``sum_p w_p = 1``, ``w >= 0``) whose
  durations ``d_v = sum_p t_vp w_p`` fit the iteration DAG (the planner LP's rows: edges with their P2P
  latency, every sink by ``T <= deadline``) and minimises ``sum_p C_p w_p + P_p2p P T``;
* *pricing*: with the master's duals ``y_v`` (price of a unit's time) and ``sigma_s`` (rank ``s``'s
  convexity row), the cheapest new column of rank ``s`` minimises ``sum_v (cost_vk + y_v t_vk) +
  switch_cost_j x changes`` over all clock sequences: an exact dynamic program along the rank's units
  (cyclic: the wrap into the next iteration counted) over every candidate clock the profile has for each
  unit (dominated clocks included: the planner may use one to avoid a change).

**Validity (weak duality).** Every real plan is a feasible point of the full master (each rank's sequence
as one column, weight 1), at the same cost. After any master solve, ``(y, sigma_s + rc_s)`` with ``rc_s =
min_p (C_p + sum_v y_v t_vp) - sigma_s <= 0`` (the pricing DP's exact minimum over *all* sequences) is
feasible for the dual of the full master, so ``z_master + sum_s min(0, rc_s)`` (Lasdon/Farley) is at most
the full master's optimum, hence at most every plan's energy with its changes counted. That holds at every
round, not only at convergence: the bound returned is the best round's. Exact up to the LP solver's
feasibility tolerances (1e-7 on duals; a relative error far below 1e-6 of the energy here).

Not included: clock latency (late transitions, minimum segment lengths) and the choice among ``ours``'s
candidate schedules (the caller takes the minimum over them). With ``switch_cost_j`` 0 the converged
bound is the LP bound; with changes charged the converged bound is at least the LP bound (each rank's
columns cost at least their units' hull costs), and the caller may take the larger of the two.

Where it lives: in testing/ (beside the MILP oracle), used by bench/switch_bound.py and the tests, not by
the planner: it takes longer than the plan itself (column generation: 0.4-1.3 CPU s per cell at P = 8,
M = 12 against 0.1-0.3 s of planning; not converged after 11 CPU s on GPT-3 1F1B at M = 96), so a plan's
printout keeps the LP bound and says it counts no change.
numpy and highspy are imported when a bound is computed, never at import.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass

from megatron_envpipe.planning.optimal.model import TimeEnergyModel

# Stop when the master's value and the bound agree to this (relative), or after this many rounds / seconds.
_BOUND_RTOL = 1e-5
_MAX_ROUNDS = 200
_MAX_SECONDS = 60.0
# Columns added per rank and round: the best sequence from each of this many start clocks.
_COLUMNS_PER_ROUND = 3


@dataclass(frozen=True)
class SwitchBound:
    """A lower bound on a plan's energy with its clock changes counted, and how it was found."""

    lower_bound_j: float  # no plan of this schedule and deadline costs less, changes counted
    master_j: float  # the relaxation's last master value (the bound is below it; equal once converged)
    rounds: int
    columns: int
    converged: bool
    seconds: float  # CPU seconds of this process


class _RankChain:
    """One rank's units in execution order, each with every candidate clock it has (time, effective energy)."""

    def __init__(self, np, units: list[int], model: TimeEnergyModel, keep: set[int] | None) -> None:
        ev = model.evaluator
        self.units = units
        per_unit = []
        for v in units:
            points = ev.key_points(model.keys[v])
            per_unit.append({p.freq_mhz: (p.time_s, p.energy_j - model.p2p_power_w * p.time_s)
                             for p in points if keep is None or p.freq_mhz in keep})
        clocks = sorted({f for opts in per_unit for f in opts}, reverse=True)
        self.clocks = clocks
        k = len(clocks)
        self.time = np.full((len(units), k), math.inf)
        self.cost = np.full((len(units), k), math.inf)
        for i, opts in enumerate(per_unit):
            if not opts:
                raise ValueError(f"unit {units[i]} has no clock among the candidates")
            for j, f in enumerate(clocks):
                if f in opts:
                    self.time[i, j], self.cost[i, j] = opts[f]
        # Durations where a clock is missing are never read (its cost is inf): keep them finite for the master.
        self.time_finite = np.where(np.isfinite(self.time), self.time, 0.0)

    def column(self, np, choice) -> tuple[float, list[float]]:
        """(cost with changes counted at 0, durations) of clock indices ``choice``; see :meth:`changes`."""
        rows = np.arange(len(self.units))
        return float(self.cost[rows, choice].sum()), self.time[rows, choice].tolist()

    @staticmethod
    def changes(choice: Sequence[int]) -> int:
        n = len(choice)
        return sum(1 for i in range(n) if choice[i] != choice[(i + 1) % n])

    def price(self, np, y, switch_cost_j: float, how_many: int) -> list[tuple[float, list[int]]]:
        """The cheapest cyclic sequences (priced cost ``sum (cost + y t)`` + changes x cost), best first: the
        exact minimum over all sequences, then the best from other start clocks (at most ``how_many``)."""
        c = self.cost + y[:, None] * self.time_finite
        c = np.where(np.isfinite(self.cost), c, math.inf)
        n, k = c.shape
        value = np.full((k, k), math.inf)  # [start clock, current clock]
        value[np.arange(k), np.arange(k)] = c[0]
        stay = np.zeros((n, k, k), dtype=bool)
        came = np.zeros((n, k), dtype=np.int64)
        for i in range(1, n):
            best = value.min(axis=1)
            came[i] = value.argmin(axis=1)
            switched = best[:, None] + switch_cost_j
            st = value <= switched
            stay[i] = st
            value = np.where(st, value, switched) + c[i]
        diag = value[np.arange(k), np.arange(k)]
        other = value.min(axis=1) + (switch_cost_j if n > 1 else 0.0)
        total = np.minimum(diag, other)
        out = []
        for k0 in np.argsort(total, kind="stable")[:how_many].tolist():
            if not math.isfinite(total[k0]):
                break
            cur = k0 if diag[k0] <= other[k0] else int(value[k0].argmin())
            choice = [0] * n
            for i in range(n - 1, 0, -1):
                choice[i] = cur
                if not stay[i, k0, cur]:
                    cur = int(came[i, k0])
            choice[0] = cur
            out.append((float(total[k0]), choice))
        return out


def switch_bound(
    model: TimeEnergyModel,
    deadline_s: float,
    switch_cost_j: float,
    candidates_mhz: Sequence[int] | None = None,
    padded: bool = False,
    seed_plans: Sequence[Sequence[int]] = (),
    max_rounds: int = _MAX_ROUNDS,
    max_seconds: float = _MAX_SECONDS,
    rtol: float = _BOUND_RTOL,
) -> SwitchBound:
    """A lower bound on the energy of every plan of ``model``'s schedule that ends by ``deadline_s``, each
    clock change (:func:`~megatron_envpipe.planning.switching.steady_clock_changes`) counted at
    ``switch_cost_j`` (module docstring: the relaxation and why it is a bound).

    ``candidates_mhz``: the clocks a plan may use (default: every profiled clock); ``padded``: energy counted
    until the deadline (``P_p2p P deadline`` added, the makespan free) instead of at the plan's makespan;
    ``seed_plans``: flat clock lists (``graph.nodes`` order, e.g. the planner's plan) whose rank sequences
    start the master (only speed: the bound is valid without them).
    """
    import highspy
    import numpy as np

    t_start = time.process_time()  # CPU: a shared machine's wall time measures its load
    graph = model.graph
    n, stages = model.n, model.num_stages
    weight = 0.0 if padded else model.p2p_power_w * stages
    const = model.p2p_power_w * stages * deadline_s if padded else 0.0
    keep = None if candidates_mhz is None else set(candidates_mhz)
    by_rank: dict[int, list[int]] = {}
    for v, (s, _) in enumerate(graph.nodes):
        by_rank.setdefault(s, []).append(v)
    chains = [_RankChain(np, units, model, keep) for _, units in sorted(by_rank.items())]
    deadline_s = max(deadline_s, model.fastest_time_s())

    # Columns: e_v (0..n-1), T (n), d_v (n+1..2n); rows: the DAG's edges and sinks, then d_v - sum t w = 0,
    # then one convexity row per rank; stage columns appended as they are priced.
    t_col = n
    rows_r: list[int] = []
    rows_c: list[int] = []
    rows_v: list[float] = []
    lo: list[float] = []
    up: list[float] = []

    def row(terms: list[tuple[int, float]], lo_: float, up_: float) -> None:
        for col, val in terms:
            rows_r.append(len(lo))
            rows_c.append(col)
            rows_v.append(val)
        lo.append(lo_)
        up.append(up_)

    has_succ = [False] * n
    for v in range(n):
        for u, lat in model.preds[v] or ((-1, 0.0),):
            terms = [(v, 1.0), (n + 1 + v, -1.0)]
            if u >= 0:
                terms.append((u, -1.0))
                has_succ[u] = True
            row(terms, lat, math.inf)
    for v in range(n):
        if not has_succ[v]:
            row([(v, 1.0), (t_col, -1.0)], -math.inf, 0.0)
    link0 = len(lo)
    for v in range(n):
        row([(n + 1 + v, 1.0)], 0.0, 0.0)
    conv0 = len(lo)
    for _ in chains:
        row([], 1.0, 1.0)
    num_cols = 2 * n + 1
    cost = np.zeros(num_cols)
    cost[t_col] = weight
    col_lo = np.zeros(num_cols)
    col_up = np.full(num_cols, math.inf)
    col_up[t_col] = deadline_s
    r = np.asarray(rows_r, dtype=np.int32)
    c = np.asarray(rows_c, dtype=np.int32)
    vals = np.asarray(rows_v, dtype=float)
    order = np.lexsort((r, c))
    start = np.zeros(num_cols + 1, dtype=np.int32)
    np.cumsum(np.bincount(c, minlength=num_cols), out=start[1:])
    h = highspy.Highs()
    h.setOptionValue("output_flag", False)
    h.setOptionValue("simplex_strategy", 4)  # primal: added columns keep the last basis primal feasible
    lp = highspy.HighsLp()
    lp.num_col_, lp.num_row_ = num_cols, len(lo)
    lp.col_cost_, lp.col_lower_, lp.col_upper_ = cost, col_lo, col_up
    lp.row_lower_, lp.row_upper_ = np.asarray(lo, float), np.asarray(up, float)
    lp.a_matrix_.format_ = highspy.MatrixFormat.kColwise
    lp.a_matrix_.start_, lp.a_matrix_.index_, lp.a_matrix_.value_ = start, r[order], vals[order]
    h.passModel(lp)

    seen: list[set[tuple[int, ...]]] = [set() for _ in chains]
    columns = 0

    def add_column(s: int, choice: list[int]) -> bool:
        nonlocal columns
        key = tuple(choice)
        if key in seen[s]:
            return False
        seen[s].add(key)
        chain = chains[s]
        energy, durations = chain.column(np, np.asarray(choice))
        if not math.isfinite(energy):
            return False
        idx = [link0 + v for v in chain.units] + [conv0 + s]
        h.addCol(energy + switch_cost_j * chain.changes(choice), 0.0, math.inf, len(idx),
                 np.asarray(idx, dtype=np.int32), np.asarray([-t for t in durations] + [1.0], dtype=float))
        columns += 1
        return True

    # Start: every unit at its fastest clock (meets any feasible deadline), one clock throughout (no change),
    # and the seeds' sequences.
    for s, chain in enumerate(chains):
        add_column(s, np.where(np.isfinite(chain.time), chain.time, math.inf).argmin(axis=1).tolist())
        for j in range(len(chain.clocks)):
            if np.isfinite(chain.cost[:, j]).all():
                add_column(s, [j] * len(chain.units))
    for flat in seed_plans:
        for s, chain in enumerate(chains):
            index = {f: j for j, f in enumerate(chain.clocks)}
            choice = [index.get(int(flat[v]), -1) for v in chain.units]
            if min(choice) >= 0:
                add_column(s, choice)

    best_bound, master, rounds, converged = -math.inf, math.inf, 0, False
    while rounds < max_rounds:
        rounds += 1
        h.run()
        if h.getModelStatus() != highspy.HighsModelStatus.kOptimal:
            raise ValueError(f"switch bound: master LP {h.modelStatusToString(h.getModelStatus())}")
        master = h.getInfo().objective_function_value
        duals = np.asarray(h.getSolution().row_dual)
        y, sigma = duals[link0:link0 + n], duals[conv0:conv0 + len(chains)]
        bound, added = master, 0
        for s, chain in enumerate(chains):
            priced = chain.price(np, y[chain.units], switch_cost_j, _COLUMNS_PER_ROUND)
            bound += min(0.0, priced[0][0] - float(sigma[s]))
            for value, choice in priced:
                if value - sigma[s] < -1e-9 * max(1.0, abs(master)):
                    added += add_column(s, choice)
        best_bound = max(best_bound, bound)
        if not added or master - best_bound <= rtol * abs(master):
            converged = True
            break
        if time.process_time() - t_start > max_seconds:
            break
    return SwitchBound(lower_bound_j=float(best_bound + const), master_j=float(master + const), rounds=rounds, columns=columns,
                       converged=converged, seconds=time.process_time() - t_start)
