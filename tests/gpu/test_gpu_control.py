"""Who may lock clocks: the start-up decision, and GPU hooks driving a simulated GPU."""

from __future__ import annotations

import time

import pytest

from megatron_envpipe.core.profile import Profile
from megatron_envpipe.core.resources import shipped_profile
from megatron_envpipe.core.schedule import B, F
from megatron_envpipe.gpu import GpuPermissionError, open_gpu
from megatron_envpipe.gpu.devices.none import NoGpu
from megatron_envpipe.gpu.devices.simulated import SimulatedGpu
from megatron_envpipe.gpu.hooks import GpuHooks
from megatron_envpipe.gpu.startup import DeviceFacts, StageDevice, clock_control, combine_stage_devices


class _Unprivileged(SimulatedGpu):
    """A device without permission: its capability bits say no and its locks are refused
    (tests our own error handling only)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, lock_refusal="NVML_ERROR_NO_PERMISSION", **kwargs)

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
        clock_control(gpu, True, "fail", stage=0)


def test_monitor_mode_continues_without_control(profile, caplog):
    gpu = _Unprivileged(profile, 0)
    assert clock_control(gpu, True, "monitor", stage=0).control is False
    assert "measuring energy only" in caplog.text


def test_baseline_and_no_gpu_need_no_control(profile):
    assert clock_control(_Unprivileged(profile, 0), False, "fail", stage=0)  # baseline.control is False
    assert clock_control(NoGpu(), True, "fail", stage=0).control is False
    assert clock_control(SimulatedGpu(profile, 0), True, "fail", stage=0).control is True


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
    assert sim.backend == "simulated" and sim.energy and sim.modelled and sim.clocks_mhz[0] == 1740
    narrower = StageDevice(backend="nvml", name="A40", driver_version="550", clocks_mhz=(1740, 1500, 1200),
                           control=True, energy=True)
    facts = combine_stage_devices([narrower, sim])
    assert facts == DeviceFacts(backend="nvml", name="A40", driver_version="550",
                                clocks_mhz=tuple(sorted(set(sim.clocks_mhz) & {1740, 1500, 1200}, reverse=True)),
                                control=True, energy=True, modelled=True)
    # One stage without control, energy or any common clock: none for the pipeline.
    absent = combine_stage_devices([narrower, StageDevice.absent()])
    assert absent.clocks_mhz == () and not absent.control and not absent.energy
    no_control = combine_stage_devices([narrower, StageDevice.of(SimulatedGpu(profile, 0), control=False)])
    assert not no_control.control and no_control.energy


def test_open_gpu_backends():
    assert open_gpu("none").backend == "none"
    assert open_gpu("auto", cuda=False).backend == "none"  # a CPU rank never grabs some GPU
    sim = open_gpu("simulated:a40/gpt3-175b", stage=3, num_stages=4, time_scale=0.01)
    assert sim.capabilities().modelled and sim.info().simulated and "Simulated" in sim.info().name
    assert sim.supported_clocks_mhz()[0] == 1740
    # The 4-stage emulation's last stage is the 8-stage profile's last (heavier) stage.
    assert sim.profile.points(3, "backward") == Profile.from_csv(shipped_profile("a40/gpt3-175b")).points(7, "backward")


def test_gpu_hooks_lock_clocks_and_measure_energy(profile, tmp_path, monkeypatch):
    """The iteration's energy is the counter read at its two edges, and the simulated
    counter is exact at every read, so the result is bracketed exactly whatever the
    CPU load: at least every unit's modelled energy plus the P2P power over the gaps
    between units, at most that plus the P2P power over the rest of the span the test
    itself observed around the hooks. (Interpolating the polled trace at the edges,
    as before, came out up to ~1 % below that floor on a loaded CPU, where a starved
    poller leaves the samples around the edges sparse: a measurement error, not noise
    to tolerate.)"""
    monkeypatch.setenv("ENVPIPE_STATE_DIR", str(tmp_path))
    scale, p2p_w = 0.02, 70.0
    gpu = SimulatedGpu(profile, 0, time_scale=scale, p2p_power_w=p2p_w, clock=time.perf_counter)
    hooks = GpuHooks(gpu, control=True, cuda=False, time_scale=scale)
    try:
        outer_begin = time.perf_counter()
        hooks.iteration_begin(0, 0)
        hooks.set_frequency(1050)
        assert gpu.locked_clock_mhz() == 1050  # applied before the next unit begins
        for unit in (F(0), F(1), B(0), B(1)):
            hooks.unit_begin(unit)
            hooks.unit_end(unit)
        windows = list(hooks.device_windows)
        hooks.iteration_end(None)
        outer_end = time.perf_counter()
        energy = hooks.last_energy
        assert len(windows) == 4 and hooks.last_unmeasured is None and hooks.intervals == 1
        assert outer_begin <= energy.start_s <= windows[0][1] and windows[-1][2] <= energy.end_s <= outer_end

        def power_w(kind: str) -> float:
            ins = "forward" if kind == "F" else "backward"
            return profile.energy_j(0, ins, 1050) / profile.time_s(0, ins, 1050)

        units_j = sum(power_w(kind) * (t1 - t0) / scale for kind, t0, t1 in windows)
        busy_s = sum(t1 - t0 for _, t0, t1 in windows)
        between_s = sum(b[1] - a[2] for a, b in zip(windows, windows[1:]))
        lower = units_j + p2p_w * between_s / scale
        upper = units_j + p2p_w * ((outer_end - outer_begin) - busy_s) / scale
        assert lower * (1 - 1e-9) <= energy.energy_j <= upper * (1 + 1e-9)
        # ...so never below the profile's energy of the four units.
        floor = 2 * (profile.energy_j(0, "forward", 1050) + profile.energy_j(0, "backward", 1050))
        assert energy.energy_j >= floor * (1 - 1e-9)
    finally:
        hooks.close()
    assert gpu.locked_clock_mhz() is None  # closing the hooks resets the clocks


def test_a_shipped_profile_by_path_is_the_same_gpu_as_by_name(tmp_path):
    """``simulated:<path of a shipped CSV>`` used to get 0 W of P2P power (no GPU known for a
    CSV) where the same file by name got the A40's 70 W, and the measurement then failed."""
    path = shipped_profile("a40/gpt3-175b")
    by_name = open_gpu("simulated:a40/gpt3-175b", stage=1, num_stages=4)
    by_path = open_gpu(f"simulated:{path}", stage=1, num_stages=4)
    assert by_path.p2p_power_w == by_name.p2p_power_w > 0
    custom = tmp_path / "custom.csv"
    custom.write_bytes(path.read_bytes())
    assert open_gpu(f"simulated:{custom}", stage=1, num_stages=4).p2p_power_w == 0.0  # no GPU named


def test_a_gpu_idling_at_zero_watts_is_measured_exactly(profile, tmp_path, monkeypatch):
    """The root cause of the `simulated:<csv path>` failure: at 0 W between units the counter
    stands still, and the meter waited (1 s, then raised) for it to change after the iteration's
    end, which only the next iteration's first unit could do. An exact counter that reads
    unchanged at zero power is the truth; the edges are read directly, so nothing waits."""
    monkeypatch.setenv("ENVPIPE_STATE_DIR", str(tmp_path))
    scale = 0.02
    # The monotonic clock counted from the test's start, as on a freshly booted host: at 68,000 s of uptime
    # unit edges ~0.002 s apart carry ~1e-9 of float rounding, the tolerance this exact counter is held to.
    real, origin = time.perf_counter, time.perf_counter()
    monkeypatch.setattr(time, "perf_counter", lambda: real() - origin)
    gpu = SimulatedGpu(profile, 0, time_scale=scale, p2p_power_w=0.0, clock=time.perf_counter)
    hooks = GpuHooks(gpu, control=True, cuda=False, time_scale=scale)
    try:
        for it in range(2):
            hooks.iteration_begin(0, it)
            hooks.set_frequency(1050)
            for unit in (F(0), F(1), B(0), B(1)):
                time.sleep(0.03)  # waiting for a neighbour stage: no power at all
                hooks.unit_begin(unit)
                hooks.unit_end(unit)
            windows = list(hooks.device_windows)
            time.sleep(0.05)  # the optimizer step, the other stages finishing
            t = time.perf_counter()
            hooks.iteration_end(None)
            assert time.perf_counter() - t < 0.5  # no waiting for the counter
            assert hooks.last_unmeasured is None
            floor = 2 * (profile.energy_j(0, "forward", 1050) + profile.energy_j(0, "backward", 1050))
            assert hooks.last_energy.energy_j == pytest.approx(floor, rel=1e-9)  # units only: exact
            # Profiling windows end before the iteration's end read, which is a (flat) sample
            # after them: answered at once too. (Their accuracy: tests/gpu/test_sweep.py.)
            t = time.perf_counter()
            samples = hooks.stage_samples(windows, [])
            assert time.perf_counter() - t < 0.5
            assert samples is not None and [u.kind for u in samples.units] == ["F", "F", "B", "B"]
    finally:
        hooks.close()
