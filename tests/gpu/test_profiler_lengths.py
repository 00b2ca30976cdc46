"""The start-up profiler at variable micro-batch sizes (issue 25 part 2): units of different sizes are never
averaged into one row; the profile holds the reference-size rows plus a sample per other size, from which
the length model is fitted (and re-fitted when the cached profile is read). Measured, not assumed: the
simulated GPUs run a known length model, the sweep measures it through the energy counter, and the fit
recovers it. Virtual time: nothing depends on the host's speed."""

from __future__ import annotations

import logging

from megatron_envpipe.core.device_dynamics import load_dynamics
from megatron_envpipe.core.length_costs import (
    LengthCoefficients,
    LengthCostModel,
    MicrobatchSize,
    UnitLengthCost,
    fit_length_costs,
)
from megatron_envpipe.core.profile import Profile
from megatron_envpipe.core.resources import configs_dir
from megatron_envpipe.gpu.profiler.profile_cache import ProfileCache
from megatron_envpipe.gpu.profiler.sweep import startup_sweep
from megatron_envpipe.testing.profiler_runs import a40_three_stages, profile_on_simulated_gpus

REF = MicrobatchSize.from_lengths([2048])
# Two iterations' micro-batches (alternating): 5 token counts, packed documents of different lengths.
SIZES = ([MicrobatchSize.from_lengths(d) for d in ([2048], [1024, 1024], [1500], [300, 300, 300])],
         [MicrobatchSize.from_lengths(d) for d in ([700], [2048], [1024, 1024], [1200, 600])])
# Sizes inside the measured range where the fitted model is checked.
CHECKED = [MicrobatchSize.from_lengths(d) for d in ([2048], [1800], [1000, 1000], [900], [500, 400])]
P2P_W = 70.0


def _truth_model(truth: Profile) -> LengthCostModel:
    """Per stage and instruction its own coefficients; energy grows unlike time (power depends on the size)."""
    costs = {}
    for s in range(truth.num_stages):
        for k, ins in enumerate(("forward", "backward")):
            time = LengthCoefficients(0.1 + 0.05 * s, (0.6 + 0.1 * k) / REF.tokens, 0.3 / REF.attention_tokens2)
            energy = LengthCoefficients(0.25, (0.5 + 0.05 * s) / REF.tokens, 0.2 / REF.attention_tokens2)
            for f in truth.frequencies(s, ins):
                costs[(s, 0, ins, f)] = UnitLengthCost(time, energy)
    return LengthCostModel(REF, costs, source="the simulated truth")


def _sweep(truth, sizes, model, **kw):
    sweep = startup_sweep(truth.common_frequencies(), 180, 30)
    profile_on_simulated_gpus(truth, sweep, p2p_power_w=P2P_W, microbatches=4, virtual_time=True, sizes=sizes,
                              length_model=model, **kw)  # sizes: per iteration, None = not known
    return sweep


def _errors(profile: Profile, truth: Profile, model: LengthCostModel) -> tuple[float, float]:
    """Largest relative errors of the measured (rows, fitted factors) against the truth's."""
    fit = fit_length_costs(profile.size_samples(), profile.reference_size)
    rows = factors = 0.0
    for s in range(truth.num_stages):
        for ins in ("forward", "backward"):
            for f in profile.frequencies(s, ins):
                rows = max(rows, abs(profile.time_s(s, ins, f) / truth.time_s(s, ins, f) - 1),
                           abs(profile.energy_j(s, ins, f) / truth.energy_j(s, ins, f) - 1))
                for size in CHECKED:
                    got, want = fit.factors(s, 0, ins, f, size), model.factors(s, 0, ins, f, size)
                    factors = max(factors, *(abs(g / w - 1) for g, w in zip(got, want)))
    return rows, factors


def test_the_fitted_model_recovers_the_simulated_one_exactly_on_an_exact_gpu():
    truth = a40_three_stages()
    model = _truth_model(truth)
    sweep = _sweep(truth, SIZES, model, time_scale=1.0)
    profile = sweep.profile()
    assert profile.reference_size == REF and sweep.length_fit == "length fit from 6 sizes"
    # A sample per other size measured, stage, instruction and clock: nothing averaged across sizes.
    per_key = {}
    for x in profile.length_samples:
        per_key.setdefault(x.key, []).append(x.size)
    assert len(per_key) == 3 * 2 * len(sweep.measured_clocks_mhz())
    assert all(len(set(sizes)) == len(sizes) >= 3 and REF not in sizes for sizes in per_key.values())
    rows, factors = _errors(profile, truth, model)
    assert rows < 1e-9 and factors < 1e-9
    # Sized micro-batches cost no more profiling iterations than fixed-length ones (the steady check
    # compares iterations at the reference size).
    assert sweep.iterations_used == _sweep(truth, None, None, time_scale=1.0).iterations_used


def test_within_the_noise_of_a_realistic_gpu_the_fit_is_as_close_as_fixed_length_rows():
    """Clock latency, a 100 ms stepped counter, averaged power, heat drift (configs/device-dynamics)."""
    truth = a40_three_stages()
    model = _truth_model(truth)
    dynamics = load_dynamics("realistic", configs_dir())
    sized = _sweep(truth, SIZES, model, time_scale=0.1, dynamics=dynamics)
    fixed = _sweep(truth, None, None, time_scale=0.1, dynamics=dynamics)
    fixed_rows = max(abs(r.energy_j / truth.energy_j(r.stage, r.instruction, r.freq_mhz) - 1) for r in fixed.rows())
    rows, factors = _errors(sized.profile(), truth, model)
    print(f"\nrealistic GPU: fixed-length rows within {100 * fixed_rows:.2f} %, sized rows {100 * rows:.2f} %, "
          f"fitted factors {100 * factors:.2f} %")
    # A factor is a ratio of two measured sizes' costs, each within the rows' noise: within ~2x of it.
    assert fixed_rows < 0.04 and rows < fixed_rows + 0.01 and factors < 2.5 * fixed_rows


def test_a_single_size_keeps_the_fixed_length_profile_and_says_why(caplog):
    truth = a40_three_stages()
    model = _truth_model(truth)
    with caplog.at_level(logging.WARNING, logger="megatron_envpipe"):
        one_size = _sweep(truth, [[REF] * 4], model, time_scale=1.0).profile()
    assert "no length fit, keeping fixed-length rows" in caplog.text and "distinct token count(s) (2048)" in caplog.text
    assert one_size.reference_size is None and not one_size.length_samples
    # At the reference size the simulated units are the profile's rows: the very same profile as without sizes.
    assert one_size.to_csv_text() == _sweep(truth, None, None, time_scale=1.0).profile().to_csv_text()


def test_iterations_whose_sizes_are_unknown_keep_the_fixed_length_profile_without_failing(caplog):
    """The executor hands None where an iteration's sizes are not known (data it cannot size)."""
    truth = a40_three_stages()
    with caplog.at_level(logging.WARNING, logger="megatron_envpipe"):
        sweep = _sweep(truth, [SIZES[0], None], _truth_model(truth), time_scale=1.0)
        profile = sweep.profile()
    assert "no sizes in some iterations at [" in caplog.text and sweep.length_fit.startswith("no length fit")
    assert profile.reference_size is None and sweep.summary().endswith(sweep.length_fit)


def test_the_cached_profile_refits_the_same_model(tmp_path):
    truth = a40_three_stages()
    profile = _sweep(truth, SIZES, _truth_model(truth), time_scale=1.0).profile()
    cache = ProfileCache(tmp_path)
    key = {"model": "test", "variable_seq_lengths": True}
    cache.store(key, profile, {"iterations_used": 8})
    loaded = cache.load(key)
    assert loaded.reference_size == REF and sorted(loaded.size_samples(), key=repr) == sorted(
        profile.size_samples(), key=repr)
    before = fit_length_costs(profile.size_samples(), profile.reference_size)
    after = fit_length_costs(loaded.size_samples(), loaded.reference_size)
    assert after.costs == before.costs
