"""Minimum-energy per-unit clock plans for an iteration-time deadline (``--type optimal``).

The problem: choose one profiled SM clock per unit of a schedule so that the
simulated iteration takes at most a deadline ``D`` and the iteration energy
(Perseus's formula, :func:`~megatron_envpipe.core.timeline.score_timeline`) is
minimal. With the makespan ``T`` and ``P`` stages,

    E = sum_units E(f) + P_p2p * sum_stages (T - busy_s)
      = sum_units [E(f) - P_p2p * t(f)] + P_p2p * P * T,

so each unit costs its *effective* energy ``E(f) - P_p2p t(f)`` (slowing a unit
trades blocking time for busy time) plus one term in ``T``.

Method (deterministic):

1. **Options.** Per (stage, instruction), the clocks that are Pareto-optimal in
   (time, effective energy), fastest first, ending at the cheapest one: a
   slower *and* costlier clock is never worth choosing.
2. **Time–cost LP** over the iteration DAG (the same edges as
   :class:`~megatron_envpipe.core.timeline.PipelineGraph`, latencies and extra
   dependencies included): each unit's cost is replaced by the lower convex
   hull of its options, written incrementally (``d_v = t_fast + sum_j x_vj``,
   ``0 <= x_vj <= segment length``, cost slope per segment) so the only rows
   are precedence constraints; ``end_v <= T <= D``. Solved with HiGHS
   (``highspy``, warm-started across deadlines; or ``scipy.optimize.linprog``).
   Its optimum is a lower bound on every plan's energy.
3. **Rounding** to real clocks: a forward pass in topological order gives each
   unit the slowest option that still lets it finish by its latest finish time
   computed from target durations (so the plan is feasible by construction),
   and the mirror-image backward pass. Targets: the LP durations, and the LP
   durations *dithered* onto hull vertices (error diffusion along each stage,
   so identical units between two far-apart clocks alternate between them in
   the LP's proportion); options: the hull's vertices only, or every option.
   Each rounding is *settled* by alternating forward/backward passes that slow
   units down wherever slack remains; the cheapest of six is kept.
4. **Local search** (bounded by a count of unit visits, not by a clock, so
   results do not depend on the machine): speed one unit up by 1-3 clock steps
   and settle again; exchange time between neighbours (speed one up, slow a
   neighbour down; slow one down, buy its time from up to three neighbours),
   each move checked by simulation; keep what lowers the energy.
5. **Repair** (a safety net against LP tolerances): while the simulated
   iteration overshoots the deadline, raise the clock of the unit on the
   critical path with the cheapest marginal energy per second saved.

On the shipped A40 profiles (8 stages, M = 12..96) a plan takes 0.1-0.7 s and
lands within 0.01-1 % of the LP bound (1F1B's gap is mostly the bound's: the
discrete clocks cannot fill the steady state's slack exactly); on small
instances it is within 0.5 % of the exact MILP optimum (:mod:`.milp`, tests).

Pure Python apart from the LP (``numpy`` + ``highspy`` or ``scipy``, imported
only here, only when an optimal plan is asked for).
"""

from __future__ import annotations

import bisect
import math
import time
from dataclasses import dataclass
from typing import Any, Sequence

from megatron_envpipe.core.plan import FrequencyPlan
from megatron_envpipe.core.profile import Profile, ProfilePoint
from megatron_envpipe.core.schedule import Schedule, ScheduleError, build_schedule, clamp_extra_warmup, raw_extra_warmup
from megatron_envpipe.core.timeline import Dependency, PlanEvaluator, PlanScore, Timeline
from megatron_envpipe.planning.basis import (
    SLOWDOWN_WARNING,
    PlannerConfig,
    PlannerError,
    PlanningBasis,
    PlanResult,
    planning_basis,
)

# A plan meets its deadline when its simulated makespan is at most D * (1 + FEASIBILITY_RTOL).
FEASIBILITY_RTOL = 1e-12
# Local search: about this many unit visits in total (a settle visits every unit ~4 times,
# a feasibility check once), half for single moves, half for exchanges. A count, not a
# clock, so plans are reproducible on any machine.
DEFAULT_SEARCH_WORK = 400_000
MIN_SEARCH_TRIALS = 8
MAX_SEARCH_ROUNDS = 6  # exchange searches: candidate lists rebuilt at most this often
MAX_FAILED_CHECKS = 150  # ... and a round ends after this many infeasible candidates in a row (best first)


class InfeasibleDeadline(PlannerError):
    """A deadline no plan can meet (faster than every unit at its fastest clock)."""


class SolverUnavailable(PlannerError):
    """No LP solver (highspy or scipy) is installed."""


# -- per-unit options ------------------------------------------------------------------
@dataclass(frozen=True)
class ClockOption:
    """One clock of one (stage, instruction): time, energy and effective energy."""

    freq_mhz: int
    time_s: float
    energy_j: float
    cost_j: float  # energy - P_p2p * time


def clock_options(
    points: Sequence[ProfilePoint], p2p_power_w: float, allowed_mhz: Sequence[int] | None = None
) -> tuple[ClockOption, ...]:
    """Options worth choosing, fastest first: strictly cheaper (effective energy) as they get slower.

    The list ends at the cheapest clock; slower clocks past it cost more and
    save nothing. Ties in time keep the cheaper clock (then the faster one).
    """
    keep = None if allowed_mhz is None else set(allowed_mhz)
    opts = sorted(
        (
            ClockOption(p.freq_mhz, p.time_s, p.energy_j, p.energy_j - p2p_power_w * p.time_s)
            for p in points
            if keep is None or p.freq_mhz in keep
        ),
        key=lambda o: (o.time_s, o.cost_j, -o.freq_mhz),
    )
    out: list[ClockOption] = []
    best = math.inf
    for o in opts:
        if o.cost_j < best:
            out.append(o)
            best = o.cost_j
    return tuple(out)


def lower_hull(options: Sequence[ClockOption]) -> tuple[int, ...]:
    """Indices (fastest first) of the options on the lower convex hull of (time, cost)."""
    hull: list[int] = []
    for i, o in enumerate(options):
        while len(hull) >= 2:
            a, b = options[hull[-2]], options[hull[-1]]
            cross = (b.time_s - a.time_s) * (o.cost_j - a.cost_j) - (b.cost_j - a.cost_j) * (o.time_s - a.time_s)
            if cross <= 0:  # b lies on or above the segment a-o
                hull.pop()
            else:
                break
        hull.append(i)
    return tuple(hull)


# -- LP backends ---------------------------------------------------------------------
class _LpBackend:
    """min c.x  s.t.  row_lo <= A x <= row_up,  col_lo <= x <= col_up (A in CSC arrays)."""

    def set_col_bounds(self, cols: Sequence[int], lo: Sequence[float], up: Sequence[float]) -> None:
        raise NotImplementedError

    def set_costs(self, cols: Sequence[int], costs: Sequence[float]) -> None:
        raise NotImplementedError

    def solve(self) -> tuple[bool, Any, float]:
        raise NotImplementedError


class _HighsBackend(_LpBackend):
    def __init__(self, np, highspy, c, start, index, value, row_lo, row_up, col_lo, col_up, integer=None,
                 time_limit_s=None, mip_rel_gap=None):
        self.np, self.highspy = np, highspy
        h = highspy.Highs()
        h.setOptionValue("output_flag", False)
        if time_limit_s is not None:
            h.setOptionValue("time_limit", float(time_limit_s))
        if mip_rel_gap is not None:
            h.setOptionValue("mip_rel_gap", float(mip_rel_gap))
        lp = highspy.HighsLp()
        lp.num_col_ = len(c)
        lp.num_row_ = len(row_lo)
        lp.col_cost_ = c
        lp.col_lower_ = col_lo
        lp.col_upper_ = col_up
        lp.row_lower_ = row_lo
        lp.row_upper_ = row_up
        lp.a_matrix_.format_ = highspy.MatrixFormat.kColwise
        lp.a_matrix_.start_ = start
        lp.a_matrix_.index_ = index
        lp.a_matrix_.value_ = value
        if integer is not None:
            kint, kcont = highspy.HighsVarType.kInteger, highspy.HighsVarType.kContinuous
            lp.integrality_ = [kint if i else kcont for i in integer]
        h.passModel(lp)
        self.h = h
        self.mip_gap = None

    def set_col_bounds(self, cols, lo, up):
        np = self.np
        self.h.changeColsBounds(len(cols), np.asarray(cols, dtype=np.int32), np.asarray(lo, float), np.asarray(up, float))

    def set_costs(self, cols, costs):
        np = self.np
        self.h.changeColsCost(len(cols), np.asarray(cols, dtype=np.int32), np.asarray(costs, float))

    def solve(self):
        h = self.h
        h.run()
        status = h.getModelStatus()
        ms = self.highspy.HighsModelStatus
        sol = h.getSolution()
        info = h.getInfo()
        ok = status == ms.kOptimal
        self.status = h.modelStatusToString(status)
        if not ok and status in (ms.kTimeLimit, ms.kInterrupt) and sol.value_valid:
            ok = True  # MILP: best incumbent within the time limit
        self.mip_gap = getattr(info, "mip_gap", None)
        self.optimal = status == ms.kOptimal
        self.mip_dual_bound = getattr(info, "mip_dual_bound", None)
        return ok, self.np.asarray(sol.col_value), info.objective_function_value


class _ScipyBackend(_LpBackend):
    """scipy.optimize.linprog / milp with method HiGHS: no warm start, re-solved each time."""

    def __init__(self, np, c, start, index, value, row_lo, row_up, col_lo, col_up, integer=None,
                 time_limit_s=None, mip_rel_gap=None):
        import scipy.sparse as sp

        self.np = np
        self.c = np.array(c, float)
        self.A = sp.csc_matrix((value, index, start), shape=(len(row_lo), len(c))).tocsr()
        self.row_lo, self.row_up = np.asarray(row_lo, float), np.asarray(row_up, float)
        self.col_lo, self.col_up = np.array(col_lo, float), np.array(col_up, float)
        self.integer = integer
        self.time_limit_s, self.mip_rel_gap = time_limit_s, mip_rel_gap
        self.mip_gap = None
        self.optimal = False

    def set_col_bounds(self, cols, lo, up):
        self.col_lo[list(cols)] = lo
        self.col_up[list(cols)] = up

    def set_costs(self, cols, costs):
        self.c[list(cols)] = costs

    def solve(self):
        np = self.np
        from scipy.optimize import Bounds, LinearConstraint, linprog, milp

        if self.integer is not None:
            options = {}
            if self.time_limit_s is not None:
                options["time_limit"] = float(self.time_limit_s)
            if self.mip_rel_gap is not None:
                options["mip_rel_gap"] = float(self.mip_rel_gap)
            res = milp(self.c, constraints=LinearConstraint(self.A, self.row_lo, self.row_up),
                       integrality=np.asarray(self.integer, dtype=int), bounds=Bounds(self.col_lo, self.col_up),
                       options=options)
            self.optimal = res.status == 0
            self.status = res.message
            self.mip_gap = getattr(res, "mip_gap", None)
            self.mip_dual_bound = getattr(res, "mip_dual_bound", None)
            ok = res.x is not None
            return ok, (res.x if ok else None), (float(res.fun) if ok else math.inf)
        import scipy.sparse as sp

        ge = np.isfinite(self.row_lo)
        le = np.isfinite(self.row_up)
        a_ub = sp.vstack([-self.A[ge], self.A[le]]).tocsr()
        b_ub = np.concatenate([-self.row_lo[ge], self.row_up[le]])
        res = linprog(self.c, A_ub=a_ub, b_ub=b_ub, bounds=np.column_stack([self.col_lo, self.col_up]),
                      method="highs")
        self.optimal = res.status == 0
        self.status = res.message
        return res.status == 0, res.x, (float(res.fun) if res.status == 0 else math.inf)


def _lp_backend(*args, **kwargs) -> _LpBackend:
    try:
        import numpy as np
    except ImportError:
        np = None
    if np is not None:
        try:
            import highspy

            return _HighsBackend(np, highspy, *args, **kwargs)
        except ImportError:
            pass
        try:
            import scipy.optimize  # noqa: F401

            return _ScipyBackend(np, *args, **kwargs)
        except ImportError:
            pass
    raise SolverUnavailable(
        "the optimal planner needs an LP solver: pip install highspy (or scipy); "
        "the EnvPipe plan types (baseline, uniform, envelope) need nothing"
    )


class _Rows:
    """Sparse constraint rows ``lo <= sum(coef * x[col]) <= up``, gathered as triplets."""

    def __init__(self) -> None:
        self.rows: list[int] = []
        self.cols: list[int] = []
        self.vals: list[float] = []
        self.lo: list[float] = []
        self.up: list[float] = []

    def add(self, terms: Sequence[tuple[int, float]], lo: float, up: float) -> None:
        r = len(self.lo)
        for col, coef in terms:
            self.rows.append(r)
            self.cols.append(col)
            self.vals.append(coef)
        self.lo.append(lo)
        self.up.append(up)

    def add_schedule(self, preds, t_col: int, duration, unit_rows=None) -> None:
        """The iteration DAG over end-time columns ``0..n-1`` and the makespan column ``t_col``.

        ``end_v - duration_v - end_u >= latency`` for every edge ``u -> v`` (a
        unit without predecessors starts at 0) and ``end_v <= T`` for every
        sink. ``duration(v)`` gives ``(terms, seconds)``: the unit's duration
        is the terms' sum plus a constant. ``unit_rows(v)``, if given, adds a
        unit's own rows right after its edges.
        """
        n = len(preds)
        has_succ = [False] * n
        for v in range(n):
            terms, const_s = duration(v)
            minus = [(col, -coef) for col, coef in terms]
            for u, lat in preds[v] or ((-1, 0.0),):
                row = [(v, 1.0), *minus]
                if u >= 0:
                    row.append((u, -1.0))
                    has_succ[u] = True
                self.add(row, lat + const_s, math.inf)
            if unit_rows is not None:
                unit_rows(v)
        for v in range(n):
            if not has_succ[v]:
                self.add([(v, 1.0), (t_col, -1.0)], -math.inf, 0.0)

    def csc(self, np, num_cols: int):
        return _csc(np, self.rows, self.cols, self.vals, num_cols)


def _csc(np, triplets_rows, triplets_cols, triplets_vals, num_cols):
    rows = np.asarray(triplets_rows, dtype=np.int32)
    cols = np.asarray(triplets_cols, dtype=np.int32)
    vals = np.asarray(triplets_vals, dtype=float)
    order = np.lexsort((rows, cols))
    rows, cols, vals = rows[order], cols[order], vals[order]
    start = np.zeros(num_cols + 1, dtype=np.int32)
    np.cumsum(np.bincount(cols, minlength=num_cols), out=start[1:])
    return start, rows, vals


# -- the model -----------------------------------------------------------------------
@dataclass
class Solution:
    """One plan for one deadline: option index per unit, its clocks and its score."""

    option_index: list[int]
    freqs_mhz: list[int]
    timeline: Timeline
    score: PlanScore
    deadline_s: float
    lp_bound_j: float  # LP relaxation: no plan meeting the deadline costs less
    lp_time_s: float  # the LP's makespan
    stats: dict[str, Any]


class TimeEnergyModel:
    """One schedule on one profile: the DAG, each unit's clock options, the LP and the rounding.

    ``freqs`` everywhere are flat lists aligned with ``graph.nodes``, like
    :class:`~megatron_envpipe.core.timeline.PlanEvaluator`.
    """

    def __init__(
        self,
        schedule: Schedule,
        profile: Profile,
        candidates_mhz: Sequence[int],
        p2p_power_w: float,
        p2p_latency_s: float = 0.0,
        extra_dependencies: Sequence[Dependency] = (),
    ) -> None:
        self.schedule = schedule
        self.profile = profile
        self.p2p_power_w = p2p_power_w
        self.evaluator = PlanEvaluator(schedule, profile, p2p_power_w, p2p_latency_s, extra_dependencies)
        graph = self.graph = self.evaluator.graph
        n = self.n = len(graph.nodes)
        self.num_stages = schedule.num_stages
        by_key: dict[tuple[int, str], tuple[ClockOption, ...]] = {}
        for s in range(schedule.num_stages):
            for ins in ("forward", "backward"):
                opts = clock_options(profile.points(s, ins), p2p_power_w, candidates_mhz)
                if not opts:
                    raise PlannerError(f"{profile.source}: stage {s} {ins} has no clock among the candidates")
                by_key[(s, ins)] = opts
        self.options_by_key = by_key
        keys = list(zip(graph.stage_of, graph.instruction_of))
        self.keys = keys
        self.options = [by_key[k] for k in keys]
        times = {k: [o.time_s for o in v] for k, v in by_key.items()}
        costs = {k: [o.cost_j for o in v] for k, v in by_key.items()}
        self.times = [times[k] for k in keys]
        self.costs = [costs[k] for k in keys]
        self.preds = graph.preds
        self.succs: list[list[tuple[int, float]]] = [[] for _ in range(n)]
        for v in range(n):
            for u, lat in graph.preds[v]:
                self.succs[u].append((v, lat))
        self.order = list(graph.order)
        self.rorder = self.order[::-1]
        self._lp = None
        self._hull_times: list[list[float]] | None = None

    # -- basic evaluation ------------------------------------------------------------
    def durations(self, idx: Sequence[int]) -> list[float]:
        times = self.times
        return [times[v][k] for v, k in enumerate(idx)]

    def cost(self, idx: Sequence[int]) -> float:
        costs = self.costs
        return sum(costs[v][k] for v, k in enumerate(idx))

    def freqs(self, idx: Sequence[int]) -> list[int]:
        return [self.options[v][k].freq_mhz for v, k in enumerate(idx)]

    def makespan(self, idx: Sequence[int]) -> float:
        return self.graph.simulate(self.durations(idx)).iteration_time_s

    def fastest_time_s(self) -> float:
        """Every unit at its fastest clock: no plan of this schedule is faster."""
        return self.makespan([0] * self.n)

    def slowest_time_s(self) -> float:
        """Every unit at its cheapest clock."""
        return self.makespan([len(t) - 1 for t in self.times])

    # -- the LP ----------------------------------------------------------------------
    def _build_lp(self) -> None:
        n = self.n
        hulls = {k: lower_hull(v) for k, v in self.options_by_key.items()}
        self.hulls = [hulls[k] for k in self.keys]
        cost = [0.0] * (n + 1)
        col_lo = [0.0] * (n + 1)
        col_up = [math.inf] * (n + 1)
        self.t_col = n
        seg_cols: list[range] = []
        self.base_cost = 0.0
        for v in range(n):
            opts, hull = self.options[v], self.hulls[v]
            self.base_cost += opts[hull[0]].cost_j
            first = len(cost)
            for a, b in zip(hull, hull[1:]):
                oa, ob = opts[a], opts[b]
                length = ob.time_s - oa.time_s
                cost.append((ob.cost_j - oa.cost_j) / length)
                col_lo.append(0.0)
                col_up.append(length)
            seg_cols.append(range(first, len(cost)))
        # Duration: the fastest hull point's time plus the segments used.
        rows = _Rows()
        rows.add_schedule(self.preds, self.t_col, lambda v: ([(j, 1.0) for j in seg_cols[v]],
                                                              self.options[v][self.hulls[v][0]].time_s))
        try:
            import numpy as np
        except ImportError:
            _lp_backend()  # raises SolverUnavailable with the install hint
            raise
        start, index, value = rows.csc(np, len(cost))
        self.seg_cols = seg_cols
        self._lp = _lp_backend(
            np.asarray(cost, float), start, index, value, np.asarray(rows.lo, float), np.asarray(rows.up, float),
            np.asarray(col_lo, float), np.asarray(col_up, float),
        )

    def solve_lp(self, deadline_s: float, time_weight: float) -> tuple[list[float], float, float]:
        """The LP relaxation: (durations, makespan T, objective = sum hull cost + time_weight * T).

        ``time_weight`` = ``P_p2p * P`` minimises energy at the plan's own makespan;
        0 minimises energy padded to the deadline.
        """
        if self._lp is None:
            self._build_lp()
        lp = self._lp
        lp.set_col_bounds([self.t_col], [0.0], [deadline_s])
        lp.set_costs([self.t_col], [time_weight])
        ok, x, obj = lp.solve()
        if not ok:
            raise InfeasibleDeadline(
                f"no plan meets an iteration time of {deadline_s:.6g} s (LP: {getattr(lp, 'status', 'infeasible')}); "
                f"the fastest plan takes {self.fastest_time_s():.6g} s"
            )
        durations = []
        for v in range(self.n):
            d = self.options[v][self.hulls[v][0]].time_s
            for j in self.seg_cols[v]:
                d += float(x[j])
            durations.append(d)
        return durations, float(x[self.t_col]), float(obj) + self.base_cost

    # -- slack passes ------------------------------------------------------------------
    def _latest_finish(self, d: Sequence[float], deadline: float) -> list[float]:
        lf = [deadline] * self.n
        succs = self.succs
        for v in self.rorder:
            m = deadline
            for w, lat in succs[v]:
                t = lf[w] - d[w] - lat
                if t < m:
                    m = t
            lf[v] = m
        return lf

    def _earliest_start(self, d: Sequence[float]) -> list[float]:
        es = [0.0] * self.n
        preds = self.preds
        for v in self.order:
            m = 0.0
            for u, lat in preds[v]:
                t = es[u] + d[u] + lat
                if t > m:
                    m = t
            es[v] = m
        return es

    def _hull_lists(self) -> tuple[list[list[float]], list[tuple[int, ...]]]:
        """Per unit: the times of its hull options and their option indices."""
        if self._hull_times is None:
            if self._lp is None:
                self._build_lp()
            self._hull_times = [[self.options[v][i].time_s for i in self.hulls[v]] for v in range(self.n)]
        return self._hull_times, self.hulls

    def _forward_pass(self, idx: list[int], d_target: Sequence[float], deadline: float,
                      hull_only: bool = False) -> list[int]:
        """Topological order: each unit takes the slowest option that finishes by its latest finish.

        ``hull_only``: only the LP's hull vertices (the first rounding: a unit
        that rounds down leaves its successors the time to round up to the
        next vertex instead of spending it on small steps in between).
        """
        lf = self._latest_finish(d_target, deadline)
        eps = FEASIBILITY_RTOL * deadline
        end = [0.0] * self.n
        out = list(idx)
        preds, times = self.preds, self.times
        hull_times, hull_idx = self._hull_lists() if hull_only else (times, None)
        for v in self.order:
            st = 0.0
            for u, lat in preds[v]:
                t = end[u] + lat
                if t > st:
                    st = t
            ts = hull_times[v]
            k = bisect.bisect_right(ts, lf[v] - st + eps) - 1
            if k < 0:
                k = 0
            out[v] = hull_idx[v][k] if hull_only else k
            end[v] = st + ts[k]
        return out

    def _backward_pass(self, idx: list[int], d_target: Sequence[float], deadline: float,
                       hull_only: bool = False) -> list[int]:
        """Reverse topological order: each unit takes the slowest option that starts after its earliest start."""
        es = self._earliest_start(d_target)
        eps = FEASIBILITY_RTOL * deadline
        start = [deadline] * self.n
        out = list(idx)
        succs, times = self.succs, self.times
        hull_times, hull_idx = self._hull_lists() if hull_only else (times, None)
        for v in self.rorder:
            le = deadline
            for w, lat in succs[v]:
                t = start[w] - lat
                if t < le:
                    le = t
            ts = hull_times[v]
            k = bisect.bisect_right(ts, le - es[v] + eps) - 1
            if k < 0:
                k = 0
            out[v] = hull_idx[v][k] if hull_only else k
            start[v] = le - ts[k]
        return out

    def _settle(self, idx: list[int], deadline: float, first: str = "f", max_passes: int = 6) -> list[int]:
        """Alternate forward/backward slow-down passes until the cost stops falling."""
        best_idx, best = idx, self.cost(idx)
        cur = idx
        for i in range(max_passes):
            fwd = (i % 2 == 0) == (first == "f")
            d = self.durations(cur)
            cur = self._forward_pass(cur, d, deadline) if fwd else self._backward_pass(cur, d, deadline)
            c = self.cost(cur)
            if c < best - 1e-12 * abs(best):
                best_idx, best = cur, c
            elif i >= 1:
                break
        return best_idx

    def _dithered(self, d_lp: Sequence[float], deadline: float) -> list[float]:
        """LP durations rounded onto hull vertices by error diffusion along each stage.

        Per (stage, instruction), in execution order, the fractions of the way
        from the faster to the slower vertex are accumulated and a unit rounds
        up whenever the sum reaches 1/2: identical units whose LP duration sits
        between two far-apart vertices alternate between them in the LP's
        proportion, instead of all rounding down. (Not feasible by itself: used
        as the target durations of a rounding pass.)
        """
        hull_times, _ = self._hull_lists()
        stage_of, ins_of = self.graph.stage_of, self.graph.instruction_of
        acc: dict[tuple[int, str], float] = {}
        out = []
        for v in range(self.n):  # graph nodes are stage by stage, in execution order
            ts, d = hull_times[v], d_lp[v]
            k = max(0, bisect.bisect_right(ts, d + FEASIBILITY_RTOL * deadline) - 1)
            frac = (d - ts[k]) / (ts[k + 1] - ts[k]) if k + 1 < len(ts) and d > ts[k] else 0.0
            key = (stage_of[v], ins_of[v])
            a = acc.get(key, 0.0) + frac
            if a >= 0.5 and k + 1 < len(ts):
                k += 1
                a -= 1.0
            acc[key] = a
            out.append(ts[k])
        return out

    def _round(self, d_lp: Sequence[float], deadline: float) -> list[int]:
        """LP durations -> real options: the best of six roundings, each settled.

        Forward-first and backward-first passes onto the hull's vertices or
        onto every option, with the LP's durations as targets; and forward
        passes with the dithered durations (:meth:`_dithered`) as targets.
        """
        zero = [0] * self.n
        dithered = self._dithered(d_lp, deadline)
        candidates = (
            (d_lp, "f", True), (d_lp, "b", True), (d_lp, "f", False), (d_lp, "b", False),
            (dithered, "f", True), (dithered, "f", False),
        )
        best, best_cost = None, math.inf
        for target, direction, hull_only in candidates:
            if direction == "f":
                cand = self._settle(self._forward_pass(zero, target, deadline, hull_only), deadline, first="b")
            else:
                cand = self._settle(self._backward_pass(zero, target, deadline, hull_only), deadline, first="f")
            c = self.cost(cand)
            if c < best_cost - 1e-12 * abs(c):
                best, best_cost = cand, c
        return best

    def _local_search(self, idx: list[int], deadline: float, max_trials: int) -> tuple[list[int], int, int]:
        """Speed one unit up by 1-3 clock steps, settle, keep the move if the plan got cheaper.

        Candidates are visited round-robin, tightest slack first (ties: the
        cheapest speed-up per second), so every unit gets a turn before any
        gets a second; stops after a full round without improvement or after
        ``max_trials`` settles (a count, not a clock: the result is reproducible).
        """
        cur, cur_cost = list(idx), self.cost(idx)
        trials = accepted = 0
        since_improvement = 0
        d = self.durations(cur)
        es, lf = self._earliest_start(d), self._latest_finish(d, deadline)
        queue = sorted(
            (v for v in range(self.n) if cur[v] > 0),
            key=lambda v: (lf[v] - es[v] - d[v], self._marginal(v, cur[v]), v),
        )
        pos = 0
        while trials < max_trials and queue and since_improvement < len(queue):
            v = queue[pos % len(queue)]
            pos += 1
            since_improvement += 1
            if cur[v] == 0:
                continue
            for steps in range(1, min(3, cur[v]) + 1):
                if trials >= max_trials:
                    break
                trials += 1
                trial = list(cur)
                trial[v] -= steps
                trial = self._settle(trial, deadline, first="f", max_passes=4)
                c = self.cost(trial)
                if c < cur_cost - 1e-9 * abs(cur_cost):
                    cur, cur_cost = trial, c
                    accepted += 1
                    since_improvement = 0
                    break
        return cur, trials, accepted

    def _neighbours(self, window: int) -> list[list[int]]:
        """Per unit: the units within ``window`` places on its stage, and its cross-stage neighbours."""
        if getattr(self, "_nbrs_window", None) != window:
            rows: dict[int, list[int]] = {}
            for v, s in enumerate(self.graph.stage_of):
                rows.setdefault(s, []).append(v)  # graph.nodes are stage by stage, in order
            pos = {}
            for s, row in rows.items():
                for i, v in enumerate(row):
                    pos[v] = (s, i)
            nbrs = []
            for v in range(self.n):
                s, i = pos[v]
                row = rows[s]
                near = [row[j] for j in range(max(0, i - window), min(len(row), i + window + 1)) if j != i]
                near += [u for u, _ in self.graph.cross_preds[v]] + [w for w, _ in self.succs[v] if pos[w][0] != s]
                nbrs.append(sorted(set(near)))
            self._nbrs, self._nbrs_window = nbrs, window
        return self._nbrs

    def _search(self, idx: list[int], deadline: float, max_checks: int, window: int, propose
                ) -> tuple[list[int], int, int]:
        """Rounds of local moves: ``propose`` lists candidates, the best are checked by simulation, then settle.

        ``propose(cur, slack, nbrs, eps)`` gets the current option indices, each
        unit's slack (latest finish - earliest start - duration) and the
        neighbour lists, and returns moves for :meth:`_apply_moves`.
        """
        cur = list(idx)
        limit = deadline * (1 + FEASIBILITY_RTOL)
        eps = FEASIBILITY_RTOL * deadline
        checks = accepted = 0
        nbrs = self._neighbours(window)
        for _round in range(MAX_SEARCH_ROUNDS):
            if checks >= max_checks:
                break
            d = self.durations(cur)
            es, lf = self._earliest_start(d), self._latest_finish(d, deadline)
            slack = [max(0.0, lf[v] - es[v] - d[v]) for v in range(self.n)]
            cands = propose(cur, slack, nbrs, eps)
            cur, n_checks, n_moves, moved = self._apply_moves(cur, cands, limit, max_checks - checks)
            checks += n_checks
            accepted += n_moves
            if not moved:
                break
            cur = self._settle(cur, deadline, first="f", max_passes=4)
        return cur, checks, accepted

    def _pair_search(self, idx: list[int], deadline: float, max_checks: int, window: int = 4
                     ) -> tuple[list[int], int, int]:
        """Speed one unit up by 1-3 steps and slow one neighbour down as far as the time allows.

        Like :meth:`_exchange_search` from the other side: for every speed-up,
        each neighbour's slowest option that fits in its slack plus the time
        freed; candidates checked best first by simulation, several per round.
        """
        return self._search(idx, deadline, max_checks, window, self._pair_moves)

    def _pair_moves(self, cur, slack, nbrs, eps):
        times, costs = self.times, self.costs
        cands = []
        for u in range(self.n):
            ku = cur[u]
            tu, cu = times[u], costs[u]
            for k in range(1, min(3, ku) + 1):
                freed = tu[ku] - tu[ku - k]
                extra = cu[ku - k] - cu[ku]
                for w in nbrs[u]:
                    kw, tw = cur[w], times[w]
                    if kw + 1 >= len(tw):
                        continue
                    room = freed + slack[w]
                    j = bisect.bisect_right(tw, tw[kw] + room + eps) - 1
                    if j > kw:
                        gain = extra + costs[w][j] - costs[w][kw]
                        if gain < -1e-9:
                            cands.append((gain, w, j, ((u, k),)))
        return cands

    def _apply_moves(self, cur, cands, limit, max_checks):
        """Try candidate moves ``(gain, w, new option of w, ((u, steps faster), ...))`` best first."""
        cands.sort()
        touched: set[int] = set()
        checks = accepted = failures = 0
        for _gain, w, j, used in cands:
            if checks >= max_checks or failures >= MAX_FAILED_CHECKS:
                break
            if w in touched or any(u in touched for u, _ in used):
                continue
            trial = list(cur)
            trial[w] = j
            for u, k in used:
                trial[u] -= k
            checks += 1
            if self.graph.simulate(self.durations(trial)).iteration_time_s <= limit:
                cur = trial
                touched.add(w)
                touched.update(u for u, _ in used)
                accepted += 1
                failures = 0
            else:
                failures += 1
        return cur, checks, accepted, accepted > 0

    def _exchange_search(self, idx: list[int], deadline: float, max_checks: int, window: int = 3
                         ) -> tuple[list[int], int, int]:
        """Exchange time between neighbours: slow one unit down, speed up to three neighbours.

        For a unit ``w`` and each slower option, the time it lacks beyond its own
        slack is bought from its neighbours (same stage within ``window``
        places, and its cross-stage producers and consumers), cheapest energy
        per second first. Costs are separable, so every candidate's gain is
        known up front; candidates are checked best first by simulating the
        iteration, several per round (those touching a unit already moved wait
        for the next round), then the plan is settled again.
        """
        return self._search(idx, deadline, max_checks, window, self._exchange_moves)

    def _exchange_moves(self, cur, slack, nbrs, eps):
        times, costs = self.times, self.costs
        cands = []
        for w in range(self.n):
            kw, tw, cw = cur[w], times[w], costs[w]
            if kw + 1 >= len(tw):
                continue
            slack_w = slack[w]
            # Speed-up offers of the neighbours: (energy per second, unit, steps, seconds, energy).
            offers = []
            for u in nbrs[w]:
                ku = cur[u]
                for k in range(1, min(3, ku) + 1):
                    freed = times[u][ku] - times[u][ku - k]
                    if freed > 0:
                        extra = costs[u][ku - k] - costs[u][ku]
                        offers.append((extra / freed, u, k, freed, extra))
            if not offers:
                continue
            # One neighbour covering it all: by seconds freed, with the cheapest from there on.
            by_freed = sorted(offers, key=lambda o: (o[3], o[4]))
            freed_keys = [o[3] for o in by_freed]
            suffix: list[tuple[float, int, int]] = [None] * len(by_freed)  # type: ignore[list-item]
            best = None
            for i in range(len(by_freed) - 1, -1, -1):
                o = by_freed[i]
                if best is None or o[4] < best[0]:
                    best = (o[4], o[1], o[2])
                suffix[i] = best
            # Up to three neighbours, cheapest energy per second first (prefix sums).
            offers.sort()
            chosen: list[tuple[int, int]] = []
            got_prefix: list[float] = []
            spent_prefix: list[float] = []
            got = spent = 0.0
            for _, u, k, freed, extra in offers:
                if any(u == c for c, _ in chosen):
                    continue
                chosen.append((u, k))
                got += freed
                spent += extra
                got_prefix.append(got)
                spent_prefix.append(spent)
                if len(chosen) == 3:
                    break
            most = max(got_prefix[-1], freed_keys[-1])
            for j in range(kw + 1, len(tw)):
                need = tw[j] - tw[kw] - slack_w
                if need > most + eps:
                    break
                if need <= eps:
                    continue  # a plain slow-down: the settle passes take those
                saving = cw[kw] - cw[j]
                i = bisect.bisect_left(freed_keys, need - eps)
                if i < len(by_freed) and suffix[i][0] < saving - 1e-9:
                    extra, u, k = suffix[i]
                    cands.append((extra - saving, w, j, ((u, k),)))
                i = bisect.bisect_left(got_prefix, need - eps)
                if 0 < i < len(got_prefix) and spent_prefix[i] < saving - 1e-9:
                    cands.append((spent_prefix[i] - saving, w, j, tuple(sorted(chosen[: i + 1]))))
        return cands

    def _marginal(self, v: int, k: int) -> float:
        """Energy per second saved by moving unit v from option k to k-1."""
        ts, cs = self.times[v], self.costs[v]
        dt = ts[k] - ts[k - 1]
        return (cs[k - 1] - cs[k]) / dt if dt > 0 else math.inf

    def _repair(self, idx: list[int], deadline: float) -> tuple[list[int], int]:
        """Raise clocks on the simulated critical path until the deadline holds."""
        steps = 0
        limit = deadline * (1 + FEASIBILITY_RTOL)
        while True:
            tl = self.graph.simulate(self.durations(idx))
            if tl.iteration_time_s <= limit:
                return idx, steps
            cands = [v for v in tl.critical_path() if idx[v] > 0]
            if not cands:
                raise InfeasibleDeadline(
                    f"no plan meets an iteration time of {deadline:.6g} s: the critical path already runs "
                    f"at the fastest clocks ({tl.iteration_time_s:.6g} s)"
                )
            v = min(cands, key=lambda u: (self._marginal(u, idx[u]), u))
            idx = list(idx)
            idx[v] -= 1
            steps += 1

    # -- the whole method ----------------------------------------------------------------
    def check_deadline(self, deadline_s: float) -> float:
        fastest = self.fastest_time_s()
        if not deadline_s >= fastest * (1 - FEASIBILITY_RTOL):
            raise InfeasibleDeadline(
                f"an iteration time of {deadline_s:.6g} s is infeasible: with every unit at its fastest clock "
                f"this {self.schedule.name} schedule takes {fastest:.6g} s "
                f"({100 * (deadline_s / fastest - 1):+.2f} %)"
            )
        return fastest

    def solve(self, deadline_s: float, padded: bool = False, search_work: int = DEFAULT_SEARCH_WORK) -> Solution:
        """Minimum-energy plan finishing by ``deadline_s``.

        ``padded=False``: energy at the plan's own makespan (a plan may finish
        early when the energy valley is faster than the deadline).
        ``padded=True``: energy counted until the deadline (the GPUs block at
        P2P power until then, e.g. when a straggler sets the pace): only the
        effective energy matters, slower is never worse.
        """
        fastest = self.check_deadline(deadline_s)
        deadline_s = max(deadline_s, fastest)
        weight = 0.0 if padded else self.p2p_power_w * self.num_stages
        d_lp, t_lp, obj = self.solve_lp(deadline_s, weight)
        lp_bound = obj + (self.p2p_power_w * self.num_stages * deadline_s if padded else 0.0)
        target = deadline_s if padded else min(deadline_s, max(t_lp, fastest))
        idx = self._round(d_lp, target)
        n = max(1, self.n)
        idx, n_trials, n_accepted = self._local_search(idx, target, max(MIN_SEARCH_TRIALS, search_work // (8 * n)))
        idx, n_checks, n_pairs = self._pair_search(idx, target, max(MIN_SEARCH_TRIALS, search_work // (4 * n)))
        idx, n_checks2, n_pairs2 = self._exchange_search(idx, target, max(MIN_SEARCH_TRIALS, search_work // (4 * n)))
        n_checks += n_checks2
        n_pairs += n_pairs2
        idx, repairs = self._repair(idx, target)
        if repairs:
            idx = self._settle(idx, target)
        freqs = self.freqs(idx)
        timeline = self.evaluator.simulate(freqs)
        score = self.evaluator.score(freqs, timeline)
        return Solution(
            option_index=idx,
            freqs_mhz=freqs,
            timeline=timeline,
            score=score,
            deadline_s=deadline_s,
            lp_bound_j=lp_bound,
            lp_time_s=t_lp,
            stats={"search_trials": n_trials, "search_accepted": n_accepted, "exchange_checks": n_checks,
                   "exchange_moves": n_pairs, "repairs": repairs},
        )


# -- schedules and the planner entry point ---------------------------------------------------
def extra_warmup_candidates(
    profile: Profile,
    num_microbatches: int,
    f_max: int,
    valley_mhz: Sequence[int],
    max_inflight: int | tuple[int | None, ...] | None = None,
) -> list[tuple[str, tuple[int, ...]]]:
    """Clamped extra warm-up vectors worth trying for ``ours``, deduplicated, in a fixed order.

    ``f_max``: the 1F1B bubble before a stage's first backward filled with
    forwards at the maximum clock; ``valley``: EnvPipe's own r_s (forwards at
    the energy-valley clock); ``1.5x``: half as many again (long pipelines,
    many micro-batches). All are clamped by the activation budget.
    """
    p = profile.num_stages
    tb = [profile.time_s(s, "backward", f_max) for s in range(p)]
    raw_fmax = raw_extra_warmup(p, tb, [profile.time_s(s, "forward", f_max) for s in range(p)])
    raw_valley = raw_extra_warmup(p, tb, [profile.time_s(s, "forward", valley_mhz[s]) for s in range(p)])
    raws = [
        ("f_max", raw_fmax),
        ("valley", raw_valley),
        ("1.5x", [int(math.ceil(1.5 * r)) for r in raw_fmax]),
    ]
    out: list[tuple[str, tuple[int, ...]]] = []
    seen: set[tuple[int, ...]] = set()
    for label, raw in raws:
        r = clamp_extra_warmup(p, num_microbatches, raw, max_inflight)
        if r not in seen:
            seen.add(r)
            out.append((label, r))
    return out


@dataclass
class _Setup(PlanningBasis):
    """The basis of every optimal plan of one (profile, M, config), and the schedules worth trying."""

    schedules: list[tuple[str, Schedule]]


def _setup(profile: Profile, num_microbatches: int, config: PlannerConfig, num_stages: int | None) -> _Setup:
    config.validate()
    basis = planning_basis(profile, num_microbatches, config, num_stages)
    p = basis.num_stages
    if config.scheduling == "ours":
        try:
            if config.extra_warmup is not None:
                warmups = [("given", clamp_extra_warmup(p, num_microbatches, list(config.extra_warmup),
                                                        config.max_inflight))]
            else:
                warmups = extra_warmup_candidates(profile, num_microbatches, basis.f_max_mhz, basis.valley_mhz,
                                                  config.max_inflight)
        except ScheduleError as exc:
            raise PlannerError(str(exc)) from None
        schedules = [(label, build_schedule("ours", p, num_microbatches, r)) for label, r in warmups]
    else:
        schedules = [("1f1b", basis.baseline_plan.schedule)]
    return _Setup(**vars(basis), schedules=schedules)


def _rank_schedules(setup: _Setup, profile: Profile, config: PlannerConfig, deadline: float, padded: bool):
    """Models of the candidate schedules that can meet ``deadline``, best LP bound first."""
    ranked = []
    skipped = []
    for label, schedule in setup.schedules:
        model = TimeEnergyModel(schedule, profile, setup.candidates_mhz, setup.p2p_power_w, config.p2p_latency_s,
                                config.dependencies(schedule))
        fastest = model.fastest_time_s()
        if fastest > deadline * (1 + FEASIBILITY_RTOL):
            skipped.append((fastest, len(skipped), label, schedule))
            continue
        _, _, bound = model.solve_lp(deadline, 0.0 if padded else setup.p2p_power_w * setup.num_stages)
        ranked.append((bound, len(ranked), label, schedule, model))
    if not ranked:
        fastest, _, label, schedule = min(skipped)
        what = (
            "1F1B at f_max" if schedule.name == "1f1b"
            else f"{schedule.name} (extra warm-up {list(schedule.extra_warmup)}) at f_max"
        )
        raise InfeasibleDeadline(
            f"an iteration time of {deadline:.6g} s is infeasible: even with every unit at its fastest clock, "
            f"{what} takes {fastest:.6g} s; allow more with --max-slowdown or a later --target-time"
        )
    ranked.sort(key=lambda x: (x[0], x[1]))
    return ranked


def plan_optimal(
    profile: Profile,
    num_microbatches: int,
    config: PlannerConfig,
    num_stages: int | None = None,
) -> PlanResult:
    """The minimum-energy plan meeting ``(1 + max_slowdown) x`` 1F1B-at-f_max's iteration time.

    With ``config.target_time_s`` the deadline is that time instead and the
    energy is counted until it (faster plans block at P2P power until then).
    ``scheduling='ours'`` tries a few extra warm-up vectors (unless
    ``extra_warmup`` is given), ranks them by their LP bound and keeps the
    best plan. Raises :class:`InfeasibleDeadline` for a deadline faster than
    every unit at its fastest clock.
    """
    t0 = time.perf_counter()
    setup = _setup(profile, num_microbatches, config, num_stages)
    p, p2p, f_max = setup.num_stages, setup.p2p_power_w, setup.f_max_mhz
    warnings = list(setup.warnings)
    baseline_score = setup.baseline
    padded = config.target_time_s is not None
    deadline = (
        float(config.target_time_s) if padded
        else baseline_score.iteration_time_s * (1.0 + config.max_slowdown)
    )
    ranked = _rank_schedules(setup, profile, config, deadline, padded)
    best_bound = ranked[0][0]
    best = None
    # Round the best-ranked schedule, and (small problems) a runner-up whose bound is within 0.2 %.
    for bound, _, label, schedule, model in ranked[: 2 if ranked[0][4].n <= 800 else 1]:
        if best is not None and bound > best_bound * 1.002:
            break
        sol = model.solve(deadline, padded=padded)
        energy = sol.score.energy_j + (p2p * p * (deadline - sol.score.iteration_time_s) if padded else 0.0)
        if best is None or energy < best[0] - 1e-9 * abs(energy):
            best = (energy, label, schedule, model, sol)
    energy, label, schedule, model, sol = best
    plan = FrequencyPlan.from_flat(schedule, sol.freqs_mhz)
    score = sol.score
    gap = energy / sol.lp_bound_j - 1.0 if sol.lp_bound_j > 0 else 0.0
    details: dict[str, Any] = {
        "method": "lp+rounding",
        "lp_bound_j": sol.lp_bound_j,
        "gap_to_lp_bound": gap,
        "padded_to_deadline": padded,
        "extra_warmup_tried": (
            {lab: list(s.extra_warmup) for lab, s in setup.schedules} if config.scheduling == "ours" else {}
        ),
        "extra_warmup_chosen": label if config.scheduling == "ours" else None,
        **sol.stats,
    }
    if padded:
        base_at = baseline_score.energy_j + p2p * p * max(0.0, deadline - baseline_score.iteration_time_s)
        details["energy_at_deadline_j"] = energy
        details["baseline_energy_at_deadline_j"] = base_at
        details["energy_saving_at_deadline"] = 1.0 - energy / base_at if base_at > 0 else 0.0
    how = (
        f"target iteration time {deadline:.4f} s (energy counted until then)" if padded
        else f"deadline {deadline:.4f} s = baseline x {1 + config.max_slowdown:g}"
    )
    reason = (
        f"optimal plan for {how}: within {100 * gap:.2f} % of the LP lower bound"
        + (f"; extra warm-up from '{label}'" if config.scheduling == "ours" else "")
        + ("" if config.reconfig == "default" else f"; '{config.reconfig}' corrections apply online only")
    )
    result = PlanResult(
        config=config,
        plan=plan,
        score=score,
        timeline=sol.timeline,
        baseline_plan=setup.baseline_plan,
        baseline=baseline_score,
        baseline_timeline=setup.baseline_timeline,
        f_max_mhz=f_max,
        valley_mhz=setup.valley_mhz,
        candidates_mhz=tuple(sorted(setup.candidates_mhz, reverse=True)),
        iterations=0,
        converged=True,
        stop_reason=reason,
        planner_seconds=0.0,
        warnings=warnings,
        deadline_s=deadline,
        lower_bound_j=sol.lp_bound_j,
        details=details,
    )
    if result.slowdown > SLOWDOWN_WARNING:
        warnings.append(
            f"this plan is {100 * result.slowdown:.2f}% slower than the baseline (1F1B at {f_max} MHz), "
            + ("as the target iteration time allows" if padded else "as --max-slowdown allows")
        )
    result.planner_seconds = time.perf_counter() - t0
    return result
