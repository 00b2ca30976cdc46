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
micro-batches the pass went from 16 to 2 CPU s, with the same plan). That state lives in
:mod:`~megatron_envpipe.planning.switching_state`: cost tables per clock built per (stage, chunk,
instruction), the plan's own simulation reused, propagation by a byte-array scan over topological
positions, and a refused merge not checked again while no merge taken since has shortened a unit
(issue 24: 1.3-1.6x less CPU again, same plans and summaries). The result is simulated and scored again by the evaluator.

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
import threading
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

from megatron_envpipe.core.clock_latency import DEFAULT_CLOCK_LATENCY, ClockLatency
from megatron_envpipe.core.plan import FrequencyPlan
from megatron_envpipe.core.timeline import PlanEvaluator, PlanScore, Timeline
from megatron_envpipe.errors import UsageError
from megatron_envpipe.planning.switching_state import ClockRun, SwitchingState

DEFAULT_SWITCH_LATENCY_S = DEFAULT_CLOCK_LATENCY.settle_s  # time lost per clock change (module docstring)
_MAX_SWITCH_COST_J = 1e6


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
                                      or not 0 <= switch_cost_j <= _MAX_SWITCH_COST_J):
        raise SwitchingError(f"switch cost (--switch-cost-j) must be a finite number of joules between 0 and "
                             f"{_MAX_SWITCH_COST_J:g} per clock change, got {switch_cost_j!r}")
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


def _greedy(state: SwitchingState, runs: Iterable[ClockRun], priority: Callable[[int, int, float], float | None],
            done: Callable[[], bool] = lambda: False) -> None:
    """Apply merges of ``runs`` (and of the runs they change), lowest ``priority(changes removed, steady changes
    removed, energy given up)`` first (None: not worth it), skipping those the deadline forbids, until ``done()``
    or none is left."""
    # Entries (priority, tick, run version, clock, run): the tick makes the order total, so the order they
    # leave the heap in does not depend on how the heap was built (heapify for the first batch).
    heap: list[tuple[float, int, int, int, ClockRun]] = []
    tick = 0
    for run in runs:
        for freq, removed, steady, loss in state.candidates(run):
            key = priority(removed, steady, loss)
            if key is not None:
                heap.append((key, tick, run.version, freq, run))
                tick += 1
    heapq.heapify(heap)
    heappush, heappop = heapq.heappush, heapq.heappop
    while heap and not done():
        _, _, version, freq, run = heappop(heap)
        if not run.alive or run.version != version or state.still_refused(run, freq):
            continue  # stale: the run changed since, or the deadline forbade this merge and still does
        changed = state.apply(run, freq)
        if changed is None:
            continue  # too slow for the deadline: this run keeps its clock
        state.touch(changed)
        for r in changed:
            for freq, removed, steady, loss in state.candidates(r):
                key = priority(removed, steady, loss)
                if key is not None:
                    heappush(heap, (key, tick, r.version, freq, r))
                    tick += 1


def _alive(runs: Iterable[ClockRun]) -> Iterator[ClockRun]:
    """The runs not absorbed into a neighbour (a merge keeps one of the two objects)."""
    return (run for run in runs if run.alive)


def _by_switch_cost(state: SwitchingState, switch_cost_j: float) -> None:
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


def _by_budget(state: SwitchingState, max_changes: int) -> None:
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


# The last few passes, by their inputs (reduce_clock_changes_remembered): the optimal planner prices its candidates'
# changes with the pass (optimal/entry.py _counted_extra_j) and then runs it again on the plan it keeps. Keyed by the identity of the
# schedule, graph and profile (immutable; the entry holds them, so the ids stay theirs) and the plan's clocks.
_RECENT_PASSES: dict[tuple, tuple[tuple, SwitchingResult]] = {}
_RECENT_PASSES_MAX = 4
_RECENT_PASSES_LOCK = threading.Lock()


def reduce_clock_changes_remembered(
    plan: FrequencyPlan,
    evaluator: PlanEvaluator,
    deadline_s: float | None = None,
    switch_cost_j: float = 0.0,
    max_clock_changes: int | None = None,
) -> SwitchingResult:
    """:func:`reduce_clock_changes`, or the (identical) result of one of the last few passes with the same
    inputs (the planner's: optimal/entry.py prices its candidates with the pass, planner.py runs it on the one kept)."""
    check_switching(switch_cost_j, max_clock_changes)
    if evaluator.microbatch_sizes is not None:
        return reduce_clock_changes(plan, evaluator, deadline_s, switch_cost_j, max_clock_changes)
    pins = (plan.schedule, evaluator.graph, evaluator.profile)
    key = (tuple(map(id, pins)), plan.freqs_mhz, repr(evaluator.p2p_power_w), repr(deadline_s), repr(switch_cost_j),
           max_clock_changes)
    with _RECENT_PASSES_LOCK:
        hit = _RECENT_PASSES.get(key)
    if hit is not None and all(a is b for a, b in zip(hit[0], pins)):
        return hit[1]
    result = reduce_clock_changes(plan, evaluator, deadline_s, switch_cost_j, max_clock_changes)
    with _RECENT_PASSES_LOCK:
        while len(_RECENT_PASSES) >= _RECENT_PASSES_MAX:
            del _RECENT_PASSES[next(iter(_RECENT_PASSES))]  # the oldest
        _RECENT_PASSES[key] = (pins, result)
    return result


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
    state = SwitchingState(plan, evaluator, deadline, before_timeline)
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
