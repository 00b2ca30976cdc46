"""Energy windows with edges on the counter's updates (issue 23, third bullet): on the simulated GPU
with a 100 ms stepped counter in virtual time, a window measures the exact energy between two updates,
its stamps err by at most half a poll bracket, and the window length from ``window_length_s`` keeps
the power within the tolerance, where reading the stale counter at the edges does not."""

from __future__ import annotations

import pytest

from megatron_envpipe.apps.gpu_check.energy_window import (
    _MIN_WINDOW_PERIODS,
    EnergyWindowError,
    measure_window,
    poll_interval_s,
    window_length_s,
)
from megatron_envpipe.core.device_dynamics import DeviceDynamics
from megatron_envpipe.core.profile import Profile, ProfilePoint
from megatron_envpipe.core.virtual_clock import VirtualClock
from megatron_envpipe.gpu.devices.simulated import SimulatedGpu

PERIOD_S = 0.1
IDLE_W = 60.0
FWD_W = 300.0


def profile() -> Profile:
    pts = {(0, "forward"): [ProfilePoint(1500, 0.01, 0.01 * FWD_W), ProfilePoint(900, 0.02, 0.02 * 200.0)],
           (0, "backward"): [ProfilePoint(1500, 0.02, 0.02 * FWD_W), ProfilePoint(900, 0.04, 0.04 * 200.0)]}
    return Profile(pts, source="<window>")


def device(period_s: float = PERIOD_S, idle_w: float = IDLE_W, seed: int = 0) -> tuple[SimulatedGpu, VirtualClock]:
    vc = VirtualClock(start_s=10.0)
    dyn = DeviceDynamics(counter_period_s=period_s, source="test") if period_s else DeviceDynamics()
    gpu = SimulatedGpu(profile(), 0, p2p_power_w=idle_w, clock=vc.now, sleep=vc.sleep, dynamics=dyn, seed=seed)
    return gpu, vc


def forwards(gpu: SimulatedGpu, n: int):
    def body() -> None:
        for _ in range(n):
            gpu.unit_begin(0, "F")
            gpu.unit_end(0, "F")
    return body


def test_window_length_from_period_and_tolerance():
    # bracket = poll (2 ms) + two reads; 1 % => 100 brackets, but never under _MIN_WINDOW_PERIODS updates
    assert window_length_s(0.1, 0.01) == pytest.approx(max(0.002 / 0.01, _MIN_WINDOW_PERIODS * 0.1))
    assert window_length_s(0.1, 0.001, read_cost_s=0.0005) == pytest.approx((0.002 + 0.001) / 0.001)
    assert window_length_s(0.1, 0.001) < window_length_s(0.1, 0.0005)
    assert window_length_s(0.0, 0.01, read_cost_s=1e-4) == pytest.approx(2e-4 / 0.01)
    assert poll_interval_s(0.1) == pytest.approx(0.002)


@pytest.mark.parametrize("bad", [dict(counter_period_s=-1, tolerance=0.01), dict(counter_period_s=0.1, tolerance=0),
                                 dict(counter_period_s=0.1, tolerance=1.5),
                                 dict(counter_period_s=float("nan"), tolerance=0.01),
                                 dict(counter_period_s=0.1, tolerance=0.01, read_cost_s=-1)])
def test_window_length_rejects_bad_input_in_one_line(bad):
    with pytest.raises(EnergyWindowError) as err:
        window_length_s(**bad)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_window_energy_is_exact_between_updates(seed):
    gpu, vc = device(seed=seed)
    w = measure_window(gpu, forwards(gpu, 30), counter_period_s=PERIOD_S, clock=vc.now, sleep=vc.sleep)
    # body: 30 x 10 ms at 300 W = 90 J; the rest of the window is at idle power
    assert w.body_s == pytest.approx(0.3)
    assert w.energy_j == pytest.approx(90.0 + IDLE_W * (w.time_s - 0.3), abs=w.uncertainty_j)
    assert 0 <= w.edge_wait_s <= PERIOD_S + 2 * poll_interval_s(PERIOD_S)
    assert w.time_s == pytest.approx(0.3 + w.edge_wait_s)
    assert w.time_uncertainty_s <= poll_interval_s(PERIOD_S) * (1 + 1e-9)
    assert w.reads >= 2


def test_aligned_power_meets_tolerance_where_edge_reads_do_not():
    tol = 0.01
    length_s = window_length_s(PERIOD_S, tol)
    errors_aligned, errors_stale = [], []
    for seed in range(8):
        gpu, vc = device(seed=seed)

        def wait(length_s=length_s, vc=vc):
            vc.sleep(length_s)  # the GPU stays at idle power through the window and its edges
        w = measure_window(gpu, wait, counter_period_s=PERIOD_S, clock=vc.now, sleep=vc.sleep)
        errors_aligned.append(abs(w.power_w - IDLE_W) / IDLE_W)
        assert w.relative_error <= tol * 1.01
        t0, e0 = vc.now(), gpu.energy_mj()
        vc.sleep(length_s * (1 + seed / 7))
        t1, e1 = vc.now(), gpu.energy_mj()
        errors_stale.append(abs((e1 - e0) / 1000 / (t1 - t0) - IDLE_W) / IDLE_W)
    assert max(errors_aligned) <= tol
    assert max(errors_stale) > tol  # the old way: a stale counter at each edge


def test_exact_counter_reads_edges_directly():
    gpu, vc = device(period_s=0.0)
    w = measure_window(gpu, forwards(gpu, 5), counter_period_s=0.0, clock=vc.now, sleep=vc.sleep)
    assert w.energy_j == pytest.approx(5 * 0.01 * FWD_W)
    assert w.time_s == pytest.approx(0.05)
    assert w.edge_wait_s == 0.0 and w.reads == 2


def test_stalled_counter_is_one_clear_error():
    gpu, vc = device(idle_w=0.0)  # no unit, no idle power: the counter never moves
    with pytest.raises(EnergyWindowError) as err:
        measure_window(gpu, lambda: None, counter_period_s=PERIOD_S, clock=vc.now, sleep=vc.sleep)
    assert "did not change" in str(err.value) and "\n" not in str(err.value)
    assert vc.now() < 10.0 + 1.0  # gave up after a few periods


def test_bad_period_is_rejected():
    gpu, vc = device()
    with pytest.raises(EnergyWindowError, match="counter_period_s"):
        measure_window(gpu, lambda: None, counter_period_s=-0.1, clock=vc.now, sleep=vc.sleep)
