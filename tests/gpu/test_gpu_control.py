"""Who may lock clocks: the start-up decision, and GPU hooks driving a simulated GPU."""

from __future__ import annotations

import time

import pytest

from megatron_envpipe.config import EnvPipeConfig
from megatron_envpipe.core.profile import Profile
from megatron_envpipe.core.resources import shipped_profile
from megatron_envpipe.core.schedule import B, F
from megatron_envpipe.gpu import GpuPermissionError, open_gpu
from megatron_envpipe.gpu.hooks import GpuHooks
from megatron_envpipe.gpu.none import NoGpu
from megatron_envpipe.gpu.simulated import SimulatedGpu
from megatron_envpipe.gpu.startup import DeviceFacts, StageDevice, clock_control, combine_stage_devices


class _Unprivileged(SimulatedGpu):
    """A device that reports no permission (tests our own error handling only)."""

    def can_set_clocks(self) -> bool:
        return False

    def permission_reason(self) -> str:
        return "CAP_SYS_ADMIN is not in this process's effective capabilities"


@pytest.fixture
def profile():
    return Profile.from_csv(shipped_profile("a40/gpt3-175b")).for_pipeline(2)


def test_missing_permission_fails_fast_with_the_fix(profile):
    gpu = _Unprivileged(profile, 0)
    with pytest.raises(GpuPermissionError, match="CAP_SYS_ADMIN.*--cap-add SYS_ADMIN.*--envpipe-on-no-permission monitor"):
        clock_control(gpu, EnvPipeConfig(plan_type="envelope"), stage=0)


def test_monitor_mode_continues_without_control(profile, caplog):
    gpu = _Unprivileged(profile, 0)
    cfg = EnvPipeConfig(plan_type="envelope", on_no_permission="monitor")
    assert clock_control(gpu, cfg, stage=0) is False
    assert "measuring energy only" in caplog.text


def test_baseline_and_no_gpu_need_no_control(profile):
    assert clock_control(_Unprivileged(profile, 0), EnvPipeConfig(), stage=0) is False
    assert clock_control(NoGpu(), EnvPipeConfig(plan_type="envelope"), stage=0) is False
    assert clock_control(SimulatedGpu(profile, 0), EnvPipeConfig(plan_type="envelope"), stage=0) is True


def test_device_capabilities_have_base_defaults(profile):
    # Declared on GpuDevice: every backend answers, with "nothing to add" by default.
    assert NoGpu().permission_reason() == ""
    assert NoGpu().last_unit_window() is None
    gpu = SimulatedGpu(profile, 0, time_scale=0.001)
    assert gpu.last_unit_window() is None  # before the first unit
    gpu.unit_begin(0, "F")
    gpu.unit_end(0, "F")
    kind, start_s, end_s = gpu.last_unit_window()
    assert kind == "F" and end_s > start_s


def test_stage_devices_combine_to_what_every_stage_has(profile):
    sim = StageDevice.of(SimulatedGpu(profile, 0), control=True)
    assert sim.backend == "simulated" and sim.energy and sim.simulated and sim.clocks_mhz[0] == 1740
    narrower = StageDevice(backend="nvml", name="A40", driver_version="550", clocks_mhz=(1740, 1500, 1200),
                           control=True, energy=True)
    facts = combine_stage_devices([narrower, sim])
    assert facts == DeviceFacts(backend="nvml", name="A40", driver_version="550",
                                clocks_mhz=tuple(sorted(set(sim.clocks_mhz) & {1740, 1500, 1200}, reverse=True)),
                                control=True, energy=True, simulated=True)
    # One stage without control, energy or any common clock: none for the pipeline.
    absent = combine_stage_devices([narrower, StageDevice.absent()])
    assert absent.clocks_mhz == () and not absent.control and not absent.energy
    no_control = combine_stage_devices([narrower, StageDevice.of(SimulatedGpu(profile, 0), control=False)])
    assert not no_control.control and no_control.energy


def test_open_gpu_backends():
    assert open_gpu("none").backend == "none"
    assert open_gpu("auto", cuda=False).backend == "none"  # a CPU rank never grabs some GPU
    sim = open_gpu("simulated:a40/gpt3-175b", stage=3, num_stages=4, time_scale=0.01)
    assert sim.simulated and sim.info().simulated and "Simulated" in sim.info().name
    assert sim.supported_clocks_mhz()[0] == 1740
    # The 4-stage emulation's last stage is the 8-stage profile's last (heavier) stage.
    assert sim.profile.points(3, "backward") == Profile.from_csv(shipped_profile("a40/gpt3-175b")).points(7, "backward")


def test_gpu_hooks_lock_clocks_and_measure_energy(profile, tmp_path, monkeypatch):
    monkeypatch.setenv("ENVPIPE_STATE_DIR", str(tmp_path))
    gpu = SimulatedGpu(profile, 0, time_scale=0.02, p2p_power_w=70.0, clock=time.perf_counter)
    hooks = GpuHooks(gpu, control=True, cuda=False, time_scale=0.02)
    try:
        hooks.iteration_begin(0, 0)
        hooks.set_frequency(1050)
        assert gpu.locked_clock_mhz() == 1050  # applied before the next unit begins
        for unit in (F(0), F(1), B(0), B(1)):
            hooks.unit_begin(unit)
            hooks.unit_end(unit)
        windows = list(hooks.device_windows)
        hooks.iteration_end(None)
        energy = hooks.last_energy
        # The model's own accounting, whatever the CPU load: each unit at its profiled power
        # for as long as it really lasted, the gaps between units at the P2P power.
        scale = 0.02
        busy = 0.0
        expected = 0.0
        for kind, t0, t1 in windows:
            ins = "forward" if kind == "F" else "backward"
            power = profile.energy_j(0, ins, 1050) / profile.time_s(0, ins, 1050)
            expected += power * (t1 - t0) / scale
            busy += t1 - t0
        expected += 70.0 * ((energy.end_s - energy.start_s) - busy) / scale
        assert len(windows) == 4
        assert energy.energy_j == pytest.approx(expected, rel=0.02)
        # ...and with no overrun it is the profile's energy of the four units.
        floor = 2 * (profile.energy_j(0, "forward", 1050) + profile.energy_j(0, "backward", 1050))
        assert energy.energy_j >= floor * 0.99
    finally:
        hooks.close()
    assert gpu.locked_clock_mhz() is None  # closing the hooks resets the clocks
