"""The planner entry point: one call for every plan type.

``plan_envpipe(profile, M, config)`` returns a :class:`PlanResult` for
``baseline``/``uniform``/``envelope`` (EnvPipe's initial plans plus offline
reconfiguration, :mod:`megatron_envpipe.planning.envpipe`) and for
``optimal`` (minimum energy per unit under a deadline,
:mod:`megatron_envpipe.planning.optimal`), then, when the config asks for it,
merges clocks that are not worth a clock change
(:mod:`megatron_envpipe.planning.switching`). The result's energy and saving count the clock
changes the plan keeps (``PlanResult.energy_j``); an optimal plan's LP gap and stop reason are
settled once, after that pass (:func:`~megatron_envpipe.planning.optimal.entry.account_optimal`).
"""

from __future__ import annotations

import time

from megatron_envpipe.core.clock_transitions import predict_with_latency
from megatron_envpipe.core.profile import Profile
from megatron_envpipe.core.sizes import check_plan_size
from megatron_envpipe.core.timeline import PlanEvaluator
from megatron_envpipe.core.vocabulary import PlanType
from megatron_envpipe.planning.basis import PlannerConfig, PlanResult, planner_candidates, planning_profile
from megatron_envpipe.planning.envpipe import plan_reconfigured
from megatron_envpipe.planning.optimal import plan_optimal
from megatron_envpipe.planning.optimal.entry import account_optimal
from megatron_envpipe.planning.switching import reduce_clock_changes


def plan_envpipe(
    profile: Profile,
    num_microbatches: int,
    config: PlannerConfig = PlannerConfig(),
    num_stages: int | None = None,
) -> PlanResult:
    """Plan one pipeline iteration on the simulated timeline of ``profile``."""
    config.validate()
    # Before any schedule, chunked profile or simulation: the limit and the reason, not minutes or MemoryError.
    check_plan_size(config.plan_type, profile.num_stages if num_stages is None else num_stages, num_microbatches,
                    config.virtual_stages)
    profile = planning_profile(profile, config)
    planned_on = profile
    if config.timing_margin > 0:
        # Plan as if every slowed unit ran (1 + margin) x longer: each keeps that much slack.
        f_max = max(planner_candidates(profile, config.gpu), default=profile.max_frequency())
        planned_on = profile.with_timing_margin(config.timing_margin, f_max)
    if config.plan_type == PlanType.OPTIMAL:
        result = plan_optimal(planned_on, num_microbatches, config, num_stages)
    else:
        result = plan_reconfigured(planned_on, num_microbatches, config, num_stages)
    result = with_fewer_clock_changes(result, planned_on)
    if result.deadline_s is not None:
        # Gap, stop reason and energies at the target from the plan the pass left (planned on the margin's
        # profile when there is one: the LP bound is that problem's).
        account_optimal(result)
    if planned_on is not profile:
        rescore_without_margin(result, profile)
        if result.deadline_s is not None:  # energies at the target: the nominal prediction, as energy_saving
            account_optimal(result, lp_gap=False)
    if config.clock_lead_rule is not None:
        rescore_with_clock_latency(result, profile)
        if result.deadline_s is not None:  # the LP gap stays its own problem's (no latency in the bound)
            account_optimal(result, lp_gap=False)
    return result


def rescore_with_clock_latency(result: PlanResult, profile: Profile) -> None:
    """Score ``result``'s plan and baseline as they run when clock changes land ``clock_latency_s`` late
    (core/clock_transitions.py): the prediction, energy and saving then include what the lead (or a late
    clock) costs; ``details['clock_latency']`` keeps the figures without latency beside it."""
    t0 = time.perf_counter()
    cfg = result.config
    lead = cfg.clock_lead_rule
    before = {"iteration_time_s": result.score.iteration_time_s, "energy_j": result.energy_j,
              "energy_saving": result.energy_saving}
    p2p = cfg.effective_p2p_power_w
    evaluator = PlanEvaluator(result.schedule, profile, p2p, graph=result.timeline.graph)
    freqs = [f for row in result.plan.freqs_mhz for f in row]
    run = predict_with_latency(evaluator, freqs, lead, nvml_call_s=cfg.clock_call_s)
    base_eval = PlanEvaluator(result.baseline_plan.schedule, profile, p2p, graph=result.baseline_timeline.graph)
    base = predict_with_latency(base_eval, [f for row in result.baseline_plan.freqs_mhz for f in row], lead,
                                nvml_call_s=cfg.clock_call_s)
    result.timeline, result.score = run.timeline, run.score
    result.baseline_timeline, result.baseline = base.timeline, base.score
    result.details["clock_latency"] = {
        "latency_s": lead.latency_s, "call_s": cfg.clock_call_s, "lead": "on" if lead.enabled else "off",
        "requests": run.requests, "led": run.led, "late_raises": run.late_raises,
        "without_latency": before,
    }
    result.planner_seconds += time.perf_counter() - t0


def rescore_without_margin(result: PlanResult, profile: Profile) -> None:
    """Score ``result``'s plan on the profile itself: the prediction a run is measured against
    (nominal unit times); the margin stays in the plan as slack."""
    t0 = time.perf_counter()
    evaluator = PlanEvaluator(result.schedule, profile, result.config.effective_p2p_power_w,
                              graph=result.timeline.graph)
    freqs = [f for row in result.plan.freqs_mhz for f in row]
    timeline = evaluator.simulate(freqs)
    result.timeline, result.score = timeline, evaluator.score(freqs, timeline)
    margin = result.config.timing_margin
    result.details["timing_margin"] = margin
    result.details["slack_kept"] = f"{100 * margin:g}% of every unit below f_max"
    result.planner_seconds += time.perf_counter() - t0


def with_fewer_clock_changes(result: PlanResult, profile: Profile) -> PlanResult:
    """``result`` after the switching pass its config asks for (``details['clock_switching']`` says what
    it did); unchanged when the switch cost is 0 and there is no clock-change budget."""
    cfg = result.config
    cost = cfg.effective_switch_cost_j
    if cost <= 0 and cfg.max_clock_changes is None:
        return result
    t0 = time.perf_counter()
    padded = bool(result.details.get("padded_to_deadline"))
    p2p = cfg.effective_p2p_power_w
    evaluator = PlanEvaluator(result.schedule, profile, p2p, graph=result.timeline.graph)
    sw = reduce_clock_changes(result.plan, evaluator, result.deadline_s if padded else None, cost,
                              cfg.max_clock_changes)
    result.plan, result.score, result.timeline = sw.plan, sw.score, sw.timeline
    result.details["clock_switching"] = sw.summary()
    if sw.budget_unmet:
        result.warnings.append(
            f"ranks {list(sw.budget_unmet)} keep more than {cfg.max_clock_changes} clock changes per iteration "
            f"({[sw.changes_after[s] for s in sw.budget_unmet]}): no further merge meets the deadline; "
            "allow more changes or --max-slowdown")
    result.planner_seconds += time.perf_counter() - t0
    return result
