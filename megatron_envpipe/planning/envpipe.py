"""EnvPipe's planner: initial plan types, reconfiguration policies, termination.

Plan types (envpipe.md §3): ``baseline`` (every unit at f_max), ``uniform``
(each stage at its energy-valley clock), ``envelope`` (the outer envelope at
f_max, everything else at the valley clock). Reconfiguration policies (§4):
``default`` (none), ``greedy`` (raise the first non-max unit from the end of
the critical path by 3 steps), ``balanced`` (raise every critical unit at the
path's minimum clock by one step), repeated until the critical path *is* the
outer envelope.

Unlike Perseus's re-implementation, which loops forever when the last stage
is not the heaviest, the loop always terminates: offline the simulation is
deterministic, so an iteration with nothing left to raise is final and we stop
and say why; online (measured, noisy) the :class:`Reconfigurer` stops after
``finish_limit`` iterations without progress, as EnvPipe does.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from megatron_envpipe.core.plan import FrequencyPlan
from megatron_envpipe.core.profile import Profile
from megatron_envpipe.core.schedule import (
    Schedule,
    ScheduleError,
    build_schedule,
    clamp_extra_warmup,
    one_f_one_b,
    raw_extra_warmup,
)
from megatron_envpipe.core.timeline import PlanEvaluator, outer_envelope
from megatron_envpipe.core.vocabulary import PlanType, ReconfigPolicy, Scheduling
from megatron_envpipe.planning.basis import (
    SLOWDOWN_WARNING,
    PlannerConfig,
    PlannerError,
    PlanResult,
    planning_basis,
)
from megatron_envpipe.planning.reconfig import ClockLadder, Reconfigurer


def plan_reconfigured(
    profile: Profile,
    num_microbatches: int,
    config: PlannerConfig,
    num_stages: int | None = None,
) -> PlanResult:
    """Plan one iteration EnvPipe's way on the simulated timeline: initial plan, then reconfiguration."""
    t0 = time.perf_counter()
    config.validate()
    basis = planning_basis(profile, num_microbatches, config, num_stages)
    p, p2p_power, candidates = basis.num_stages, basis.p2p_power_w, basis.candidates_mhz
    f_max, valley, warnings = basis.f_max_mhz, basis.valley_mhz, basis.warnings
    ladder = ClockLadder(candidates, config.effective_reconfig_step_mhz)
    inner = valley if config.plan_type != PlanType.BASELINE else (f_max,) * p

    if config.scheduling == Scheduling.OURS:
        raw = (
            list(config.extra_warmup)
            if config.extra_warmup is not None
            else raw_extra_warmup(
                p,
                [profile.time_s(s, "backward", f_max) for s in range(p)],
                [profile.time_s(s, "forward", inner[s]) for s in range(p)],
            )
        )
        try:
            r = clamp_extra_warmup(p, num_microbatches, raw, config.max_inflight)
        except ScheduleError as exc:
            raise PlannerError(str(exc)) from None
        schedule = build_schedule("ours", p, num_microbatches, r)
    elif config.scheduling == Scheduling.INTERLEAVED:
        # Megatron's order, as the baseline: EnvPipe's extra warm-up does not carry over to chunks
        # (interleaved.md finding (b)), so only the clocks are planned.
        schedule = basis.baseline_plan.schedule
    else:
        schedule = one_f_one_b(p, num_microbatches)

    evaluator = PlanEvaluator(schedule, profile, p2p_power, config.p2p_latency_s, config.dependencies(schedule))
    plan = initial_plan(schedule, config.plan_type, f_max, inner)
    reconf = Reconfigurer(plan, config.reconfig, ladder)
    iterations, converged, reason = 0, False, ""
    timeline = evaluator.simulate(plan.flat())
    if config.reconfig == ReconfigPolicy.DEFAULT:
        converged = reconf.on_envelope(timeline.critical_units())
        reason = "no reconfiguration (policy 'default')"
    else:
        while True:
            path = timeline.critical_units()
            if reconf.on_envelope(path):
                converged, reason = True, "critical path is the outer envelope"
                break
            if iterations >= config.max_iterations:
                reason = f"stopped after max_iterations={config.max_iterations}"
                break
            if not reconf.apply(path):
                if all(f == f_max for f in reconf.freqs_flat()):
                    converged, reason = True, "nothing to reconfigure: every unit runs at f_max"
                    break
                off = [f"S{s} {u}" for s, u in path if (s, u) not in reconf.envelope]
                reason = (
                    "stalled: the critical path leaves the outer envelope (at "
                    + ", ".join(off[:3])
                    + (" ..." if len(off) > 3 else "")
                    + ") but every unit on it already runs at f_max; the last stage is not the "
                    "heaviest, so EnvPipe's stopping rule cannot be met"
                )
                break
            iterations += 1
            timeline = evaluator.simulate(reconf.freqs_flat())
        plan = reconf.plan
    score = evaluator.score(plan.flat(), timeline)
    result = PlanResult(
        config=config,
        plan=plan,
        score=score,
        timeline=timeline,
        baseline_plan=basis.baseline_plan,
        baseline=basis.baseline,
        baseline_timeline=basis.baseline_timeline,
        f_max_mhz=f_max,
        valley_mhz=valley,
        candidates_mhz=tuple(sorted(candidates, reverse=True)),
        iterations=iterations,
        converged=converged,
        stop_reason=reason,
        planner_seconds=0.0,
        warnings=warnings,
    )
    if result.slowdown > SLOWDOWN_WARNING:
        warnings.append(
            f"this plan is {100 * result.slowdown:.2f}% slower than the baseline ({config.baseline_name}, "
            f"{f_max} MHz); "
            + (
                "reconfiguration stalled before reaching the envelope"
                if not converged and config.reconfig != ReconfigPolicy.DEFAULT
                else "try --reconfig balanced or --type optimal"
                if config.reconfig == ReconfigPolicy.DEFAULT
                else "the envelope itself is slower than the baseline"
            )
        )
    result.planner_seconds = time.perf_counter() - t0
    return result


def initial_plan(schedule: Schedule, plan_type: str, f_max: int, inner_mhz: Sequence[int]) -> FrequencyPlan:
    """The plan before any reconfiguration (envpipe.md §3)."""
    if plan_type == PlanType.BASELINE:
        return FrequencyPlan.constant(schedule, [f_max] * schedule.num_stages)
    if plan_type == PlanType.UNIFORM:
        return FrequencyPlan.constant(schedule, inner_mhz)
    if plan_type == PlanType.ENVELOPE:
        env = outer_envelope(schedule)
        return FrequencyPlan(
            schedule,
            tuple(
                tuple(f_max if (s, u) in env else int(inner_mhz[s]) for u in order)
                for s, order in enumerate(schedule.orders)
            ),
        )
    raise PlannerError(f"unknown plan type {plan_type!r}")
