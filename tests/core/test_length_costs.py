"""Per-micro-batch cost model (issue 25, part 2): sizes, the fit, the default model, the profile columns,
and the evaluator's per-micro-batch costs. Pure arithmetic: no host timing."""

from __future__ import annotations

import random

import pytest

from megatron_envpipe.core.length_costs import (
    LengthCoefficients,
    LengthCostError,
    LengthCostModel,
    LengthSample,
    MicrobatchSize,
    UnitLengthCost,
    _default_length_model,
    default_length_model_for,
    fit_length_costs,
    size_classes,
)
from megatron_envpipe.core.profile import Profile, ProfileError
from megatron_envpipe.core.schedule import one_f_one_b
from megatron_envpipe.core.timeline import PlanEvaluator

REF = MicrobatchSize.from_lengths([2048])


def test_microbatch_size_from_lengths():
    assert MicrobatchSize.from_lengths([3, 4]) == MicrobatchSize(7, 25)
    assert MicrobatchSize.from_lengths([2048]) == MicrobatchSize(2048, 2048**2)
    for bad, needle in (([], "at least one sequence"), ([3, 0], "whole numbers > 0"), ([2.5], "whole numbers > 0")):
        with pytest.raises(LengthCostError, match=needle):
            MicrobatchSize.from_lengths(bad)
    with pytest.raises(LengthCostError, match="must lie in tokens..tokens"):
        MicrobatchSize(10, 101)
    with pytest.raises(LengthCostError, match="1..1000000000000 tokens"):
        MicrobatchSize(0, 0)
    with pytest.raises(LengthCostError, match="whole numbers"):
        MicrobatchSize(True, 1)


def samples_for(key, coeffs_t, coeffs_e, sizes, noise=0.0, seed=0):
    rng = random.Random(seed)
    stage, chunk, ins, freq = key
    return [LengthSample(stage, chunk, ins, freq, size,
                         coeffs_t.value(size) * (1 + noise * rng.uniform(-1, 1)),
                         coeffs_e.value(size) * (1 + noise * rng.uniform(-1, 1))) for size in sizes]


def test_two_sizes_fit_fixed_and_per_token_cost_exactly():
    t = LengthCoefficients(0.01, 5e-5)
    e = LengthCoefficients(3.0, 0.015)
    model = fit_length_costs(samples_for((0, 0, "forward", 1410), t, e, [REF, MicrobatchSize.from_lengths([1024])]), REF)
    cost = model.costs[(0, 0, "forward", 1410)]
    assert cost.time.fixed == pytest.approx(0.01, rel=1e-9)
    assert cost.time.per_token == pytest.approx(5e-5, rel=1e-9)
    assert cost.time.per_attention_token2 == 0.0
    assert cost.energy.per_token == pytest.approx(0.015, rel=1e-9)


def test_three_sizes_fit_the_attention_term_and_collinear_ones_do_not():
    t = LengthCoefficients(0.01, 5e-5, 2e-9)
    sizes = [REF, MicrobatchSize.from_lengths([1024]), MicrobatchSize.from_lengths([512, 512, 512])]
    cost = fit_length_costs(samples_for((1, 0, "backward", 1200), t, t, sizes), REF).costs[(1, 0, "backward", 1200)]
    assert (cost.time.fixed, cost.time.per_token, cost.time.per_attention_token2) == pytest.approx((0.01, 5e-5, 2e-9))
    # Sequences of one length: attention_tokens2 = 512 x tokens, indistinguishable from per-token cost.
    same = [MicrobatchSize.from_lengths([512] * k) for k in (1, 2, 4)]
    cost = fit_length_costs(samples_for((1, 0, "backward", 1200), t, t, same), REF).costs[(1, 0, "backward", 1200)]
    assert cost.time.per_attention_token2 == 0.0
    assert cost.time.value(same[1]) == pytest.approx(t.value(same[1]), rel=1e-9)


def test_fit_errors_name_the_key():
    t = LengthCoefficients(0.01, 5e-5)
    with pytest.raises(LengthCostError, match="stage 2 forward at 1410 MHz was measured at 1 distinct token count"):
        fit_length_costs(samples_for((2, 0, "forward", 1410), t, t, [REF]), REF)
    # Convex samples of one sequence length (so the two-term fit): the line undershoots the smallest.
    bad = [LengthSample(3, 0, "backward", 900, MicrobatchSize.from_lengths([512] * k), time_s, 1.0)
           for k, time_s in ((1, 0.001), (2, 0.001), (3, 10.0))]
    with pytest.raises(LengthCostError, match="stage 3 backward at 900 MHz: the fitted time is -.* at 512 tokens"):
        fit_length_costs(bad, REF)
    with pytest.raises(LengthCostError, match="stage 3 backward at 900 MHz at 512 tokens .*: a sample needs time > 0"):
        LengthSample(3, 0, "backward", 900, MicrobatchSize.from_lengths([512]), 0.0, 1.0)
    with pytest.raises(LengthCostError, match="no length samples"):
        fit_length_costs([], REF)


def test_the_model_reproduces_the_profile_rows_at_the_reference_size_bit_for_bit(gpt3_profile):
    # A noisy 3-size fit does not pass through the reference sample; the factor form still gives the row.
    t = LengthCoefficients(0.004, 5e-5, 1e-9)
    sizes = [REF, MicrobatchSize.from_lengths([1024]), MicrobatchSize.from_lengths([700, 300])]
    model = fit_length_costs(samples_for((0, 0, "forward", 1740), t, t, sizes, noise=0.03), REF)
    assert model.factors(0, 0, "forward", 1740, REF) == (1.0, 1.0)
    assert model.factors(0, 0, "forward", 1740, sizes[1])[0] < 0.6
    # Chunk 1 of a split profile uses chunk 0's coefficients; an unknown clock is a clear error.
    assert model.factors(0, 1, "forward", 1740, sizes[1]) == model.factors(0, 0, "forward", 1740, sizes[1])
    with pytest.raises(LengthCostError, match="no length costs for stage 0 forward at 1725 MHz"):
        model.factors(0, 0, "forward", 1725, REF)


def test_default_model_is_the_flop_count_with_a_fixed_share():
    model = _default_length_model("gpt3-175b")
    h, s = 12288, 2048
    dense, attention = 24 * h * h * s, 4 * h * s * s
    full = dense + attention
    # Half a sequence: half the dense flops, a quarter of the attention, the whole fixed share.
    half = MicrobatchSize.from_lengths([1024])
    expected = 0.03 + 0.97 * (dense / 2 + attention / 4) / full
    assert model.factors(5, 0, "backward", 1200, half) == pytest.approx((expected, expected), rel=1e-12)
    assert model.factors(5, 0, "backward", 1200, model.reference) == (1.0, 1.0)
    # Two documents of 1024 packed: the same tokens, half the attention of one 2048 sequence.
    packed = model.factors(0, 0, "forward", 1740, MicrobatchSize.from_lengths([1024, 1024]))[0]
    assert packed == pytest.approx(1 - 0.97 * attention / 2 / full, rel=1e-12)
    assert default_length_model_for("data/profiles/a40/bloom-176b_bf16-pp8-stage-profile.csv").source.startswith(
        "default length model (bloom-176b, h = 14336")
    with pytest.raises(LengthCostError, match="no default length model"):
        default_length_model_for("mine.csv")


def test_a_model_must_be_positive_at_its_reference():
    bad = LengthCoefficients(-1.0, 1e-6)
    with pytest.raises(LengthCostError, match="time at the reference size .* must be > 0"):
        LengthCostModel(REF, {(0, 0, "forward", 1410): UnitLengthCost(bad, bad)})


def test_size_classes_share_equal_sizes():
    a, b = MicrobatchSize.from_lengths([5]), MicrobatchSize.from_lengths([2, 3])
    assert size_classes([a, b, a]) == ((1, 0, 1), (b, a))


# -- the profile columns ----------------------------------------------------------------------------------

OLD = """stage,instruction,frequency,time,energy
0,forward,1410,0.1,30.0
0,backward,1410,0.2,60.0
1,forward,1410,0.11,31.0
1,backward,1410,0.21,61.0
"""

SIZED = """stage,instruction,frequency,time,energy,tokens,attention_tokens2
0,forward,1410,0.10,30.0,,
0,backward,1410,0.20,60.0,2048,4194304
1,forward,1410,0.11,31.0,,
1,backward,1410,0.21,61.0,,
0,forward,1410,0.052,15.8,1024,1048576
0,backward,1410,0.104,31.6,1024,1048576
1,forward,1410,0.057,16.3,1024,1048576
1,backward,1410,0.109,32.1,1024,1048576
"""


def test_old_profiles_read_and_write_exactly_as_before():
    prof = Profile.from_csv_text(OLD)
    assert prof.reference_size is None and prof.length_samples == () and prof.size_samples() == ()
    assert prof.to_csv_text() == OLD


def test_size_columns_hold_samples_at_other_sizes_and_roundtrip():
    prof = Profile.from_csv_text(SIZED)
    assert prof.reference_size == REF  # the largest size stated; rows without a size are at it
    assert prof.time_s(0, "backward", 1410) == 0.20 and prof.time_s(0, "forward", 1410) == 0.10
    assert len(prof.length_samples) == 4
    again = Profile.from_csv_text(prof.to_csv_text())
    assert again.reference_size == REF and set(again.length_samples) == set(prof.length_samples)
    assert again.points(1, "backward") == prof.points(1, "backward")
    model = fit_length_costs(prof.size_samples(), prof.reference_size, prof.source)
    assert model.factors(0, 0, "forward", 1410, REF) == (1.0, 1.0)
    half = MicrobatchSize.from_lengths([1024])
    assert 0.10 * model.factors(0, 0, "forward", 1410, half)[0] == pytest.approx(0.052, rel=1e-12)


@pytest.mark.parametrize("mutate,needle", [
    (lambda t: t.replace("0,forward,1410,0.10,30.0,,", "0,forward,1410,0.10,30.0,2048,"),
     r"<text>:2: give both tokens and attention_tokens2 or neither"),
    (lambda t: t.replace("0,forward,1410,0.10,30.0,,", "0,forward,1410,0.10,30.0,2048,5"),
     r"<text>:2: attention_tokens2 .* must lie in tokens..tokens\*\*2"),
    (lambda t: t.replace("0,forward,1410,0.10,30.0,,", "0,forward,1410,0.10,30.0,20.5,500"),
     r"<text>:2: tokens/attention_tokens2 .* must be whole numbers"),
    (lambda t: t + "0,backward,1410,0.20,60.0,,\n",
     r"stage 0 backward at 1410 MHz is given both without a size and at the reference size"),
    (lambda t: t + "0,backward,1410,0.104,31.6,1024,1048576\n", r"<text>:10: duplicate row .* at 1024 tokens"),
    (lambda t: t.replace(",tokens,", ",Tokens,"), r"unknown column\(s\) 'Tokens' \(did you mean 'tokens'\?\)"),
])
def test_bad_size_columns_name_file_and_line(mutate, needle):
    with pytest.raises(ProfileError, match=needle):
        Profile.from_csv_text(mutate(SIZED))


# -- the evaluator with per-micro-batch sizes -----------------------------------------------------------------


def test_evaluator_without_sizes_is_unchanged_and_reference_sizes_cost_the_same(gpt3_profile):
    prof = gpt3_profile.for_pipeline(4)
    sched = one_f_one_b(4, 6)
    freqs = [1740 if i % 3 else 1200 for i in range(sum(len(o) for o in sched.orders))]
    plain = PlanEvaluator(sched, prof, 80.0)
    model = _default_length_model("gpt3-175b")
    sized = PlanEvaluator(sched, prof, 80.0, microbatch_sizes=[model.reference] * 6, length_model=model)
    assert plain.cost_keys[0] == (0, 0, "forward")
    assert sized.cost_keys[0] == (0, 0, "forward", 0)
    assert sized.durations(freqs) == plain.durations(freqs)
    assert sized.score(freqs) == plain.score(freqs)


def test_evaluator_costs_each_microbatch_at_its_size(gpt3_profile):
    prof = gpt3_profile.for_pipeline(4)
    sched = one_f_one_b(4, 3)
    model = _default_length_model("gpt3-175b")
    sizes = [MicrobatchSize.from_lengths([2048]), MicrobatchSize.from_lengths([512, 300]),
             MicrobatchSize.from_lengths([2048])]
    ev = PlanEvaluator(sched, prof, 80.0, microbatch_sizes=sizes, length_model=model)
    freqs = [1500] * len(ev.graph.nodes)
    durations, energies = ev.durations(freqs), ev.unit_energies(freqs)
    for v, (stage, unit) in enumerate(ev.graph.nodes):
        ins = "forward" if unit.is_forward else "backward"
        ft, fe = model.factors(stage, 0, ins, 1500, sizes[unit.microbatch])
        assert durations[v] == prof.time_s(stage, ins, 1500) * ft
        assert energies[v] == prof.energy_j(stage, ins, 1500) * fe
    assert len({k for k in ev.cost_keys}) == 4 * 2 * 2  # micro-batches 0 and 2 share a size class
    with pytest.raises(LengthCostError, match="need a length cost model"):
        PlanEvaluator(sched, prof, 80.0, microbatch_sizes=sizes)
    with pytest.raises(LengthCostError, match="2 micro-batch sizes for a schedule of 3 micro-batches"):
        PlanEvaluator(sched, prof, 80.0, microbatch_sizes=sizes[:2], length_model=model)


def test_clock_latency_prediction_costs_units_at_their_size(gpt3_profile):
    # With no latency the prediction is the plain simulation; sized units must run at their size's time.
    from megatron_envpipe.core.clock_lead import ClockLead
    from megatron_envpipe.core.clock_transitions import predict_with_latency

    prof = gpt3_profile.for_pipeline(4)
    sched = one_f_one_b(4, 3)
    model = _default_length_model("gpt3-175b")
    sizes = [MicrobatchSize.from_lengths([2048]), MicrobatchSize.from_lengths([512, 300]),
             MicrobatchSize.from_lengths([1024])]
    ev = PlanEvaluator(sched, prof, 80.0, microbatch_sizes=sizes, length_model=model)
    freqs = [1740 if v % 2 else 1200 for v in range(len(ev.graph.nodes))]
    pred = predict_with_latency(ev, freqs, ClockLead(0.0))
    assert pred.timeline.duration_s == ev.simulate(freqs).duration_s
    assert pred.score.energy_j == pytest.approx(ev.score(freqs).energy_j, rel=1e-12)
    plain = PlanEvaluator(sched, prof, 80.0)
    assert pred.timeline.duration_s != plain.simulate(freqs).duration_s
