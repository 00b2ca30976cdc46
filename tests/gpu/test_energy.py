"""EnergyMonitor: piecewise-linear attribution of a polled cumulative counter."""

from __future__ import annotations

import bisect
import threading
import time

import pytest

from megatron_envpipe.core.profile import Profile, ProfilePoint
from megatron_envpipe.gpu.devices.base import GpuDevice, GpuInfo
from megatron_envpipe.gpu.devices.simulated import SimulatedGpu
from megatron_envpipe.gpu.energy.counter_errors import (
    CounterReadError,
    CounterStalledError,
    CounterWentBackError,
    EnergyMonitorError,
)
from megatron_envpipe.gpu.energy.iteration_energy import IterationEnergy
from megatron_envpipe.gpu.energy.iteration_meter import IterationEnergyMeter
from megatron_envpipe.gpu.energy.monitor import EnergyMonitor
from megatron_envpipe.gpu.profiler.attribution import _attribute_windows, _fit_window_powers

UPDATE_S = 0.010  # NVML's counter period


class FakeClock:
    def __init__(self, now: float = 0.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


class PowerTraceGpu(GpuDevice):
    """A GPU whose power is a known step function of time, with NVML's stepped counter:
    the reported value is the exact integral up to the last multiple of ``update_s``."""

    backend = "fake"

    def __init__(self, clock, steps: list[tuple[float, float]], update_s: float = UPDATE_S) -> None:
        self.clock = clock
        self.steps = steps  # (from time s, power W), sorted
        self.update_s = update_s
        self.offset_mj = 0.0

    def true_energy_j(self, t: float) -> float:
        total = 0.0
        for i, (t_from, p) in enumerate(self.steps):
            t_to = self.steps[i + 1][0] if i + 1 < len(self.steps) else float("inf")
            if t <= t_from:
                break
            total += p * (min(t, t_to) - t_from)
        return total

    def energy_mj(self) -> float:
        t = self.clock()
        if self.update_s > 0:
            t = (t // self.update_s) * self.update_s
        return self.true_energy_j(t) * 1000.0 + self.offset_mj

    def power_spread_w(self, t0: float, t1: float) -> float:
        """Max - min power over [t0, t1]."""
        times = [s for s, _ in self.steps]
        i = max(bisect.bisect_right(times, t0) - 1, 0)
        j = bisect.bisect_right(times, t1)
        powers = [p for _, p in self.steps[i:j]]
        return max(powers) - min(powers)

    def power_w(self) -> float:
        t = self.clock()
        i = bisect.bisect_right([s for s, _ in self.steps], t) - 1
        return self.steps[max(i, 0)][1]

    def info(self) -> GpuInfo:
        return GpuInfo("Fake", "FAKE-0", "none", "none", "fake")

    def supported_clocks_mhz(self):
        return (1000,)

    def can_set_clocks(self):
        return False

    def set_locked_clocks(self, freq_mhz):
        raise NotImplementedError

    def reset_locked_clocks(self):
        pass

    def locked_clock_mhz(self):
        return None


def run_polled(device: PowerTraceGpu, clock: FakeClock, until: float, poll_s: float = 0.001,
               start: float = 0.0) -> EnergyMonitor:
    """A monitor fed by deterministic polls every ``poll_s`` (what the thread does)."""
    mon = EnergyMonitor(device, poll_interval_s=poll_s, clock=clock)
    k = 0
    while True:
        clock.now = start + k * poll_s + poll_s * 0.3  # reads land 0.3 poll after the grid
        if clock.now > until:
            break
        mon.sample()
        k += 1
    return mon


def test_constant_power_is_exact_with_a_stepped_counter():
    clock = FakeClock()
    dev = PowerTraceGpu(clock, [(0.0, 250.0)])
    mon = run_polled(dev, clock, until=0.5)
    samples = mon.samples()
    assert 45 <= len(samples) <= 51, "one sample per counter update, not per poll"
    # An update is stamped midway between the unchanged read before it and the read that saw it.
    assert samples[1].time_s == pytest.approx(0.0098)
    for t0, t1 in [(0.1, 0.1037), (0.2012, 0.2049), (0.05, 0.45), (0.3, 0.3)]:
        assert mon.energy_j(t0, t1) == pytest.approx(250.0 * (t1 - t0), abs=1e-9)
    assert mon.average_power_w(0.1, 0.4) == pytest.approx(250.0)


def test_interpolation_exact_at_sample_points_and_between_for_piecewise_linear_energy():
    # Continuous counter read exactly where power changes: E(t) is the trace itself.
    clock = FakeClock()
    dev = PowerTraceGpu(clock, [(0.0, 100.0), (0.02, 300.0), (0.05, 70.0)], update_s=0.0)
    mon = EnergyMonitor(dev, clock=clock)
    for t in (0.0, 0.02, 0.05, 0.08):
        clock.now = t
        mon.sample()
    for t0, t1 in [(0.0, 0.08), (0.02, 0.05), (0.01, 0.03), (0.021, 0.024), (0.049, 0.06)]:
        assert mon.energy_j(t0, t1) == pytest.approx(dev.true_energy_j(t1) - dev.true_energy_j(t0), abs=1e-12)
    assert mon.energy_mj_at(0.035) == pytest.approx(dev.true_energy_j(0.035) * 1000)


def short_unit_trace() -> tuple[PowerTraceGpu, FakeClock, list[tuple[str, float, float]], EnergyMonitor]:
    """Back-to-back forward/backward units of 3-7 ms (300 W / 285 W) after idle;
    NVML-like counter updating every 10 ms, polled every 1 ms."""
    steps, units = [(0.0, 70.0)], []
    t = 0.02
    for i in range(60):
        for kind, dur, p in (("F", 0.003 + 0.0001 * (i % 7), 300.0), ("B", 0.007 - 0.0001 * (i % 5), 285.0)):
            steps.append((t, p))
            units.append((kind, t, t + dur))
            t += dur
    steps.append((t, 70.0))
    clock = FakeClock()
    dev = PowerTraceGpu(clock, steps)
    mon = run_polled(dev, clock, until=t + 0.03)
    return dev, clock, units, mon


def test_units_shorter_than_the_update_period_interpolated_within_the_bound():
    """Interpolation assumes constant power between samples, so a unit's energy is
    off by at most (power spread within a sample interval) x (spacing / 4 + timestamp
    error) per edge: here 15 W x (10/4 + 0.5) ms. The bias does not average out
    (it pulls each unit towards its neighbours' power), but the total is right."""
    dev, _, units, mon = short_unit_trace()
    measured = _attribute_windows(mon, [(a, b) for _, a, b in units])
    errors = {"F": [], "B": []}
    for (kind, a, b), e in zip(units, measured, strict=True):
        truth = dev.true_energy_j(b) - dev.true_energy_j(a)
        spread_w = dev.power_spread_w(a - UPDATE_S, b + UPDATE_S)  # 15 W, or 230 W next to idle
        assert abs(e - truth) <= 2 * spread_w * (UPDATE_S / 4 + 0.0005), (kind, a, e, truth)
        errors[kind].append(e / truth - 1)
    # Between F and B only: F comes out ~3.5 % low, B ~1.6 % high (blended), never worse than 4 %.
    assert max(abs(x) for x in errors["F"][:-1] + errors["B"][:-1]) < 0.04
    first, last = units[0][1], units[-1][2]
    total_truth = dev.true_energy_j(last) - dev.true_energy_j(first)
    assert sum(measured) == pytest.approx(total_truth, rel=0.01)


def test_units_shorter_than_the_update_period_by_power_regression():
    """One power per kind fitted to all counter increments: each unit's energy is
    exact up to the counter's timestamp uncertainty (update instants are known to
    half a poll, 0.5 ms here): within 1 %, where interpolation is off by 3.5 %."""
    dev, _, units, mon = short_unit_trace()
    powers = _fit_window_powers(mon, units)
    assert powers["F"] == pytest.approx(300.0, rel=0.01)
    assert powers["B"] == pytest.approx(285.0, rel=0.01)
    # "other" is only the 50 ms of idle around the units, where the timestamp error weighs most.
    assert powers["other"] == pytest.approx(70.0, rel=0.2)
    for kind, a, b in units:
        truth = dev.true_energy_j(b) - dev.true_energy_j(a)
        assert powers[kind] * (b - a) == pytest.approx(truth, rel=0.01)
    with pytest.raises(ValueError, match="overlap"):
        _fit_window_powers(mon, [("F", 0.02, 0.03), ("B", 0.025, 0.04)])
    assert _fit_window_powers(mon, []) == {}


def test_power_regression_needs_separable_labels():
    clock = FakeClock()
    dev = PowerTraceGpu(clock, [(0.0, 100.0)], update_s=0.0)
    mon = EnergyMonitor(dev, clock=clock)
    for t in (0.0, 1.0):
        clock.now = t
        mon.sample()
    # One counter increment cannot tell three powers apart.
    with pytest.raises(ValueError, match="cannot separate"):
        _fit_window_powers(mon, [("F", 0.2, 0.4), ("B", 0.5, 0.7)])


def test_short_unit_between_idle_periods_is_blended_within_the_bound():
    """The honest limit: a 3 ms, 300 W unit between 70 W idle, counter every 10 ms.
    Its energy is blended with the idle power; the error stays within
    |dP| * spacing / 2 (two edges), the documented bound."""
    clock = FakeClock()
    dev = PowerTraceGpu(clock, [(0.0, 70.0), (0.1033, 300.0), (0.1063, 70.0)])
    mon = run_polled(dev, clock, until=0.2)
    truth = 300.0 * 0.003
    got = mon.energy_j(0.1033, 0.1063)
    assert abs(got - truth) <= 230.0 * UPDATE_S / 2
    # A window covering the whole busy period plus whole update periods is accurate again.
    assert mon.energy_j(0.08, 0.13) == pytest.approx(dev.true_energy_j(0.13) - dev.true_energy_j(0.08), rel=0.02)


def test_edges_clamp_within_tolerance_and_raise_beyond():
    clock = FakeClock()
    dev = PowerTraceGpu(clock, [(0.0, 100.0)], update_s=0.0)
    mon = EnergyMonitor(dev, poll_interval_s=0.002, clock=clock)
    with pytest.raises(EnergyMonitorError, match="empty"):
        mon.energy_j(0.0, 1.0)
    for t in (1.0, 1.5, 2.0):
        clock.now = t
        mon.sample()
    assert mon.energy_j(0.999, 1.0) == 0.0  # before the first sample, within one poll
    assert mon.energy_j(1.5, 2.001) == pytest.approx(50.0)  # after the last, within one poll
    with pytest.raises(EnergyMonitorError, match="before the first energy sample"):
        mon.energy_j(0.9, 1.2)
    with pytest.raises(EnergyMonitorError, match=r"after the last energy sample.*wait_covered"):
        mon.energy_j(1.2, 2.5)
    with pytest.raises(ValueError, match="ends before it starts"):
        mon.energy_j(1.6, 1.4)
    with pytest.raises(ValueError, match="positive length"):
        mon.average_power_w(1.6, 1.6)
    with pytest.raises(EnergyMonitorError, match="not running"):
        mon.wait_covered(3.0)


def test_trim_keeps_windows_from_the_cut_point():
    clock = FakeClock()
    dev = PowerTraceGpu(clock, [(0.0, 100.0)], update_s=0.0)
    mon = EnergyMonitor(dev, clock=clock)
    for k in range(11):
        clock.now = k * 0.1
        mon.sample()
    mon.trim(0.55)
    assert mon.samples()[0].time_s == pytest.approx(0.5)
    assert mon.energy_j(0.55, 1.0) == pytest.approx(45.0)
    with pytest.raises(EnergyMonitorError, match="trim"):
        mon.energy_j(0.3, 1.0)


def test_counter_reset_keeps_the_trace_monotonic():
    clock = FakeClock()
    dev = PowerTraceGpu(clock, [(0.0, 100.0)], update_s=0.0)
    mon = EnergyMonitor(dev, clock=clock)
    for k in range(5):
        clock.now = k / 10
        if k == 3:
            dev.offset_mj = -dev.energy_mj()  # driver reload: the counter restarts near 0
        mon.sample()
    energies = [s.energy_mj for s in mon.samples()]
    assert all(b >= a for a, b in zip(energies, energies[1:]))
    assert mon.energy_j(0.3, 0.4) == pytest.approx(10.0)
    assert mon.energy_j(0.0, 0.2) == pytest.approx(20.0)
    # What happened between the last read before the reset and the first after is unknown.
    assert mon.gaps() == ((0.2, 0.3, "counter went backwards"),) and mon.went_back == 1
    with pytest.raises(CounterWentBackError, match="went backwards"):
        mon.energy_j(0.1, 0.4)


def test_poller_thread_on_a_simulated_gpu():
    """The background poller on a real-time simulated GPU. Each unit's interpolated
    energy is within the interpolation bound for the sample spacing the poller
    actually achieved around its edges (tight on a quiet machine; a starved poller
    on a busy one widens the bound, never the error beyond it)."""
    prof = Profile({(0, "forward"): [ProfilePoint(1000, 0.2, 60.0)], (0, "backward"): [ProfilePoint(1000, 0.4, 116.0)]})
    scale, p2p_w = 0.05, 70.0
    gpu = SimulatedGpu(prof, 0, time_scale=scale, p2p_power_w=p2p_w)
    with EnergyMonitor(gpu, poll_interval_s=0.0002) as mon:
        assert mon.running
        windows = []
        for kind in "FBFB":
            gpu.unit_begin(0, kind)
            gpu.unit_end(0, kind)
            windows.append(gpu.last_unit_window())
            time.sleep(0.002)
        energies = _attribute_windows(mon, [(a, b) for _, a, b in windows])
    assert not mon.running
    times = [x.time_s for x in mon.samples()]

    def spacing(t: float) -> float:
        i = bisect.bisect_right(times, t)
        return times[i] - times[i - 1]

    for (kind, a, b), e in zip(windows, energies, strict=True):
        truth = 60.0 if kind == "F" else 116.0
        jump_j_per_s = (truth / (0.2 if kind == "F" else 0.4) - p2p_w) / scale  # energy per wall second
        bound_j = jump_j_per_s * (spacing(a) + spacing(b)) / 4 + 0.002 * truth
        assert abs(e - truth) <= bound_j, (kind, e, truth, bound_j)
    assert mon.covered_until() >= windows[-1][2]  # stop() extends the trace to the stop time


def test_poller_survives_failed_reads_and_a_frozen_counter_is_reported():
    class Broken(PowerTraceGpu):
        calls = 0

        def energy_mj(self) -> float:
            Broken.calls += 1
            if Broken.calls > 3:
                raise RuntimeError("NVML_ERROR_GPU_IS_LOST")
            return float(Broken.calls)

    mon = EnergyMonitor(Broken(time.monotonic, [(0.0, 1.0)]), poll_interval_s=0.001).start()
    time.sleep(0.05)
    assert mon.running and mon.read_errors >= 1 and "GPU_IS_LOST" in repr(mon.failing)
    # A failing counter answers at once, naming why, instead of waiting out the timeout.
    t = time.monotonic()
    with pytest.raises(CounterReadError, match="GPU_IS_LOST") as info:
        mon.wait_covered(t, timeout_s=5.0)
    assert info.value.reason == "counter read failed" and time.monotonic() - t < 1.0
    with pytest.raises(RuntimeError, match="GPU_IS_LOST"):
        mon.read()  # a direct read raises what the device raised
    mon.stop()  # never raises: the poller's failures were counted, not stored

    class Frozen(PowerTraceGpu):
        def energy_mj(self) -> float:
            return 5.0

    # Stands still at 1 W for longer than stall_after_s: stalled, answered at once.
    with EnergyMonitor(Frozen(time.monotonic, [(0.0, 1.0)]), poll_interval_s=0.001, stall_after_s=0.02) as mon:
        time.sleep(0.1)
        with pytest.raises(CounterStalledError, match="stalled"):
            mon.wait_covered(time.monotonic() + 0.001, timeout_s=5.0)
    # Too short a wait to tell: the old timeout message.
    with EnergyMonitor(Frozen(time.monotonic, [(0.0, 1.0)]), poll_interval_s=0.001) as mon:
        with pytest.raises(EnergyMonitorError, match="did not change.*frozen"):
            mon.wait_covered(time.monotonic() + 0.001, timeout_s=0.05)


def test_retain_bounds_memory():
    prof = Profile({(0, "forward"): [ProfilePoint(1000, 0.2, 60.0)], (0, "backward"): [ProfilePoint(1000, 0.4, 116.0)]})
    gpu = SimulatedGpu(prof, 0, p2p_power_w=70.0)
    with EnergyMonitor(gpu, poll_interval_s=0.0005, retain_s=0.02) as mon:
        time.sleep(0.15)
        samples = mon.samples()
    assert samples[-1].time_s - samples[0].time_s < 0.05


def test_iteration_energy_helpers():
    a = IterationEnergy(3, 0, 10.0, 12.0, 500.0)
    assert a.time_s == 2.0 and a.average_power_w == 250.0

    clock = FakeClock()
    dev = PowerTraceGpu(clock, [(0.0, 200.0)], update_s=0.0)
    mon = EnergyMonitor(dev, clock=clock)
    meter = IterationEnergyMeter(mon, stage=2)
    mon.sample()
    meter.begin(0)
    clock.now = 0.5
    mon.sample()
    result = meter.end()
    assert result == IterationEnergy(0, 2, 0.0, 0.5, pytest.approx(100.0))
    assert meter.history == [result]
    with pytest.raises(RuntimeError, match="without begin"):
        meter.end()


def test_concurrent_sample_calls_keep_the_trace_ordered():
    prof = Profile({(0, "forward"): [ProfilePoint(1000, 0.2, 60.0)], (0, "backward"): [ProfilePoint(1000, 0.4, 116.0)]})
    gpu = SimulatedGpu(prof, 0, p2p_power_w=70.0)
    mon = EnergyMonitor(gpu)
    threads = [threading.Thread(target=lambda: [mon.sample() for _ in range(500)]) for _ in range(3)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    s = mon.samples()
    assert all(b.time_s > a.time_s and b.energy_mj >= a.energy_mj for a, b in zip(s, s[1:]))
