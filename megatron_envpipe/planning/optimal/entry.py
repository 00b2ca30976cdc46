"""``--type optimal``'s entry point: the candidate schedules, ranked by LP bound, and the best plan."""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, NamedTuple

from megatron_envpipe.core.kinds import build_schedule, scheduling_kind
from megatron_envpipe.core.plan import FrequencyPlan
from megatron_envpipe.core.profile import Profile
from megatron_envpipe.core.schedule import (
    ClampedWarmup,
    Schedule,
    ScheduleError,
    clamp_extra_warmup,
    clamp_extra_warmup_explained,
    raw_extra_warmup,
)
from megatron_envpipe.core.sizes import check_plan_size
from megatron_envpipe.planning.basis import (
    SLOWDOWN_WARNING,
    PlannerConfig,
    PlannerError,
    PlanningBasis,
    PlanResult,
    planning_basis,
)
from megatron_envpipe.planning.optimal.deadline import FEASIBILITY_RTOL, InfeasibleDeadline
from megatron_envpipe.planning.optimal.model import TimeEnergyModel
from megatron_envpipe.planning.optimal.search import DEFAULT_SEARCH_WORK
from megatron_envpipe.planning.switching import reduce_clock_changes_remembered

# Local-search work (unit visits, planning/optimal/search.py) when clock changes are charged and the problem
# is large (more than _RUNNER_UP_MAX_UNITS units): the minimum. The searches lower switch-free energy, then the
# merge pass and the segment DP re-plan the clocks; on bench/switch_costs.py's cells the searches took about a
# quarter of the planning time for ~0.01 points of counted saving per cell. Small problems keep the full search
# (cheap there, and worth up to 0.1 points on P = 4, M = 8: bench/switch_costs_exact.py).
_COUNTED_SEARCH_WORK = 0

# Small problems (at most this many units) also round the runner-up schedule when its LP bound
# is within this of the best one's: rounding, not the bound, decides between close candidates.
_RUNNER_UP_MAX_UNITS = 800
_RUNNER_UP_RTOL = 0.002


def extra_warmup_candidates(
    profile: Profile,
    num_microbatches: int,
    f_max: int,
    valley_mhz: Sequence[int],
    max_inflight: int | tuple[int | None, ...] | None = None,
    counts_changes: bool = False,
) -> list[tuple[str, tuple[int, ...]]]:
    """Clamped extra warm-up vectors worth trying for ``ours``, deduplicated, in a fixed order.

    ``f_max``: the 1F1B bubble before a stage's first backward filled with
    forwards at the maximum clock; ``valley``: EnvPipe's own r_s (forwards at
    the energy-valley clock); ``1.5x``: half as many again (long pipelines,
    many micro-batches). All are clamped by the activation budget.

    ``counts_changes`` (a switch cost is charged, small problems: :func:`_small_problem`): also ``f_max@2x``, ``f_max`` held to twice 1F1B's
    in-flight activations per stage (``2 (P - s)``). Switch-free it ties ``f_max`` on the LP bound on the
    shipped profiles; counting changes it can be worth less (A40 GPT-3, M = 12: 18.17 % vs 18.09 %), and
    without it an unbounded budget planned less than that bounded one (issue 34).
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
    budgets: list[int | tuple[int | None, ...] | None] = [max_inflight] * len(raws)
    if counts_changes:
        given = max_inflight if isinstance(max_inflight, tuple) else (max_inflight,) * p
        raws.append(("f_max@2x", raw_fmax))
        budgets.append(tuple(2 * (p - s) if b is None else min(b, 2 * (p - s)) for s, b in enumerate(given)))
    out: list[tuple[str, tuple[int, ...]]] = []
    seen: set[tuple[int, ...]] = set()
    for (label, raw), budget in zip(raws, budgets):
        r = clamp_extra_warmup(p, num_microbatches, raw, budget)
        if r not in seen:
            seen.add(r)
            out.append((label, r))
    return out


def _small_problem(num_stages: int, num_microbatches: int) -> bool:
    """Whether an ``ours`` schedule has at most :data:`_RUNNER_UP_MAX_UNITS` units: plan_optimal then rounds every
    candidate whose LP bound ties the best one's (by their clock changes, where changes are charged)."""
    return 2 * num_stages * num_microbatches <= _RUNNER_UP_MAX_UNITS


@dataclass
class OptimalSetup(PlanningBasis):
    """The basis of every optimal plan of one (profile, M, config), and the schedules worth trying."""

    schedules: list[tuple[str, Schedule]]  # (label, schedule)
    warmup_clamp: ClampedWarmup | None = None  # a given --extra-warmup, clamped (PlanResult.warmup_clamp)

    def model(self, schedule: Schedule, profile: Profile, config: PlannerConfig) -> TimeEnergyModel:
        """The time-energy model of one candidate schedule."""
        return TimeEnergyModel(schedule, profile, self.candidates_mhz, self.p2p_power_w, config.p2p_latency_s,
                               config.dependencies(schedule))


def optimal_setup(
    profile: Profile, num_microbatches: int, config: PlannerConfig, num_stages: int | None = None
) -> OptimalSetup:
    """Validate ``config``, build the planning basis and the candidate schedules (``ours``: a few extra warm-ups)."""
    config.validate()
    check_plan_size("optimal", profile.num_stages if num_stages is None else num_stages, num_microbatches,
                    config.virtual_stages)
    basis = planning_basis(profile, num_microbatches, config, num_stages)
    p = basis.num_stages
    given: ClampedWarmup | None = None
    if scheduling_kind(config.scheduling).extra_warmup:
        try:
            if config.extra_warmup is not None:
                given = clamp_extra_warmup_explained(p, num_microbatches, list(config.extra_warmup),
                                                     config.max_inflight)
                warmups = [("given", given.clamped)]
            else:
                warmups = extra_warmup_candidates(profile, num_microbatches, basis.f_max_mhz, basis.valley_mhz,
                                                  config.max_inflight,
                                                  config.effective_switch_cost_j > 0 and _small_problem(p, num_microbatches))
        except ScheduleError as exc:
            raise PlannerError(str(exc)) from None
        schedules = [(label, build_schedule("ours", p, num_microbatches, r)) for label, r in warmups]
    else:
        schedules = [("1f1b", basis.baseline_plan.schedule)]
    return OptimalSetup(**vars(basis), schedules=schedules, warmup_clamp=given)


class RankedSchedule(NamedTuple):
    """A candidate schedule that can meet the deadline, with its LP bound."""

    lp_bound_j: float
    position: int  # ties in the bound keep the candidates' order
    label: str
    schedule: Schedule
    model: TimeEnergyModel


def rank_schedules(
    setup: OptimalSetup, profile: Profile, config: PlannerConfig, deadline: float, padded: bool,
    cut_off: list[str] | None = None, speculate: Callable[[TimeEnergyModel], Any] | None = None,
    speculated: dict[int, Any] | None = None,
) -> list[RankedSchedule]:
    """Models of the candidate schedules that can meet ``deadline``, best LP bound first.

    A candidate whose LP was stopped because it cannot win gets the bound
    ``inf`` (ranked last) and its label is appended to ``cut_off``.

    With ``speculate`` (large problems: the LPs take seconds) the work overlaps, HiGHS
    releasing the GIL: the other candidates' models are built while the first LP runs, their
    LPs then run side by side, each warm-started from the first's basis and cut off at its
    bound, and ``speculate(model)`` (rounding the best-ranked so far) runs meanwhile; its
    result lands in ``speculated[id(model)]``. Every LP's start and cut-off are fixed before
    any of them runs, so the ranking does not depend on thread timing. (Sequentially, a later
    candidate starts from the best basis so far: the two differ only where a later candidate
    beats the first.)
    """
    cut_off = [] if cut_off is None else cut_off
    ranked: list[RankedSchedule] = []
    skipped: list[tuple[float, int, str, Schedule]] = []
    state: dict[str, Any] = {"best": math.inf, "warm": None}
    weight = 0.0 if padded else setup.p2p_power_w * setup.num_stages

    def bound(model: TimeEnergyModel, best: float, warm: Any) -> tuple[list[float], float, float] | None | str:
        """The LP answer, None (cut off: cannot win) or "slow" (cannot meet the deadline)."""
        if model.fastest_time_s() > deadline * (1 + FEASIBILITY_RTOL):
            return "slow"
        # Each LP starts from the best one's optimal basis so far (same shape, a few units moved) and
        # stops once its bound cannot make it the one plan_optimal rounds (or a runner-up it rounds too).
        cutoff = best * (1 + _RUNNER_UP_RTOL) if model.n <= _RUNNER_UP_MAX_UNITS else best
        return model.lp_bound(deadline, weight, warm, cutoff)

    def record(label: str, schedule: Schedule, model: TimeEnergyModel, answer: Any) -> None:
        if answer == "slow":
            skipped.append((model.fastest_time_s(), len(skipped), label, schedule))
        elif answer is None:
            cut_off.append(label)
            ranked.append(RankedSchedule(math.inf, len(ranked), label, schedule, model))
        else:
            if answer[2] < state["best"]:
                state["best"], state["warm"] = answer[2], model.lp_basis()
            ranked.append(RankedSchedule(answer[2], len(ranked), label, schedule, model))

    schedules = setup.schedules
    if speculate is None or len(schedules) < 2:
        for label, schedule in schedules:
            model = setup.model(schedule, profile, config)
            record(label, schedule, model, bound(model, state["best"], state["warm"]))
    else:
        # Large problems: the first candidate's LP, then the others' side by side, each from the first's
        # basis and cut off at its bound (fixed, so the outcome never depends on which finishes first).
        (label0, schedule0), rest = schedules[0], schedules[1:]
        model0 = setup.model(schedule0, profile, config)
        with ThreadPoolExecutor(max_workers=len(rest), thread_name_prefix="envpipe-plan") as pool:
            models = pool.submit(lambda: [setup.model(s, profile, config).prepare_lp() for _, s in rest])
            record(label0, schedule0, model0, bound(model0, state["best"], state["warm"]))
            best, warm = state["best"], state["warm"]
            answers = [pool.submit(bound, m, best, warm) for m in models.result()]
            if ranked and speculated is not None:
                speculated[id(ranked[0].model)] = speculate(ranked[0].model)
            for (label, schedule), model, answer in zip(rest, models.result(), answers):
                record(label, schedule, model, answer.result())
    if not ranked:
        fastest, _, label, schedule = min(skipped)
        what = (
            f"{config.baseline_name}" if not schedule.extra_warmup  # 1F1B's: "1F1B at f_max"
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
    setup = optimal_setup(profile, num_microbatches, config, num_stages)
    p, p2p, f_max = setup.num_stages, setup.p2p_power_w, setup.f_max_mhz
    warnings = list(setup.warnings)
    baseline_score = setup.baseline
    padded = config.target_time_s is not None
    deadline = (
        float(config.target_time_s) if padded
        else baseline_score.iteration_time_s * (1.0 + config.max_slowdown)
    )
    cut_off: list[str] = []
    # Large problems round the first candidate while the others' LPs run (the same plan, sooner).
    speculated: dict[int, Any] = {}
    units = sum(len(order) for order in setup.baseline_plan.schedule.orders)
    # Where clock changes are charged, the merge pass and the segment DP re-plan the clocks after this: on large
    # problems the switch-free local searches are cut to their minimum (_COUNTED_SEARCH_WORK).
    counted_large = config.effective_switch_cost_j > 0 and units > _RUNNER_UP_MAX_UNITS
    work = _COUNTED_SEARCH_WORK if counted_large else DEFAULT_SEARCH_WORK
    large = len(setup.schedules) > 1 and units > _RUNNER_UP_MAX_UNITS
    ranked = rank_schedules(setup, profile, config, deadline, padded, cut_off,
                            (lambda model: model.solve(deadline, padded=padded, search_work=work)) if large else None,
                            speculated)
    best_bound = ranked[0].lp_bound_j
    best = None
    small = ranked[0].model.n <= _RUNNER_UP_MAX_UNITS
    # Small problems whose clock changes are charged compare every candidate within 0.2 % of the best bound by
    # what it is worth with its changes counted (the bound counts none: near-ties are decided by the changes).
    switch_cost = config.effective_switch_cost_j if small else 0.0
    # Round the best-ranked schedule, and (small problems) a runner-up whose bound is within 0.2 %.
    for bound, _, label, schedule, model in ranked[: len(ranked) if switch_cost > 0 else 2 if small else 1]:
        if best is not None and bound > best_bound * (1 + _RUNNER_UP_RTOL):
            break
        sol = speculated.get(id(model)) or model.solve(deadline, padded=padded, search_work=work)
        energy = sol.score.energy_j + (p2p * p * (deadline - sol.score.iteration_time_s) if padded else 0.0)
        if switch_cost > 0:
            energy += _counted_extra_j(FrequencyPlan.from_flat(schedule, sol.freqs_mhz), model,
                                      deadline if padded else None, switch_cost)
        if best is None or energy < best[0] - 1e-9 * abs(energy):
            best = (energy, label, schedule, model, sol)
    assert best is not None
    energy, label, schedule, model, sol = best
    plan = FrequencyPlan.from_flat(schedule, sol.freqs_mhz)
    score = sol.score
    warmup = scheduling_kind(config.scheduling).extra_warmup  # schedules differ in their extra warm-up
    details: dict[str, Any] = {
        "method": "lp+rounding",
        "lp_bound_j": sol.lp_bound_j,
        "padded_to_deadline": padded,
        "extra_warmup_tried": (
            {lab: list(s.extra_warmup) for lab, s in setup.schedules} if warmup else {}
        ),
        "extra_warmup_chosen": label if warmup else None,
        "extra_warmup_cut_off": cut_off,  # LP stopped early: its bound could not beat the chosen one
        **sol.stats,
    }
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
        stop_reason="",  # account_optimal's
        planner_seconds=0.0,
        warnings=warnings,
        deadline_s=deadline,
        lower_bound_j=sol.lp_bound_j,
        details=details,
        warmup_clamp=setup.warmup_clamp,
    )
    account_optimal(result)
    if result.slowdown > SLOWDOWN_WARNING:
        warnings.append(
            f"this plan is {100 * result.slowdown:.2f}% slower than the baseline ({config.baseline_name}, {f_max} MHz), "
            + ("as the target iteration time allows" if padded else "as --max-slowdown allows")
        )
    result.planner_seconds = time.perf_counter() - t0
    return result


def _counted_extra_j(plan: FrequencyPlan, model: TimeEnergyModel, deadline_s: float | None,
                    switch_cost_j: float) -> float:
    """What ``plan`` is worth beyond its simulated energy once the planner's merge pass
    (planning/switching.py) has priced its clock changes at ``switch_cost_j``: energy the merges give up plus
    the changes kept x the cost."""
    sw = reduce_clock_changes_remembered(plan, model.evaluator, deadline_s, switch_cost_j)
    return sw.energy_given_up_j + switch_cost_j * sum(sw.charged_after)


# What the LP lower bound (``lower_bound_j``) is a bound on, as --json and the stop reason say it.
_LP_BOUND_INCLUDES = ("unit energies at convex-hull clocks and P2P blocking power until the iteration's end; "
                     "no clock changes (switch cost) and no clock latency: a plan's gap includes what its changes cost")


def account_optimal(result: PlanResult, lp_gap: bool = True) -> None:
    """What an optimal plan is worth, in one place: ``details`` gets the LP gap (and, for a target time, the
    energies counted until it) from :attr:`PlanResult.energy_j` (clock changes charged), and ``stop_reason``
    quotes that gap. The planner calls it again after the switching pass, so both always describe the plan
    returned. ``lp_gap`` False: only the energies at the target (a plan rescored on the nominal profile after
    planning with a timing margin keeps the gap to its own problem's bound)."""
    cfg, details, deadline = result.config, result.details, result.deadline_s
    assert deadline is not None and result.lower_bound_j is not None, "not an optimal plan"
    padded = bool(details.get("padded_to_deadline"))
    energy = result.energy_j
    if padded:  # energy counted until the target: faster plans block at P2P power until then
        p2p, p = cfg.effective_p2p_power_w, result.schedule.num_stages
        energy += p2p * p * (deadline - result.score.iteration_time_s)
        base = result.baseline_energy_j + p2p * p * max(0.0, deadline - result.baseline.iteration_time_s)
        details["energy_at_deadline_j"] = energy
        details["baseline_energy_at_deadline_j"] = base
        details["energy_saving_at_deadline"] = 1.0 - energy / base if base > 0 else 0.0
    if not lp_gap:
        return
    # The bound is on simulated energy; clock changes only add to any plan's, so it bounds their total too.
    gap = energy / result.lower_bound_j - 1.0 if result.lower_bound_j > 0 else 0.0
    details["gap_to_lp_bound"] = gap
    details["lp_bound_includes"] = _LP_BOUND_INCLUDES
    details["switch_cost_j"] = result.switch_cost_j
    details["switch_energy_j"] = result.switch_energy_j
    how = (
        f"target iteration time {deadline:.4f} s (energy counted until then)" if padded
        else f"deadline {deadline:.4f} s = baseline x {1 + cfg.max_slowdown:g}"
    )
    label = details.get("extra_warmup_chosen")
    kept = details.get("kept_plan")
    result.stop_reason = (
        f"optimal plan for {how}: within {100 * gap:.2f} % of the LP lower bound"
        + (" (the plan's clock changes counted; the bound counts none, nor clock latency)" if result.switch_cost_j
           else " (the bound: unit energies and blocking power, no clock changes)")
        + ("; EnvPipe's envelope plan of the same schedule and memory kept: with its clock changes counted it "
           "is worth less than the LP plan" if kept == "envelope" else "")
        + (f"; {details['clock_changes_removed_by_latency']} clock changes per iteration removed by the clock "
           f"latency (no clock segment shorter than {cfg.clock_latency_s:g} s)"
           if "clock_changes_removed_by_latency" in details else "")
        + (f"; extra warm-up from '{label}'" if scheduling_kind(cfg.scheduling).extra_warmup else "")
        + ("" if cfg.reconfig == "default" else f"; '{cfg.reconfig}' corrections apply online only")
    )
