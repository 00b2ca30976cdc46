"""The simulated GPU's length dependence (issue 25): a unit of a given micro-batch size takes the profile's
row at the running clock scaled by the length model's factors for that size; without sizes, exactly as
before. Simulated time only (virtual clocks), so nothing depends on the host's speed."""

from __future__ import annotations

import pytest

from megatron_envpipe.core.device_dynamics import DeviceDynamics
from megatron_envpipe.core.hooks import RecordingHooks
from megatron_envpipe.core.length_costs import (
    LengthCoefficients,
    LengthCostModel,
    LengthSample,
    MicrobatchSize,
    UnitLengthCost,
)
from megatron_envpipe.core.profile import Profile, ProfilePoint
from megatron_envpipe.core.schedule import B, F
from megatron_envpipe.core.virtual_clock import VirtualClock
from megatron_envpipe.gpu import open_gpu
from megatron_envpipe.gpu.devices.base import GpuError
from megatron_envpipe.gpu.devices.simulated import SimulatedGpu
from megatron_envpipe.gpu.hooks import GpuHooks

REF = MicrobatchSize.from_lengths([2048])
MID = MicrobatchSize.from_lengths([1024, 1024])
SMALL = MicrobatchSize.from_lengths([300, 300, 300])
CLOCKS = (1500, 1200, 900)


def _profile(stages: int = 2) -> Profile:
    pts = {}
    for s in range(stages):
        for ins, t, e in (("forward", 0.10, 30.0), ("backward", 0.20, 58.0)):
            pts[(s, ins)] = [ProfilePoint(1500, t * (1 + 0.1 * s), e), ProfilePoint(1200, t * 1.2, e * 0.85),
                             ProfilePoint(900, t * 1.6, e * 0.9)]
    return Profile(pts, source="<small>")


def _model() -> LengthCostModel:
    """Time and energy scale differently, so a unit's power depends on its size too."""
    time = LengthCoefficients(0.1, 0.6 / REF.tokens, 0.3 / REF.attention_tokens2)
    energy = LengthCoefficients(0.3, 0.5 / REF.tokens, 0.2 / REF.attention_tokens2)
    return LengthCostModel(REF, {}, UnitLengthCost(time, energy), source="test model")


LATENCY = DeviceDynamics(clock_latency_s=0.03, source="test: 30 ms clock latency")


def _run(device: SimulatedGpu, vc: VirtualClock, sizes, *, lock_inside: int | None = None):
    """F then B per entry of ``sizes`` (``...``: no set_unit_size call at all); with ``lock_inside`` a lock
    to that clock is requested inside the first unit (it lands mid-unit). -> per unit (window, energy J)."""
    out = []
    device.set_locked_clocks(1500)
    vc.sleep(0.1)
    for i, size in enumerate(sizes):
        for kind in "FB":
            if size is not ...:
                device.set_unit_size(size)
            e0 = device.true_energy_mj()
            device.unit_begin(0, kind)
            if lock_inside is not None and i == 0 and kind == "F":
                device.set_locked_clocks(lock_inside)
            device.unit_end(0, kind)
            out.append((device.last_unit_window(), (device.true_energy_mj() - e0) / 1000.0))
            vc.sleep(0.01)
    return out


def _device(profile=None, **kw) -> tuple[SimulatedGpu, VirtualClock]:
    vc = VirtualClock()
    return SimulatedGpu(profile or _profile(), 0, p2p_power_w=50.0, clock=vc.now, sleep=vc.sleep,
                        dynamics=LATENCY, **kw), vc


def test_without_sizes_a_unit_is_the_profiles_row_bit_for_bit():
    plain = _run(*_device(), [..., ...], lock_inside=900)
    with_model = _run(*_device(length_model=_model()), [..., ...], lock_inside=900)
    unsized = _run(*_device(length_model=_model()), [None, None], lock_inside=900)
    at_reference = _run(*_device(length_model=_model()), [REF, REF], lock_inside=900)  # factor exactly 1
    assert plain == with_model == unsized == at_reference


def test_a_sized_unit_takes_the_row_scaled_by_the_models_time_and_energy_factors():
    model, profile = _model(), _profile()
    runs = _run(*_device(length_model=model), [SMALL, MID])
    for ((_, begin, end), energy_j), (size, ins) in zip(runs, [(SMALL, "forward"), (SMALL, "backward"),
                                                                  (MID, "forward"), (MID, "backward")]):
        time_factor, energy_factor = model.factors(0, 0, ins, 1500, size)
        assert time_factor < 1 and energy_factor < 1 and time_factor != energy_factor
        assert end - begin == pytest.approx(profile.time_s(0, ins, 1500) * time_factor, rel=1e-12)
        assert energy_j == pytest.approx(profile.energy_j(0, ins, 1500) * energy_factor, rel=1e-9)


def test_a_clock_change_inside_a_sized_unit_continues_at_the_new_clocks_scaled_row():
    """The same as a device whose profile rows are already scaled to that size (no sizes given)."""
    model, profile = _model(), _profile()
    scaled = Profile({(s, ins): [ProfilePoint(p.freq_mhz, p.time_s * model.factors(s, 0, ins, p.freq_mhz, SMALL)[0],
                                              p.energy_j * model.factors(s, 0, ins, p.freq_mhz, SMALL)[1])
                                 for p in profile.points(s, ins)]
                      for s in range(2) for ins in ("forward", "backward")}, source="<scaled>")
    sized = _run(*_device(length_model=model), [SMALL], lock_inside=900)
    prescaled = _run(*_device(scaled), [...], lock_inside=900)
    (_, b0, e0), _ = sized[0]
    assert e0 - b0 > 0.03  # the lock landed inside the unit
    for ((_, b, e), ej), ((_, b2, e2), ej2) in zip(sized, prescaled):
        assert (b, e) == pytest.approx((b2, e2), rel=1e-12) and ej == pytest.approx(ej2, rel=1e-9)


def test_a_size_without_a_length_model_is_refused_with_what_to_do():
    device, _ = _device()
    with pytest.raises(GpuError, match="no length model: give SimulatedGpu\\(length_model=...\\)"):
        device.set_unit_size(SMALL)
    device.set_unit_size(None)  # no size: fine


def test_the_hooks_give_each_unit_its_microbatchs_size_and_tag_its_profiling_sample():
    model, profile = _model(), _profile()
    vc = VirtualClock()
    device = SimulatedGpu(profile, 0, p2p_power_w=50.0, clock=vc.now, sleep=vc.sleep, length_model=model)
    hooks = GpuHooks(device, control=True, cuda=False, virtual_clock=vc)
    units = (F(0), F(1), B(0), B(1))
    try:
        hooks.iteration_begin(0, 0)
        hooks.iteration_sizes([MID, SMALL])
        hooks.set_frequency(1200)
        for unit in units:
            vc.sleep(0.01)
            hooks.unit_begin(unit)
            hooks.unit_end(unit)
        windows = list(hooks.device_windows)
        vc.sleep(0.05)
        hooks.iteration_end(None)
        samples = hooks.stage_samples(windows, [])
        sizes = [MID, SMALL, MID, SMALL]
        for (kind, begin, end), size in zip(windows, sizes):
            ins = "forward" if kind == "F" else "backward"
            assert end - begin == pytest.approx(profile.time_s(0, ins, 1200) * model.factors(0, 0, ins, 1200, size)[0],
                                                rel=1e-12)
        assert [(u.kind, u.size) for u in samples.units] == list(zip("FFBB", sizes))
        for u, size in zip(samples.units, sizes):  # one power per kind and size: each unit's own energy
            ins = "forward" if u.kind == "F" else "backward"  # (within the 2 ms energy poll's edges)
            assert u.energy_j == pytest.approx(profile.energy_j(0, ins, 1200) * model.factors(0, 0, ins, 1200, size)[1],
                                               rel=2e-3)
        # The next iteration gives no sizes: every unit is the profile's row again, its sample unsized.
        hooks.iteration_begin(0, 1)
        vc.sleep(0.01)
        hooks.unit_begin(F(1))
        hooks.unit_end(F(1))
        _, begin, end = device.last_unit_window()
        assert end - begin == profile.time_s(0, "forward", 1200)
        # A size list that does not cover the micro-batch is a bug of the caller: said at once.
        hooks.iteration_begin(0, 2)
        hooks.iteration_sizes([MID])
        with pytest.raises(ValueError, match="unit F1 of micro-batch 1, but iteration_sizes gave 1 sizes"):
            hooks.unit_begin(F(1))
    finally:
        hooks.close()


def test_recording_hooks_keep_the_sizes_apart_from_the_events():
    hooks = RecordingHooks()
    hooks.iteration_begin(0, 0)
    hooks.iteration_sizes([MID, SMALL])
    hooks.iteration_sizes(None)
    assert hooks.sizes == [(MID, SMALL), None] and hooks.events == ["begin S0 it0"]


def test_open_gpu_scales_a_shipped_profile_by_its_default_model_and_a_sized_csv_by_its_fit(tmp_path):
    shipped = open_gpu("simulated:a40/gpt3-175b", stage=1, num_stages=4, cuda=False)
    assert "gpt3-175b" in shipped.length_model.source and "assumed" in shipped.length_model.source
    plain_csv = tmp_path / "plain.csv"
    plain_csv.write_text(_profile(3).to_csv_text())
    assert open_gpu(f"simulated:{plain_csv}", stage=0, cuda=False).length_model is None
    # Three stages measured at two sizes; the last stage's time grows twice as fast with tokens.
    base = _profile(3)
    half = MicrobatchSize.from_lengths([1024])
    samples = [LengthSample(s, 0, ins, p.freq_mhz, half, p.time_s * (0.5 if s < 2 else 0.25), p.energy_j * 0.5)
               for s in range(3) for ins in ("forward", "backward") for p in base.points(s, ins)]
    sized = Profile({(s, ins): list(base.points(s, ins)) for s in range(3) for ins in ("forward", "backward")},
                    source="<sized>", reference_size=REF, length_samples=samples)
    sized_csv = tmp_path / "sized.csv"
    sized_csv.write_text(sized.to_csv_text())
    # Two stages emulated with the three-stage profile: stage 1 is its last stage, with that stage's fit.
    device = open_gpu(f"simulated:{sized_csv}", stage=1, num_stages=2, cuda=False)
    assert device.length_model.factors(1, 0, "forward", 1200, half)[0] == pytest.approx(0.25, rel=1e-9)
    assert device.length_model.factors(0, 0, "forward", 1200, half)[0] == pytest.approx(0.5, rel=1e-9)
