"""Fewer clock changes: a post-pass that merges a unit run's clock into its neighbour's when switching buys little.

Optimal plans change the SM clock at almost every unit (interleaved.md finding (c): 160-185
changes per rank per iteration at V = 2), yet many of those changes save a fraction of a joule:
neighbouring units sit on the same slack and differ by one clock step. Each change has a price
the profile does not show (the lock call, the transition during which the GPU runs at neither
clock), so a change is only worth keeping when it saves more than that price.

The pass works per rank on *runs* (maximal stretches of consecutive units at one clock, in
execution order). Merging a run means giving it a neighbouring run's clock, which removes one
change (two when both neighbours share that clock). At a fixed iteration time a unit costs its
*effective* energy ``E(f) - P_p2p * t(f)`` (the optimal planner's objective), so the energy a
merge gives up is the run's effective-energy difference, exact while the iteration time stays
put and an upper bound when a faster clock shortens it.

* **Switch cost** ``switch_cost_j``: merges are taken greedily, best first, while the energy
  given up is below ``switch_cost_j`` per change removed (so energy + switch_cost x changes
  only falls). The changes counted are those a repeating iteration makes
  (:func:`steady_clock_changes`: the wrap from an iteration's last unit to the next one's first
  included), the same count the plan's energy is charged for.
* **Budget** ``max_clock_changes``: then, on every rank still above the budget, the merges that
  give up the least energy per change removed, until the rank is within it. A higher clock is
  not always a shorter unit (profiles are measured: Bloom's stage 0 forward takes longer at
  1740 MHz than at 1560 MHz), so a rank may have no merge left that meets the deadline: it is
  then listed in ``budget_unmet`` (the planner warns) rather than made slower.

**Deadline.** A faster clock never delays any unit (the simulation is an earliest-start walk);
a slower one is accepted only if the iteration still ends by ``deadline_s``. The pass keeps the
simulated timeline exact incrementally (a merge's changes are propagated, with the simulator's
own recurrence, only as far as a later check reads them, and a check stops once its answer is
certain), so each check costs what it touches, not a whole simulation (at 32 stages x 256
micro-batches the pass went from 16 to 2 CPU s, with the same plan). The result is simulated and scored again by the evaluator.

**Default switch cost.** The GPU's clock-change latency model
(:class:`~megatron_envpipe.core.clock_latency.ClockLatency`, ``configs/gpus.toml`` or the default):
settle time x the P2P blocking power, a GPU whose clock is being changed being assumed to spend its
settle time doing nothing useful at blocking power. The default settle time (10 ms,
``DEFAULT_SWITCH_LATENCY_S``) is an assumption, not a measurement of ours (EnvPipe's code neither
measures nor states a latency; Velicka et al., arXiv 2502.20075, show it differs markedly between
GPUs): measure it with ``envpipe gpu-check`` (step 3) and pass ``--switch-cost-j`` (latency x power) for your GPU.

**What a plan is worth.** A plan's energy is its simulated energy plus ``switch_cost_j`` x its
:func:`steady_clock_changes`; its baseline (every unit at f_max) makes none. See
``PlanResult.energy_j`` (planning/basis.py).
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass

from megatron_envpipe.core.clock_latency import DEFAULT_CLOCK_LATENCY, ClockLatency
from megatron_envpipe.core.graph import latest_times, successors
from megatron_envpipe.core.plan import FrequencyPlan
from megatron_envpipe.core.profile import ProfileError
from megatron_envpipe.core.timeline import PlanEvaluator, PlanScore, Timeline
from megatron_envpipe.errors import UsageError

DEFAULT_SWITCH_LATENCY_S = DEFAULT_CLOCK_LATENCY.settle_s  # time lost per clock change (module docstring)
MAX_SWITCH_COST_J = 1e6
_RTOL = 1e-12  # a plan meets its deadline when its makespan is at most deadline x (1 + _RTOL)
_PRUNE_RTOL = 1e-9  # slack (x deadline) that rounding along any path cannot eat: _Pass._ends_by_deadline


class SwitchingError(UsageError, ValueError):
    """A switch cost or clock-change budget that cannot be used."""


def default_switch_cost_j(p2p_power_w: float, latency: ClockLatency = DEFAULT_CLOCK_LATENCY) -> float:
    """The switch cost used when none is given: the latency model's, ``latency.settle_s`` x the P2P blocking power."""
    return latency.switch_cost_j(p2p_power_w)


def steady_clock_changes(plan: FrequencyPlan) -> tuple[int, ...]:
    """Per rank, the clock changes one iteration makes when iterations repeat: between consecutive units,
    and from the iteration's last unit to the next one's first (the clock controller skips a request for
    the clock already locked, so a plan at one clock makes none). What a plan's switch energy counts."""
    return tuple(sum(1 for a, b in zip(row, (*row[1:], *row[:1])) if a != b) for row in plan.freqs_mhz)


def switch_energy_j(plan: FrequencyPlan, switch_cost_j: float) -> float:
    """``switch_cost_j`` x every rank's :func:`steady_clock_changes`: the energy a plan's switches cost."""
    return switch_cost_j * sum(steady_clock_changes(plan)) if switch_cost_j else 0.0


def check_switching(switch_cost_j: float | None, max_clock_changes: int | None) -> None:
    """Range and kind of the two knobs (None: not given); SwitchingError naming the flag otherwise."""
    if switch_cost_j is not None and (isinstance(switch_cost_j, bool) or not isinstance(switch_cost_j, int | float)
                                      or not 0 <= switch_cost_j <= MAX_SWITCH_COST_J):
        raise SwitchingError(f"switch cost (--switch-cost-j) must be a finite number of joules between 0 and "
                             f"{MAX_SWITCH_COST_J:g} per clock change, got {switch_cost_j!r}")
    if max_clock_changes is not None and (isinstance(max_clock_changes, bool) or not isinstance(max_clock_changes, int)
                                          or max_clock_changes < 1):
        raise SwitchingError(f"clock-change budget (--max-clock-changes) must be a whole number >= 1 per rank per "
                             f"iteration (the first lock counts), got {max_clock_changes!r}")


@dataclass(frozen=True)
class SwitchingResult:
    """A plan after the pass, scored, with what the pass changed."""

    plan: FrequencyPlan
    timeline: Timeline
    score: PlanScore
    deadline_s: float
    switch_cost_j: float
    max_clock_changes: int | None
    changes_before: tuple[int, ...]  # per rank per iteration, the first lock counted (FrequencyPlan.clock_changes)
    changes_after: tuple[int, ...]
    charged_before: tuple[int, ...]  # per rank per iteration in a repeating run (steady_clock_changes)
    charged_after: tuple[int, ...]
    energy_before_j: float
    merges: int
    budget_unmet: tuple[int, ...]  # ranks still above max_clock_changes: no merge left meets the deadline
    exact_checks: int  # merges that slowed some unit, so needed a deadline check
    units_walked: int = 0  # units whose times the pass recomputed (its cost; not in the summary)

    @property
    def energy_given_up_j(self) -> float:
        return self.score.energy_j - self.energy_before_j

    def summary(self) -> dict:
        """The JSON entry ``clock_switching`` of a plan."""
        return {
            "switch_cost_j": self.switch_cost_j,
            "max_clock_changes": self.max_clock_changes,
            "clock_changes_before": list(self.changes_before),
            "clock_changes_after": list(self.changes_after),
            "energy_before_j": self.energy_before_j,
            "energy_given_up_j": self.energy_given_up_j,
            "charged_clock_changes_before": list(self.charged_before),
            "charged_clock_changes_after": list(self.charged_after),
            "switch_energy_saved_j": self.switch_cost_j * (sum(self.charged_before) - sum(self.charged_after)),
            "merges": self.merges,
            "budget_unmet_ranks": list(self.budget_unmet),
            "exact_deadline_checks": self.exact_checks,
        }


class _Run:
    """Units ``start..end-1`` (positions on one rank) at one clock; a node of the rank's linked list."""

    __slots__ = ("stage", "start", "end", "freq", "prev", "next", "version", "alive")

    def __init__(self, stage: int, start: int, end: int, freq: int) -> None:
        self.stage, self.start, self.end, self.freq = stage, start, end, freq
        self.prev: _Run | None = None
        self.next: _Run | None = None
        self.version = 0
        self.alive = True


class _Pass:
    """The state of one pass over one plan: per-clock unit tables, runs per rank, the exact timeline."""

    def __init__(self, plan: FrequencyPlan, evaluator: PlanEvaluator, deadline_s: float) -> None:
        self.schedule = plan.schedule
        self.evaluator = evaluator
        self.graph = evaluator.graph
        self.deadline_s = deadline_s
        self.freqs = plan.flat()
        self.offset = []
        k = 0
        for order in self.schedule.orders:
            self.offset.append(k)
            k += len(order)
        self.n = k
        p2p = evaluator.p2p_power_w
        # Per clock, every unit's duration and effective energy, as prefix sums along each rank: a run's
        # cost at any clock is then two lookups. A clock not profiled for every unit is no merge target.
        self.durations: dict[int, list[float]] = {}
        self.prefix: dict[int, list[float]] = {}
        for f in sorted(set(self.freqs)):
            try:
                dur = evaluator.durations([f] * self.n)
                energy = evaluator.unit_energies([f] * self.n)
            except ProfileError:
                continue
            self.durations[f] = dur
            acc, pre = 0.0, [0.0]
            for d, e in zip(dur, energy):
                acc += e - p2p * d
                pre.append(acc)
            self.prefix[f] = pre
        self.succs = successors(self.graph.preds)
        self.topo_pos = [0] * self.n
        for i, v in enumerate(self.graph.order):
            self.topo_pos[v] = i
        self.dur = evaluator.durations(self.freqs)
        timeline = self.graph.simulate(self.dur)
        self.start, self.end = list(timeline.start_s), list(timeline.end_s)
        self.latest_start, self.latest_finish = latest_times(self.graph.order, self.succs, self.dur, deadline_s)
        self.runs: list[list[_Run]] = []
        for s, row in enumerate(plan.freqs_mhz):
            runs: list[_Run] = []
            i = 0
            while i < len(row):
                j = i
                while j < len(row) and row[j] == row[i]:
                    j += 1
                run = _Run(s, i, j, row[i])
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
        # Changes of merges taken, not yet propagated (heaps by topological position, forward and backward):
        # propagated only as far as a later check reads (the recurrences depend on durations alone, so the
        # values are those of propagating at once; most merges are followed by checks that read little).
        self._fwd_heap: list[tuple[int, int]] = []
        self._fwd_queued: set[int] = set()
        self._bwd_heap: list[tuple[int, int]] = []
        self._bwd_queued: set[int] = set()

    # -- timing --------------------------------------------------------------------------
    def _fits(self, first: int, last: int, freq: int) -> bool:
        """Run units ``first..last-1`` (flat) at ``freq`` if the iteration still ends by the deadline.

        The timeline (earliest start/end) and the latest finish times for the deadline are kept
        exact incrementally with the simulator's own recurrences, so the numbers are bit for bit a
        full simulation's. A merge that slows no unit always fits: its changes are queued and
        propagated only as far as a later check reads (:meth:`_settle`). A merge that slows units
        is first checked along its own rank (a lower bound of the new end times against the latest
        finish times: a cheap, exact rejection), then by propagation (:meth:`_ends_by_deadline`).
        """
        table = self.durations[freq]
        dur, end, lf = self.dur, self.end, self.latest_finish
        old_dur = dur[first:last]
        new_dur = table[first:last]
        if all(b <= a for a, b in zip(old_dur, new_dur)):  # no unit ends later: it fits
            dur[first:last] = new_dur
            self._defer(range(first, last))
            return True
        self.exact_checks += 1
        longer = all(b >= a for a, b in zip(old_dur, new_dur))
        if longer:
            # The check reads the ends of units before the run and the latest finishes of the run's own.
            self._settle(self.topo_pos[last - 1], self.topo_pos[first])
            # Nothing gets faster, so no unit ends earlier than now: walking the run with the
            # current ends of its other inputs gives lower bounds of its new end times.
            preds = self.graph.preds
            chain = -math.inf
            for v in range(first, last):
                t = 0.0
                for u, lat in preds[v]:
                    ready = (chain if first <= u < last else end[u]) + lat
                    if ready > t:
                        t = ready
                chain = t + dur[v] + (new_dur[v - first] - old_dur[v - first])
                if chain > lf[v] * (1 + _RTOL):
                    return False
        self._settle(math.inf, -math.inf)
        dur[first:last] = new_dur
        if not self._ends_by_deadline(first, last, longer):
            dur[first:last] = old_dur
            return False
        self._defer(range(first, last))
        return True

    def _defer(self, seeds: range) -> None:
        """Queue ``seeds`` (durations changed, the merge taken) for propagation both ways."""
        pos = self.topo_pos
        for v in seeds:
            if v not in self._fwd_queued:
                self._fwd_queued.add(v)
                heapq.heappush(self._fwd_heap, (pos[v], v))
            if v not in self._bwd_queued:
                self._bwd_queued.add(v)
                heapq.heappush(self._bwd_heap, (-pos[v], v))

    def _settle(self, fwd_upto: float, bwd_downto: float) -> None:
        """Propagate queued changes: earliest times exact up to topological position ``fwd_upto``, latest times
        from ``bwd_downto`` on (a unit's inputs all come earlier in the order, so the rest can wait)."""
        heap, queued = self._fwd_heap, self._fwd_queued
        if heap and heap[0][0] <= fwd_upto:
            dur, start, end = self.dur, self.start, self.end
            pos, preds, succs = self.topo_pos, self.graph.preds, self.succs
            while heap and heap[0][0] <= fwd_upto:
                _, v = heapq.heappop(heap)
                queued.discard(v)
                self.units_walked += 1
                t = 0.0
                for u, lat in preds[v]:
                    ready = end[u] + lat
                    if ready > t:
                        t = ready
                e = t + dur[v]
                start[v] = t
                if e != end[v]:
                    end[v] = e
                    for w, _ in succs[v]:
                        if w not in queued:
                            queued.add(w)
                            heapq.heappush(heap, (pos[w], w))
        heap, queued = self._bwd_heap, self._bwd_queued
        if heap and -heap[0][0] >= bwd_downto:
            dur, ls, lf = self.dur, self.latest_start, self.latest_finish
            pos, preds, succs, deadline = self.topo_pos, self.graph.preds, self.succs, self.deadline_s
            while heap and -heap[0][0] >= bwd_downto:
                _, v = heapq.heappop(heap)
                queued.discard(v)
                self.units_walked += 1
                t = deadline
                for w, lat in succs[v]:
                    by = ls[w] - lat
                    if by < t:
                        t = by
                new_ls = t - dur[v]
                lf[v] = t
                if new_ls != ls[v]:
                    ls[v] = new_ls
                    for u, _ in preds[v]:
                        if u not in queued:
                            queued.add(u)
                            heapq.heappush(heap, (-pos[u], u))

    def _ends_by_deadline(self, first: int, last: int, longer: bool) -> bool:
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
        dur, start, end, lf = self.dur, self.start, self.end, self.latest_finish
        pos, preds, succs = self.topo_pos, self.graph.preds, self.succs
        limit = self.deadline_s * (1 + _RTOL)
        margin = self.deadline_s * _PRUNE_RTOL
        boundary = pos[last - 1]
        heap = [(pos[v], v) for v in range(first, last)]
        queued = set(range(first, last))
        undo: list[tuple[int, float, float]] = []
        fits = True
        while heap:
            _, v = heapq.heappop(heap)
            self.units_walked += 1
            t = 0.0
            for u, lat in preds[v]:
                ready = end[u] + lat
                if ready > t:
                    t = ready
            e = t + dur[v]
            old = end[v]
            if e == old:
                continue
            undo.append((v, start[v], old))
            start[v], end[v] = t, e
            after = pos[v] > boundary
            if e > limit or (e > lf[v] + margin and (longer or after)):  # a path on from v ends too late
                fits = False
                break
            if after and old < e <= lf[v] - margin:
                continue  # every path on through v ends before the deadline
            for w, _ in succs[v]:
                if w not in queued:
                    queued.add(w)
                    heapq.heappush(heap, (pos[w], w))
        for w, s0, e0 in reversed(undo):
            start[w], end[w] = s0, e0
        return fits

    # -- merges --------------------------------------------------------------------------
    def loss_j(self, run: _Run, freq: int) -> float:
        """Effective energy run ``run`` gives up at ``freq`` (negative: it saves energy)."""
        base = self.offset[run.stage]
        new, old = self.prefix[freq], self.prefix[run.freq]
        a, b = base + run.start, base + run.end
        return (new[b] - new[a]) - (old[b] - old[a])

    def candidates(self, run: _Run) -> list[tuple[int, int, int, float]]:
        """(clock, changes removed, steady changes removed, energy given up) for each neighbour clock ``run``
        could take. Changes count the first lock (FrequencyPlan.clock_changes); steady changes are those of a
        repeating iteration (steady_clock_changes): a rank's first and last run also meet across iterations."""
        if run.freq not in self.prefix:
            return []
        head, tail = self.head[run.stage], self.tail[run.stage]
        across = tail if run is head and run is not tail else head if run is tail and run is not head else None
        out = []
        for freq in {r.freq for r in (run.prev, run.next) if r is not None}:
            if freq not in self.prefix:
                continue
            removed = sum(1 for r in (run.prev, run.next) if r is not None and r.freq == freq)
            steady = removed
            if across is not None:  # the change into the next iteration may appear or go
                steady += (across.freq != run.freq) - (across.freq != freq)
            out.append((freq, removed, steady, self.loss_j(run, freq)))
        return sorted(out)

    def apply(self, run: _Run, freq: int) -> list[_Run] | None:
        """Give ``run`` the clock ``freq`` if the deadline allows; the runs whose candidates changed, or None."""
        base = self.offset[run.stage]
        first, last = base + run.start, base + run.end
        if not self._fits(first, last, freq):
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

    def _absorb(self, run: _Run, other: _Run) -> None:
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

    def touch(self, runs: Sequence[_Run]) -> None:
        for r in runs:
            r.version += 1

    def plan(self) -> FrequencyPlan:
        return FrequencyPlan.from_flat(self.schedule, self.freqs)


def _greedy(state: _Pass, runs: Iterable[_Run], priority: Callable[[int, int, float], float | None],
            done: Callable[[], bool] = lambda: False) -> None:
    """Apply merges of ``runs`` (and of the runs they change), lowest ``priority(changes removed, steady changes
    removed, energy given up)`` first (None: not worth it), skipping those the deadline forbids, until ``done()``
    or none is left."""
    heap: list[tuple[float, int, int, int, _Run]] = []
    tick = 0

    def push(run: _Run) -> None:
        nonlocal tick
        for freq, removed, steady, loss in state.candidates(run):
            key = priority(removed, steady, loss)
            if key is not None:
                heapq.heappush(heap, (key, tick, run.version, freq, run))  # tick: deterministic ties
                tick += 1

    for run in runs:
        push(run)
    while heap and not done():
        _, _, version, freq, run = heapq.heappop(heap)
        if not run.alive or run.version != version:
            continue  # stale: the run changed since
        changed = state.apply(run, freq)
        if changed is None:
            continue  # too slow for the deadline: this run keeps its clock
        state.touch(changed)
        for r in changed:
            push(r)


def _alive(runs: Iterable[_Run]) -> Iterator[_Run]:
    """The runs not absorbed into a neighbour (a merge keeps one of the two objects)."""
    return (run for run in runs if run.alive)


def _by_switch_cost(state: _Pass, switch_cost_j: float) -> None:
    """Merges giving up less than ``switch_cost_j`` per steady change removed, the largest net gain first."""
    def net_loss(removed: int, steady: int, loss: float) -> float | None:
        value = loss - steady * switch_cost_j
        return value if value < 0 else None

    # A merge the deadline forbade may fit once others have sped units up: rounds until none is taken.
    while True:
        merges = state.merges
        _greedy(state, _alive(run for runs in state.runs for run in runs), net_loss)
        if state.merges == merges:
            return


def _by_budget(state: _Pass, max_changes: int) -> None:
    """On every rank above ``max_changes``: the merges giving up the least energy per change removed."""
    # Sweeps over the ranks until none merges: another rank's merges may make room for this one's.
    while True:
        merges = state.merges
        for s in range(len(state.runs)):
            if state.changes[s] > max_changes:
                _greedy(state, _alive(state.runs[s]), lambda removed, steady, loss: loss / removed,
                        lambda s=s: state.changes[s] <= max_changes)
        if state.merges == merges:
            return  # every rank within budget, or no merge of the others fits the deadline (reported)


def reduce_clock_changes(
    plan: FrequencyPlan,
    evaluator: PlanEvaluator,
    deadline_s: float | None = None,
    switch_cost_j: float = 0.0,
    max_clock_changes: int | None = None,
) -> SwitchingResult:
    """Merge clocks of neighbouring unit runs per rank (module docstring); the plan never ends after ``deadline_s``.

    ``deadline_s`` None: the plan's own iteration time (the pass never slows the iteration).
    ``evaluator`` must be the plan's schedule's (it scores the result).
    """
    check_switching(switch_cost_j, max_clock_changes)
    if evaluator.schedule is not plan.schedule and evaluator.schedule.orders != plan.schedule.orders:
        raise SwitchingError("the evaluator scores another schedule than the plan's")
    before_timeline = evaluator.simulate(plan.flat())
    before = evaluator.score(plan.flat(), before_timeline)
    own = before_timeline.iteration_time_s
    deadline = own if deadline_s is None else max(float(deadline_s), own)
    if not math.isfinite(deadline):
        raise SwitchingError(f"deadline must be a finite number of seconds, got {deadline_s!r}")
    state = _Pass(plan, evaluator, deadline)
    if switch_cost_j > 0:
        _by_switch_cost(state, float(switch_cost_j))
    if max_clock_changes is not None:
        _by_budget(state, max_clock_changes)
    new_plan = state.plan() if state.merges else plan
    timeline = evaluator.simulate(new_plan.flat()) if state.merges else before_timeline
    score = evaluator.score(new_plan.flat(), timeline) if state.merges else before
    if timeline.iteration_time_s > deadline * (1 + 1e-9):  # the tests above are exact or conservative
        raise AssertionError(f"clock-change pass broke the deadline: {timeline.iteration_time_s} > {deadline}")
    return SwitchingResult(
        plan=new_plan,
        timeline=timeline,
        score=score,
        deadline_s=deadline,
        switch_cost_j=float(switch_cost_j),
        max_clock_changes=max_clock_changes,
        changes_before=plan.clock_changes(),
        changes_after=new_plan.clock_changes(),
        charged_before=steady_clock_changes(plan),
        charged_after=steady_clock_changes(new_plan),
        energy_before_j=before.energy_j,
        merges=state.merges,
        budget_unmet=tuple(s for s, c in enumerate(new_plan.clock_changes())
                           if max_clock_changes is not None and c > max_clock_changes),
        exact_checks=state.exact_checks,
        units_walked=state.units_walked,
    )
