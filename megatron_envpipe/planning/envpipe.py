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

from megatron_envpipe.core.kinds import KindError, plan_kind, scheduling_kind
from megatron_envpipe.core.plan import FrequencyPlan
from megatron_envpipe.core.profile import Profile
from megatron_envpipe.core.schedule import (
    ClampedWarmup,
    Schedule,
    ScheduleError,
    clamp_extra_warmup_explained,
    one_f_one_b,
    raw_extra_warmup,
)
from megatron_envpipe.core.timeline import PlanEvaluator
from megatron_envpipe.core.vocabulary import ReconfigPolicy
from megatron_envpipe.planning.basis import (
    SLOWDOWN_WARNING,
    PlannerConfig,
    PlannerError,
    PlanningBasis,
    PlanResult,
    planning_basis,
)
from megatron_envpipe.planning.reconfig import ClockLadder, Reconfigurer
from megatron_envpipe.planning.resimulation import Resimulator


def plan_reconfigured(
    profile: Profile,
    num_microbatches: int,
    config: PlannerConfig,
    num_stages: int | None = None,
    basis: PlanningBasis | None = None,
    known_schedules: Sequence[Schedule] = (),
) -> PlanResult:
    """Plan one iteration EnvPipe's way on the simulated timeline: initial plan, then reconfiguration.

    ``basis``: this (profile, M, config)'s :func:`planning_basis` when the caller already has it (another plan
    type of the same problem: the basis depends on neither the plan type nor the reconfiguration policy).
    ``known_schedules``: schedules already planned on; one equal to this plan's is used as it is (its graph is
    built already: :meth:`PipelineGraph.shared` knows a schedule by its identity)."""
    t0 = time.perf_counter()
    config.validate()
    if basis is None:
        basis = planning_basis(profile, num_microbatches, config, num_stages)
    p, p2p_power, candidates = basis.num_stages, basis.p2p_power_w, basis.candidates_mhz
    f_max, valley, warnings = basis.f_max_mhz, basis.valley_mhz, basis.warnings
    ladder = ClockLadder(candidates, config.effective_reconfig_step_mhz)
    inner = valley if plan_kind(config.plan_type).sets_clocks else (f_max,) * p
    order = scheduling_kind(config.scheduling)

    given: ClampedWarmup | None = None  # a given --extra-warmup, clamped (PlanResult.warmup_clamp)
    if order.extra_warmup:
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
            clamp = clamp_extra_warmup_explained(p, num_microbatches, raw, config.max_inflight)
        except ScheduleError as exc:
            raise PlannerError(str(exc)) from None
        r = clamp.clamped
        if config.extra_warmup is not None:
            given = clamp
        schedule = order.build(p, num_microbatches, r, 1, None)
    elif order.model_chunks:
        # Megatron's order, as the baseline: EnvPipe's extra warm-up does not carry over to chunks
        # (interleaved.md finding (b)), so only the clocks are planned.
        schedule = basis.baseline_plan.schedule
    else:
        schedule = one_f_one_b(p, num_microbatches)

    schedule = next((known for known in known_schedules if known == schedule), schedule)
    evaluator = PlanEvaluator(schedule, profile, p2p_power, config.p2p_latency_s, config.dependencies(schedule))
    plan = initial_plan(schedule, config.plan_type, f_max, inner)
    reconf = Reconfigurer(plan, config.reconfig, ladder)
    iterations, converged, reason = 0, False, ""
    timeline = evaluator.simulate(plan.flat())
    if config.reconfig == ReconfigPolicy.DEFAULT:
        converged = reconf.on_envelope(timeline.critical_units())
        reason = "no reconfiguration (policy 'default')"
    else:
        # The loop walks node indices: per node its (stage, position in its order) and whether it is on the
        # outer envelope, set up once (the graph's nodes are the schedule's units stage by stage, in order:
        # core/units.py unit_dag); the policy raises (reconf.raise_off_envelope, as reconf.apply does on
        # timeline.critical_units()). Unit durations are kept up to date where a raise changed a clock
        # (evaluator.simulate's, per unit; each (cost key, clock) looked up once); each step's timeline reuses
        # the last one's lists (Resimulator.advance).
        # tests/planning/test_planning_reuse.py holds the loop to the long way (apply, full simulations).
        graph = evaluator.graph
        position = [(s, i) for s, order in enumerate(schedule.orders) for i in range(len(order))]
        offset = [0] * len(schedule.orders)
        for s in range(1, len(offset)):
            offset[s] = offset[s - 1] + len(schedule.orders[s - 1])
        on_envelope = [False] * len(position)
        for node in reconf.envelope:
            v = graph.index.get(node)
            if v is not None:
                on_envelope[v] = True
        durations = list(timeline.duration_s)
        resim = Resimulator(evaluator.graph)
        keys = evaluator.cost_keys
        key_id: dict[tuple, int] = {}
        kid = [key_id.setdefault(k, len(key_id)) for k in keys]
        time_at: dict[int, dict[int, float]] = {}  # clock -> key id -> the unit time there
        while True:
            critical = timeline.critical_path()
            if all([on_envelope[v] for v in critical]):
                converged, reason = True, "critical path is the outer envelope"
                break
            if iterations >= config.max_iterations:
                reason = f"stopped after max_iterations={config.max_iterations}"
                break
            changes = reconf.raise_off_envelope([position[v] for v in critical])
            if not changes:
                path = timeline.critical_units()
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
            changed = []
            for stage, i, _, new_mhz in changes:
                v = offset[stage] + i
                table = time_at.get(new_mhz)
                if table is None:
                    time_at[new_mhz] = table = {}
                d = table.get(kid[v])
                if d is None:
                    table[kid[v]] = d = evaluator.key_point(keys[v], new_mhz).time_s
                durations[v] = d
                changed.append(v)
            timeline = resim.advance(timeline, durations, changed)
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
        warmup_clamp=given,
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
    """The plan before any reconfiguration (envpipe.md §3): the registered plan type's (core/kinds.py)."""
    try:
        make = plan_kind(plan_type).initial_plan
    except KindError as exc:
        raise PlannerError(str(exc)) from None
    if make is None:
        raise PlannerError(f"plan type {plan_type!r} is planned by the optimal planner, not from an initial plan")
    return make(schedule, f_max, inner_mhz)
