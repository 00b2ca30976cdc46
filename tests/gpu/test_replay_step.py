"""gpu-check step 6's replay (megatron_envpipe.apps.gpu_check.replay, replay_step._replay_plans) on the simulated GPU on
virtual time, with a blocking power that depends on the locked clock (as a GPU spinning on a flag does) and a
stepped (100 ms) energy counter. The replay must match the prediction that charges each wait at its own clock,
within the tolerance the measurement implies; a replay at the wrong clocks must come out as a mismatch."""

from __future__ import annotations

import time

import pytest

from megatron_envpipe.apps.gpu_check.replay import (
    ReplayError,
    ReplaySetup,
    _predicted_stage_energy_j,
    interpolated_power,
    replay_plan,
)
from megatron_envpipe.apps.gpu_check.stage_profile import identical_stages
from megatron_envpipe.core.device_dynamics import DeviceDynamics
from megatron_envpipe.core.schedule import Unit
from megatron_envpipe.core.virtual_clock import VirtualClock
from megatron_envpipe.gpu.devices.simulated import SimulatedGpu
from megatron_envpipe.gpu.hooks import GpuHooks
from megatron_envpipe.planning.basis import PlannerConfig
from megatron_envpipe.planning.planner import plan_envpipe

PERIOD_S = 0.1
F_MAX = 1740


def blocking_w(f: int) -> float:
    """Steep on purpose: 40 W at 0 MHz, 110 W at 1740 MHz."""
    return 40.0 + 70.0 * f / F_MAX


class NoKernels:
    def run(self, unit: Unit) -> None:
        pass

    def sync(self) -> None:
        pass

    def reset(self) -> None:
        pass


@pytest.fixture
def pipeline(gpt3_profile):
    return identical_stages(gpt3_profile.restricted((1740, 1560, 1410, 1260, 1110)), 4)


def _setup(profile, blocking=blocking_w):
    vc = VirtualClock()
    device = SimulatedGpu(profile, 0, clock=vc.now, sleep=vc.sleep, blocking_power_w_at=blocking,
                          dynamics=DeviceDynamics(counter_period_s=PERIOD_S, source="test: stepped counter"))
    hooks = GpuHooks(device, control=True, cuda=False, virtual_clock=vc)
    return ReplaySetup(hooks, NoKernels(), lambda s, f: vc.sleep(s), PERIOD_S, 0.4, blocking, vc.now, vc.sleep)


def _plan(profile, plan_type="optimal", scheduling="ours"):
    cfg = PlannerConfig(plan_type=plan_type, scheduling=scheduling, p2p_power_w=blocking_w(F_MAX))
    return plan_envpipe(profile, 8, cfg, 4)


def test_prediction_with_constant_blocking_power_is_the_planners(pipeline):
    res = _plan(pipeline)
    constant = lambda f: blocking_w(F_MAX)  # noqa: E731
    ours = sum(_predicted_stage_energy_j(res.plan, res.timeline, pipeline, s, constant) for s in range(4))
    assert ours == pytest.approx(res.score.energy_j, rel=1e-12)
    by_clock = sum(_predicted_stage_energy_j(res.plan, res.timeline, pipeline, s, blocking_w) for s in range(4))
    assert by_clock < ours - 1.0  # the plan waits at lowered clocks: less blocking energy there


def test_replay_matches_the_by_clock_prediction_and_not_the_constant_one(pipeline):
    res = _plan(pipeline)
    setup = _setup(pipeline)
    try:
        rep = replay_plan(setup, res.plan, res.timeline, pipeline, blocking_w)
        assert setup.hooks.clock_control_lost is None
    finally:
        setup.hooks.close()
    assert 0 < rep.rel_uncertainty < 0.01
    assert abs(rep.error) <= rep.rel_uncertainty, rep  # within what the counter allows
    assert rep.measured_time_s == pytest.approx(rep.predicted_time_s, rel=1e-9)
    # Blocking power taken at f_max for every wait (the old bias): off by more than the measurement's bound.
    planner_error = rep.measured_j / res.score.energy_j - 1
    assert abs(planner_error) > 3 * rep.rel_uncertainty, (planner_error, rep.rel_uncertainty)


def test_a_replay_at_the_wrong_clocks_is_a_mismatch(pipeline):
    res = _plan(pipeline)
    setup = _setup(pipeline)
    try:
        rep = replay_plan(setup, res.plan, res.timeline, pipeline, blocking_w, clocks=lambda f: F_MAX)
    finally:
        setup.hooks.close()
    assert rep.error > 0.05 and rep.error > 10 * rep.rel_uncertainty, rep


def test_replay_plans_reports_plans_and_a_control_that_mismatches(pipeline, tmp_path):
    pytest.importorskip("torch")  # the step module imports the Megatron stage (torch)
    from megatron_envpipe.apps.gpu_check.replay_step import _PLANS, _replay_plans
    from megatron_envpipe.apps.gpu_check.step_api import StepContext

    ctx = StepContext(out_dir=tmp_path, device="cpu", device_index=0, limit_s=90.0,
                      started_monotonic=time.monotonic())
    profile = pipeline  # stage 0 of it is what profile.csv holds
    setup = _setup(profile)
    try:
        summaries, rows, stopped = _replay_plans(ctx, profile, setup, blocking_w, 0.0)
    finally:
        setup.hooks.close()
    assert stopped is None
    by = {(s["plan"], s["replay_clocks"]): s for s in summaries}
    assert set(by) == {(p, "planned") for p in _PLANS} | {("optimal:ours", "max")}
    for plan in _PLANS:
        s = by[(plan, "planned")]
        assert s["ok"] and abs(s["error"]) <= s["tolerance"] < 0.01, s
        assert s["measured_saving"] == pytest.approx(s["predicted_saving"], abs=0.01)
    assert by[("optimal:ours", "planned")]["predicted_saving"] > 0.05  # not vacuous: clocks were lowered
    control = by[("optimal:ours", "max")]
    assert not control["ok"] and control["error"] > 0.05
    assert len(rows) == 5 * (4 + 1)  # per plan: 4 stages and a total


def test_interpolated_power():
    at = interpolated_power({1000: 50.0, 1500: 60.0, "2000": 80.0})
    assert at(1000) == 50.0 and at(1250) == pytest.approx(55.0) and at(1750) == pytest.approx(70.0)
    assert at(500) == 50.0 and at(2500) == 80.0  # the nearest end outside
    for bad in ({}, {1000: float("nan")}, {1000: -1.0}):
        with pytest.raises(ReplayError, match="power by clock"):
            interpolated_power(bad)


@pytest.mark.parametrize("latency_s", [0.0, 0.02])
def test_simulated_wait_costs_the_blocking_power_of_its_clock(gpt3_profile, latency_s):
    vc = VirtualClock()
    dyn = DeviceDynamics(clock_latency_s=latency_s, counter_period_s=PERIOD_S, source="test")
    device = SimulatedGpu(gpt3_profile, 0, clock=vc.now, sleep=vc.sleep, dynamics=dyn, blocking_power_w_at=blocking_w)
    for f in (1740, 1110):
        device.set_locked_clocks(f)
        vc.sleep(0.5)  # the change lands
        e0 = device.true_energy_mj()
        vc.sleep(2.0)
        assert (device.true_energy_mj() - e0) / 1000 == pytest.approx(2.0 * blocking_w(f), rel=1e-9)
        assert device.power_w() == pytest.approx(blocking_w(f), rel=1e-9)
    # The stepped counter reads the past through the same clock-dependent power: 10 s at two clocks.
    device.set_locked_clocks(1740)
    vc.sleep(5.0)
    device.set_locked_clocks(1110)
    vc.sleep(5.0)
    stale_j = (device.true_energy_mj() - device.energy_mj()) / 1000  # since the counter's last update
    assert 0 <= stale_j <= PERIOD_S * blocking_w(1110) + 1e-9
