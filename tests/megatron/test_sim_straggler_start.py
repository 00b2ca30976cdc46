"""``--envpipe-sim-straggler R:F@I`` slows replica R from iteration I (0-based, the run-time's count) exactly,
and from the first iteration when no @I is given. In-process: the executor calls _apply_sim_straggler
before each iteration with ``runtime.iteration``."""

from __future__ import annotations

import argparse
from types import SimpleNamespace

import pytest

from megatron_envpipe.config import EnvPipeConfig, add_envpipe_args
from megatron_envpipe.core.profile import Profile
from megatron_envpipe.core.resources import shipped_profile
from megatron_envpipe.core.virtual_clock import VirtualClock
from megatron_envpipe.gpu.devices.simulated import SimulatedGpu
from megatron_envpipe.megatron.groups import StageGroups
from megatron_envpipe.megatron.stragglers import _apply_sim_straggler


class _Group:
    def __init__(self, rank: int, size: int) -> None:
        self._rank, self._size = rank, size

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._size


def _config(flag: str) -> EnvPipeConfig:
    args = add_envpipe_args(argparse.ArgumentParser()).parse_args(
        ["--envpipe-gpu", "simulated:a40/gpt3-175b", "--envpipe-sim-straggler", flag])
    return EnvPipeConfig.from_args(args)


def _unit_times(flag: str, replica: int, iterations: int) -> list[float]:
    """One forward per iteration on ``replica``'s stage-0 GPU, as the executor runs it: the straggler
    applied before the iteration with the run-time's 0-based iteration count."""
    config = _config(flag)
    vc = VirtualClock()
    gpu = SimulatedGpu(Profile.from_csv(shipped_profile("a40/gpt3-175b")), 0, clock=vc.now, sleep=vc.sleep,
                       p2p_power_w=70.0)
    groups = StageGroups(None, 0, 2, 1, 1, (), _Group(replica, 2))
    hooks = SimpleNamespace(device=gpu)
    times = []
    for iteration in range(iterations):
        _apply_sim_straggler(config, hooks, groups, iteration)
        t0 = vc.now()
        gpu.unit_begin(0, "F")
        gpu.unit_end(0, "F")
        times.append(vc.now() - t0)
    return times


def test_the_straggler_starts_exactly_at_its_iteration():
    times = _unit_times("1:1.2@3", replica=1, iterations=6)
    base = times[0]
    assert times[:3] == [base] * 3  # iterations 0, 1, 2: not yet
    assert times[3:] == [pytest.approx(1.2 * base, rel=1e-12)] * 3  # from iteration 3 on, every one


def test_without_a_start_the_straggler_slows_the_first_iteration():
    slow = _unit_times("1:1.2", replica=1, iterations=2)
    normal = _unit_times("1:1.2", replica=0, iterations=2)
    assert slow == [pytest.approx(1.2 * normal[0], rel=1e-12)] * 2
    assert normal[0] == normal[1]


def test_other_replicas_never_slow_down():
    times = _unit_times("1:1.2@1", replica=0, iterations=4)
    assert times == [times[0]] * 4
