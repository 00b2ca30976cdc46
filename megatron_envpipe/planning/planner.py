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

import dataclasses
import time

from megatron_envpipe.core.clock_transitions import predict_with_latency
from megatron_envpipe.core.kinds import plan_kind, scheduling_kind
from megatron_envpipe.core.profile import Profile
from megatron_envpipe.core.sizes import check_plan_size
from megatron_envpipe.core.timeline import PlanEvaluator
from megatron_envpipe.core.vocabulary import PlanType
from megatron_envpipe.errors import EnvPipeError
from megatron_envpipe.planning.basis import (
    PlannerConfig,
    PlanningBasis,
    PlanResult,
    planner_candidates,
    planning_profile,
)
from megatron_envpipe.planning.envpipe import plan_reconfigured
from megatron_envpipe.planning.optimal import plan_optimal
from megatron_envpipe.planning.optimal.entry import account_optimal
from megatron_envpipe.planning.switching import (
    reduce_clock_changes,
    reduce_clock_changes_remembered,
    steady_clock_changes,
)
from megatron_envpipe.planning.switching_dp import PAIR_MAX_RANK_UNITS, PAIR_TRIALS, plan_segments, short_segments


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
    if plan_kind(config.plan_type).optimized:  # core/kinds.py: planned by the LP, not from an initial plan
        result = plan_optimal(planned_on, num_microbatches, config, num_stages)
    else:
        result = plan_reconfigured(planned_on, num_microbatches, config, num_stages)
    result = _with_fewer_clock_changes(result, planned_on)
    if plan_kind(config.plan_type).optimized and counts_changes(config):
        # Changes priced inside the choice (per-rank DP over clock segments), then the better of this plan
        # and EnvPipe's envelope plan of the same schedule and memory, both counted the same way.
        result = _with_segments(result, planned_on)
        result = _better_than_envelope(result, planned_on, num_microbatches, num_stages)
        _refresh_switching_summary(result)
    if result.deadline_s is not None:
        # Gap, stop reason and energies at the target from the plan the pass left (planned on the margin's
        # profile when there is one: the LP bound is that problem's).
        account_optimal(result)
    if planned_on is not profile:
        _rescore_without_margin(result, profile)
        if result.deadline_s is not None:  # energies at the target: the nominal prediction, as energy_saving
            account_optimal(result, lp_gap=False)
    if config.clock_lead_rule is not None:
        _rescore_with_clock_latency(result, profile)
        if result.deadline_s is not None:  # the LP gap stays its own problem's (no latency in the bound)
            account_optimal(result, lp_gap=False)
    return result


def _rescore_with_clock_latency(result: PlanResult, profile: Profile) -> None:
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


def _rescore_without_margin(result: PlanResult, profile: Profile) -> None:
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


def _with_fewer_clock_changes(result: PlanResult, profile: Profile) -> PlanResult:
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
    sw = reduce_clock_changes_remembered(result.plan, evaluator, result.deadline_s if padded else None, cost,
                                         cfg.max_clock_changes)  # plan_optimal priced this very plan: its pass
    result.plan, result.score, result.timeline = sw.plan, sw.score, sw.timeline
    result.details["clock_switching"] = sw.summary()
    if sw.budget_unmet:
        result.warnings.append(
            f"ranks {list(sw.budget_unmet)} keep more than {cfg.max_clock_changes} clock changes per iteration "
            f"({[sw.changes_after[s] for s in sw.budget_unmet]}): no further merge meets the deadline; "
            "allow more changes or --max-slowdown")
    result.planner_seconds += time.perf_counter() - t0
    return result


# The envelope rival (_better_than_envelope) gets the segment DP when, after the merge pass, it is worth at
# most this much more than the optimal plan: the DP has not gained more than about 1 % of a plan's energy.
_RIVAL_DP_WITHIN = 0.02


def _refresh_switching_summary(result: PlanResult) -> None:
    """``details['clock_switching']`` from the plan before the merge pass to the plan returned, whatever
    came between (segment DP, the merge pass again, EnvPipe's plan kept)."""
    summary = result.details.get("clock_switching")
    if summary is None:
        return
    charged = steady_clock_changes(result.plan)
    summary.update(
        clock_changes_after=list(result.plan.clock_changes()),
        charged_clock_changes_after=list(charged),
        energy_given_up_j=result.score.energy_j - summary["energy_before_j"],
        switch_energy_saved_j=summary["switch_cost_j"] * (sum(summary["charged_clock_changes_before"]) - sum(charged)),
    )


def counts_changes(config: PlannerConfig) -> bool:
    """Whether clock changes have a price for this config: a switch cost, or a clock latency that bounds segments."""
    return config.effective_switch_cost_j > 0 or config.clock_latency_s > 0


def _counted_energy_j(result: PlanResult) -> float:
    """What a plan is worth with its clock changes counted (:attr:`PlanResult.energy_j`), until the target
    iteration time when the plan is padded to one (faster plans block at P2P power until then)."""
    energy = result.energy_j
    if result.details.get("padded_to_deadline") and result.deadline_s is not None:
        p2p, p = result.config.effective_p2p_power_w, result.schedule.num_stages
        energy += p2p * p * max(0.0, result.deadline_s - result.score.iteration_time_s)
    return energy


def _latency_summary(result: PlanResult, profile: Profile) -> dict:
    """Segments too short for the clock latency (planning/switching_dp.short_segments) and changes per rank."""
    evaluator_durations = result.timeline.duration_s
    short, k = 0, 0
    for row in result.plan.freqs_mhz:
        short += short_segments(list(row), evaluator_durations[k:k + len(row)], result.config.clock_latency_s)
        k += len(row)
    return {"short_segments": short, "charged_clock_changes": sum(steady_clock_changes(result.plan))}


def _with_segments(result: PlanResult, profile: Profile) -> PlanResult:
    """``result`` after the per-rank segment DP (planning/switching_dp.py) and the merge pass again; the DP
    holds every segment to the clock latency (``config.clock_latency_s``); ``details['clock_segments']``
    says what it did, ``details['clock_changes_removed_by_latency']`` how many changes the latency removed."""
    cfg = result.config
    t0 = time.perf_counter()
    cost = cfg.effective_switch_cost_j
    padded = bool(result.details.get("padded_to_deadline"))
    evaluator = PlanEvaluator(result.schedule, profile, cfg.effective_p2p_power_w, graph=result.timeline.graph)
    deadline = result.deadline_s if padded and result.deadline_s is not None else result.score.iteration_time_s
    latency = cfg.clock_latency_s
    before = _latency_summary(result, profile) if latency > 0 else None
    # Moves of two ranks at once where the ranks are short enough for them to be cheap (switching_dp.PAIR_*).
    pairs = PAIR_TRIALS if max(map(len, result.schedule.orders)) <= PAIR_MAX_RANK_UNITS else 0
    dp = plan_segments(result.plan, evaluator, deadline, cost, min_segment_s=latency, pair_trials=pairs)
    # The same DP without the latency bound says how many changes the latency removed.
    free = plan_segments(result.plan, evaluator, deadline, cost, pair_trials=pairs) if latency > 0 else dp
    if dp.ranks_improved:
        result.plan, result.score, result.timeline = dp.plan, dp.score, dp.timeline
        if cost > 0 or cfg.max_clock_changes is not None:  # merges the DP's bounds did not reach
            sw = reduce_clock_changes(result.plan, evaluator, deadline if padded else None, cost,
                                      cfg.max_clock_changes)
            result.plan, result.score, result.timeline = sw.plan, sw.score, sw.timeline
            if "clock_switching" in result.details:
                result.details["clock_switching"]["merges"] += sw.merges
    result.details["clock_segments"] = {
        "objective_before_j": dp.objective_before_j, "objective_after_j": dp.objective_after_j,
        "ranks_replanned": dp.ranks_improved, "sweeps": dp.sweeps, "min_segment_s": latency,
    }
    if before is not None:
        after = _latency_summary(result, profile)
        result.details["clock_segments"].update(short_segments_before=before["short_segments"],
                                                short_segments_after=after["short_segments"])
        result.details["clock_changes_removed_by_latency"] = max(
            0, sum(steady_clock_changes(free.plan)) - sum(steady_clock_changes(dp.plan)))
    result.planner_seconds += time.perf_counter() - t0
    return result


def _better_than_envelope(result: PlanResult, profile: Profile, num_microbatches: int,
                         num_stages: int | None) -> PlanResult:
    """The better of the optimal ``result`` and EnvPipe's envelope plan of the same scheduling and memory
    (balanced reconfiguration, the same switch cost, merge pass and segment DP), counted the same way
    (:func:`_counted_energy_j`); the rival must meet the optimal plan's deadline. ``details['kept_plan']``
    says which was kept, ``details['envelope_rival']`` what the other was worth."""
    cfg = result.config
    t0 = time.perf_counter()
    rival_cfg = dataclasses.replace(cfg, plan_type=PlanType.ENVELOPE, reconfig="balanced",
                                    switch_cost_j=cfg.effective_switch_cost_j, target_time_s=None)
    mine = _counted_energy_j(result)
    result.details["kept_plan"] = "optimal"
    # The rival starts from the optimal plan's basis (clocks, baseline): the same problem, planned once.
    # (Its warnings are not reported, only its plan: the basis's own warnings are the optimal plan's.)
    basis = PlanningBasis(result.schedule.num_stages, cfg.effective_p2p_power_w, result.candidates_mhz,
                          result.f_max_mhz, result.valley_mhz, [], result.baseline_plan, result.baseline_timeline,
                          result.baseline)
    try:
        rival = plan_reconfigured(profile, num_microbatches, rival_cfg, num_stages, basis,
                                  (result.schedule, result.baseline_plan.schedule))
    except EnvPipeError:
        return result
    rival = _with_fewer_clock_changes(rival, profile)
    rival.details["padded_to_deadline"] = result.details.get("padded_to_deadline", False)
    rival.deadline_s = result.deadline_s
    if _counted_energy_j(rival) < mine * (1 + _RIVAL_DP_WITHIN) or cfg.clock_latency_s > 0:
        rival = _with_segments(rival, profile)  # only where it may win: the DP takes about as long as the plan
    theirs = _counted_energy_j(rival)
    fits = result.deadline_s is None or rival.score.iteration_time_s <= result.deadline_s * (1 + 1e-9)
    result.details["envelope_rival"] = {"energy_j": theirs, "meets_deadline": fits,
                                        "charged_clock_changes": sum(rival.charged_clock_changes)}
    if fits and theirs < mine - 1e-9 * abs(mine):
        result.plan, result.score, result.timeline = rival.plan, rival.score, rival.timeline
        for key in ("clock_segments", "clock_changes_removed_by_latency"):
            if key in rival.details:
                result.details[key] = rival.details[key]
        result.details["kept_plan"] = "envelope"
        if scheduling_kind(cfg.scheduling).extra_warmup and result.details.get("extra_warmup_chosen") is not None:
            result.details["extra_warmup_chosen"] = "envelope"
    result.planner_seconds += time.perf_counter() - t0
    return result

