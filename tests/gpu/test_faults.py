"""Measurement never stops training: faults injected under the real GpuHooks, EnergyMonitor,
ClockController and ClockSweep (tests/gpu/fault_double.py wraps a SimulatedGpu).

Each test drives the hooks the way the executor does (iteration_begin, a clock per
unit, unit_begin/unit_end, iteration_end) through a fault, and checks that no call
raised, that exactly the intervals the fault touched are reported unmeasured (once
in the log, counted by reason), that the ones after it are measured exactly again,
and that the clocks end reset.
"""

from __future__ import annotations

import logging
import time

import pytest
from fault_double import FaultyGpu  # noqa: E402  (tests/gpu is on sys.path under pytest)

from megatron_envpipe.core.profile import Profile
from megatron_envpipe.core.resources import shipped_profile
from megatron_envpipe.core.schedule import B, F
from megatron_envpipe.gpu.control.safety import ClockGuard
from megatron_envpipe.gpu.devices.simulated import SimulatedGpu
from megatron_envpipe.gpu.energy.counter_errors import READ_FAILED, STALLED, WENT_BACK
from megatron_envpipe.gpu.hooks import EnergyStatus, GpuHooks
from megatron_envpipe.gpu.profiler.sweep import ClockSweep, StageSamples

SCALE = 0.05  # wall seconds per simulated second: an iteration of 4 units takes ~50 ms
P2P_W = 70.0
UNITS = (F(0), F(1), B(0), B(1))
CLOCKS = (1050, 1200)


@pytest.fixture
def profile() -> Profile:
    return Profile.from_csv(shipped_profile("a40/gpt3-175b")).for_pipeline(2)


@pytest.fixture
def guard(tmp_path):
    g = ClockGuard(tmp_path / "state", install_handlers=False)
    yield g
    g.close()


@pytest.fixture
def rig(profile, guard):
    gpu = FaultyGpu(SimulatedGpu(profile, 0, time_scale=SCALE, p2p_power_w=P2P_W, clock=time.perf_counter))
    hooks = GpuHooks(gpu, control=True, cuda=False, time_scale=SCALE, guard=guard)
    yield gpu, hooks
    hooks.close()


class Iteration:
    """What one iteration looked like from outside the hooks."""

    def __init__(self, hooks: GpuHooks, outer: tuple[float, float], windows, clocks, end_call_s: float) -> None:
        self.energy = hooks.last_energy
        self.reason = hooks.last_unmeasured
        self.outer = outer  # the test's own clock readings around the hooks' calls
        self.windows = windows  # (kind, start, end) of each unit as the model ran it
        self.clocks = clocks  # the clock each unit ran at
        self.end_call_s = end_call_s  # how long iteration_end took


def run(hooks: GpuHooks, n: int, first: int = 0) -> list[Iteration]:
    """``n`` iterations as the executor drives them, alternating clocks per unit."""
    out = []
    for it in range(first, first + n):
        t0 = time.perf_counter()
        hooks.iteration_begin(0, it)
        clocks = []
        for u, unit in enumerate(UNITS):
            hooks.set_frequency(CLOCKS[(it + u) % 2])
            clocks.append(hooks.device.inner.model_clock_mhz)  # the locked clock, or the maximum
            hooks.unit_begin(unit)
            hooks.unit_end(unit)
        windows = list(hooks.device_windows)
        t_end = time.perf_counter()
        hooks.iteration_end(None)
        t1 = time.perf_counter()
        out.append(Iteration(hooks, (t0, t1), windows, clocks, t1 - t_end))
    return out


def assert_exact(profile: Profile, it: Iteration) -> None:
    """A measured iteration holds its units' modelled energy plus P2P power between them, and
    at most P2P power over the rest of the span observed around it (exact counter, exact edges)."""
    assert it.energy is not None and it.reason is None
    units_j = 0.0
    for (kind, a, b), f in zip(it.windows, it.clocks, strict=True):
        ins = "forward" if kind == "F" else "backward"
        units_j += (b - a) / SCALE * profile.energy_j(0, ins, f) / profile.time_s(0, ins, f)
    busy = sum(b - a for _, a, b in it.windows)
    between = sum(b[1] - a[2] for a, b in zip(it.windows, it.windows[1:]))
    lower = units_j + P2P_W * between / SCALE
    upper = units_j + P2P_W * ((it.outer[1] - it.outer[0]) - busy) / SCALE
    assert lower * (1 - 1e-9) <= it.energy.energy_j <= upper * (1 + 1e-9), (lower, it.energy.energy_j, upper)


def warnings_about(caplog, text: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING and text in r.getMessage()]


def run_until(hooks: GpuHooks, t_end: float, first: int) -> list[Iteration]:
    out: list[Iteration] = []
    while time.perf_counter() < t_end:
        out += run(hooks, 1, first + len(out))
    return out


def test_stalled_counter_makes_its_intervals_unmeasured_and_the_monitor_recovers(rig, profile, caplog):
    gpu, hooks = rig
    before = run(hooks, 3)
    gpu.inject("stall", seconds=1.0)  # mid-run, between two iterations
    stalled_until = time.perf_counter() + 1.0
    during = run_until(hooks, stalled_until, 3)
    after = run(hooks, 4, 3 + len(during))
    for it in before + after[1:]:
        assert_exact(profile, it)  # after[0] may still begin inside the stall
    # The simulated counter is exact: one read unchanged while the GPU draws power is a stall,
    # so even the iteration that began as the counter froze is caught.
    assert all(it.reason == STALLED for it in during), [it.reason for it in during]
    # No iteration_end ever waits for the counter (the old code waited 1 s and raised).
    assert max(it.end_call_s for it in before + during + after) < 0.5
    n = len(during) + (after[0].reason == STALLED)
    assert hooks.unmeasured == {STALLED: n}
    assert hooks.intervals == len(before + during + after) and hooks.monitor.stalls == 1
    assert len(warnings_about(caplog, f"is not measured ({STALLED}")) == 1  # once, however many
    # The catch-up after the stall is attributed to no measured iteration (assert_exact above).
    status = hooks.energy_status()
    assert status.unmeasured == ((STALLED, n),) and status.clock_control_lost is None


def test_counter_going_back_makes_one_interval_unmeasured(rig, profile, caplog):
    gpu, hooks = rig
    gpu.inject("back", unit=4 * 3 + 2)  # a driver reload inside iteration 3
    its = run(hooks, 7)
    assert [it.reason for it in its] == [None, None, None, WENT_BACK, None, None, None]
    for it in its[:3] + its[4:]:
        assert_exact(profile, it)  # the trace continues across the reset
    assert hooks.unmeasured == {WENT_BACK: 1} and hooks.monitor.went_back == 1
    assert len(warnings_about(caplog, f"is not measured ({WENT_BACK}")) == 1


def test_failing_reads_are_unmeasured_intervals_and_the_poller_keeps_polling(rig, profile, caplog):
    gpu, hooks = rig
    run(hooks, 2)
    gpu.inject("read_fail", seconds=0.3)  # the next iteration's first read fails, and polls for 0.3 s
    failing_until = time.perf_counter() + 0.3
    during = run_until(hooks, failing_until, 2)
    time.sleep(0.05)
    after = run(hooks, 3, 2 + len(during))
    assert during[0].reason == READ_FAILED
    assert all(it.reason in (READ_FAILED, None) for it in during)
    for it in after:
        assert_exact(profile, it)
    monitor = hooks.monitor
    assert monitor.running and monitor.failing is None and gpu.reads_failed >= 2
    assert monitor.read_errors == gpu.reads_failed  # every failed read counted, none fatal
    assert monitor.covered_until() > failing_until  # the trace resumed with the counter
    assert hooks.unmeasured == {READ_FAILED: sum(it.reason == READ_FAILED for it in during)}
    assert len(warnings_about(caplog, f"is not measured ({READ_FAILED}")) == 1
    assert len(warnings_about(caplog, "reading the energy counter")) == 1  # the poller's own, once


def test_clock_lock_failure_mid_run_falls_back_to_monitor_only(rig, profile, guard, caplog):
    gpu, hooks = rig
    gpu.inject("lock_fail", after=5)
    its = run(hooks, 6)
    lines = warnings_about(caplog, "continuing monitor-only")
    assert len(lines) == 1 and "NVML_ERROR_NO_PERMISSION" in lines[0] and "reset to the driver's default" in lines[0]
    assert gpu.lock_calls == 6  # five locks, the failed one, and never another
    assert gpu.locked_clock_mhz() is None and guard.locked_devices() == []  # reset at once
    assert hooks.clock_control_lost and hooks.controller.monitor_only
    for it in its:
        assert_exact(profile, it)  # energy is still measured, every iteration
    assert hooks.unmeasured == {}
    # A profiling iteration after the fall-back did not run at the swept clock: no samples.
    assert hooks.stage_samples([("F", 0.0, 1.0)], []) is None
    assert hooks.energy_status().clock_control_lost.startswith("NVML_ERROR_NO_PERMISSION")
    hooks.close()
    assert gpu.locked_clock_mhz() is None and not hooks.controller.worker_alive


def test_profile_samples_of_an_unmeasured_iteration_are_none(rig):
    gpu, hooks = rig
    run(hooks, 1)
    windows = [(k, a, b) for k, a, b in hooks.device_windows]
    assert isinstance(hooks.stage_samples(windows, []), StageSamples)
    gpu.inject("read_fail", seconds=0.2)
    run(hooks, 1, 1)
    assert hooks.last_unmeasured == READ_FAILED
    assert hooks.stage_samples(list(hooks.device_windows), []) is None


def test_sweep_repeats_an_unmeasured_clock_and_gives_up_after_a_few():
    def samples(e: float) -> StageSamples:
        return StageSamples.of([("F", 1.0, e), ("B", 2.0, 2 * e)])

    sweep = ClockSweep([1500, 1200, 900], iterations_per_clock=1, max_unmeasured=2)
    sweep.record(1500, [samples(100.0), None])  # warm-up: discarded either way
    sweep.record(1500, [samples(100.0), samples(100.0)])
    assert sweep.next_clock() == 1200
    sweep.record(1200, [None, samples(90.0)])  # unmeasured: the clock is repeated
    assert sweep.next_clock() == 1200 and sweep.unmeasured_iterations == 1
    sweep.record(1200, [samples(90.0), samples(90.0)])
    assert sweep.measured_clocks_mhz() == (1500, 1200) and sweep.next_clock() == 900
    sweep.record(900, [None, None])
    sweep.record(900, [samples(95.0), None])
    assert sweep.done and sweep.measured_clocks_mhz() == (1500, 1200)
    assert "2 iterations in a row at 900 MHz were not measured" in sweep.stop_reason
    assert "3 iteration(s) unmeasured" in sweep.summary()
    assert sweep.iterations_used == 6 and sweep.profile().frequencies(0, "forward") == (1500, 1200)


def test_runtime_plans_without_a_profile_when_no_clock_was_measured():
    pytest.importorskip("torch")
    from megatron_envpipe.config import EnvPipeConfig
    from megatron_envpipe.gpu.startup import DeviceFacts
    from megatron_envpipe.megatron.runtime import EnvPipeRuntime

    rt = EnvPipeRuntime(EnvPipeConfig(plan_type="envelope", scheduling="ours", reconfig="balanced",
                                      profile_cache="off", profile_step_mhz=300))
    rt.attach_device(DeviceFacts(backend="simulated", name="Simulated", driver_version="simulated",
                                 clocks_mhz=(1740, 1440, 1140), control=True, energy=True, modelled=True))
    for _ in range(1 + 3):  # warm-up, then three unmeasured iterations at the first clock
        it = rt.prepare(4, 8)
        assert it.profiling
        rt.finish(4, 8, None, [None] * 4)
    it = rt.prepare(4, 8)  # no exception: EnvPipe's schedule at the one clock it knows
    assert not it.profiling and rt.profile is None and it.schedule.name != "1f1b"


def test_energy_report_names_what_was_not_measured():
    pytest.importorskip("torch")
    from megatron_envpipe.megatron.reporting import _unmeasured_summary

    ok = EnergyStatus(None, None, 5, ())
    stalled = EnergyStatus(None, STALLED, 5, ((STALLED, 2),))
    lost = EnergyStatus(None, None, 5, ((READ_FAILED, 1), (STALLED, 1)), clock_control_lost="lost CAP_SYS_ADMIN")
    assert _unmeasured_summary([ok, ok]) == ""
    assert _unmeasured_summary([ok, stalled, lost]) == (
        f" | 4 of 15 intervals unmeasured ({READ_FAILED}: 1, {STALLED}: 3)"
        " | clock control lost on stage 2 (lost CAP_SYS_ADMIN): monitor-only"
    )
