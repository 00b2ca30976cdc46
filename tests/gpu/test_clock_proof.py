"""Clock control proven by trying: one lock, read back, reset (gpu/control/clock_proof.py), and what
start-up and the bench scripts do with the answer.

Driven by the NVML test double (tests/gpu/nvml_double.py: a lock refused, accepted and
clamped, clock-event reasons) and the simulated GPU's lock settings; clocks and sleeps are
injected where the trial waits, so nothing depends on how fast the host is.
"""

from __future__ import annotations

import logging
import sys
import types
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from nvml_double import NvmlDouble, node  # noqa: E402

from megatron_envpipe.config import EnvPipeConfig  # noqa: E402
from megatron_envpipe.core.profile import Profile  # noqa: E402
from megatron_envpipe.core.resources import shipped_profile  # noqa: E402
from megatron_envpipe.gpu.control.clock_proof import (  # noqa: E402
    ProofOutcome,
    _probe_clock_mhz,
    clock_step_mhz,
    prove_clock_control,
)
from megatron_envpipe.gpu.control.safety import ClockGuard  # noqa: E402
from megatron_envpipe.gpu.devices.base import GpuError, GpuPermissionError  # noqa: E402
from megatron_envpipe.gpu.devices.nvml import NvmlGpu  # noqa: E402
from megatron_envpipe.gpu.devices.nvml_library import decode_clock_event_reasons  # noqa: E402
from megatron_envpipe.gpu.devices.simulated import SimulatedGpu  # noqa: E402
from megatron_envpipe.gpu.hooks import GpuHooks  # noqa: E402
from megatron_envpipe.gpu.startup import clock_control  # noqa: E402

REPO = Path(__file__).resolve().parents[2]


class FakeTime:
    """An injected clock whose sleeps advance it exactly."""

    def __init__(self) -> None:
        self.now = 0.0
        self.sleeps = 0

    def clock(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.sleeps += 1
        self.now += seconds


@pytest.fixture
def guard(tmp_path):
    g = ClockGuard(tmp_path / "state", install_handlers=False)
    yield g
    g.close()


@pytest.fixture
def use(monkeypatch):
    """use(**fake_gpu_changes, permission=...) -> (double, NvmlGpu) of one fake A40."""
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    opened = []

    def install(permission: bool = True, legacy: bool = False, **changes) -> tuple[NvmlDouble, NvmlGpu]:
        gpus = node(1)
        for k, v in changes.items():
            setattr(gpus[0], k, v)
        double = NvmlDouble(gpus, permission=permission)
        double.legacy_binding = legacy
        monkeypatch.setitem(sys.modules, "pynvml", double.module())
        gpu = NvmlGpu.for_nvml_index(0)
        opened.append(gpu)
        return double, gpu

    yield install
    for gpu in opened:
        gpu.close()


@pytest.fixture
def profile():
    return Profile.from_csv(shipped_profile("a40/gpt3-175b")).for_pipeline(2)


# ---------------------------------------------------------------------------
# the probe against the NVML double
# ---------------------------------------------------------------------------


def test_accepted_lock_reads_back_and_is_reset(use, guard, tmp_path):
    double, gpu = use()
    t = FakeTime()
    proof = prove_clock_control(gpu, guard, clock=t.clock, sleep=t.sleep)
    # 60 % of the A40's 1740 MHz, a supported clock distinct from the default (max) and the minimum.
    assert proof.outcome == ProofOutcome.OK and proof.control
    assert proof.requested_mhz == 1050 and proof.readback_mhz == 1050 and proof.default_mhz == 1740
    assert proof.tolerance_mhz == 15 and t.sleeps == 0  # read back at once: no waiting
    assert proof.reasons == ("user_defined_clocks",)
    fake = double.gpu(gpu.uuid)
    assert fake.lock_count == 1 and fake.reset_count == 1 and fake.locked is None
    assert gpu.locked_clock_mhz() is None and guard.locked_devices() == []
    assert list((tmp_path / "state").glob("*.json")) == []  # the state file was written and removed
    assert "locked 1050 MHz and the SMs ran at 1050 MHz" in proof.message


@pytest.mark.parametrize("changes", [{"permission": False}, {"lock_supported": False}])
def test_refused_lock_is_refused_and_nothing_stays_locked(use, guard, changes):
    double, gpu = use(**changes)
    proof = prove_clock_control(gpu, guard)
    assert proof.outcome == ProofOutcome.REFUSED and not proof.control
    assert "was refused" in proof.message and proof.readback_mhz is None
    fake = double.gpu(gpu.uuid)
    assert fake.lock_count == 0 and fake.locked is None and guard.locked_devices() == []


def test_clamped_lock_is_not_reached_after_a_bounded_wait(use, guard):
    # Accepted, but the SMs never go below 1400 MHz (a minimum the driver does not hold).
    double, gpu = use(sm_clock_range=[1400, 1740])
    t = FakeTime()
    proof = prove_clock_control(gpu, guard, clock=t.clock, sleep=t.sleep, settle_s=0.25, poll_s=0.01)
    assert proof.outcome == ProofOutcome.NOT_REACHED and not proof.control
    assert proof.requested_mhz == 1050 and proof.readback_mhz == 1400
    assert proof.wait_s == pytest.approx(0.25) and 20 <= t.sleeps <= 26  # a few reads, then it gives up
    assert "the SMs ran at 1400 MHz" in proof.message and "none reported" not in proof.message
    fake = double.gpu(gpu.uuid)
    assert fake.locked is None and fake.reset_count == 1  # reset even so


def test_power_capped_lock_names_the_reason(use, guard):
    _, gpu = use(sm_clock_range=[210, 900])
    proof = prove_clock_control(gpu, guard, freq_mhz=1500, clock=FakeTime().clock, sleep=FakeTime().sleep)
    assert proof.outcome == ProofOutcome.NOT_REACHED and proof.readback_mhz == 900
    assert proof.reasons == ("user_defined_clocks", "sw_power_cap") and "sw_power_cap" in proof.message


def test_one_clock_step_off_is_reached(use, guard):
    _, gpu = use(sm_clock_range=[1065, 1740])  # 15 MHz (one step) above the lock
    proof = prove_clock_control(gpu, guard, clock=FakeTime().clock, sleep=FakeTime().sleep)
    assert proof.outcome == ProofOutcome.OK and proof.readback_mhz == 1065


def test_idle_gpu_or_no_readback_is_unverified_but_trusted(use, guard, monkeypatch):
    _, gpu = use(sm_clock_range=[210, 210], event_reasons=0x1)  # parked at idle
    proof = prove_clock_control(gpu, guard, clock=FakeTime().clock, sleep=FakeTime().sleep)
    assert proof.outcome == ProofOutcome.UNVERIFIED and proof.control and "gpu_idle" in proof.reasons
    # With a load keeping it busy, the same read-back is a clock not reached.
    loads = []
    proof = prove_clock_control(gpu, guard, load=loads.append, clock=FakeTime().clock, sleep=FakeTime().sleep)
    assert proof.outcome == ProofOutcome.NOT_REACHED and loads == [0.25]
    monkeypatch.setattr(gpu, "current_sm_clock_mhz", lambda: None)
    proof = prove_clock_control(gpu, guard)
    assert proof.outcome == ProofOutcome.UNVERIFIED and proof.readback_mhz is None


def test_nvml_readback_and_reasons_fail_soft(use):
    double, gpu = use(event_reasons_supported=False)
    assert gpu.current_sm_clock_mhz() == 1740 and gpu.clock_event_reasons() is None
    double.update(failures={"nvmlDeviceGetClockInfo": nvml_double_code("NVML_ERROR_NOT_SUPPORTED")})
    assert gpu.current_sm_clock_mhz() is None
    _, old = use(legacy=True, event_reasons=0x20 | 0x800)
    assert not hasattr(sys.modules["pynvml"], "nvmlDeviceGetCurrentClocksEventReasons")
    assert old.clock_event_reasons() == ("sw_thermal_slowdown", "bit 0x800")  # the older call's name
    assert decode_clock_event_reasons(0) == () and decode_clock_event_reasons(0x44) == (
        "sw_power_cap", "hw_thermal_slowdown")


def nvml_double_code(name: str) -> int:
    import pynvml

    return getattr(getattr(pynvml, "_real", pynvml), name)


def test_probe_clock_choice():
    a40 = tuple(range(1740, 209, -15))
    assert _probe_clock_mhz(a40) == 1050
    assert _probe_clock_mhz(a40, default_mhz=1050) != 1050  # distinct from where the GPU runs
    assert _probe_clock_mhz((1500, 1200, 900)) == 1200  # not the max, not the min
    assert _probe_clock_mhz((1500,)) == 1500
    assert clock_step_mhz(a40, 1050) == 15 and clock_step_mhz((1500,), 1500) == 1
    with pytest.raises(GpuError, match="no supported clocks"):
        _probe_clock_mhz(())


# ---------------------------------------------------------------------------
# the simulated GPU: refusing and clamping (defaults stay exact)
# ---------------------------------------------------------------------------


def test_simulated_gpu_is_exact_by_default(profile, guard):
    gpu = SimulatedGpu(profile, 0)
    assert gpu.current_sm_clock_mhz() == 1740 and gpu.clock_event_reasons() == ()
    gpu.set_locked_clocks(1200)
    assert gpu.current_sm_clock_mhz() == 1200 == gpu.model_clock_mhz
    assert prove_clock_control(gpu, guard).outcome == ProofOutcome.OK


def test_simulated_gpu_refuses_and_clamps(profile, guard):
    refusing = SimulatedGpu(profile, 0, lock_refusal="a VM forbids clock changes")
    assert refusing.can_set_clocks()  # the capability bits say yes: only trying tells
    with pytest.raises(GpuPermissionError, match="a VM forbids clock changes"):
        refusing.set_locked_clocks(1200)
    assert prove_clock_control(refusing, guard).outcome == ProofOutcome.REFUSED
    capped = SimulatedGpu(profile, 0, sm_clock_range_mhz=(1200, 1410))
    assert capped.current_sm_clock_mhz() == 1410  # the default is capped too
    capped.set_locked_clocks(1740)
    assert capped.locked_clock_mhz() == 1740 and capped.model_clock_mhz == 1410
    assert capped.unit_time_s("F") == profile.time_s(0, "forward", 1410)  # units run at the capped clock
    assert capped.clock_event_reasons() == ("user_defined_clocks", "sw_power_cap")
    capped.set_locked_clocks(900)  # below the held minimum: runs at 1200, no reason reported
    assert capped.current_sm_clock_mhz() == 1200 and capped.clock_event_reasons() == ("user_defined_clocks",)
    assert prove_clock_control(capped, guard, freq_mhz=900).outcome == ProofOutcome.NOT_REACHED
    with pytest.raises(GpuError, match="sm_clock_range_mhz"):
        SimulatedGpu(profile, 0, sm_clock_range_mhz=(100, 200))


# ---------------------------------------------------------------------------
# start-up: refused -> the no-permission path, not reached -> monitor-only, logged once
# ---------------------------------------------------------------------------


def test_startup_refused_lock_takes_the_no_permission_path(profile, guard, caplog):
    gpu = SimulatedGpu(profile, 0, lock_refusal="NVML_ERROR_NO_PERMISSION")
    with pytest.raises(GpuPermissionError, match=r"was refused \(a VM.*--envpipe-on-no-permission monitor"):
        clock_control(gpu, True, "fail", stage=1, guard=guard)
    decision = clock_control(gpu, True, "monitor", stage=1, guard=guard)
    assert not decision.control and decision.lost is None
    assert decision.proof.outcome == ProofOutcome.REFUSED and "measuring energy only" in caplog.text


def test_startup_lock_not_reached_goes_monitor_only_logged_once(profile, guard, caplog):
    gpu = SimulatedGpu(profile, 0, time_scale=0.001, sm_clock_range_mhz=(1410, 1740))
    # Even with --envpipe-on-no-permission fail: the lock is permitted, it just does not hold.
    decision = clock_control(gpu, True, "fail", stage=0, guard=guard)
    assert not decision.control and decision.proof.outcome == ProofOutcome.NOT_REACHED
    assert "clock check at start-up" in decision.lost
    caplog.set_level(logging.WARNING, "megatron_envpipe")
    hooks = GpuHooks(gpu, control=decision.control, cuda=False, guard=guard, lost=decision.lost)
    try:
        assert hooks.clock_control_lost == decision.lost  # reported with the energy, like a loss mid-run
        for f in (1200, 1050, 1200):
            hooks.set_frequency(f)
        assert gpu.locked_clock_mhz() is None  # monitor-only: nothing is locked
    finally:
        hooks.close()
    warnings = [r for r in caplog.records if "continuing monitor-only" in r.getMessage()]
    assert len(warnings) == 1 and "the SMs ran at 1410 MHz" in warnings[0].getMessage()


def test_setup_device_uses_the_proof(profile, monkeypatch, guard):
    """The executor's first-iteration set-up (megatron/devices.py) plans without control
    when the trial lock is not reached, and its hooks are monitor-only."""
    pytest.importorskip("torch")
    from megatron_envpipe.gpu import stage_gpu
    from megatron_envpipe.megatron import devices

    gpu = SimulatedGpu(profile, 0, time_scale=0.001, sm_clock_range_mhz=(1410, 1740))
    monkeypatch.setattr(stage_gpu, "open_gpu", lambda *a, **k: gpu)  # devices.py opens it through stage_gpu
    monkeypatch.setattr(devices, "memory_source", lambda *a, **k: None)
    monkeypatch.setattr("megatron_envpipe.gpu.startup.default_guard", lambda: guard)
    seen = {}
    runtime = types.SimpleNamespace(config=EnvPipeConfig(plan_type="envelope"),
                                    attach_device=lambda facts, key, session=None: seen.update(facts=facts),
                                    attach_memory=lambda source: None)
    state = types.SimpleNamespace(runtime=runtime, user_hooks=False, device_ready=False,
                                  use_hooks=lambda hooks: seen.update(hooks=hooks),
                                  device_set_up=lambda device_time: seen.update(device_time=device_time))
    groups = types.SimpleNamespace(stage=0, num_stages=1, gather_stages=lambda mine: [mine], agree=lambda v: v)
    import torch

    devices.setup_device(state, groups, torch.device("cpu"), {})
    try:
        assert seen["facts"].control is False and seen["facts"].energy is True
        assert "the SMs ran at 1410 MHz" in seen["hooks"].clock_control_lost
    finally:
        seen["hooks"].close()
