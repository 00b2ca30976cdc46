"""The state of one clock-switching pass (planning/switching.py): runs per rank, cost tables, the exact timeline.

The pass gives a run of units a neighbouring run's clock when the iteration still ends by the
deadline. This module keeps what that decision reads, incrementally and bit for bit a full
simulation's:

* per clock, every unit's duration and the prefix sums of its effective energy (a run's cost at
  any clock is two lookups), built from one table per (stage, chunk, instruction), not per unit;
* the earliest ends and latest finishes of every unit, kept with the simulator's own recurrences
  (core/graph.py). A merge's changes are marked dirty, by topological position, and propagated
  only as far as a later check reads (:meth:`SwitchingState.settle`): a scan of a byte array for
  the next dirty position, in the order a priority queue would pop them;
* which checks said no: a merge the deadline forbade stays forbidden while no merge taken since has
  shortened any unit (every end can then only have grown and every latest finish only fallen, and
  the check's answer is monotone in both), so the greedy loop does not run that check again.
"""

from __future__ import annotations

import math
import threading
from itertools import accumulate

from megatron_envpipe.core.graph import (
    due_pair_s,
    due_s,
    flat_steps,
    latest_times,
    ready_pair_s,
    ready_s,
    successors,
)
from megatron_envpipe.core.plan import FrequencyPlan
from megatron_envpipe.core.timeline import PlanEvaluator, Timeline

# Per graph (keyed by its id, holding it so the id stays its own): successors, topological positions, flat steps.
_GRAPH_PARTS: dict[tuple[int, int], tuple] = {}
_GRAPH_PARTS_MAX = 8
_GRAPH_PARTS_LOCK = threading.Lock()
_RTOL = 1e-12  # a plan meets its deadline when its makespan is at most deadline x (1 + _RTOL)
_PRUNE_RTOL = 1e-9  # slack (x deadline) that rounding along any path cannot eat: SwitchingState.ends_by_deadline


class ClockRun:
    """Units ``start..end-1`` (positions on one rank) at one clock; a node of the rank's linked list."""

    __slots__ = ("stage", "start", "end", "freq", "prev", "next", "version", "alive", "cands", "cands_version")

    def __init__(self, stage: int, start: int, end: int, freq: int) -> None:
        self.stage, self.start, self.end, self.freq = stage, start, end, freq
        self.prev: ClockRun | None = None
        self.next: ClockRun | None = None
        self.version = 0
        self.alive = True
        self.cands: list[tuple[int, int, int, float]] = []
        self.cands_version = -1  # the version ``cands`` were computed at (every change bumps the version)


class SwitchingState:
    """The state of one pass over one plan: per-clock unit tables, runs per rank, the exact timeline."""

    def __init__(self, plan: FrequencyPlan, evaluator: PlanEvaluator, deadline_s: float,
                 timeline: Timeline | None = None) -> None:
        """``timeline``: the plan's own simulation on ``evaluator`` when the caller has it (not simulated again)."""
        self.schedule = plan.schedule
        self.evaluator = evaluator
        self.graph = graph = evaluator.graph
        self.deadline_s = deadline_s
        self.freqs = plan.flat()
        self.offset = []
        k = 0
        for order in self.schedule.orders:
            self.offset.append(k)
            k += len(order)
        self.n = n = k
        self._build_tables(evaluator)
        self.preds = graph.preds
        self.order = order = graph.order
        # The graph's parts the walks read (never written): built once per graph (the pass runs several times
        # per plan, on the graph PipelineGraph.shared hands out).
        key = (id(graph), n)
        with _GRAPH_PARTS_LOCK:
            parts = _GRAPH_PARTS.get(key)
        if parts is None or parts[0] is not graph:
            self.succs = successors(graph.preds)
            self.topo_pos = pos = [0] * n
            for i, v in enumerate(order):
                pos[v] = i
            parts = (graph, self.succs, pos, self._two_edge_steps())
            with _GRAPH_PARTS_LOCK:
                while len(_GRAPH_PARTS) >= _GRAPH_PARTS_MAX:
                    del _GRAPH_PARTS[next(iter(_GRAPH_PARTS))]  # the oldest
                _GRAPH_PARTS[key] = parts
        _, self.succs, self.topo_pos, self._steps = parts
        if timeline is None:
            timeline = evaluator.simulate(self.freqs)
        self.dur = list(timeline.duration_s)
        self.latest_start, self.latest_finish = latest_times(order, self.succs, self.dur, deadline_s)
        # Slot n: the absent edge of a unit with fewer than two (a start of 0 s, a latest start at the deadline,
        # neither ever wins its comparison), so the walks below can take every unit as two edges.
        self.end = [*timeline.end_s, 0.0]
        self.latest_start.append(deadline_s)
        self.runs: list[list[ClockRun]] = []
        for s, row in enumerate(plan.freqs_mhz):
            runs: list[ClockRun] = []
            i = 0
            while i < len(row):
                j = i
                while j < len(row) and row[j] == row[i]:
                    j += 1
                run = ClockRun(s, i, j, row[i])
                if runs:
                    runs[-1].next, run.prev = run, runs[-1]
                runs.append(run)
                i = j
            self.runs.append(runs)
        # Each rank's first and last run: their clocks make the change from one iteration into the next.
        self.head = [runs[0] for runs in self.runs]
        self.tail = [runs[-1] for runs in self.runs]
        self.changes = [len(r) for r in self.runs]  # == FrequencyPlan.clock_changes()
        self.merges = 0
        self.exact_checks = 0
        self.units_walked = 0  # units whose times a propagation recomputed (the pass's cost)
        # Units whose duration (forward) or latest start (backward) changed and whose dependants are not
        # recomputed yet, marked by topological position; _fwd_lo/_bwd_hi bound the marked positions.
        self._fwd_dirty = bytearray(n + 1)  # + the absent edge's slot, never scanned
        self._fwd_lo = n
        self._bwd_dirty = bytearray(n + 1)
        self._bwd_hi = -1
        # (run, clock) -> (run version, epoch) of a check that said no; the epoch counts merges taken that
        # shortened some unit (only those can turn a no into a yes).
        self._refused: dict[tuple[ClockRun, int], tuple[int, int]] = {}
        self._epoch = 0

    def _two_edge_steps(self) -> tuple[list[tuple], list[tuple]] | None:
        """Per topological position, the unit and its edges flattened for the walks: forward
        ``(v, a, lat_a, b, lat_b, pos_w1, pos_w2)`` (predecessors a, b; successors' positions), backward
        ``(v, w1, lat_w1, w2, lat_w2, pos_a, pos_b)``; an absent edge is slot n. None when some unit has
        more than two edges either way (the general loops run)."""
        ahead = flat_steps(self.preds, self.order)
        behind = flat_steps(self.succs, self.order, backward=True)  # in reverse topological order
        if ahead is None or behind is None:
            return None
        at = [*self.topo_pos, self.n]  # the absent edge's slot is its own position
        forward, backward = [], []
        for (v, a, lat_a, b, lat_b), (_, w1, lat_w1, w2, lat_w2) in zip(ahead, reversed(behind)):
            forward.append((v, a, lat_a, b, lat_b, at[w1], at[w2]))
            backward.append((v, w1, lat_w1, w2, lat_w2, at[a], at[b]))
        return forward, backward

    def _build_tables(self, evaluator: PlanEvaluator) -> None:
        """Per clock profiled for every unit, the durations and the prefix sums of effective energy
        ``E - P_p2p * t`` along the flat unit order (the same sums, term by term, as a loop over units)."""
        keys = evaluator.cost_keys
        distinct = list(dict.fromkeys(keys))
        index = {key: i for i, key in enumerate(distinct)}
        ids = [index[key] for key in keys]
        p2p = evaluator.p2p_power_w
        points = [evaluator.key_points(key) for key in distinct]  # per micro-batch size class too, if sized
        times = [{p.freq_mhz: p.time_s for p in pts} for pts in points]
        energies = [{p.freq_mhz: p.energy_j for p in pts} for pts in points]
        self.durations: dict[int, list[float]] = {}
        self.prefix: dict[int, list[float]] = {}
        for f in sorted(set(self.freqs)):
            if not all(f in t for t in times):
                continue  # a clock not profiled for every unit is no merge target
            t_key = [t[f] for t in times]
            eff_key = [e[f] - p2p * t[f] for t, e in zip(times, energies)]
            self.durations[f] = list(map(t_key.__getitem__, ids))
            self.prefix[f] = list(accumulate(map(eff_key.__getitem__, ids), initial=0.0))

    # -- timing --------------------------------------------------------------------------
    def fits(self, run: ClockRun, first: int, last: int, freq: int) -> bool:
        """Run units ``first..last-1`` (flat; ``run``'s) at ``freq`` if the iteration still ends by the deadline.

        A merge that slows no unit always fits: its changes are marked and propagated only as far as
        a later check reads (:meth:`settle`). A merge that slows units is first checked along its own
        rank (a lower bound of the new end times against the latest finish times: a cheap, exact
        rejection), then by propagation (:meth:`ends_by_deadline`). The rank's no is remembered (module docstring).
        """
        table = self.durations[freq]
        dur, end, lf = self.dur, self.end, self.latest_finish
        old_dur = dur[first:last]
        new_dur = table[first:last]
        if last - first == 1:  # most runs are one unit: no generators
            no_later = new_dur[0] <= old_dur[0]
            longer = new_dur[0] >= old_dur[0]
        else:
            no_later = all(b <= a for a, b in zip(old_dur, new_dur))
            longer = not no_later and all(b >= a for a, b in zip(old_dur, new_dur))
        if no_later:  # no unit ends later: it fits
            if new_dur != old_dur:
                self._epoch += 1
            dur[first:last] = new_dur
            self._defer(first, last)
            return True
        self.exact_checks += 1
        if longer:
            pos = self.topo_pos
            # The check reads the ends of units before the run and the latest finishes of the run's own.
            if self._fwd_lo <= pos[last - 1] or self._bwd_hi >= pos[first]:
                self.settle(pos[last - 1], pos[first])
            # Nothing gets faster, so no unit ends earlier than now: walking the run with the
            # current ends of its other inputs gives lower bounds of its new end times.
            preds = self.preds
            ends = _RunChain(end, first, last)
            for v in range(first, last):
                chain = ready_s(preds[v], ends) + dur[v] + (new_dur[v - first] - old_dur[v - first])
                ends.chain = chain
                if chain > lf[v] * (1 + _RTOL):
                    self._refused[(run, freq)] = (run.version, self._epoch)
                    return False
        self.settle(math.inf, -math.inf)
        dur[first:last] = new_dur
        if not self.ends_by_deadline(first, last, longer):
            dur[first:last] = old_dur
            return False
        if not longer:
            self._epoch += 1
        self._defer(first, last)
        return True

    def still_refused(self, run: ClockRun, freq: int) -> bool:
        """Whether giving ``run`` the clock ``freq`` was refused by a check whose answer stands (module
        docstring): counted as a deadline check, answered without one."""
        refused = self._refused.get((run, freq))
        if refused is not None and refused[0] == run.version and refused[1] == self._epoch:
            self.exact_checks += 1
            return True
        return False

    def _defer(self, first: int, last: int) -> None:
        """Mark units ``first..last-1`` (durations changed, the merge taken) for propagation both ways."""
        pos, fwd, bwd = self.topo_pos, self._fwd_dirty, self._bwd_dirty
        lo, hi = self._fwd_lo, self._bwd_hi
        for v in range(first, last):
            p = pos[v]
            fwd[p] = 1
            bwd[p] = 1
            if p < lo:
                lo = p
            if p > hi:
                hi = p
        self._fwd_lo, self._bwd_hi = lo, hi

    def settle(self, fwd_upto: float, bwd_downto: float) -> None:
        """Propagate marked changes: earliest times exact up to topological position ``fwd_upto``, latest times
        from ``bwd_downto`` on (a unit's inputs all come earlier in the order, so the rest can wait)."""
        n = self.n
        if self._fwd_lo <= fwd_upto:
            stop = n if fwd_upto >= n - 1 else int(fwd_upto) + 1
            dirty = self._fwd_dirty
            find = dirty.find
            dur, end, order = self.dur, self.end, self.order
            pos, preds, succs = self.topo_pos, self.preds, self.succs
            walked = 0
            steps = self._steps and self._steps[0]
            p = find(1, self._fwd_lo, stop)
            if steps is not None:
                while p >= 0:
                    dirty[p] = 0
                    walked += 1
                    v, a, lat_a, b, lat_b, p1, p2 = steps[p]
                    e = ready_pair_s(end, a, lat_a, b, lat_b) + dur[v]
                    if e != end[v]:
                        end[v] = e
                        dirty[p1] = 1
                        dirty[p2] = 1
                    p = find(1, p + 1, stop)
            while p >= 0:
                dirty[p] = 0
                v = order[p]
                walked += 1
                e = ready_s(preds[v], end) + dur[v]
                if e != end[v]:
                    end[v] = e
                    for w, _ in succs[v]:
                        dirty[pos[w]] = 1
                p = find(1, p + 1, stop)
            self.units_walked += walked
            self._fwd_lo = stop
        if self._bwd_hi >= bwd_downto:
            lo = 0 if bwd_downto <= 0 else int(bwd_downto)
            dirty = self._bwd_dirty
            rfind = dirty.rfind
            dur, ls, lf, order = self.dur, self.latest_start, self.latest_finish, self.order
            pos, preds, succs, deadline = self.topo_pos, self.preds, self.succs, self.deadline_s
            walked = 0
            steps = self._steps and self._steps[1]
            p = rfind(1, lo, self._bwd_hi + 1)
            if steps is not None:
                while p >= 0:
                    dirty[p] = 0
                    walked += 1
                    v, w1, lat_w1, w2, lat_w2, p1, p2 = steps[p]
                    t = due_pair_s(ls, deadline, w1, lat_w1, w2, lat_w2)
                    new_ls = t - dur[v]
                    lf[v] = t
                    if new_ls != ls[v]:
                        ls[v] = new_ls
                        dirty[p1] = 1
                        dirty[p2] = 1
                    p = rfind(1, lo, p)
            while p >= 0:
                dirty[p] = 0
                v = order[p]
                walked += 1
                t = due_s(succs[v], ls, deadline)
                new_ls = t - dur[v]
                lf[v] = t
                if new_ls != ls[v]:
                    ls[v] = new_ls
                    for u, _ in preds[v]:
                        dirty[pos[u]] = 1
                p = rfind(1, lo, p)
            self.units_walked += walked
            self._bwd_hi = lo - 1

    def ends_by_deadline(self, first: int, last: int, longer: bool) -> bool:
        """Whether every unit still ends by the deadline (x (1 + _RTOL)) with the durations of ``first..last-1``
        just changed (everything else settled); leaves the timeline as it was.

        Propagates earliest times downstream in topological order, with a margin far above rounding
        (_PRUNE_RTOL x deadline) either way. It stops at a unit that ends past its latest finish by the
        margin (a path on from it ends too late): any unit when all changed units are ``longer`` (latest
        finishes then only fall), else one after the run (no ancestor of it: its latest finish stands).
        It does not go on from a unit after the run whose end grew but stays below its latest finish less
        the margin: whatever follows through it ends before the deadline. Ends that fall always propagate,
        so every end computed is a lower bound of its true one (exact without such stops), and both
        answers are the full propagation's, which walks every unit to the iteration's end.
        """
        dur, end, lf, order = self.dur, self.end, self.latest_finish, self.order
        pos, preds, succs, n = self.topo_pos, self.preds, self.succs, self.n
        limit = self.deadline_s * (1 + _RTOL)
        margin = self.deadline_s * _PRUNE_RTOL
        boundary = pos[last - 1]
        # A unit is walked at most once (its dependants come later in the order); slot n: the absent edge's.
        marked = bytearray(n + 1)
        find = marked.find
        for v in range(first, last):
            marked[pos[v]] = 1
        undo: list[tuple[int, float]] = []
        fits = True
        walked = 0
        steps = self._steps and self._steps[0]
        p1 = p2 = n
        p = find(1, min(pos[v] for v in range(first, last)), n)
        while p >= 0:
            walked += 1
            if steps is not None:
                v, a, lat_a, b, lat_b, p1, p2 = steps[p]
                t = ready_pair_s(end, a, lat_a, b, lat_b)
            else:
                v = order[p]
                t = ready_s(preds[v], end)
            e = t + dur[v]
            old = end[v]
            if e != old:
                undo.append((v, old))
                end[v] = e
                after = p > boundary
                if e > limit or (e > lf[v] + margin and (longer or after)):  # a path on from v ends too late
                    fits = False
                    break
                if not (after and old < e <= lf[v] - margin):  # else every path on through v ends in time
                    if steps is not None:
                        marked[p1] = 1
                        marked[p2] = 1
                    else:
                        for w, _ in succs[v]:
                            marked[pos[w]] = 1
            p = find(1, p + 1, n)
        self.units_walked += walked
        for w, e0 in reversed(undo):
            end[w] = e0
        return fits

    # -- merges --------------------------------------------------------------------------
    def loss_j(self, run: ClockRun, freq: int) -> float:
        """Effective energy run ``run`` gives up at ``freq`` (negative: it saves energy)."""
        base = self.offset[run.stage]
        new, old = self.prefix[freq], self.prefix[run.freq]
        a, b = base + run.start, base + run.end
        return (new[b] - new[a]) - (old[b] - old[a])

    def candidates(self, run: ClockRun) -> list[tuple[int, int, int, float]]:
        """(clock, changes removed, steady changes removed, energy given up) for each neighbour clock ``run``
        could take. Changes count the first lock (FrequencyPlan.clock_changes); steady changes are those of a
        repeating iteration (steady_clock_changes): a rank's first and last run also meet across iterations.
        Kept per run version (whatever they read bumps the version: :meth:`apply`, :meth:`touch`)."""
        if run.cands_version == run.version:
            return run.cands
        out = []
        if run.freq in self.prefix:
            head, tail = self.head[run.stage], self.tail[run.stage]
            across = tail if run is head and run is not tail else head if run is tail and run is not head else None
            prev, nxt = run.prev, run.next
            for freq in {r.freq for r in (prev, nxt) if r is not None}:
                if freq not in self.prefix:
                    continue
                removed = (prev is not None and prev.freq == freq) + (nxt is not None and nxt.freq == freq)
                steady = removed
                if across is not None:  # the change into the next iteration may appear or go
                    steady += (across.freq != run.freq) - (across.freq != freq)
                out.append((freq, removed, steady, self.loss_j(run, freq)))
            out.sort()
        run.cands, run.cands_version = out, run.version
        return out

    def apply(self, run: ClockRun, freq: int) -> list[ClockRun] | None:
        """Give ``run`` the clock ``freq`` if the deadline allows; the runs whose candidates changed, or None."""
        base = self.offset[run.stage]
        first, last = base + run.start, base + run.end
        if not self.fits(run, first, last, freq):
            return None
        self.freqs[first:last] = [freq] * (last - first)
        run.freq = freq
        run.version += 1
        for other in (run.prev, run.next):
            if other is not None and other.freq == freq:
                self._absorb(run, other)
        self.merges += 1
        # The first and last run's candidates depend on each other's clock (the change across iterations).
        ends = (self.head[run.stage], self.tail[run.stage])
        return list(dict.fromkeys(r for r in (run.prev, run, run.next, *ends) if r is not None))

    def _absorb(self, run: ClockRun, other: ClockRun) -> None:
        """Join neighbour ``other`` (same clock) into ``run``."""
        run.start, run.end = min(run.start, other.start), max(run.end, other.end)
        if other is run.prev:
            run.prev = other.prev
            if other.prev is not None:
                other.prev.next = run
        else:
            run.next = other.next
            if other.next is not None:
                other.next.prev = run
        other.alive = False
        if self.head[run.stage] is other:
            self.head[run.stage] = run
        if self.tail[run.stage] is other:
            self.tail[run.stage] = run
        self.changes[run.stage] -= 1

    def touch(self, runs: list[ClockRun]) -> None:
        for r in runs:
            r.version += 1

    def plan(self) -> FrequencyPlan:
        return FrequencyPlan.from_flat(self.schedule, self.freqs)


class _RunChain:
    """The end times :meth:`SwitchingState.fits` reads for a run ``first..last-1`` walked along its rank: a unit
    of the run reads the bound just computed for the run (``chain``), any other unit its current end."""

    __slots__ = ("end", "first", "last", "chain")

    def __init__(self, end: list[float], first: int, last: int) -> None:
        self.end, self.first, self.last = end, first, last
        self.chain = -math.inf

    def __getitem__(self, u: int) -> float:
        return self.chain if self.first <= u < self.last else self.end[u]
