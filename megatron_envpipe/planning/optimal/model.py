"""One schedule on one profile as a time-energy problem: each unit's clock options, the LP bound, the plan.

``freqs`` everywhere are flat lists aligned with ``graph.nodes``, like
:class:`~megatron_envpipe.core.timeline.PlanEvaluator`; ``idx`` lists hold one
option index per unit (0 = its fastest option).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from operator import getitem
from typing import Any

from megatron_envpipe.core.kinds import build_schedule
from megatron_envpipe.core.length_costs import LengthCostModel, MicrobatchSize
from megatron_envpipe.core.profile import Profile
from megatron_envpipe.core.schedule import Schedule, ScheduleError
from megatron_envpipe.core.timeline import Dependency, PlanEvaluator, PlanScore, Timeline
from megatron_envpipe.planning.basis import PlannerError
from megatron_envpipe.planning.optimal.deadline import FEASIBILITY_RTOL, InfeasibleDeadline
from megatron_envpipe.planning.optimal.lp import LpBackend, lp_backend
from megatron_envpipe.planning.optimal.options import ClockOption, clock_options, lower_hull
from megatron_envpipe.planning.optimal.rows import schedule_csc
from megatron_envpipe.planning.optimal.search import (
    DEFAULT_SEARCH_WORK,
    MIN_SEARCH_TRIALS,
    SEARCH_SKIP_GAP,
    ClockSearch,
)

# Smaller LPs solve cold in a few hundredths of a second; below this many units the shorter
# pipeline's start is not tried, so their plans (all P = 8 cases) stay exactly as before.
_MIN_UNITS_FOR_START = 3000
# The short pipeline holds this many warm-ups' worth of micro-batches (its middle is the steady state).
_SHORT_PIPELINE_WARMUPS = 3
# The short LP is itself started from a shorter one only from this many units: at P = 32 (1F1B's 6,144,
# interleaved's 20,480) it halves the LP's time; at P = 16 (interleaved's 5,120) it saves nothing.
_MIN_UNITS_FOR_NESTED_START = 6000
# From this many units a cold LP skips presolve: HiGHS's presolve finds little to remove in these
# chains and costs a quarter of the solve (`ours` at P = 32, M = 256: its first LP 8.2 -> 6.2 CPU s, the plan
# 17.0 -> 15.0 s and 0.003 % less energy; P = 16: 0.7 -> 0.45 s). A warm-started solve never presolves.
_MIN_UNITS_WITHOUT_PRESOLVE = 3000


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
        microbatch_sizes: Sequence[MicrobatchSize] | None = None,
        length_model: LengthCostModel | None = None,
    ) -> None:
        self.schedule = schedule
        self.profile = profile
        self.candidates_mhz = tuple(candidates_mhz)
        self.p2p_power_w = p2p_power_w
        self.p2p_latency_s = p2p_latency_s
        self.evaluator = PlanEvaluator(schedule, profile, p2p_power_w, p2p_latency_s, extra_dependencies,
                                       microbatch_sizes=microbatch_sizes, length_model=length_model)
        graph = self.graph = self.evaluator.graph
        self.n = len(graph.nodes)
        self.num_stages = schedule.num_stages
        # Costs per (stage, chunk, instruction[, size class]), read through the evaluator (its profile is
        # the one split into the schedule's chunks), so chunks (and micro-batch sizes) that differ are
        # planned as they are.
        ev_profile = self.evaluator.profile
        keys = self.keys = self.evaluator.cost_keys
        by_key: dict[tuple, tuple[ClockOption, ...]] = {}
        for key in dict.fromkeys(keys):
            s, chunk, ins = key[:3]
            opts = clock_options(self.evaluator.key_points(key), p2p_power_w, candidates_mhz)
            if not opts:
                where = f"stage {s}" + (f" chunk {chunk}" if chunk else "")
                raise PlannerError(f"{ev_profile.source}: {where} {ins} has no clock among the candidates")
            by_key[key] = opts
        self.options_by_key = by_key
        self.options = [by_key[k] for k in keys]
        times = {k: [o.time_s for o in v] for k, v in by_key.items()}
        costs = {k: [o.cost_j for o in v] for k, v in by_key.items()}
        self.times = [times[k] for k in keys]
        self.costs = [costs[k] for k in keys]
        hulls = {k: lower_hull(v) for k, v in by_key.items()}
        self.hulls = [hulls[k] for k in keys]
        self.preds = graph.preds
        self._lp: LpBackend | None = None
        # The last LP answer by (deadline, time weight): ranking the schedules and
        # solving the best one ask the same LP twice.
        self._lp_answer: tuple[tuple[float, float], tuple[list[float], float, float]] | None = None
        self._lp_answer_x: Any = None  # ... and its column values
        self._search: ClockSearch | None = None
        self._start_basis: Any = None  # shorter_pipeline_start's basis, mapped onto this LP
        # Micro-batches of the shorter pipeline that starts this LP (None: the default size; 0: no start).
        self.start_microbatches: int | None = None
        self.start_chain: tuple[int, ...] = ()  # micro-batches of the shorter LPs solved as starts, outermost first

    # -- basic evaluation ------------------------------------------------------------
    def durations(self, idx: Sequence[int]) -> list[float]:
        return list(map(getitem, self.times, idx))

    def cost(self, idx: Sequence[int]) -> float:
        return sum(map(getitem, self.costs, idx))  # left to right, like every energy sum here

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
        """Columns: end time per unit, the makespan T, then one column per hull segment of each unit.

        Built per cost key, then gathered per unit in numpy (the matrix in one
        go: :func:`~.rows.schedule_csc`); the rows and columns are those of
        :meth:`ConstraintRows.add_schedule` with each unit's segments as its duration.
        """
        try:
            import numpy as np
        except ImportError:
            lp_backend()  # raises SolverUnavailable with the install hint
            raise
        n = self.n
        key_id: dict[tuple, int] = {}
        key_first: list[int] = []  # per key: its first segment in the flat lists below
        key_count: list[int] = []
        key_t0: list[float] = []
        key_c0: list[float] = []
        slopes: list[float] = []
        lengths: list[float] = []
        for key, opts in self.options_by_key.items():
            hull = lower_hull(opts)
            key_id[key] = len(key_first)
            key_first.append(len(slopes))
            key_count.append(len(hull) - 1)
            key_t0.append(opts[hull[0]].time_s)
            key_c0.append(opts[hull[0]].cost_j)
            for a, b in zip(hull, hull[1:]):
                oa, ob = opts[a], opts[b]
                length = ob.time_s - oa.time_s
                slopes.append((ob.cost_j - oa.cost_j) / length)
                lengths.append(length)
        unit_key = np.fromiter((key_id[k] for k in self.keys), dtype=np.int64, count=n)
        count = np.asarray(key_count, dtype=np.int64)[unit_key]
        first = n + 1 + np.cumsum(count) - count  # each unit's first segment column
        flat = np.repeat(np.asarray(key_first, dtype=np.int64)[unit_key], count) + (
            np.arange(int(count.sum()), dtype=np.int64) - np.repeat(first - n - 1, count))
        num_cols = n + 1 + len(flat)
        cost = np.concatenate([np.zeros(n + 1), np.asarray(slopes, dtype=float)[flat]])
        col_lo = np.zeros(num_cols)
        col_up = np.concatenate([np.full(n + 1, math.inf), np.asarray(lengths, dtype=float)[flat]])
        t0 = np.asarray(key_t0, dtype=float)[unit_key]
        self.t_col = n
        self.seg_first, self.seg_count, self.t0 = first, count, t0
        self.base_cost = sum(key_c0[i] for i in unit_key.tolist())  # in unit order, as the plans' sums
        self._lp_num_cols = num_cols
        start, index, value, row_lo, row_up = schedule_csc(np, self.preds, n, first, count, t0, num_cols)
        lp = lp_backend(cost, start, index, value, row_lo, row_up, col_lo, col_up)
        if n >= _MIN_UNITS_WITHOUT_PRESOLVE:
            lp.set_presolve(False)
        return lp

    def prepare_lp(self) -> "TimeEnergyModel":
        """Build the LP now (numpy; otherwise the first :meth:`lp_bound` does): lets a caller build
        it while another model's LP runs."""
        if self._lp is None:
            self._lp = self._build_lp()
        return self

    def lp_basis(self) -> Any:
        """The LP's last optimal basis (None before a solve, or without one): a warm start for
        :meth:`solve_lp` of another schedule with the same LP shape (another extra warm-up)."""
        return None if self._lp is None else self._lp.basis()

    def solve_lp(self, deadline_s: float, time_weight: float, warm_basis: Any = None
                 ) -> tuple[list[float], float, float]:
        """The LP relaxation: (durations, makespan T, objective = sum hull cost + time_weight * T).

        ``time_weight`` = ``P_p2p * P`` minimises energy at the plan's own makespan;
        0 minimises energy padded to the deadline. ``warm_basis`` (from
        :meth:`lp_basis` of a model of the same shape) starts the first solve
        from another schedule's optimum: the candidates differ in a few units per stage.
        """
        answer = self.lp_bound(deadline_s, time_weight, warm_basis)
        assert answer is not None
        d, t, obj = answer
        return list(d), t, obj

    def lp_bound(self, deadline_s: float, time_weight: float, warm_basis: Any = None,
                 cutoff_j: float = math.inf) -> tuple[list[float], float, float] | None:
        """:meth:`solve_lp`'s answer (the caller must not change it), or None once the LP optimum
        is proven above ``cutoff_j``: such a schedule cannot beat one whose bound is ``cutoff_j``."""
        if self._lp_answer is not None and self._lp_answer[0] == (deadline_s, time_weight):
            return self._lp_answer[1]
        first = self._lp_answer_x is None  # no solve yet: a start may help
        if self._lp is None:
            self._lp = self._build_lp()
        lp = self._lp
        lp.set_col_bounds([self.t_col], [0.0], [deadline_s])
        lp.set_costs([self.t_col], [time_weight])
        lp.set_objective_bound(cutoff_j - self.base_cost)
        if first and warm_basis is not None:
            lp.set_basis(warm_basis)
        elif first:  # (a start given before the last change of bounds or costs is dropped)
            start = self.shorter_pipeline_start(deadline_s, time_weight)
            if self._start_basis is not None:
                lp.set_basis(self._start_basis)  # the short LP's optimal basis, mapped: no crossover
            elif start is not None:
                lp.set_start(start)
        ok, x, obj = lp.solve()
        if not ok and lp.cut_off:
            return None
        if not ok:
            raise InfeasibleDeadline(
                f"no plan meets an iteration time of {deadline_s:.6g} s (LP: {getattr(lp, 'status', 'infeasible')}); "
                f"the fastest plan takes {self.fastest_time_s():.6g} s"
            )
        # t_fast + x_0 + x_1 + ... left to right per unit (the sums the plans were made with).
        d = self.t0.copy()
        for j in range(int(self.seg_count.max(initial=0))):
            has = self.seg_count > j
            d[has] += x[self.seg_first[has] + j]
        answer = (d.tolist(), float(x[self.t_col]), float(obj) + self.base_cost)
        self._lp_answer = ((deadline_s, time_weight), answer)
        self._lp_answer_x = x
        return answer

    def shorter_pipeline_start(self, deadline_s: float, time_weight: float) -> Any:
        """A starting point for the LP of a long steady state: the same LP with fewer micro-batches,
        its middle micro-batch repeated (None where that does not apply or would not pay).

        With no slack (the deadline is the fastest plan's time: the default,
        zero slowdown against 1F1B at f_max) the LP's solution repeats in the
        steady state (every period runs at the critical stage's fastest pace),
        so the optimum of a pipeline with ``M_s = 3 W`` micro-batches (``W``:
        the longest warm-up, at least P) extended to M is the optimum of the
        whole LP or close to it (1F1B at P = 16 and 32: equal; tests). With
        slack (bloom-like profiles: 1F1B at f_max is slower than the fastest clocks) the short LP
        gets the same *relative* slack, so its steady state runs at about the long one's pace
        (an absolute slack, spent in the short steady state, would be multiplied by the copies);
        bloom repeated to P = 32, M = 256: 44 s of LP CPU -> 12 s, small LP included, the same
        optimum. It is only a start: the solve that follows is exact
        (the simplex starts from the basis it crosses over to). At P = 32,
        M = 256 (1F1B): 8.8k simplex iterations instead of 54k, plus the 3x shorter LP's 17k.
        Since issue 24 the short LP's optimal *basis* is mapped the same way (columns and
        rows through the same unit image, :meth:`row_image`) into ``_start_basis``, which
        :meth:`lp_bound` prefers: the dual simplex starts at once, with no crossover (1F1B
        on gpt3-175b repeated to P = 32, M = 256: 35 s of LP CPU -> 8 s, small LP included;
        the same optimum). Applies to schedules without extra dependencies whose
        ``M >= 2 M_s`` with at least :data:`_MIN_UNITS_FOR_START` units; interleaved ones too,
        in groups of P micro-batches (Megatron's default group size): ``M_s`` rounded up to a
        multiple of P, ``M >= M_s + 2P``, the middle groups mapped onto one. Extra
        warm-ups long enough to fill the pipeline do not qualify.
        """
        import numpy as np  # only with the LP, like numpy everywhere in the planners

        if self._lp is None:
            self._lp = self._build_lp()  # the column layout the start is written in
        sched, graph = self.schedule, self.graph
        p, m = sched.num_stages, sched.num_microbatches
        chunks = sched.num_chunks
        # Per-micro-batch sizes: the steady state does not repeat, so a short pipeline's optimum is no start.
        if not self._lp.warm_starts or graph.extra_dependencies or self.evaluator.microbatch_sizes is not None:
            return None
        warmup = max(next((i for i, u in enumerate(order) if not u.is_forward), len(order))
                     for order in sched.orders)
        # Interleaved: the steady state repeats per group of P micro-batches (Megatron's default
        # group size), and a warm-up of W units is W / V micro-batches.
        period = p if chunks > 1 else 1
        warmup_mb = max(-(-warmup // chunks), p)
        m_small = _SHORT_PIPELINE_WARMUPS * warmup_mb if self.start_microbatches is None else self.start_microbatches
        if not m_small:
            return None
        m_small = -(-m_small // period) * period
        if m < (m_small + 2 * period if chunks > 1 else 2 * m_small) or m % period or self.n < _MIN_UNITS_FOR_START:
            return None
        # Slack: the short LP gets the same relative slack (its steady state then runs at about the
        # long one's pace; M / M_s copies of an absolute slack would overshoot). Only a start either way.
        slack = max(1.0, deadline_s / self.fastest_time_s())
        try:
            small_sched = (build_schedule(sched.name, p, m_small, num_chunks=chunks) if chunks > 1
                           else build_schedule(sched.name, p, m_small, list(sched.extra_warmup) or None))
        except ScheduleError:
            return None
        small = TimeEnergyModel(small_sched, self.profile, self.candidates_mhz, self.p2p_power_w,
                                self.p2p_latency_s)
        # The short LP is itself started from one half as long, while that one still covers the warm-up and
        # half a pipeline of steady state (1F1B at P = 32, M = 256: 256 <- 96 <- 48 micro-batches, the 96's
        # 20k simplex iterations cold -> 8k; interleaved V = 2: 256 <- 160 <- 96, the 160's 48k -> 7k; the
        # same optimum: at P = 32 the same LP durations to 1e-12 s on gpt3-175b and bloom-176b repeated).
        nested = -(-(m_small // 2) // period) * period
        small.start_microbatches = (nested if nested >= warmup_mb + -(-p // 2) and small.n >= _MIN_UNITS_FOR_NESTED_START
                                    else 0)
        try:
            small.lp_bound(small.fastest_time_s() * slack, time_weight)
        except PlannerError:  # no start, then: the exact solve below says what is wrong
            return None
        x_small = small._lp_answer_x
        half, shift = (m_small // 2) // period * period, m - m_small
        index = small.graph.index
        image = np.empty(self.n, dtype=np.int64)
        for v, (s, unit) in enumerate(graph.nodes):
            mb = unit.microbatch
            mb = mb if mb < half else mb - shift if mb >= half + shift else half + (mb - half) % period
            small_unit = index.get((s, replace(unit, microbatch=mb)))
            if small_unit is None:  # another group size: no counterpart, no start
                return None
            image[v] = small_unit
        x = np.zeros(self._lp_num_cols)
        col_image = np.empty(self._lp_num_cols, dtype=np.int64)
        col_image[: self.n], col_image[self.t_col] = image, small.t_col
        for j in range(int(self.seg_count.max(initial=0))):
            has = self.seg_count > j
            x[self.seg_first[has] + j] = x_small[small.seg_first[image[has]] + j]
            col_image[self.seg_first[has] + j] = small.seg_first[image[has]] + j
        basis = small.lp_basis()
        if basis is not None:
            self._start_basis = self._lp.mapped_basis(basis, col_image, self.row_image(small, image))
        d = self.t0.copy()
        for j in range(int(self.seg_count.max(initial=0))):
            has = self.seg_count > j
            d[has] += x[self.seg_first[has] + j]
        ends = graph.simulate(d.tolist()).end_s
        x[: self.n] = ends
        x[self.t_col] = min(max(ends), deadline_s)
        self.start_chain = (m_small, *small.start_chain)
        return x

    def row_image(self, small: "TimeEnergyModel", image: Any) -> Any:
        """Each LP row's counterpart in ``small``'s LP, units mapped by ``image``: edge ``i`` into
        unit ``v`` -> edge ``i`` into ``image[v]``, a sink's row -> its image's (rows in
        :func:`~.rows.schedule_csc`'s order: every unit's edges, then the sinks)."""
        import numpy as np

        def layout(preds: Any) -> tuple[list[int], dict[int, int]]:
            first, r, has_succ = [], 0, [False] * len(preds)
            for ps in preds:
                first.append(r)
                r += max(1, len(ps))
                for u, _ in ps:
                    has_succ[u] = True
            sinks = {v: r + k for k, v in enumerate(v for v in range(len(preds)) if not has_succ[v])}
            return first, sinks

        first, sinks = layout(self.preds)
        small_first, small_sinks = layout(small.preds)
        out = np.empty(first[-1] + max(1, len(self.preds[-1])) + len(sinks), dtype=np.int64)
        for v, ps in enumerate(self.preds):
            w = int(image[v])
            last = max(1, len(small.preds[w])) - 1
            for i in range(max(1, len(ps))):
                out[first[v] + i] = small_first[w] + min(i, last)
        fallback = next(iter(small_sinks.values()))
        for v, r in sinks.items():
            out[r] = small_sinks.get(int(image[v]), fallback)
        return out

    def plan_energy_j(self, idx: Sequence[int], deadline_s: float, padded: bool) -> float:
        """Iteration energy of option indices ``idx`` as the LP bound counts it (padded: until the deadline)."""
        score = self.evaluator.score(self.freqs(idx))
        if padded:
            return score.energy_j + self.p2p_power_w * self.num_stages * max(0.0, deadline_s - score.iteration_time_s)
        return score.energy_j

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
        n_trials = n_accepted = n_checks = n_pairs = 0
        # No search can gain more than the rounding's gap to the LP bound: skip them when it is negligible
        # (at P = 32, M = 256 the rounding lands within 0.03 % and the searches take a quarter of the time).
        if self.plan_energy_j(idx, deadline_s, padded) > lp_bound * (1 + SEARCH_SKIP_GAP):
            idx, n_trials, n_accepted = search.local_search(idx, target,
                                                            max(MIN_SEARCH_TRIALS, search_work // (8 * n)))
            idx, n_checks, n_pairs = search.pair_search(idx, target, max(MIN_SEARCH_TRIALS, search_work // (4 * n)))
            idx, n_checks2, n_pairs2 = search.exchange_search(idx, target,
                                                              max(MIN_SEARCH_TRIALS, search_work // (4 * n)))
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
