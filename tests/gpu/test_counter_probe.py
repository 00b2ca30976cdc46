"""Polling the energy counter (gpu-check step 2) against the simulated GPU with a 100 ms stepped
counter and 1 s power averaging, on a virtual clock: the probe's trace, through the analysis,
must give back the counter's period within a few per cent, the idle (P2P) and load (unit) power,
and power readings that agree with the counter once their averaging window has passed."""

from __future__ import annotations

import pytest

from megatron_envpipe.apps.gpu_check.counter_probe import CounterProbeError, SimulatedUnitLoad, poll_counter
from megatron_envpipe.core.counter_analysis import analyze_counter
from megatron_envpipe.core.device_dynamics import DeviceDynamics
from megatron_envpipe.core.profile import Profile, ProfilePoint
from megatron_envpipe.core.virtual_clock import VirtualClock
from megatron_envpipe.gpu.devices.simulated import SimulatedGpu

IDLE_W = 65.0
LOAD_W = 280.0


def profile() -> Profile:
    pts = {(0, "forward"): [ProfilePoint(1410, 0.05, 0.05 * LOAD_W), ProfilePoint(1000, 0.07, 0.07 * 200.0)],
           (0, "backward"): [ProfilePoint(1410, 0.13, 0.13 * LOAD_W), ProfilePoint(1000, 0.18, 0.18 * 200.0)]}
    return Profile(pts, source="<probe>")


def device(period_s: float = 0.1, seed: int = 0) -> tuple[SimulatedGpu, VirtualClock]:
    vc = VirtualClock(start_s=100.0)
    dyn = DeviceDynamics(counter_period_s=period_s, power_average_s=1.0, source="test")
    return SimulatedGpu(profile(), 0, p2p_power_w=IDLE_W, clock=vc.now, sleep=vc.sleep, dynamics=dyn,
                        seed=seed), vc


@pytest.mark.parametrize("period_s, seed", [(0.1, 0), (0.1, 1), (0.05, 2)])
def test_probe_recovers_the_simulated_counter(period_s, seed):
    gpu, vc = device(period_s, seed)
    reads, powers = poll_counter(gpu, 3.0, clock=vc.now, sleep=vc.sleep)
    idle = analyze_counter(reads, powers)
    load = SimulatedUnitLoad(gpu)
    poll_counter(gpu, 1.0, feed=load.feed, clock=vc.now, sleep=vc.sleep)  # warm-up, as the step does
    reads, powers = poll_counter(gpu, 4.0, feed=load.feed, clock=vc.now, sleep=vc.sleep)
    load.stop()
    loaded = analyze_counter(reads, powers)
    for f in (idle, loaded):
        assert f.counter_period_s == pytest.approx(period_s, rel=0.02)
        assert f.missed_updates == 0
    assert idle.counter_power_w == pytest.approx(IDLE_W, rel=0.01)
    assert idle.counter_step_j == pytest.approx(IDLE_W * period_s, rel=0.02)
    # back-to-back units, each noticed within one poll of its end: a few ms at idle power per 130 ms unit
    assert loaded.counter_power_w == pytest.approx(LOAD_W, rel=0.02)
    assert loaded.power_agreement == pytest.approx(0.0, abs=0.02)
    assert load.units >= 30
    assert idle.read_cost_s == 0.0  # virtual time: a read costs nothing


def test_power_every_thins_power_readings():
    gpu, vc = device()
    reads, powers = poll_counter(gpu, 2.0, power_every_s=0.5, clock=vc.now, sleep=vc.sleep)
    assert 4 <= len(powers) <= 5
    assert len(reads) >= 1900  # one read per ms


@pytest.mark.parametrize("kw", [dict(duration_s=-1), dict(duration_s=1, poll_s=float("nan")),
                                dict(duration_s=1, power_every_s=float("inf"))])
def test_bad_arguments_are_one_line(kw):
    gpu, vc = device()
    with pytest.raises(CounterProbeError) as err:
        poll_counter(gpu, **kw, clock=vc.now, sleep=vc.sleep)
    assert "\n" not in str(err.value)
