"""The iteration-time vs energy Pareto frontier of a schedule, and picking a plan for a target time.

From the fastest plan (every unit at its fastest clock; for 1F1B that is the
baseline's iteration time) to the energy valley (the slowest iteration worth
running: beyond it, blocking power outweighs what slower clocks save), the
frontier holds, for evenly spaced deadlines, the minimum-energy plan meeting
each (:mod:`megatron_envpipe.planning.optimal`), each scored with the same formula as
everything else, Pareto-filtered so energy strictly falls as time grows.

**Target time.** When something else sets the pace — a straggler pipeline, a
data-loader, a fixed step budget — every iteration lasts ``T_target`` anyway
and a faster plan blocks at P2P power until then (Perseus's accounting):
``E(T_target) = E_plan + P_p2p * P * (T_target - T_plan)``. The best frontier
plan is then the slowest one not slower than the target. (At run time,
``--envpipe-target-time`` plans directly for the target instead.)

**Clock changes.** With a switch cost (``config.effective_switch_cost_j``: ``--switch-cost-j``, or
the derived default of ``envpipe frontier``, as for ``envpipe plan --type optimal``) or a clock-change
budget, every point goes through the same switching pass as a plan
(:mod:`megatron_envpipe.planning.switching`), and its energy counts the clock changes it keeps
(``switch_cost_j`` x :func:`~megatron_envpipe.planning.switching.steady_clock_changes`), as
``PlanResult.energy_j`` does; the baseline (every unit at f_max) makes none.

CSV columns: ``time_s,energy_j,saving,slowdown`` (energy with clock changes; saving and slowdown
against 1F1B at the maximum clock, as fractions).
"""

from __future__ import annotations

import csv
import dataclasses
import io
import time
from dataclasses import dataclass, field
from pathlib import Path

from megatron_envpipe.core.atomic import write_atomic
from megatron_envpipe.core.plan import FrequencyPlan
from megatron_envpipe.core.profile import Profile, pareto_filter
from megatron_envpipe.core.schedule import ClampedWarmup, Schedule
from megatron_envpipe.core.sizes import check_frontier_size
from megatron_envpipe.core.timeline import PlanScore
from megatron_envpipe.core.vocabulary import PlanType
from megatron_envpipe.planning.basis import PlannerConfig, PlannerError, planning_profile
from megatron_envpipe.planning.optimal.deadline import InfeasibleDeadline
from megatron_envpipe.planning.optimal.entry import optimal_setup, rank_schedules
from megatron_envpipe.planning.optimal.search import DEFAULT_SEARCH_WORK
from megatron_envpipe.planning.switching import reduce_clock_changes, steady_clock_changes

DEFAULT_POINTS = 20
CSV_COLUMNS = ("time_s", "energy_j", "saving", "slowdown")


@dataclass(frozen=True)
class FrontierPoint:
    time_s: float
    energy_j: float
    saving: float  # vs the baseline (1F1B, or interleaved, at f_max; at the baseline's own iteration time)
    slowdown: float  # time / baseline time - 1
    plan: FrequencyPlan
    deadline_s: float  # the deadline this plan was computed for (time_s <= deadline_s)
    switch_energy_j: float = 0.0  # part of energy_j: switch cost x the clock changes the plan keeps

    def energy_at(self, target_time_s: float, p2p_power_w: float, num_stages: int) -> float:
        """Energy of an iteration stretched to ``target_time_s`` (blocking until then)."""
        return self.energy_j + p2p_power_w * num_stages * max(0.0, target_time_s - self.time_s)


@dataclass
class Frontier:
    schedule: Schedule
    points: list[FrontierPoint]  # fastest first; energy strictly decreasing
    baseline: PlanScore  # 1F1B at f_max (interleaved: the same schedule at f_max)
    p2p_power_w: float
    fastest_s: float  # every unit at its fastest clock
    valley_s: float  # the LP's minimum-energy iteration time
    planner_seconds: float
    config: PlannerConfig
    warnings: list[str] = field(default_factory=list)
    warmup_clamp: ClampedWarmup | None = None  # a given --extra-warmup, clamped (as PlanResult's)

    @property
    def num_stages(self) -> int:
        return self.schedule.num_stages

    def pick(self, target_time_s: float) -> tuple[FrontierPoint, float, float]:
        """The plan to run when iterations last ``target_time_s``: (point, its energy, baseline's energy), both
        stretched to the target. Raises :class:`InfeasibleDeadline` if no plan is that fast."""
        fits = [pt for pt in self.points if pt.time_s <= target_time_s * (1 + 1e-12)]
        if not fits:
            raise InfeasibleDeadline(
                f"target iteration time {target_time_s:.6g} s is faster than the fastest plan "
                f"({self.points[0].time_s:.6g} s, every unit at its fastest clock)"
            )
        p, n = self.p2p_power_w, self.num_stages
        best = min(fits, key=lambda pt: (pt.energy_at(target_time_s, p, n), -pt.time_s))
        base = self.baseline.energy_j + p * n * max(0.0, target_time_s - self.baseline.iteration_time_s)
        return best, best.energy_at(target_time_s, p, n), base

    def csv_text(self) -> str:
        out = io.StringIO()
        w = csv.writer(out, lineterminator="\n")
        w.writerow(CSV_COLUMNS)
        for pt in self.points:
            w.writerow([repr(pt.time_s), repr(pt.energy_j), repr(pt.saving), repr(pt.slowdown)])
        return out.getvalue()

    def to_csv(self, path: str | Path) -> Path:
        return write_atomic(path, self.csv_text())


def compute_frontier(
    profile: Profile,
    num_microbatches: int,
    config: PlannerConfig = PlannerConfig("optimal", "ours", "default"),
    points: int = DEFAULT_POINTS,
    num_stages: int | None = None,
    search_work: int = DEFAULT_SEARCH_WORK // 2,
) -> Frontier:
    """The Pareto frontier from the fastest plan to the energy valley, ``points`` deadlines apart.

    ``config`` gives scheduling, GPU, P2P power, activation budget, extra
    warm-up and communication model (its plan type, max_slowdown and
    target_time_s are ignored). For ``ours`` the extra warm-up is chosen as
    for the zero-slowdown optimal plan and kept along the frontier.
    """
    if points < 2:
        raise PlannerError(f"a frontier needs at least 2 points, got {points}")
    check_frontier_size(profile.num_stages if num_stages is None else num_stages, num_microbatches,
                        config.virtual_stages, points)
    t0 = time.perf_counter()
    config = dataclasses.replace(config, plan_type=PlanType.OPTIMAL, max_slowdown=0.0, target_time_s=None)
    profile = planning_profile(profile, config)
    setup = optimal_setup(profile, num_microbatches, config, num_stages)
    base = setup.baseline
    # Schedule: the one the zero-slowdown plan would use (or, if even that is infeasible,
    # the fastest candidate's deadline).
    try:
        ranked = rank_schedules(setup, profile, config, base.iteration_time_s, padded=False)
    except InfeasibleDeadline:
        slowest_ok = min(setup.model(s, profile, config).fastest_time_s() for _, s in setup.schedules)
        ranked = rank_schedules(setup, profile, config, slowest_ok, padded=False)
    schedule, model = ranked[0].schedule, ranked[0].model
    weight = setup.p2p_power_w * setup.num_stages
    fastest = model.fastest_time_s()
    slowest = model.slowest_time_s()
    _, valley_lp, _ = model.solve_lp(max(slowest, fastest), weight)
    valley_lp = max(valley_lp, fastest)
    deadlines = [fastest + (valley_lp - fastest) * i / (points - 1) for i in range(points)]
    cost = config.effective_switch_cost_j
    raw = []
    for d in deadlines:
        sol = model.solve(d, padded=False, search_work=search_work)
        plan, score = FrequencyPlan.from_flat(schedule, sol.freqs_mhz), sol.score
        if cost > 0 or config.max_clock_changes is not None:  # as plan_envpipe: never slower than the plan
            sw = reduce_clock_changes(plan, model.evaluator, None, cost, config.max_clock_changes)
            plan, score = sw.plan, sw.score
        switches = cost * sum(steady_clock_changes(plan))
        raw.append((score.iteration_time_s, score.energy_j + switches, d, plan, switches))
    # Pareto filter: keep a plan only if it uses less energy (clock changes counted) than every faster one.
    kept = pareto_filter(raw, key=lambda x: (x[0], x[1]), cost=lambda x: x[1], rtol=1e-12)
    pts = [
        FrontierPoint(
            time_s=t,
            energy_j=e,
            saving=1.0 - e / base.energy_j if base.energy_j > 0 else 0.0,
            slowdown=t / base.iteration_time_s - 1.0,
            plan=plan,
            deadline_s=d,
            switch_energy_j=switches,
        )
        for t, e, d, plan, switches in kept
    ]
    return Frontier(
        schedule=schedule,
        points=pts,
        baseline=base,
        p2p_power_w=setup.p2p_power_w,
        fastest_s=fastest,
        valley_s=valley_lp,
        planner_seconds=time.perf_counter() - t0,
        config=config,
        warnings=list(setup.warnings),
        warmup_clamp=setup.warmup_clamp,
    )
