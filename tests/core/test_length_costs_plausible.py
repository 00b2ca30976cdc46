"""Physical plausibility of micro-batch-size rows (core/length_costs.py, issue 39 item 6): a profile whose
stages state different micro-batch sizes, and length samples no micro-batch of that size could give, are
refused when the profile is read (every command, --envpipe-profile, the simulated GPU's CSV) and when a
fit is made from samples. Pure arithmetic on small profiles written here."""

from __future__ import annotations

import pytest

from megatron_envpipe.core.length_costs import (
    _PLAUSIBLE_RTOL,
    LengthCostError,
    LengthSample,
    MicrobatchSize,
    _default_length_model,
    fit_length_costs,
)
from megatron_envpipe.core.profile import Profile, ProfileError

REF = MicrobatchSize(2048, 2048 ** 2)
HALF = MicrobatchSize(1024, 1024 ** 2)
# 2 stages x forward/backward x 2 clocks, at the reference size: (stage, instruction, MHz, s, J).
PLAIN = [(s, ins, f, t * (1.2 if f == 1200 else 1.0), e) for s in (0, 1) for ins, t, e in
         (("forward", 0.1, 30.0), ("backward", 0.25, 75.0)) for f in (1740, 1200)]


def _csv(rows: list[tuple]) -> str:
    lines = ["stage,instruction,frequency,time,energy,tokens,attention_tokens2"]
    lines += [",".join(str(v) for v in (s, ins, f, t, e, size.tokens, size.attention_tokens2))
              for s, ins, f, t, e, size in rows]
    return "\n".join(lines) + "\n"


def _profile(extra: list[tuple], plain_size: dict[int, MicrobatchSize] | None = None) -> Profile:
    sizes = plain_size or {}
    rows = [(s, ins, f, t, e, sizes.get(s, REF)) for s, ins, f, t, e in PLAIN]
    return Profile.from_csv_text(_csv(rows + extra), "p.csv")


def test_honest_samples_are_read_and_fitted():
    # Half the tokens, a quarter of the attention: between 0.25x and 1x, as any non-negative cost model gives.
    extra = [(s, ins, f, t * 0.55, e * 0.5, HALF) for s, ins, f, t, e in PLAIN]
    profile = _profile(extra)
    assert len(profile.length_samples) == len(PLAIN) and profile.num_stages == 2
    fit_length_costs(profile.size_samples(), profile.reference_size, source="p.csv")


@pytest.mark.parametrize("stage", [0, 1])
def test_stages_that_state_different_sizes_are_refused_not_planned_as_fewer_stages(stage):
    """Before: the stage at the smaller size became length samples only and the plan covered the others."""
    with pytest.raises(ProfileError) as info:
        _profile([], plain_size={stage: HALF})
    message = str(info.value)
    assert "\n" not in message and f"stage {stage}" in message and "reference size" in message, message


@pytest.mark.parametrize("what, time_factor, energy_factor", [
    ("time", 50.0, 0.5),    # half the tokens taking 50x the time
    ("time", 0.1, 0.5),     # ... or a tenth of it (below even the attention's quarter)
    ("energy", 0.5, 8.0),   # ... drawing 16x the power (4.8 kW: below the per-row ceiling of any GPU)
    ("energy", 0.5, 0.0),   # ... for no energy at all
])
def test_implausible_samples_are_refused_when_read(what, time_factor, energy_factor):
    s, ins, f, t, e = PLAIN[0]
    with pytest.raises(ProfileError) as info:
        _profile([(s, ins, f, t * time_factor, e * energy_factor, HALF)])
    message = str(info.value)
    assert "\n" not in message and what in message and "re-measure" in message, message


def test_the_bound_is_the_size_ratio_with_measurement_noise_allowed():
    """Half the tokens, a quarter of the attention: no less than 0.25x the time, give or take the noise."""
    s, ins, f, t, e = PLAIN[0]
    low = 0.25 / (1 + _PLAUSIBLE_RTOL)
    _profile([(s, ins, f, t * low * 1.001, e * 0.5, HALF)])  # just inside
    with pytest.raises(ProfileError):
        _profile([(s, ins, f, t * low * 0.99, e * 0.5, HALF)])  # just outside


def test_a_fit_from_samples_checks_them_too():
    """Samples that never were a file (the start-up profiler's) meet the same rule in the fit."""
    model = _default_length_model("gpt3-175b")
    samples = []
    for size in (REF, HALF, MicrobatchSize(512, 512 ** 2)):
        t_factor, e_factor = model.factors(0, 0, "forward", 1740, size)
        samples.append(LengthSample(0, 0, "forward", 1740, size, 0.1 * t_factor, 30.0 * e_factor))
    fit_length_costs(samples, REF)  # the documented model's own figures pass
    samples[1] = LengthSample(0, 0, "forward", 1740, HALF, 5.0, 15.0)
    with pytest.raises(LengthCostError, match="re-measure"):
        fit_length_costs(samples, REF)
