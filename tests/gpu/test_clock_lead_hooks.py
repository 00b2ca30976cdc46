"""The clock lead in the executor's GPU hooks (issue 21 item 2, run-time half): a raise is requested
``latency`` before its predicted boundary, so the next unit runs wholly at the new clock; lowerings and
the rule switched off change clocks at the boundary, as before. Simulated time only (a VirtualClock):
nothing here depends on how fast the host is."""

from __future__ import annotations

import sys

import pytest

from megatron_envpipe.config import EnvPipeConfig, load_profile
from megatron_envpipe.core.clock_lead import ClockLead
from megatron_envpipe.core.device_dynamics import DeviceDynamics
from megatron_envpipe.core.profile import Profile, ProfilePoint, instruction_of
from megatron_envpipe.core.schedule import B, F
from megatron_envpipe.core.virtual_clock import VirtualClock
from megatron_envpipe.gpu.control.clocks import DelayedEvent
from megatron_envpipe.gpu.devices.nvml import NvmlGpu
from megatron_envpipe.gpu.devices.simulated import SimulatedGpu
from megatron_envpipe.gpu.hooks import GpuHooks
from megatron_envpipe.megatron.device_session import ClockTiming
from megatron_envpipe.megatron.runtime import EnvPipeRuntime

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from nvml_double import NvmlDouble, node  # noqa: E402

LOW, HIGH = 1050, 1410
LATENCY_S = 0.015
# forward 100 ms at LOW, 80 ms at HIGH; backward twice that
TIMES = {("forward", LOW): 0.100, ("forward", HIGH): 0.080, ("backward", LOW): 0.200, ("backward", HIGH): 0.160}
UNITS = (F(0), F(1), B(0), B(1))
FREQS = (LOW, HIGH, HIGH, LOW)  # F0 -> F1 a raise, B0 -> B1 a lowering


@pytest.fixture(autouse=True)
def _state_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("ENVPIPE_STATE_DIR", str(tmp_path))  # the clock guard's record of locked clocks


def _profile() -> Profile:
    points = {(0, ins): [ProfilePoint(f, TIMES[(ins, f)], 250.0 * TIMES[(ins, f)]) for f in (LOW, HIGH)]
              for ins in ("forward", "backward")}
    return Profile(points, source="two clocks")


def _predicted() -> tuple[float, ...]:
    return tuple(TIMES[("forward" if u.is_forward else "backward", f)] for u, f in zip(UNITS, FREQS))


class _LockLog(SimulatedGpu):
    """Keeps the device time of every lock request (what the test checks: when a change is asked for)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.locks: list[tuple[float, int]] = []

    def set_locked_clocks(self, freq_mhz: int) -> None:
        self.locks.append((self._clock(), int(freq_mhz)))
        super().set_locked_clocks(freq_mhz)


def _run_iteration(lead: ClockLead | None, time_scale: float = 1.0):
    """One iteration of UNITS at FREQS as the executor drives the hooks; -> (device, hooks, windows)."""
    vc = VirtualClock()
    dynamics = DeviceDynamics(clock_latency_s=LATENCY_S, nvml_call_s=0.010, source="test: 15 ms")
    device = _LockLog(_profile(), 0, time_scale=time_scale, clock=vc.now, sleep=vc.sleep, dynamics=dynamics)
    hooks = GpuHooks(device, control=True, cuda=False, time_scale=time_scale, clock_lead=lead)
    windows = []
    try:
        hooks.set_frequency(LOW)  # the clock of the iteration before, settled
        vc.sleep(0.1 * time_scale)
        hooks.iteration_begin(0, 0)
        hooks.clock_plan(UNITS, FREQS, _predicted())
        current = LOW
        for unit, f in zip(UNITS, FREQS):
            if f != current:  # the program's SetFrequency, after the previous unit's compute
                hooks.set_frequency(f)
                current = f
            vc.sleep(0.002 * time_scale)  # the input arrives a little later (a receive wait)
            hooks.unit_begin(unit)
            hooks.unit_end(unit)
            windows.append(device.last_unit_window())
        hooks.controller.flush()
    finally:
        hooks.close()
    return device, hooks, windows


@pytest.mark.parametrize("time_scale", [1.0, 0.01])
def test_a_raise_is_requested_latency_before_its_boundary_and_the_next_unit_runs_at_the_new_clock(time_scale):
    device, hooks, windows = _run_iteration(ClockLead(LATENCY_S), time_scale)
    (_, f0_begin, f0_end), (_, f1_begin, f1_end) = windows[0], windows[1]
    raise_at, freq = device.locks[1]
    assert freq == HIGH
    # Requested at F0's begin + its predicted time - latency: the SMs reach HIGH as F0 ends.
    assert raise_at == pytest.approx(f0_begin + (TIMES[("forward", LOW)] - LATENCY_S) * time_scale, abs=1e-12)
    assert f0_end == pytest.approx(f0_begin + TIMES[("forward", LOW)] * time_scale, abs=1e-12)
    # F1 runs wholly at the new clock.
    assert f1_end - f1_begin == pytest.approx(TIMES[("forward", HIGH)] * time_scale, abs=1e-12)
    assert hooks.led == 1
    # The boundary's own SetFrequency(HIGH) was skipped: one lock per change, three changes in all.
    assert [f for _, f in device.locks] == [LOW, HIGH, LOW]


def test_without_the_rule_a_raise_lands_late_and_the_next_unit_is_slower():
    device, hooks, windows = _run_iteration(ClockLead(LATENCY_S, enabled=False))
    (_, _, f0_end), (_, f1_begin, f1_end) = windows[0], windows[1]
    raise_at, freq = device.locks[1]
    assert freq == HIGH and raise_at == pytest.approx(f0_end, abs=1e-12)  # at the boundary
    # F1 starts at the old clock: its first (latency - receive wait) runs at LOW, the rest of its work at HIGH.
    at_low_s = LATENCY_S - 0.002
    expected_s = at_low_s + (1 - at_low_s / TIMES[("forward", LOW)]) * TIMES[("forward", HIGH)]
    assert f1_end - f1_begin == pytest.approx(expected_s, abs=1e-12)
    assert f1_end - f1_begin > TIMES[("forward", HIGH)] + 0.002
    assert hooks.led == 0


def test_lowerings_are_requested_at_the_boundary():
    device, _, windows = _run_iteration(ClockLead(LATENCY_S))
    (_, _, b0_end) = windows[2]
    lower_at, freq = device.locks[2]
    assert freq == LOW and lower_at == pytest.approx(b0_end, abs=1e-12)


def test_rule_off_is_what_the_hooks_did_before():
    off_device, _, off_windows = _run_iteration(ClockLead(LATENCY_S, enabled=False))
    none_device, _, none_windows = _run_iteration(None)
    assert off_device.locks == none_device.locks
    assert off_windows == none_windows


def test_expected_lead_is_the_devices_latency():
    def lead(device, enabled=True):  # as the run's device session hands it to the hooks
        return ClockTiming.of(device.capabilities()).clock_lead(enabled)

    exact = SimulatedGpu(_profile(), 0)
    assert lead(exact) is None  # nothing to lead: changes at the boundary, as before
    slow = SimulatedGpu(_profile(), 0, dynamics=DeviceDynamics(clock_latency_s=0.03, source="test"))
    assert lead(slow) == ClockLead(0.03)
    assert lead(slow, enabled=False) == ClockLead(0.03, enabled=False)


# -- a real GPU (CUDA events, NVML): the worker waits for the unit's begin, then the offset ----------


class _Event:
    def __init__(self, log: list) -> None:
        self.log = log

    def synchronize(self) -> None:
        self.log.append("event")


def test_delayed_event_waits_for_the_event_then_the_offset():
    log: list = []
    DelayedEvent(_Event(log), 0.065, sleep=lambda s: log.append(("sleep", s))).synchronize()
    assert log == ["event", ("sleep", 0.065)]
    log.clear()
    DelayedEvent(None, 0.0, sleep=lambda s: log.append(("sleep", s))).synchronize()
    assert log == []  # no event, no offset: at once
    with pytest.raises(ValueError, match="delay must be a number of seconds >= 0"):
        DelayedEvent(None, -1.0)


def test_real_gpu_queues_the_raise_when_the_unit_before_begins(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.delenv("CUDA_DEVICE_ORDER", raising=False)
    double = NvmlDouble(node(1))
    monkeypatch.setitem(sys.modules, "pynvml", double.module())
    device = NvmlGpu.for_cuda_device(0)
    waits: list[float] = []
    hooks = GpuHooks(device, control=True, cuda=False, clock_lead=ClockLead(LATENCY_S), sleep=waits.append)

    def locks() -> list[int]:
        return [args[-1] for name, args in double.calls if name == "nvmlDeviceSetGpuLockedClocks"]

    try:
        hooks.iteration_begin(0, 0)
        hooks.clock_plan(UNITS[:2], FREQS[:2], _predicted()[:2])
        hooks.set_frequency(LOW)
        hooks.controller.flush()
        hooks.unit_begin(UNITS[0])
        hooks.controller.flush()
        # Queued at F0's begin: the worker waited its predicted time less the latency, then locked HIGH.
        assert waits == [pytest.approx(TIMES[("forward", LOW)] - LATENCY_S)]
        assert locks() == [LOW, HIGH]
        hooks.unit_end(UNITS[0])
        requested = hooks.controller.requested
        hooks.set_frequency(HIGH)  # the boundary's SetFrequency: already requested
        hooks.unit_begin(UNITS[1])
        hooks.unit_end(UNITS[1])
        hooks.controller.flush()
        assert hooks.controller.requested == requested and locks() == [LOW, HIGH]
        assert hooks.led == 1
    finally:
        hooks.close()


# -- what the executor hands the hooks: each unit's predicted time at its planned clock -----------


def test_runtime_predicts_each_units_time_at_its_planned_clock():
    rt = EnvPipeRuntime(EnvPipeConfig(plan_type="envelope", scheduling="ours", profile="a40/gpt3-175b"))
    it = rt.prepare(8, 16)
    profile = load_profile("a40/gpt3-175b")
    assert it.phase == "steady" and len(set(it.plan.flat())) > 1  # a plan that changes clocks
    assert it.unit_times_s == tuple(
        tuple(profile.time_s(s, instruction_of(u.kind), f) for u, f in zip(order, it.plan.freqs_mhz[s]))
        for s, order in enumerate(it.schedule.orders))
