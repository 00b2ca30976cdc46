"""The simulated GPU with device dynamics (issue 21 item 1): clock latency, serialised NVML calls,
a stepped energy counter, averaged power and heat, all in simulated time (VirtualClock), so nothing
here depends on the host's speed. Figures are checked against the closed-form piecewise model."""

from __future__ import annotations

import bisect
import math
import random

import pytest

from megatron_envpipe.core.device_dynamics import EXACT, DeviceDynamics, DeviceDynamicsError, load_dynamics
from megatron_envpipe.core.profile import Profile, ProfilePoint
from megatron_envpipe.core.resources import configs_dir
from megatron_envpipe.core.virtual_clock import VirtualClock
from megatron_envpipe.gpu.devices.base import GpuError
from megatron_envpipe.gpu.devices.simulated import SimulatedGpu

P2P_W = 70.0
LATENCY_S = 0.015
CALL_S = 0.010


def profile() -> Profile:
    """One stage, three clocks; forward 0.10 s / 300 W and backward 0.20 s / 290 W at the top clock."""
    pts = {}
    for ins, t, e in (("forward", 0.10, 30.0), ("backward", 0.20, 58.0)):
        pts[(0, ins)] = [ProfilePoint(1500, t, e), ProfilePoint(1200, t * 1.2, e * 0.85),
                         ProfilePoint(900, t * 1.6, e * 0.9)]
    return Profile(pts, source="<dynamics>")


PROF = profile()


def t_of(kind: str, mhz: int) -> float:
    return PROF.time_s(0, "forward" if kind == "F" else "backward", mhz)


def p_of(kind: str, mhz: int) -> float:
    return PROF.point(0, "forward" if kind == "F" else "backward", mhz).power_w


def device(dynamics: DeviceDynamics = EXACT, time_scale: float = 1.0, **kw) -> tuple[SimulatedGpu, VirtualClock]:
    vc = VirtualClock()
    gpu = SimulatedGpu(PROF, 0, time_scale=time_scale, p2p_power_w=P2P_W, clock=vc.now, sleep=vc.sleep,
                       dynamics=dynamics, **kw)
    return gpu, vc


def lagged(**figures: float) -> DeviceDynamics:
    return DeviceDynamics(**{"clock_latency_s": LATENCY_S, "nvml_call_s": CALL_S, **figures}, source="test")


def start_at(gpu: SimulatedGpu, vc: VirtualClock, mhz: int) -> None:
    gpu.set_locked_clocks(mhz)
    vc.sleep(1.0)  # long past the latency: the SMs run at mhz
    assert gpu.current_sm_clock_mhz() == mhz


@pytest.mark.parametrize("time_scale", [1.0, 0.25])
def test_a_raise_at_a_boundary_lands_the_latency_later_and_the_unit_runs_piecewise(time_scale):
    gpu, vc = device(lagged(), time_scale=time_scale)
    start_at(gpu, vc, 900)
    t0, e0 = vc.now(), gpu.true_energy_mj()
    gpu.set_locked_clocks(1500)
    assert vc.now() == t0  # the caller does not wait: the clock worker absorbs the call
    assert gpu.locked_clock_mhz() == 1500  # NVML reports the setting at once ...
    assert gpu.current_sm_clock_mhz() == 900 and gpu.model_clock_mhz == 900  # ... the SMs are not there yet
    gpu.unit_begin(0, "B")
    assert gpu.open_unit_begin_s() == t0
    gpu.wait_until(t0 + 0.9 * LATENCY_S * time_scale)
    assert gpu.current_sm_clock_mhz() == 900
    assert gpu.power_w() == pytest.approx(p_of("B", 900))
    gpu.wait_until(t0 + 1.1 * LATENCY_S * time_scale)
    assert gpu.current_sm_clock_mhz() == 1500
    assert gpu.power_w() == pytest.approx(p_of("B", 1500))
    gpu.unit_end(0, "B")
    # The first LATENCY_S at 900 MHz does that share of the work; the rest runs at 1500 MHz.
    left = 1.0 - LATENCY_S / t_of("B", 900)
    want_s = LATENCY_S + left * t_of("B", 1500)
    want_j = p_of("B", 900) * LATENCY_S + p_of("B", 1500) * left * t_of("B", 1500)
    kind, begin, end = gpu.last_unit_window()
    assert (kind, begin) == ("B", t0)
    assert (end - begin) / time_scale == pytest.approx(want_s, rel=1e-12)
    assert vc.now() == pytest.approx(end, abs=1e-12)
    assert (gpu.true_energy_mj() - e0) / 1000 == pytest.approx(want_j, rel=1e-12)
    assert gpu.open_unit_begin_s() is None
    # The next unit runs at the new clock throughout.
    gpu.unit_begin(0, "F")
    gpu.unit_end(0, "F")
    _, b, e = gpu.last_unit_window()
    assert (e - b) / time_scale == pytest.approx(t_of("F", 1500), rel=1e-12)


def test_two_quick_requests_serialise_by_the_call_time_and_a_unit_sees_both():
    gpu, vc = device(lagged())
    start_at(gpu, vc, 900)
    t0, e0 = vc.now(), gpu.true_energy_mj()
    gpu.set_locked_clocks(1200)
    gpu.set_locked_clocks(1500)  # issued when the first call returned: CALL_S later
    assert gpu.locked_clock_mhz() == 1500
    gpu.unit_begin(0, "B")
    first, second = t0 + LATENCY_S, t0 + CALL_S + LATENCY_S
    gpu.wait_until(first - 1e-6)
    assert gpu.current_sm_clock_mhz() == 900
    gpu.wait_until(first + 1e-6)
    assert gpu.current_sm_clock_mhz() == 1200
    gpu.wait_until(second + 1e-6)
    assert gpu.current_sm_clock_mhz() == 1500
    gpu.unit_end(0, "B")
    w900 = LATENCY_S / t_of("B", 900)
    w1200 = CALL_S / t_of("B", 1200)
    rest = 1.0 - w900 - w1200
    _, begin, end = gpu.last_unit_window()
    assert end - begin == pytest.approx(LATENCY_S + CALL_S + rest * t_of("B", 1500), rel=1e-12)
    want_j = p_of("B", 900) * LATENCY_S + p_of("B", 1200) * CALL_S + p_of("B", 1500) * rest * t_of("B", 1500)
    assert (gpu.true_energy_mj() - e0) / 1000 == pytest.approx(want_j, rel=1e-12)


def test_a_lower_clock_landing_mid_unit_moves_its_end_later_and_one_after_the_unit_does_nothing():
    gpu, vc = device(lagged())
    start_at(gpu, vc, 1500)
    t0 = vc.now()
    gpu.unit_begin(0, "F")
    gpu.wait_until(t0 + 0.05)
    gpu.set_locked_clocks(900)  # lands at 0.065, 0.035 s of 1500-MHz work left
    gpu.unit_end(0, "F")
    _, begin, end = gpu.last_unit_window()
    assert end - begin == pytest.approx(0.065 + (1 - 0.065 / t_of("F", 1500)) * t_of("F", 900), rel=1e-12)
    # A unit the host closes late: the change requested after its compute ended leaves it alone.
    gpu.set_locked_clocks(1500)
    vc.sleep(1.0)
    t1 = vc.now()
    gpu.unit_begin(0, "F")
    vc.sleep(t_of("F", 1500) + 0.01)  # host work outlasts the model
    gpu.set_locked_clocks(900)
    gpu.unit_end(0, "F")
    assert gpu.last_unit_window()[1:] == pytest.approx((t1, t1 + t_of("F", 1500)), abs=1e-12)
    assert gpu.overrun_units == 1


def test_a_change_requested_from_another_thread_while_unit_end_sleeps_moves_the_end():
    """The clock worker thread may request while the training thread sleeps in unit_end."""
    vc = VirtualClock()
    requests = []

    def sleep(seconds: float) -> None:
        vc.sleep(min(seconds, 0.02) if not requests else seconds)
        if not requests:  # the worker requests 20 ms into the unit's sleep
            requests.append(vc.now())
            gpu.set_locked_clocks(1500)

    gpu = SimulatedGpu(PROF, 0, p2p_power_w=P2P_W, clock=vc.now, sleep=sleep, dynamics=lagged())
    gpu.set_locked_clocks(900)
    vc.sleep(1.0)
    t0 = vc.now()
    gpu.unit_begin(0, "B")
    gpu.unit_end(0, "B")
    at = requests[0] + LATENCY_S - t0
    _, begin, end = gpu.last_unit_window()
    assert end - begin == pytest.approx(at + (1 - at / t_of("B", 900)) * t_of("B", 1500), rel=1e-12)


def test_stepped_counter_is_constant_between_ticks_and_exact_at_them():
    period = 0.1
    dyn = DeviceDynamics(counter_period_s=period, source="test")
    # The phase: an idle twin (same seed and stage) draws constant power, so its first step tells it.
    twin, tvc = device(dyn)
    while twin.energy_mj() == 0.0:
        tvc.sleep(0.001)
    phase_s = twin.energy_mj() / 1000 / P2P_W
    assert 0 < phase_s < period
    other, ovc = device(dyn, seed=1)  # another seed: another phase
    while other.energy_mj() == 0.0:
        ovc.sleep(0.001)
    assert other.energy_mj() / 1000 / P2P_W != pytest.approx(phase_s, abs=1e-3)

    gpu, vc = device(dyn)
    rng = random.Random(5)
    ticks = [phase_s + n * period for n in range(40)]
    reads: list[tuple[float, float, float]] = []  # (time, counter, truth)

    def read() -> None:
        reads.append((vc.now(), gpu.energy_mj(), gpu.true_energy_mj()))

    for _ in range(12):
        kind = rng.choice("FB")
        gpu.unit_begin(0, kind)
        end = vc.now() + t_of(kind, 1500)
        while vc.now() + 0.0013 < end:
            vc.sleep(0.0013)
            read()
        gpu.unit_end(0, kind)
        read()
        vc.sleep(rng.uniform(0.001, 0.02))
        read()
    assert vc.now() > 1.0
    counters = [c for _, c, _ in reads]
    assert all(b >= a for a, b in zip(counters, counters[1:]))
    times = [t for t, _, _ in reads]
    for t, counter, truth in reads:
        n = math.floor((t - phase_s) / period + 1e-12)
        if n < 0:
            assert counter == 0.0
            continue
        last = ticks[n]
        # Exactly the integral at the last tick: between the truths read around it, and constant till the next.
        i = bisect.bisect_right(times, last)
        before = reads[i - 1][2] if i else 0.0
        after = reads[i][2]
        assert before <= counter <= after
        assert counter < truth or t == last
    changes = sum(1 for a, b in zip(counters, counters[1:]) if b != a)
    assert changes == sum(1 for k in ticks if reads[0][0] < k <= reads[-1][0])
    # At a tick itself (a hair after it), the counter is the true integral.
    k = next(k for k in ticks if k > vc.now())
    vc.sleep(k + 1e-9 - vc.now())
    assert gpu.energy_mj() == pytest.approx(gpu.true_energy_mj(), abs=1e-3)
    vc.sleep(period * 0.99)
    assert gpu.energy_mj() < gpu.true_energy_mj() - 0.9 * P2P_W * period * 1000


def test_power_readings_average_the_last_window():
    gpu, vc = device(DeviceDynamics(power_average_s=1.0, source="test"))
    assert gpu.power_w() == P2P_W  # at start: nothing to average yet
    vc.sleep(0.5)
    assert gpu.power_w() == pytest.approx(P2P_W)  # averaged over the device's life so far
    vc.sleep(2.0)
    marks = []
    for _ in range(6):
        marks.append((vc.now(), gpu.true_energy_mj()))
        gpu.unit_begin(0, "F")
        gpu.unit_end(0, "F")
    t, e = vc.now(), gpu.true_energy_mj()
    # 0.6 s of forwards at 300 W and 0.4 s of P2P power in the last second.
    assert gpu.power_w() == pytest.approx(0.6 * 300.0 + 0.4 * P2P_W, rel=1e-9)
    assert gpu.power_w() == pytest.approx((e - gpu_energy_before(marks, t - 1.0)) / 1000, rel=1e-9)
    gpu.unit_begin(0, "B")
    assert gpu.power_w() < 290.0  # instantaneous would be the backward's 290 W
    gpu.unit_end(0, "B")


def gpu_energy_before(marks, t):
    """Energy at ``t`` from (time, energy) marks taken at P2P power before it."""
    when, energy = max((m for m in marks if m[0] <= t), default=marks[0])
    return energy + P2P_W * (t - when) * 1000


def test_heat_a_cold_gpu_reads_lower_and_converges_unit_times_do_not_drift():
    drift, tau = 0.03, 60.0
    gpu, vc = device(DeviceDynamics(thermal_drift=drift, thermal_tau_s=tau, source="test"))
    assert gpu.power_w() == pytest.approx(P2P_W * (1 - drift))
    vc.sleep(30.0)
    assert gpu.power_w() == pytest.approx(P2P_W * (1 - drift * math.exp(-0.5)), rel=1e-12)
    # Energy is the closed-form integral of the factor.
    assert gpu.true_energy_mj() / 1000 == pytest.approx(
        P2P_W * (30.0 - drift * tau * (1 - math.exp(-0.5))), rel=1e-12)
    assert gpu.energy_mj() == gpu.true_energy_mj()  # an exact counter: no stepping
    e0 = gpu.true_energy_mj()
    gpu.unit_begin(0, "F")
    gpu.unit_end(0, "F")
    cold_j = (gpu.true_energy_mj() - e0) / 1000
    _, b, e = gpu.last_unit_window()
    assert e - b == pytest.approx(t_of("F", 1500), rel=1e-12)
    assert cold_j < PROF.energy_j(0, "forward", 1500)
    vc.sleep(20 * tau)  # hot
    assert gpu.power_w() == pytest.approx(P2P_W, rel=1e-8)
    e0 = gpu.true_energy_mj()
    gpu.unit_begin(0, "F")
    gpu.unit_end(0, "F")
    assert (gpu.true_energy_mj() - e0) / 1000 == pytest.approx(PROF.energy_j(0, "forward", 1500), rel=1e-8)
    _, b2, e2 = gpu.last_unit_window()
    assert e2 - b2 == pytest.approx(e - b, rel=1e-12)


def test_exact_is_the_ideal_gpu():
    """EXACT (the default): a lock lands at once, a running unit keeps its clock, the counter is exact."""
    for dyn in (EXACT, None):
        vc = VirtualClock()
        kw = {} if dyn is None else {"dynamics": dyn}
        gpu = SimulatedGpu(PROF, 0, p2p_power_w=P2P_W, clock=vc.now, sleep=vc.sleep, **kw)
        assert gpu.dynamics is EXACT
        gpu.set_locked_clocks(900)
        assert gpu.current_sm_clock_mhz() == 900
        gpu.unit_begin(0, "B")
        gpu.set_locked_clocks(1500)
        assert gpu.current_sm_clock_mhz() == 1500
        vc.sleep(0.0123)
        assert gpu.energy_mj() == gpu.true_energy_mj()
        gpu.unit_end(0, "B")
        _, b, e = gpu.last_unit_window()
        assert e - b == pytest.approx(t_of("B", 900), rel=1e-12)
        assert gpu.unit_time_s("B") == t_of("B", 1500) and gpu.unit_time_s("F", 900) == t_of("F", 900)


def test_realistic_preset_runs_and_counts_below_the_truth():
    dyn = load_dynamics("realistic", configs_dir())
    gpu, vc = device(dyn, time_scale=0.5)
    assert gpu.dynamics == dyn
    last = gpu.energy_mj()
    for i in range(30):
        gpu.set_locked_clocks((1500, 900, 1200)[i % 3])
        for kind in "FB":
            gpu.unit_begin(0, kind)
            gpu.unit_end(0, kind)
            now = gpu.energy_mj()
            assert last <= now <= gpu.true_energy_mj()
            last = now


def test_bad_dynamics_are_refused_with_one_clear_line():
    with pytest.raises(GpuError, match=r"dynamics must be a DeviceDynamics .*got 'realistic'") as exc:
        SimulatedGpu(PROF, 0, dynamics="realistic")
    assert "\n" not in str(exc.value)
    for figures, match in (({"clock_latency_s": 15}, r"clock_latency_s must be a number in \[0, 1\], got 15"),
                           ({"counter_period_s": -0.1}, "counter_period_s must be a number"),
                           ({"clock_latency_s": 0.01, "nvml_call_s": 0.02}, "cannot exceed it"),
                           ({"thermal_drift": 0.03, "thermal_tau_s": 0.0}, "needs thermal_tau_s > 0")):
        with pytest.raises(DeviceDynamicsError, match=match) as exc:
            DeviceDynamics(**figures, source="test")
        assert "\n" not in str(exc.value)
    gpu, _ = device(lagged())
    with pytest.raises(GpuError, match="wait_until needs a finite time"):
        gpu.wait_until(math.nan)
    with pytest.raises(GpuError, match="1000"):
        gpu.unit_time_s("F", 1000)
