"""A simulated-GPU preset from gpu-check's figures (core/calibration.py, apps/gpu_check/preset_step.py), and
the optional measured blocking power the simulated GPU charges while it waits."""

from __future__ import annotations

import time

import pytest

from megatron_envpipe.apps.gpu_check import preset_step
from megatron_envpipe.apps.gpu_check.step_api import StepContext
from megatron_envpipe.core.calibration import calibration_from_figures, preset_text
from megatron_envpipe.core.device_dynamics import EXACT, DeviceDynamics, DeviceDynamicsError, load_dynamics
from megatron_envpipe.core.profile import Profile
from megatron_envpipe.core.resources import configs_dir, shipped_profile
from megatron_envpipe.core.virtual_clock import VirtualClock
from megatron_envpipe.gpu.devices.simulated import SimulatedGpu

REALISTIC = load_dynamics("realistic", configs_dir())
MEASURED = {
    "facts": {"gpu_name": "NVIDIA H100 80GB HBM3", "driver": "550.54.15"},
    "counter": {"counter_period_s": 0.025},
    "clock_changes": {"sm_settle_s": 0.0042, "nvml_call_s": 0.0031},
    "blocking_power": {"blocking_power_w": 118.5},
}


def _write(tmp_path, earlier) -> tuple[str, DeviceDynamics]:
    c = calibration_from_figures(earlier, REALISTIC, base_name="realistic-gpu.toml", date_utc="2026-11-27")
    text = preset_text(c)
    path = tmp_path / "calibrated-gpu.toml"
    path.write_text(text)
    return text, load_dynamics(str(path), configs_dir())  # as --envpipe-sim-dynamics PATH reads it


def test_measured_figures_round_trip_through_the_loader(tmp_path):
    text, loaded = _write(tmp_path, MEASURED)
    assert loaded.clock_latency_s == pytest.approx(0.0042) and loaded.nvml_call_s == pytest.approx(0.0031)
    assert loaded.counter_period_s == pytest.approx(0.025) and loaded.blocking_power_w == pytest.approx(118.5)
    # what gpu-check does not measure is the published preset's, and the file says so
    assert (loaded.power_average_s, loaded.thermal_drift, loaded.thermal_tau_s) == \
        (REALISTIC.power_average_s, REALISTIC.thermal_drift, REALISTIC.thermal_tau_s)
    assert "# GPU: NVIDIA H100 80GB HBM3; driver 550.54.15; 2026-11-27 UTC" in text
    assert "# measured here: clock_latency_ms, nvml_call_ms, counter_period_ms, blocking_power_w" in text
    assert "# kept from realistic-gpu.toml (not measured by gpu-check): power_average_ms, thermal_drift, " \
           "thermal_tau_s" in text
    assert "power_average_ms = 1000.0  # kept from realistic-gpu.toml" in text
    assert "SIMULATED" not in text


def test_missing_or_unusable_figures_keep_the_published_ones_and_say_why(tmp_path):
    earlier = {"facts": {"gpu_name": "G", "driver": "d", "simulated": True},
               "clock_changes": {"sm_settle_s": 3.0, "nvml_call_s": None},  # 3 s: a unit mistake, out of range
               "blocking_power": {"blocking_power_w": float("nan")}}
    text, loaded = _write(tmp_path, earlier)
    assert loaded.clock_latency_s == REALISTIC.clock_latency_s and loaded.nvml_call_s == REALISTIC.nvml_call_s
    assert loaded.counter_period_s == REALISTIC.counter_period_s and loaded.blocking_power_w is None
    assert "measured 3 out of range" in text and "gave no nvml_call_s" in text
    assert "(step counter did not run or failed)" in text
    assert "# measured here: nothing" in text
    assert "# SIMULATED: these figures come from --device cpu" in text


def test_a_call_longer_than_the_latency_is_capped_at_it(tmp_path):
    earlier = dict(MEASURED, clock_changes={"sm_settle_s": 0.002, "nvml_call_s": 0.009})
    text, loaded = _write(tmp_path, earlier)
    assert loaded.nvml_call_s == loaded.clock_latency_s == pytest.approx(0.002)
    assert "capped at clock_latency" in text


def test_preset_step_returns_the_file_and_what_was_measured(tmp_path):
    ctx = StepContext(out_dir=tmp_path, device="cuda", device_index=0, limit_s=10,
                      started_monotonic=time.monotonic(), earlier=MEASURED)
    result = preset_step.run(ctx)
    assert result.status == "ok" and set(result.files) == {"calibrated-gpu.toml"}
    assert result.figures["measured"] == ["clock_latency_s", "nvml_call_s", "counter_period_s", "blocking_power_w"]
    assert result.figures["blocking_power_w"] == pytest.approx(118.5)
    assert not list(tmp_path.iterdir())  # a step never writes into the output folder itself
    empty = preset_step.run(StepContext(out_dir=tmp_path, device="cpu", device_index=0, limit_s=10,
                                        started_monotonic=time.monotonic()))
    assert empty.status == "ok" and empty.figures["measured"] == []


# -- the blocking power in the dynamics ------------------------------------------------------------

@pytest.mark.parametrize("bad", [-1.0, 1e6, float("inf"), True, "100"])
def test_blocking_power_is_validated_like_the_other_figures(bad):
    with pytest.raises(DeviceDynamicsError, match="blocking_power_w must be a number in"):
        DeviceDynamics(blocking_power_w=bad)


def test_a_bad_blocking_power_in_a_file_names_the_file(tmp_path):
    path = tmp_path / "bad.toml"
    path.write_text("[dynamics]\nblocking_power_w = -5\n")
    with pytest.raises(DeviceDynamicsError, match=r"bad.toml: .*blocking_power_w = -5: must be >= 0 W"):
        load_dynamics(str(path), configs_dir())


def _idle_energy_j(dynamics: DeviceDynamics, wait_s: float = 2.0) -> float:
    profile = Profile.from_csv(shipped_profile("a40/gpt3-175b"))
    vc = VirtualClock()
    gpu = SimulatedGpu(profile, 0, p2p_power_w=75.0, clock=vc.now, sleep=vc.sleep, time_scale=1.0,
                       dynamics=dynamics)
    before = gpu.energy_mj()
    vc.sleep(wait_s)  # a wait: no unit runs
    return (gpu.energy_mj() - before) / 1000.0


def test_a_measured_blocking_power_sets_the_simulated_energy_of_a_wait():
    assert _idle_energy_j(EXACT) == pytest.approx(2.0 * 75.0)  # unchanged without it: the table's P2P power
    assert _idle_energy_j(DeviceDynamics(blocking_power_w=118.5)) == pytest.approx(2.0 * 118.5)
