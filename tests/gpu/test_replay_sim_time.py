"""The one-GPU replay (megatron_envpipe.apps.gpu_check.replay) on simulated time: what it measures cannot depend on
the host's speed. The kernels here stall the host on purpose (3 ms of real sleep per unit, three times a
unit's wall length): on a VirtualClock the replay still matches the plan to rounding; on the wall clock the
same stalls make it late and off, which is what made the bench's test fail on a busy machine."""

from __future__ import annotations

import time

import pytest

from megatron_envpipe.apps.gpu_check.replay import ReplaySetup, replay_plan
from megatron_envpipe.core.profile import Profile, ProfilePoint
from megatron_envpipe.core.schedule import Unit
from megatron_envpipe.core.virtual_clock import VirtualClock, VirtualClockError
from megatron_envpipe.gpu.devices.simulated import SimulatedGpu
from megatron_envpipe.gpu.hooks import GpuHooks
from megatron_envpipe.planning.basis import PlannerConfig
from megatron_envpipe.planning.planner import plan_envpipe

P2P_W = 70.0
STALL_S = 0.003  # real host time per unit: a loaded CPU, made certain


class StallingKernels:
    """Stage kernels that take real host time and do nothing else."""

    def __init__(self) -> None:
        self.units = 0

    def run(self, unit: Unit) -> None:
        self.units += 1
        time.sleep(STALL_S)

    def sync(self) -> None:
        pass

    def reset(self) -> None:
        pass


def _identical_stages(source: Profile, num_stages: int) -> Profile:
    """``num_stages`` copies of stage 0 (the replay runs every stage on the one device)."""
    points = {}
    for ins in ("forward", "backward"):
        row = [ProfilePoint(f, source.time_s(0, ins, f), source.energy_j(0, ins, f))
               for f in source.frequencies(0, ins)]
        for s in range(num_stages):
            points[(s, ins)] = row
    return Profile(points, source="stage 0 x4")


def _replay(profile: Profile, *, virtual: bool):
    # A forward at f_max lasts 1 ms of device time: a third of the host's stall.
    scale = 0.001 / profile.time_s(0, "forward", profile.max_frequency())
    profile = profile.scaled(scale, scale)  # the same powers, shorter units
    res = plan_envpipe(profile, 4, PlannerConfig(plan_type="envelope", scheduling="ours", p2p_power_w=P2P_W), 4)
    vc = VirtualClock()
    clock, sleep = (vc.now, vc.sleep) if virtual else (time.perf_counter, time.sleep)
    device = SimulatedGpu(profile, 0, p2p_power_w=P2P_W, clock=clock, sleep=sleep)
    assert device.timebase == (clock, sleep)
    hooks = GpuHooks(device, control=True, cuda=False, virtual_clock=vc if virtual else None)
    kernels = StallingKernels()
    setup = ReplaySetup(hooks, kernels, lambda s, f: sleep(s), 0.0, 1e-9, lambda f: P2P_W, clock, sleep)
    try:
        rep = replay_plan(setup, res.plan, res.timeline, profile, lambda f: P2P_W)
    finally:
        hooks.close()
    assert kernels.units == 4 * 2 * 4  # every stage ran its forwards and backwards for real
    return rep, res


def test_replay_on_simulated_time_ignores_host_stalls(gpt3_profile):
    profile = _identical_stages(gpt3_profile, 4)
    rep, res = _replay(profile, virtual=True)
    assert rep.predicted_j == pytest.approx(res.score.energy_j, rel=1e-12)
    # Exact up to float rounding, however long the host took: nothing but the model advances the clock.
    assert abs(rep.error) <= 1e-9, rep
    assert max(s.late_s for s in rep.stages) <= 1e-9 * rep.predicted_time_s, rep
    assert res.score.energy_j < res.baseline.energy_j  # not vacuous: the plan lowers clocks


def test_the_same_stalls_on_the_wall_clock_bias_the_replay(gpt3_profile):
    """The control: what virtual time removes. Load-proof too: the stall is a floor (sleep never returns
    early), so the wall-clock replay is late and over the prediction however fast the host is."""
    profile = _identical_stages(gpt3_profile, 4)
    rep, _ = _replay(profile, virtual=False)
    assert max(s.late_s for s in rep.stages) > 0.10 * rep.predicted_time_s, rep  # 21 % measured
    assert rep.error > 0.02, rep  # 6.5 % measured


def test_virtual_clock_advances_only_by_sleeps():
    vc = VirtualClock(5.0)
    time.sleep(0.001)
    assert vc() == vc.now() == 5.0
    vc.sleep(0.25)
    vc.sleep(0)
    vc.sleep(-1.0)  # never backwards
    assert vc.now() == 5.25 and vc.sleeps == 1
    for bad in (float("nan"), float("inf")):
        with pytest.raises(VirtualClockError, match="finite"):
            vc.sleep(bad)
        with pytest.raises(VirtualClockError, match="finite"):
            VirtualClock(bad)


def test_virtual_clock_runs_ticks_at_their_simulated_times():
    vc = VirtualClock()
    seen: list[float] = []
    vc.every(0.1, lambda: seen.append(vc.now()))
    vc.sleep(0.35)
    assert seen == pytest.approx([0.1, 0.2, 0.3]) and vc.now() == pytest.approx(0.35)
    vc.sleep(0.06)  # past the next tick: it runs at its own time, not the sleep's end
    assert seen == pytest.approx([0.1, 0.2, 0.3, 0.4]) and vc.now() == pytest.approx(0.41)
    with pytest.raises(VirtualClockError, match="period"):
        vc.every(0.0, lambda: None)
