"""Issue 24 cleanup: the straggler agreement's own window flag, the wait for a straggler said once instead of
a warning on every energy line, and "not following" energy counted like the followed plan's (clock changes)."""

from __future__ import annotations

import argparse
import logging

import pytest

from megatron_envpipe.config import EnvPipeConfig, add_envpipe_args
from megatron_envpipe.core.energy_report import EnergyReport
from megatron_envpipe.core.profile import Profile
from megatron_envpipe.core.resources import shipped_profile
from megatron_envpipe.core.timeline import PlanEvaluator
from megatron_envpipe.flag_types import EnvPipeConfigError
from megatron_envpipe.megatron.reporting import Local, _slower_than_planned
from megatron_envpipe.megatron.runtime import EnvPipeRuntime
from megatron_envpipe.megatron.stragglers import StragglerFollow, _waiting_energy_j
from megatron_envpipe.planning.basis import planning_profile
from megatron_envpipe.planning.straggler import _compute_frontier_plans
from megatron_envpipe.testing.straggler_runs import follow_run


def _parse(*argv: str) -> EnvPipeConfig:
    return EnvPipeConfig.from_args(add_envpipe_args(argparse.ArgumentParser()).parse_args(list(argv))).validate()


def test_straggler_window_is_its_own_flag_and_works_without_online_reconfiguration():
    assert _parse().straggler_window == 3
    cfg = _parse("--envpipe-type", "optimal", "--envpipe-reconfig", "default", "--envpipe-straggler-window", "5")
    assert cfg.straggler_window == 5 and cfg.reconfig_window == 3
    assert StragglerFollow(EnvPipeRuntime(cfg)).window == 5  # the agreement's window
    with pytest.raises(EnvPipeConfigError, match="--envpipe-reconfig-window 5 tunes online reconfiguration"):
        _parse("--envpipe-reconfig", "default", "--envpipe-reconfig-window", "5")
    with pytest.raises(EnvPipeConfigError, match=r"--envpipe-straggler-window 0: .*give e.g. "
                                                 r"--envpipe-straggler-window 3"):
        _parse("--envpipe-straggler-window", "0")


def _report(time_s: float) -> EnergyReport:
    return EnergyReport(9, time_s, 1000.0, (200.0, 200.0), 900.0, True, 3.6, 0.1, None, 3)


def test_the_wait_for_a_straggler_is_said_once_not_warned_every_line():
    follow, local = StragglerFollow(EnvPipeRuntime(EnvPipeConfig())), Local()
    assert _slower_than_planned(follow, _report(3.6), local) is None  # on plan: nothing
    level, line = _slower_than_planned(follow, _report(4.14), local)  # no agreement yet: a warning
    assert level == logging.WARNING and "ran slower than planned" in line
    follow.dp_wait = (1, 4.14)  # the agreement: replica 1's pace is 4.14 s
    level, line = _slower_than_planned(follow, _report(4.14), local)
    assert level == logging.INFO and "waits at the data-parallel gradient sync for replica 1 (its pace 4.140 s)" in line
    assert _slower_than_planned(follow, _report(4.14), local) is None  # once
    level, line = _slower_than_planned(follow, _report(4.5), local)  # slower than the straggler too: its own
    assert level == logging.WARNING and "ran slower than planned" in line


def test_not_following_counts_the_clock_changes_as_the_followed_plan_does():
    profile = Profile.from_csv(shipped_profile("a40/gpt3-175b")).for_pipeline(2)
    rt = EnvPipeRuntime(EnvPipeConfig(plan_type="optimal", scheduling="ours", p2p_power_w=70.0, switch_cost_j=0.7))
    rt.adopt_profile(profile, rt.profile_p2p_power_w)
    rt.prepare(2, 8)
    prof, m, pcfg = rt.planned_with
    frontier = _compute_frontier_plans(prof, m, pcfg, points=4).frontier
    point = frontier.points[0]
    score = PlanEvaluator(point.plan.schedule, planning_profile(prof, pcfg), frontier.p2p_power_w).score(
        point.plan.flat())
    assert point.switch_energy_j > 0  # the frontier counts clock changes ...
    # ... and so does "not following": the same plan, waiting for nobody, scores what the frontier says.
    target = point.time_s * 1.1
    assert _waiting_energy_j(score.energy_j, point.plan, pcfg.effective_switch_cost_j, score.iteration_time_s,
                            target, frontier.p2p_power_w, frontier.num_stages) == pytest.approx(
        point.energy_at(target, frontier.p2p_power_w, frontier.num_stages), rel=1e-9)


def test_detection_without_following_tells_the_waiting_replica_why(tmp_path):
    fast, slow = follow_run(tmp_path, factor=1.15, iterations=6, follow=False)
    assert not any(r["following"] for r in fast + slow)
    # Window 1 (iterations 0-2) launches the gather, window 2 (3-5) reads it.
    assert [r["dp_wait"] is not None for r in fast] == [False] * 5 + [True]
    replica, pace_s = fast[-1]["dp_wait"]
    assert replica == 1 and pace_s == pytest.approx(1.15 * fast[0]["own_time_s"])
    assert not any(r["dp_wait"] for r in slow)  # the straggler waits for nobody
