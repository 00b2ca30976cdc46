"""One schedule on one profile as a time-energy problem: each unit's clock options, the LP bound, the plan.

``freqs`` everywhere are flat lists aligned with ``graph.nodes``, like
:class:`~megatron_envpipe.core.timeline.PlanEvaluator`; ``idx`` lists hold one
option index per unit (0 = its fastest option).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from megatron_envpipe.core.profile import Profile
from megatron_envpipe.core.schedule import Schedule
from megatron_envpipe.core.timeline import Dependency, PlanEvaluator, PlanScore, Timeline
from megatron_envpipe.planning.basis import PlannerError
from megatron_envpipe.planning.optimal.deadline import FEASIBILITY_RTOL, InfeasibleDeadline
from megatron_envpipe.planning.optimal.lp import LpBackend, lp_backend
from megatron_envpipe.planning.optimal.options import ClockOption, clock_options, lower_hull
from megatron_envpipe.planning.optimal.rows import ConstraintRows
from megatron_envpipe.planning.optimal.search import DEFAULT_SEARCH_WORK, MIN_SEARCH_TRIALS, ClockSearch


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
    """One schedule on one profile: the DAG, each unit's clock options, the LP and the rounding."""

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
        self.n = len(graph.nodes)
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
        hulls = {k: lower_hull(v) for k, v in by_key.items()}
        self.hulls = [hulls[k] for k in keys]
        self.preds = graph.preds
        self._lp: LpBackend | None = None
        self._search: ClockSearch | None = None

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
    def _build_lp(self) -> LpBackend:
        """Columns: end time per unit, the makespan T, then one column per hull segment of each unit."""
        n = self.n
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
        rows = ConstraintRows()
        rows.add_schedule(self.preds, self.t_col, lambda v: ([(j, 1.0) for j in seg_cols[v]],
                                                             self.options[v][self.hulls[v][0]].time_s))
        try:
            import numpy as np
        except ImportError:
            lp_backend()  # raises SolverUnavailable with the install hint
            raise
        start, index, value = rows.csc(np, len(cost))
        self.seg_cols = seg_cols
        return lp_backend(
            np.asarray(cost, float), start, index, value, np.asarray(rows.lo, float), np.asarray(rows.up, float),
            np.asarray(col_lo, float), np.asarray(col_up, float),
        )

    def solve_lp(self, deadline_s: float, time_weight: float) -> tuple[list[float], float, float]:
        """The LP relaxation: (durations, makespan T, objective = sum hull cost + time_weight * T).

        ``time_weight`` = ``P_p2p * P`` minimises energy at the plan's own makespan;
        0 minimises energy padded to the deadline.
        """
        if self._lp is None:
            self._lp = self._build_lp()
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

    # -- the whole method ----------------------------------------------------------------
    def check_deadline(self, deadline_s: float) -> float:
        """The fastest possible iteration time; InfeasibleDeadline if ``deadline_s`` is faster."""
        fastest = self.fastest_time_s()
        if not deadline_s >= fastest * (1 - FEASIBILITY_RTOL):
            raise InfeasibleDeadline(
                f"an iteration time of {deadline_s:.6g} s is infeasible: with every unit at its fastest clock "
                f"this {self.schedule.name} schedule takes {fastest:.6g} s "
                f"({100 * (deadline_s / fastest - 1):+.2f} %)"
            )
        return fastest

    def search(self) -> ClockSearch:
        """The rounding and local searches over this model (built once: it caches neighbour lists)."""
        if self._search is None:
            self._search = ClockSearch(self)
        return self._search

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
        search = self.search()
        idx = search.round(d_lp, target)
        n = max(1, self.n)
        idx, n_trials, n_accepted = search.local_search(idx, target, max(MIN_SEARCH_TRIALS, search_work // (8 * n)))
        idx, n_checks, n_pairs = search.pair_search(idx, target, max(MIN_SEARCH_TRIALS, search_work // (4 * n)))
        idx, n_checks2, n_pairs2 = search.exchange_search(idx, target, max(MIN_SEARCH_TRIALS, search_work // (4 * n)))
        n_checks += n_checks2
        n_pairs += n_pairs2
        idx, repairs = search.repair(idx, target)
        if repairs:
            idx = search.settle(idx, target)
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
