"""The clock-lead rule (core/clock_lead.py) and the latency-aware prediction (core/clock_transitions.py).

Hand-computed cases on a two-clock synthetic profile: no host timing anywhere.
"""

import pytest

from megatron_envpipe.core.clock_lead import ClockLead, ClockLeadError
from megatron_envpipe.core.clock_transitions import predict_with_latency
from megatron_envpipe.core.plan import FrequencyPlan
from megatron_envpipe.core.profile import Profile, ProfilePoint
from megatron_envpipe.core.schedule import B, F, one_f_one_b
from megatron_envpipe.core.timeline import PlanEvaluator
from megatron_envpipe.errors import EnvPipeError
from megatron_envpipe.planning.basis import PlannerConfig, PlannerError

LO, HI = 1000, 2000
# Per instruction: (time, energy) at LO and HI; the same on both stages.
ROWS = {"forward": ((0.200, 20.0), (0.100, 15.0)), "backward": ((0.400, 40.0), (0.200, 30.0))}
P2P_W = 30.0


def profile(num_stages=2):
    return Profile({(s, ins): [ProfilePoint(LO, *lo), ProfilePoint(HI, *hi)]
                    for s in range(num_stages) for ins, (lo, hi) in ROWS.items()}, source="synthetic two-clock")


# -- the rule ---------------------------------------------------------------------------------------

def test_raise_is_requested_latency_and_margin_before_the_boundary():
    assert ClockLead(0.015).request_after_begin_s(LO, HI, 0.100) == pytest.approx(0.085, abs=1e-15)
    assert ClockLead(0.015, margin_s=0.005).request_after_begin_s(LO, HI, 0.100) == pytest.approx(0.080, abs=1e-15)
    # A unit shorter than the lead: at its begin (as early as the hooks can ask).
    assert ClockLead(0.015).request_after_begin_s(LO, HI, 0.010) == 0.0


def test_lowerings_unchanged_clocks_and_rule_off_stay_at_the_boundary():
    assert ClockLead(0.015).request_after_begin_s(HI, LO, 0.100) is None
    assert ClockLead(0.015).request_after_begin_s(HI, HI, 0.100) is None
    assert ClockLead(0.015, enabled=False).request_after_begin_s(LO, HI, 0.100) is None


@pytest.mark.parametrize("kwargs, words", [
    ({"latency_s": -0.001}, "latency_s must be a number of seconds in [0, 1]"),
    ({"latency_s": 15}, "latency_s must be a number of seconds in [0, 1]"),  # ms given as s
    ({"latency_s": float("nan")}, "latency_s"),
    ({"latency_s": 0.01, "margin_s": -1}, "margin_s"),
    ({"latency_s": 0.01, "enabled": "yes"}, "enabled must be True or False"),
])
def test_bad_settings_are_refused_with_one_clear_line(kwargs, words):
    with pytest.raises(ClockLeadError, match=words.replace("[", r"\[").replace("]", r"\]")) as info:
        ClockLead(**kwargs)
    assert isinstance(info.value, EnvPipeError) and "\n" not in str(info.value)


@pytest.mark.parametrize("args, words", [((0, HI, 0.1), "old_mhz"), ((LO, 1.5, 0.1), "new_mhz"),
                                         ((LO, HI, -0.1), "previous_unit_s"), ((LO, HI, float("inf")), "previous_unit_s")])
def test_bad_queries_are_refused(args, words):
    with pytest.raises(ClockLeadError, match=words):
        ClockLead(0.01).request_after_begin_s(*args)


# -- the prediction ---------------------------------------------------------------------------------

def critical_raise_case():
    """P = 2, M = 1: F(s0) -> F(s1) -> B(s1) -> B(s0), all on the critical path. Stage 1 runs its
    forward at LO and its backward at HI: a raise right on the critical path."""
    schedule = one_f_one_b(2, 1)
    plan = FrequencyPlan(schedule, ((HI, HI), (LO, HI)))
    evaluator = PlanEvaluator(schedule, profile(), P2P_W)
    return evaluator, plan.flat()


def test_zero_latency_is_the_plan_evaluator_exactly():
    evaluator, freqs = critical_raise_case()
    exact = evaluator.score(freqs)
    for enabled in (True, False):
        run = predict_with_latency(evaluator, freqs, ClockLead(0.0, enabled))
        assert run.score == exact
        assert run.late_raises == 0


def test_without_the_rule_a_critical_raise_lands_late_and_slows_the_iteration():
    evaluator, freqs = critical_raise_case()
    lat = 0.015
    zero = evaluator.score(freqs).iteration_time_s  # 0.1 + 0.2 + 0.2 + 0.2 = 0.7
    run = predict_with_latency(evaluator, freqs, ClockLead(lat, enabled=False))
    # B(s1) runs its first 15 ms at LO (15/400 of its work), the rest at HI.
    slower = lat * (1 - 0.200 / 0.400)
    assert run.score.iteration_time_s == pytest.approx(zero + slower, abs=1e-12)
    assert run.score.iteration_time_s > zero + 0.007
    assert run.late_raises == 1 and run.led == 0


def test_with_the_rule_the_raise_lands_on_time():
    evaluator, freqs = critical_raise_case()
    zero = evaluator.score(freqs)
    run = predict_with_latency(evaluator, freqs, ClockLead(0.015))
    # Requested 15 ms before F(s1)'s planned end, the raise lands right at it: the zero-latency iteration.
    assert run.led == 1 and run.late_raises == 0
    assert run.score.iteration_time_s == pytest.approx(zero.iteration_time_s, abs=1e-12)
    assert run.score.energy_j == pytest.approx(zero.energy_j, abs=1e-9)


def test_a_margin_runs_the_tail_of_the_unit_before_at_the_higher_clock():
    evaluator, freqs = critical_raise_case()
    zero = evaluator.score(freqs)
    margin = 0.005
    run = predict_with_latency(evaluator, freqs, ClockLead(0.015, margin_s=margin))
    # The raise lands 5 ms before F(s1)'s planned end: its last 5/200 of work runs at HI, in 2.5 ms.
    tail_work = margin / 0.200
    saved_s = margin - tail_work * 0.100
    assert run.score.iteration_time_s == pytest.approx(zero.iteration_time_s - saved_s, abs=1e-12)
    # ... at HI's energy for that work (15 J vs 20 J per forward), and stage 0 waits 2.5 ms less at P2P power
    # (stage 1 was computing: its idle time is unchanged).
    expected_j = zero.energy_j + tail_work * (15.0 - 20.0) - P2P_W * saved_s
    assert run.score.energy_j == pytest.approx(expected_j, abs=1e-9)


def test_a_lowering_requested_while_waiting_for_input_lands_before_the_unit():
    # Stage 1 ends the previous iteration at HI and waits 100 ms for F(s0): the lowering to LO
    # requested at t = 0 lands at 15 ms, before its forward begins; it runs entirely at LO.
    evaluator, freqs = critical_raise_case()
    run = predict_with_latency(evaluator, freqs, ClockLead(0.015), initial_mhz=(HI, HI))
    v = evaluator.graph.node(1, F(0))
    assert run.timeline.duration_s[v] == pytest.approx(0.200, abs=1e-15)
    # A lowering at the boundary instead (stage 1's backward runs LO after a HI forward): the backward's first
    # 15 ms still run at HI.
    schedule = one_f_one_b(2, 1)
    low = PlanEvaluator(schedule, profile(), P2P_W)
    freqs = FrequencyPlan(schedule, ((HI, HI), (HI, LO))).flat()
    run = predict_with_latency(low, freqs, ClockLead(0.015), initial_mhz=(HI, HI))
    b1 = low.graph.node(1, B(0))
    assert run.timeline.duration_s[b1] == pytest.approx(0.015 + (1 - 0.015 / 0.200) * 0.400, abs=1e-12)


def test_driver_serialises_requests_by_the_call_time():
    # Long latency (0.3 s), call 0.2 s: stage 1 (HI at the start) asks for LO at t = 0, lands at 0.3; its
    # raise for B is asked at F's begin (0.1: F is shorter than the lead) but the driver is busy until 0.2.
    # F(s1) runs at HI (0.1-0.2); B(s1) from 0.2 at HI, LO from 0.3, HI again from the raise's landing.
    evaluator, freqs = critical_raise_case()
    lead = ClockLead(0.3)
    free = predict_with_latency(evaluator, freqs, lead, nvml_call_s=0.0, initial_mhz=(HI, HI))
    busy = predict_with_latency(evaluator, freqs, lead, nvml_call_s=0.2, initial_mhz=(HI, HI))
    b1 = evaluator.graph.node(1, B(0))
    # Raise lands at 0.4: half of B at HI (0.1 s), a quarter at LO (0.1 s), a quarter at HI (0.05 s).
    assert free.timeline.end_s[b1] == pytest.approx(0.45, abs=1e-12)
    # Raise issued at 0.2, lands at 0.5: the other half at LO (0.2 s).
    assert busy.timeline.end_s[b1] == pytest.approx(0.5, abs=1e-12)
    assert busy.score.iteration_time_s == pytest.approx(0.7, abs=1e-12)
    with pytest.raises(ClockLeadError, match="nvml_call_s"):
        predict_with_latency(evaluator, freqs, ClockLead(0.015), nvml_call_s=0.02)


def test_planner_config_refuses_a_latency_it_cannot_use():
    with pytest.raises(ClockLeadError, match="latency_s must be a number of seconds"):
        PlannerConfig(clock_latency_s=15).validate()  # ms given as s
    with pytest.raises(PlannerError, match="clock call time must be between 0 and the clock latency"):
        PlannerConfig(clock_latency_s=0.01, clock_call_s=0.02).validate()
    assert PlannerConfig().clock_lead_rule is None  # default: changes land at once, as before
    assert PlannerConfig(clock_latency_s=0.015, clock_lead=False).validate().clock_lead_rule == ClockLead(0.015, False)
