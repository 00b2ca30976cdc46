"""Clock changes priced inside the choice: a dynamic program over each rank's clock segments.

The merge pass (planning/switching.py) can only give a run of units its neighbour's clock, one
merge at a time, greedily. When changes are expensive next to the units (short units, a rank that
alternates between neighbouring clocks), the plan that counts its changes best is a different
one: a few long segments, some at a clock neither neighbour had. This pass finds, for one rank at
a time, the clocks of all its units that minimise

    sum over its units of E(f) - P_p2p * t(f)   +   switch_cost_j x (its changes per iteration)

(the planner's effective energy, the change from the iteration's last unit to the next one's
first counted), with every other rank's clocks kept. Feasibility by construction: each unit must
end by the time its current successors on other ranks start (less the edge latency), and by the
deadline; its inputs from other ranks arrive no later than now (nothing else gets slower, by
induction in topological order), so no unit anywhere ends later than the bound it was given and
the iteration never ends later. The rank's own units run back to back, each starting when the
previous one ends or its input arrives: the DP's state is (unit, clock), holding a short Pareto
list of (end time, cost) pairs (``keep`` of them: the earliest end, the cheapest), so the search is
a heuristic but never returns a plan that breaks a bound. Each rank's result is taken only when it
is worth less than the rank's current clocks; sweeps over the ranks repeat while one improves.

Clocks tried per unit: its own and the ``max_clocks`` clocks its rank uses most (ties: the faster),
plus the fastest clock every unit has: few enough that the pass costs about one simulation per rank.

Pair moves (``pair_trials``, :func:`_pair_pass`): a rank at its DP optimum with the others fixed may still
be worth less together with a neighbour, e.g. one of its segments at the next segment's slower clock (a
change less) while the neighbour runs the units that then end late one clock faster. After the sweeps, a
few such merges (those missing the least time first) are tried: the neighbour's late units one clock
faster, then both ranks re-planned by the DP; taken when the plan is worth less and ends in time.

``min_segment_s`` (the clock latency, :mod:`megatron_envpipe.core.clock_latency`): a change is only
allowed after a segment whose units compute for at least that long (their durations summed: the
segment lasts at least that), so a lock that takes ``min_segment_s`` to land is not overtaken by the
next one. A rank whose current clocks break that rule takes the DP's answer even when it costs more.
The last segment (it runs into the next iteration) is not held to it.
"""

from __future__ import annotations

from dataclasses import dataclass
from operator import itemgetter

from megatron_envpipe.core.graph import Edges, due_s, latest_times, ready_s, successors
from megatron_envpipe.core.plan import FrequencyPlan
from megatron_envpipe.core.schedule import Schedule
from megatron_envpipe.core.timeline import PlanEvaluator, PlanScore, Timeline

# Pareto entries kept per (unit, clock). issue 34 bench, 24 cells: 3 -> 16 raised the counted saving by 0.16
# points per cell on average (the entry a later bound needs is kept more often) for ~10 % more planning time.
_DEFAULT_KEEP = 16
_DEFAULT_MAX_CLOCKS = 6  # clocks a rank uses most, tried for each of its units
_DEFAULT_SWEEPS = 2
# Pair moves (_pair_pass): merges tried per plan, and only on ranks of at most this many units. Issue 34 bench,
# 114 cells: on ranks of every size they gained 0.43 points in all (mostly interleaved and M = 96 cells) for
# +16 % of the planning CPU time; on ranks up to 48 units (M <= 24 without interleaving) 0.11 points for +2 %.
PAIR_TRIALS = 8
PAIR_MAX_RANK_UNITS = 48
_END_COST = itemgetter(0, 1)
_INF = float("inf")


@dataclass(frozen=True)
class SegmentResult:
    """A plan after the per-rank DP, scored, with what it did."""

    plan: FrequencyPlan
    timeline: Timeline
    score: PlanScore
    objective_before_j: float  # simulated energy + switch cost x steady changes, before and after
    objective_after_j: float
    ranks_improved: int  # rank re-plans taken, over all sweeps
    sweeps: int


def _steady_changes_of(row: list[int]) -> int:
    """The changes one rank makes per iteration when iterations repeat (switching.steady_clock_changes)."""
    return sum(1 for a, b in zip(row, (*row[1:], *row[:1])) if a != b)


def short_segments(row: list[int], durations_s: list[float], min_segment_s: float) -> int:
    """Segments of one rank (units at one clock in a row) whose units compute for less than ``min_segment_s``
    and that another clock follows in the same iteration: changes requested before the last one landed."""
    count, busy = 0, 0.0
    for i, (f, t) in enumerate(zip(row, durations_s)):
        busy += t
        if i + 1 < len(row) and row[i + 1] != f:
            count += busy < min_segment_s
            busy = 0.0
    return count


class _Tables:
    """Per unit, clock -> (time, effective energy), for every clock its key was profiled at."""

    def __init__(self, evaluator: PlanEvaluator) -> None:
        p2p = evaluator.p2p_power_w
        per_key: dict[tuple, dict[int, tuple[float, float]]] = {}
        for key in set(evaluator.cost_keys):
            per_key[key] = {p.freq_mhz: (p.time_s, p.energy_j - p2p * p.time_s) for p in evaluator.key_points(key)}
        self.at = [per_key[key] for key in evaluator.cost_keys]
        common = set.intersection(*(set(t) for t in per_key.values())) if per_key else set()
        self.fastest_common = min(common, key=lambda f: (max(t[f][0] for t in per_key.values()), -f)) if common else None


def _stage_dp(units: range, allowed: list[list[int]], tables: _Tables, ready: list[float], cap: list[float],
              switch_cost_j: float, keep: int, min_segment_s: float) -> tuple[float, list[int]] | None:
    """The cheapest clocks for the rank's ``units`` (in execution order) under the bounds; None: none found."""
    at = tables.at
    sc = switch_cost_j
    cut = keep - 1
    prev: dict[int, list[tuple]] | None = None
    # Entry: (end, cost, first clock, busy time of its segment so far, clock, the previous unit's entry or None).
    # Per (unit, clock) the same lists as a Pareto filter over every candidate (own clock's entries, then a change
    # from the best entries of any clock; kept: the earliest end and the ``keep - 1`` cheapest, costs falling by
    # more than 1e-12; test_segment_dp_exact's _plain_pareto), built with less work: candidates are made in end
    # order, so the first too late ends the scan; of those ending at the same time (all that wait for the input,
    # at r + t) only the first cheapest can survive it, so only it is kept (the lists are the same to the bit for
    # finite costs, which profile energies are).
    for i, v in enumerate(units):
        r, c_lim, tab = ready[i], cap[i], at[v]
        cur: dict[int, list[tuple]] = {}
        if prev is None:
            for f in allowed[i]:
                t, eff = tab[f]
                if r + t <= c_lim:
                    cur[f] = [(r + t, eff, f, t, f, None)]
        else:
            if min_segment_s > 0:  # only a segment that lasted long enough for a change may end
                every = [e for lst in prev.values() for e in lst if e[3] >= min_segment_s]
            else:
                every = [e for lst in prev.values() for e in lst]
            every.sort(key=_END_COST)
            glob = []  # the Pareto filter of every (keep entries), as (end, cost with the change, clock, entry)
            thr = _INF
            for g in every:
                if g[1] < thr:
                    thr = g[1] - 1e-12
                    glob.append((g[0], g[1] + sc, g[4], g))
            if len(glob) > keep:
                glob = glob[:1] + glob[len(glob) - cut:]
            for f in allowed[i]:
                t, eff = tab[f]
                rt = r + t
                if rt > c_lim:  # every candidate ends at r + t or later
                    continue
                own: list[tuple] = []  # (end, cost, entry before, busy): staying at f
                last_end = None
                for e in prev.get(f, ()):
                    e0 = e[0]
                    end = e0 + t if e0 > r else rt
                    if end > c_lim:
                        break
                    c = e[1] + eff
                    if end == last_end:
                        if c < own[-1][1]:
                            own[-1] = (end, c, e, e[3] + t)
                    else:
                        last_end = end
                        own.append((end, c, e, e[3] + t))
                moved: list[tuple] = []  # changing to f
                last_end = None
                for g0, gc, gf, g in glob:
                    if gf == f:
                        continue
                    end = g0 + t if g0 > r else rt
                    if end > c_lim:
                        break
                    c = gc + eff
                    if end == last_end:
                        if c < moved[-1][1]:
                            moved[-1] = (end, c, g, t)
                    else:
                        last_end = end
                        moved.append((end, c, g, t))
                out = []
                thr = _INF  # the last cost kept - 1e-12 (the Pareto filter's test)
                if moved and own:
                    # the Pareto filter's scan over own + moved in (end, cost) order, staying first among equals
                    # (a stable sort's order): both lists are in strictly increasing end order already, so a merge.
                    i_o = i_m = 0
                    n_o, n_m = len(own), len(moved)
                    while i_o < n_o and i_m < n_m:
                        xo, xm = own[i_o], moved[i_m]
                        if xm[0] < xo[0] or (xm[0] == xo[0] and xm[1] < xo[1]):
                            x = xm
                            i_m += 1
                        else:
                            x = xo
                            i_o += 1
                        if x[1] < thr:
                            thr = x[1] - 1e-12
                            e = x[2]
                            out.append((x[0], x[1], e[2], x[3], f, e))
                    own = own[i_o:] if i_o < n_o else moved[i_m:]
                elif moved:
                    own = moved
                for x in own:  # the Pareto filter's scan (of what the merge left)
                    if x[1] < thr:
                        thr = x[1] - 1e-12
                        e = x[2]
                        out.append((x[0], x[1], e[2], x[3], f, e))
                if out:
                    if len(out) > keep:
                        out = out[:1] + out[len(out) - cut:]
                    cur[f] = out
        if not cur:
            return None
        prev = cur
    assert prev is not None
    found: tuple | None = None
    total = 0.0
    for f, lst in prev.items():
        for e in lst:
            x = e[1] + (sc if f != e[2] else 0.0)
            if found is None or x < total:
                total, found = x, e
    if found is None:
        return None
    clocks = []
    while found is not None:
        clocks.append(found[4])
        found = found[5]
    clocks.reverse()
    return total, clocks


def _allowed(units: range, row: list[int], tables: _Tables, max_clocks: int,
             hints: tuple[int, ...] = ()) -> list[list[int]]:
    """Clocks tried per unit: its own, the rank's ``max_clocks`` most used ones (in ``row`` and in the
    hint row ``hints``, e.g. another plan's clocks for this rank), the fastest common one."""
    counts: dict[int, int] = {}
    for f in (*row, *hints):
        counts[f] = counts.get(f, 0) + 1
    top = sorted(counts, key=lambda f: (-counts[f], -f))[:max_clocks]
    if tables.fastest_common is not None and tables.fastest_common not in top:
        top.append(tables.fastest_common)
    return [[f for f in dict.fromkeys((own, *top)) if f in tables.at[v]] for v, own in zip(units, row)]


def _bounds(graph, units: range, s: int, timeline: Timeline, limit: float,
            cross_succs: list[list[tuple[int, float]]], latest_finish: list[float] | None
            ) -> tuple[list[float], list[float]]:
    """Per unit of rank ``s``: the time its inputs from elsewhere arrive and the time it must end by.
    ``latest_finish`` given (optimistic): every unit's latest finish for the whole pipeline to end by ``limit``
    (needs a simulation to confirm); None: the start of its successors on other ranks (module docstring)."""
    start, end = timeline.start_s, timeline.end_s
    if latest_finish is not None:
        lf = latest_finish
        cap = [max(lf[v], end[v]) for v in units]
    else:
        # rounding: the current end always fits
        cap = [max(due_s(cross_succs[v], start, limit), end[v]) for v in units]
    ends = _RankEnds(cap, units.start, graph.stage_of, s, end)
    return [ready_s(graph.cross_preds[v], ends) for v in units], cap


class _RankEnds:
    """End times as rank ``s``'s DP sees them: its own units at their cap, every other unit as simulated."""

    __slots__ = ("cap", "first", "stage_of", "s", "end")

    def __init__(self, cap: list[float], first: int, stage_of, s: int, end: list[float]) -> None:
        self.cap, self.first, self.stage_of, self.s, self.end = cap, first, stage_of, s, end

    def __getitem__(self, u: int) -> float:
        return self.cap[u - self.first] if self.stage_of[u] == self.s else self.end[u]


def plan_segments(plan: FrequencyPlan, evaluator: PlanEvaluator, deadline_s: float, switch_cost_j: float,
                  min_segment_s: float = 0.0, keep: int = _DEFAULT_KEEP, max_clocks: int = _DEFAULT_MAX_CLOCKS,
                  max_sweeps: int = _DEFAULT_SWEEPS, hints: FrequencyPlan | None = None,
                  pair_trials: int = 0, ranks: tuple[int, ...] | None = None) -> SegmentResult:
    """Re-plan each rank's clocks by the DP (module docstring) until a sweep improves none; never ends later
    than ``max(deadline_s, the plan's own iteration time)`` and never worth more (energy + changes x cost).
    ``pair_trials`` > 0: then up to that many moves of two neighbouring ranks at once (:func:`_pair_pass`),
    tried after the sweeps. ``ranks``: re-plan only these ranks."""
    graph = evaluator.graph
    tables = _Tables(evaluator)
    freqs = plan.flat()
    timeline = evaluator.simulate(freqs)
    score = evaluator.score(freqs, timeline)
    before = score.energy_j + switch_cost_j * sum(_steady_changes_of(list(r)) for r in plan.freqs_mhz)
    limit = max(float(deadline_s), timeline.iteration_time_s)
    offsets, k = [], 0
    for order in plan.schedule.orders:
        offsets.append(k)
        k += len(order)
    bounds = [range(offsets[s], offsets[s] + len(order)) for s, order in enumerate(plan.schedule.orders)]
    cross_succs: list[list[tuple[int, float]]] = [[] for _ in freqs]
    for w, cps in enumerate(graph.cross_preds):
        for u, lat in cps:
            cross_succs[u].append((w, lat))
    chain_ok = [all(graph.stage_pred[v] == (v - 1 if v > b.start else -1) for v in b) for b in bounds]
    succs = successors(graph.preds)
    latest: list[float] | None = None  # latest finishes of ``timeline``: one walk until a rank is re-planned
    improved = sweeps = 0
    # Per rank, the number of re-plans taken when its DP last took nothing: while no rank has been re-planned
    # since, its inputs (clocks, timeline, bounds) and so its answer are the same, and it is not run again.
    settled: dict[int, int] = {}
    while sweeps < max_sweeps:
        sweeps += 1
        taken = 0
        for s, units in enumerate(bounds):
            if not chain_ok[s] or not len(units) or settled.get(s) == improved + taken or (
                    ranks is not None and s not in ranks):
                continue
            row = freqs[units.start:units.stop]
            allowed = _allowed(units, row, tables, max_clocks, hints.freqs_mhz[s] if hints is not None else ())
            current = sum(tables.at[v][f][1] for v, f in zip(units, row)) + switch_cost_j * _steady_changes_of(row)
            # A rank with a segment too short for the clock latency takes the DP's answer whatever it costs.
            forced = min_segment_s > 0 and short_segments(row, [tables.at[v][f][0] for v, f in zip(units, row)],
                                                          min_segment_s) > 0
            # First with every unit's latest finish as its bound (the slack of the whole pipeline: other ranks'
            # units may start later, so the result is simulated and kept only if the iteration still ends in
            # time), then with the bounds that keep every other rank as it is (feasible by construction).
            taken_before = taken
            for optimistic in (True, False):
                if optimistic and latest is None:
                    latest = latest_times(graph.order, succs, timeline.duration_s, limit)[1]
                ready, cap = _bounds(graph, units, s, timeline, limit, cross_succs, latest if optimistic else None)
                found = _stage_dp(units, allowed, tables, ready, cap, switch_cost_j, keep, min_segment_s)
                if found is None:
                    continue
                total, clocks = found
                if clocks == row or not (forced or total < current - 1e-9 * max(1.0, abs(current))):
                    break  # the tighter bounds cannot do better than these
                trial = freqs[:units.start] + clocks + freqs[units.stop:]
                new_timeline = evaluator.simulate(trial)
                if new_timeline.iteration_time_s > limit * (1 + 1e-12):
                    continue
                freqs, timeline = trial, new_timeline
                latest = None
                taken += 1
                break
            if taken == taken_before:
                settled[s] = improved + taken
        improved += taken
        if not taken:
            break
    if pair_trials > 0:
        ctx = _PairContext(evaluator, tables, succs, bounds, chain_ok, limit, switch_cost_j, keep, max_clocks,
                           min_segment_s, hints, plan.schedule)
        objective = evaluator.score(freqs, timeline).energy_j + switch_cost_j * sum(
            _steady_changes_of(freqs[b.start:b.stop]) for b in bounds)
        freqs, timeline, pairs = _pair_pass(ctx, freqs, timeline, objective, pair_trials)
        improved += pairs
    new_plan = FrequencyPlan.from_flat(plan.schedule, freqs)
    new_score = evaluator.score(freqs, timeline)
    after = new_score.energy_j + switch_cost_j * sum(_steady_changes_of(list(r)) for r in new_plan.freqs_mhz)
    if timeline.iteration_time_s > limit * (1 + 1e-9) or (after > before and min_segment_s <= 0):
        # The bounds make neither possible; should rounding ever tip it, the plan stays as it was.
        return SegmentResult(plan, evaluator.simulate(plan.flat()), score, before, before, 0, sweeps)
    return SegmentResult(new_plan, timeline, new_score, before, after, improved, sweeps)


@dataclass(frozen=True)
class _PairContext:
    """What the pair moves share with the sweeps of one plan_segments call."""

    evaluator: PlanEvaluator
    tables: _Tables
    succs: Edges
    bounds: list[range]
    chain_ok: list[bool]
    limit: float
    switch_cost_j: float
    keep: int
    max_clocks: int
    min_segment_s: float
    hints: FrequencyPlan | None
    schedule: Schedule


def _segment_merges(row: list[int]) -> list[tuple[int, int, int]]:
    """(first unit, end, clock): one segment (a run of units at one clock) at its previous or next segment's
    clock (the iteration wraps around); each removes at least one change."""
    starts = [i for i in range(len(row)) if i == 0 or row[i] != row[i - 1]]
    out = []
    for k, a in enumerate(starts):
        b = starts[k + 1] if k + 1 < len(starts) else len(row)
        for f in dict.fromkeys((row[a - 1] if a else row[-1], row[b] if b < len(row) else row[0])):
            if f != row[a]:
                out.append((a, b, f))
    return out


def _speed_up(ctx: _PairContext, trial: list[int], mid: Timeline, lf: list[float], n: int,
              faster: dict[int, dict[int, int]]) -> list[int] | None:
    """``trial`` with every unit of rank ``n`` that ends after its latest finish ``lf`` in ``mid`` at its next
    faster clock (``faster``: per cost table, clock -> the next faster one), or None when none can be."""
    at = ctx.tables.at
    out, moved = list(trial), False
    for v in ctx.bounds[n]:
        if mid.end_s[v] > lf[v] + ctx.limit * 1e-12:
            up = faster[id(at[v])].get(trial[v])
            if up is not None:
                out[v] = up
                moved = True
    return out if moved else None


def _next_faster(tables: _Tables) -> dict[int, dict[int, int]]:
    """Per cost table (by id): clock -> the clock with the next shorter time."""
    out: dict[int, dict[int, int]] = {}
    for tab in tables.at:
        if id(tab) not in out:
            by_time = sorted(tab, key=lambda f: (tab[f][0], -f))
            out[id(tab)] = {f: by_time[k - 1] for k, f in enumerate(by_time)
                            if k and tab[by_time[k - 1]][0] < tab[f][0]}
    return out


def _pair_candidates(ctx: _PairContext, freqs: list[int], timeline: Timeline
                     ) -> list[tuple[float, int, int, int, int]]:
    """Segment merges (:func:`_segment_merges`) that slow their segment by more than the slack after it, as
    (time missing, rank, first unit, end, clock), the least missing first. The others need no neighbour: they
    are the merge pass's and the DP's moves. The rank's units run back to back, so the segment's extra time
    reaches its last unit."""
    at = ctx.tables.at
    lf = latest_times(ctx.evaluator.graph.order, ctx.succs, timeline.duration_s, ctx.limit)[1]
    end = timeline.end_s
    out = []
    for s, units in enumerate(ctx.bounds):
        if not ctx.chain_ok[s] or not len(units):
            continue
        row = freqs[units.start:units.stop]
        for a, b, f in _segment_merges(row):
            extra = 0.0
            for v in range(units.start + a, units.start + b):
                extra += at[v][f][0] - at[v][row[a]][0]
            last = units.start + b - 1
            slack = lf[last] - end[last]
            if extra > slack:
                out.append((extra - slack, s, a, b, f))
    out.sort(key=itemgetter(0, 1, 2))
    return out


def _pair_pass(ctx: _PairContext, freqs: list[int], timeline: Timeline, objective_j: float,
               max_trials: int) -> tuple[list[int], Timeline, int]:
    """Moves of two neighbouring ranks at once, which the rank-at-a-time DP cannot make (each rank is at
    its optimum with the others fixed): one segment of rank ``s`` takes its neighbour segment's clock (a
    change less), which makes the iteration end too late; neighbour rank ``n``'s late units then run one
    clock faster, and the DP re-plans ranks ``n`` and ``s`` from there. Taken when the plan is worth less
    and the simulated iteration ends by the limit. At most ``max_trials`` merges are tried, those missing
    the least time first. On the issue 34 miniature (P = 4, M = 8) the exact counted optimum differs from
    the DP's plan by such a move: rank 1 drops its last-but-one backward to the slow clock while rank 0 runs
    its own faster."""
    faster = _next_faster(ctx.tables)
    taken = trials = 0
    candidates = _pair_candidates(ctx, freqs, timeline)
    while candidates and trials < max_trials:
        _, s, a, b, f = candidates.pop(0)
        trials += 1
        units = ctx.bounds[s]
        trial = list(freqs)
        trial[units.start + a:units.start + b] = [f] * (b - a)
        mid = ctx.evaluator.simulate(trial)
        if mid.iteration_time_s <= ctx.limit * (1 + 1e-12):
            continue
        mid_lf = latest_times(ctx.evaluator.graph.order, ctx.succs, mid.duration_s, ctx.limit)[1]
        for n in (s - 1, s + 1):
            if not (0 <= n < len(ctx.bounds)) or not ctx.chain_ok[n]:
                continue
            both = _speed_up(ctx, trial, mid, mid_lf, n, faster)
            if both is None or ctx.evaluator.simulate(both).iteration_time_s > ctx.limit * (1 + 1e-12):
                continue
            res = plan_segments(FrequencyPlan.from_flat(ctx.schedule, both), ctx.evaluator, ctx.limit,
                                ctx.switch_cost_j, ctx.min_segment_s, ctx.keep, ctx.max_clocks, max_sweeps=1,
                                hints=ctx.hints, ranks=(n, s))
            if res.objective_after_j < objective_j - 1e-9 * max(1.0, abs(objective_j)):
                freqs, timeline, objective_j = res.plan.flat(), res.timeline, res.objective_after_j
                taken += 1
                candidates = _pair_candidates(ctx, freqs, timeline)
                break
    return freqs, timeline, taken
