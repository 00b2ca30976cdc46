"""Replay a plan's per-stage unit sequence on one device and measure its energy.

A one-GPU check of the energy model (``bench/gpu_stage_replay.py``): with P
identical stages, stage ``s`` of a P-stage plan can be run on one GPU in turn.
Each unit runs the stage's real forward or backward kernels, with the planned
clock requested before it through the executor's own :class:`GpuHooks` (its
clock worker, its unit hooks), and starts at its planned start time: the
stage idles until then, which is the planned receive wait (and the bubble at
the end of the iteration, up to the planned iteration time). The energy
counter over the stage's replay is what the plan charges that stage: its
units' energy plus blocking power times its idle time.

On the simulated GPU, time is scaled (``time_scale`` device seconds per
simulated second) and the idle power is the device's P2P power. Every function
takes the device's ``clock`` and ``sleep``: a simulated GPU on a
:class:`~megatron_envpipe.core.virtual_clock.VirtualClock` replays in simulated
time, so the host's speed and load cannot bias what is measured (a real GPU
replays on ``time.perf_counter``/``time.sleep``). Pure Python: the kernels come
in through :class:`StageKernels`.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from megatron_envpipe.core.plan import FrequencyPlan
from megatron_envpipe.core.profile import Profile, ProfilePoint
from megatron_envpipe.core.schedule import Unit
from megatron_envpipe.core.timeline import Timeline
from megatron_envpipe.errors import EnvPipeError
from megatron_envpipe.gpu.hooks import GpuHooks

__all__ = [
    "IdleMeasurement",
    "PlanReplay",
    "ReplayError",
    "StageKernels",
    "StageReplay",
    "measure_idle",
    "profile_stage",
    "replay_plan",
]


class ReplayError(EnvPipeError, RuntimeError):
    """The replay could not measure what it needs (e.g. an energy counter that never moves)."""


class StageKernels(Protocol):
    """The stage's compute: ``run(unit)`` issues a forward or backward (a backward needs its
    micro-batch's forward first), ``sync()`` waits for the device, ``reset()`` drops stored activations."""

    def run(self, unit: Unit) -> None: ...

    def sync(self) -> None: ...

    def reset(self) -> None: ...


@dataclass(frozen=True)
class IdleMeasurement:
    power_w: float  # the device idling (the plan's blocking power)
    counter_period_s: float  # median time between two changes of the energy counter (device seconds)
    counter_updates: int


@dataclass(frozen=True)
class StageReplay:
    stage: int
    energy_j: float  # measured over the stage's iteration (per iteration when repeated)
    wall_s: float  # device seconds from the first unit's start to the iteration's end
    late_s: float  # how far past the planned iteration time the stage finished (host overruns)
    switch_excess_s: tuple[float, ...]  # unit time minus profiled time, units right after a clock change
    steady_excess_s: tuple[float, ...]  # the same, units that kept the clock


@dataclass(frozen=True)
class PlanReplay:
    predicted_j: float
    measured_j: float
    predicted_time_s: float
    stages: tuple[StageReplay, ...]

    @property
    def error(self) -> float:
        """Measured over predicted, minus one."""
        return self.measured_j / self.predicted_j - 1.0 if self.predicted_j > 0 else math.inf

    @property
    def switch_excess_s(self) -> float:
        """Median extra unit time right after a clock change, beyond the steady units' median: the
        clock-switch latency as the kernel timing sees it."""
        after = [x for s in self.stages for x in s.switch_excess_s]
        steady = [x for s in self.stages for x in s.steady_excess_s]
        if not after:
            return 0.0
        return statistics.median(after) - (statistics.median(steady) if steady else 0.0)


def measure_idle(hooks: GpuHooks, kernels: StageKernels, duration_s: float = 1.0,
                 clock: Callable[[], float] = time.perf_counter,
                 sleep: Callable[[float], None] = time.sleep) -> IdleMeasurement:
    """Idle power and the energy counter's update period, polling the counter for ``duration_s``
    device seconds while nothing runs."""
    if not 0 < duration_s < math.inf:
        raise ReplayError(f"idle measurement: duration must be > 0 s, got {duration_s}")
    device = hooks.device
    kernels.sync()
    scale = hooks.time_scale
    t0, e0 = clock(), device.energy_mj()
    changes: list[float] = []
    last = e0
    while clock() - t0 < duration_s * scale:
        e = device.energy_mj()
        if e != last:
            changes.append(clock())
            last = e
        sleep(min(0.0005, duration_s * scale / 1000))
    t1, e1 = clock(), device.energy_mj()
    if e1 <= e0 or len(changes) < 2:
        raise ReplayError(f"{device.info().label()}: the energy counter did not move during {duration_s} s of idle "
                          "(no energy counter, or the window is shorter than its update period: raise --idle-s)")
    gaps = [b - a for a, b in zip(changes, changes[1:])]
    return IdleMeasurement(power_w=(e1 - e0) / 1000.0 / ((t1 - t0) / scale),
                           counter_period_s=statistics.median(gaps) / scale, counter_updates=len(changes))


def _window(hooks: GpuHooks, kernels: StageKernels, units: Sequence[Unit], idle_power_w: float,
            clock: Callable[[], float]) -> tuple[float, float]:
    """(device seconds, joules) of ``units`` run back to back at the locked clock."""
    device = hooks.device
    kernels.sync()
    e0, t0 = device.energy_mj(), clock()
    busy_s = 0.0
    for unit in units:
        hooks.unit_begin(unit)
        kernels.run(unit)
        hooks.unit_end(unit)
        window = device.last_unit_window()
        if window is not None:
            busy_s += window[2] - window[1]
    kernels.sync()
    e1, t1 = device.energy_mj(), clock()
    wall_s = t1 - t0
    energy_j = (e1 - e0) / 1000.0
    if busy_s > 0:
        # The device reports its units' windows (simulated GPU): the host's gaps between them,
        # at idle power, are not the units'. A real GPU's stream runs the units back to back.
        energy_j -= idle_power_w * max(0.0, wall_s - busy_s) / hooks.time_scale
        wall_s = busy_s
    return wall_s / hooks.time_scale, energy_j


def profile_stage(hooks: GpuHooks, kernels: StageKernels, clocks_mhz: Sequence[int], num_stages: int,
                  idle_power_w: float, reps: int = 3, source: str = "stage replay",
                  clock: Callable[[], float] = time.perf_counter) -> Profile:
    """Forward and backward time/energy of the stage at each clock, as a Perseus-format profile
    of ``num_stages`` identical stages. Each clock is locked through the executor's clock worker.

    As ``bench/gpu_probe.py`` does: a window of ``reps`` forwards, then one of ``reps`` forward +
    backward pairs; backward = pair - forward. One activation is alive at a time, whatever ``reps``.
    """
    if reps < 1:
        raise ReplayError(f"profile: need at least one repetition per clock, got {reps}")
    if num_stages < 1 or not clocks_mhz:
        raise ReplayError(f"profile: need >= 1 stage and >= 1 clock, got {num_stages} and {list(clocks_mhz)}")
    fwd, bwd = [], []
    forward_only = [Unit("F", 0)] * reps
    pairs = [Unit("F", 0), Unit("B", 0)] * reps
    for f in clocks_mhz:
        hooks.set_frequency(int(f))
        if hooks.controller is not None:
            hooks.controller.flush()
        kernels.reset()
        t_f, e_f = _window(hooks, kernels, forward_only, idle_power_w, clock)
        t_fb, e_fb = _window(hooks, kernels, pairs, idle_power_w, clock)
        tf, ef = t_f / reps, e_f / reps
        tb, eb = t_fb / reps - tf, e_fb / reps - ef
        if not (tf > 0 and tb > 0 and ef > 0 and eb > 0):
            raise ReplayError(f"profile at {f} MHz: non-positive time or energy (F {tf:.3g} s {ef:.3g} J, "
                              f"B {tb:.3g} s {eb:.3g} J): the counter is too coarse for the window; raise --reps")
        fwd.append(ProfilePoint(int(f), tf, ef))
        bwd.append(ProfilePoint(int(f), tb, eb))
    kernels.reset()
    points = {}
    for s in range(num_stages):
        points[(s, "forward")] = fwd
        points[(s, "backward")] = bwd
    return Profile(points, source=source)


def _sleep_until(target_s: float, clock: Callable[[], float], sleep: Callable[[float], None]) -> None:
    remaining = target_s - clock()
    if sleep is not time.sleep:
        sleep(max(0.0, remaining))  # an injected (virtual) sleep is exact: once is enough
        return
    while remaining > 0:
        time.sleep(remaining if remaining > 0.002 else 0)
        remaining = target_s - clock()


def _replay_stage(hooks: GpuHooks, kernels: StageKernels, plan: FrequencyPlan, timeline: Timeline,
                  profile: Profile, stage: int, iterations: int, clocks: Callable[[int], int],
                  clock: Callable[[], float], sleep: Callable[[float], None]) -> StageReplay:
    device, scale = hooks.device, hooks.time_scale
    graph = timeline.graph
    order = plan.schedule.orders[stage]
    freqs = [clocks(f) for f in plan.freqs_mhz[stage]]
    nodes = [graph.node(stage, u) for u in order]
    period_s = timeline.iteration_time_s
    switch, steady = [], []
    kernels.reset()
    kernels.sync()
    e0 = device.energy_mj()
    t0 = clock()
    for it in range(iterations):
        base = t0 + it * period_s * scale
        previous = None
        for unit, f, v in zip(order, freqs, nodes):
            hooks.set_frequency(f)  # before the wait: the worker switches during it, as in training
            kernels.sync()  # idle means idle: no queued kernels during the wait
            _sleep_until(base + timeline.start_s[v] * scale, clock, sleep)
            begin = clock()
            hooks.unit_begin(unit)
            kernels.run(unit)
            hooks.unit_end(unit)
            window = device.last_unit_window()
            if window is None:  # a real GPU: host time around a synchronized unit
                kernels.sync()
                took_s = (clock() - begin) / scale
            else:
                took_s = (window[2] - window[1]) / scale
            excess = took_s - profile.time_s(stage, "forward" if unit.kind == "F" else "backward", f)
            (switch if previous is not None and previous != f else steady).append(excess)
            previous = f
        kernels.sync()
        _sleep_until(base + period_s * scale, clock, sleep)
    t1 = clock()
    e1 = device.energy_mj()
    kernels.reset()
    wall_s = (t1 - t0) / scale
    return StageReplay(stage, (e1 - e0) / 1000.0 / iterations, wall_s / iterations,
                       max(0.0, wall_s - iterations * period_s) / iterations, tuple(switch), tuple(steady))


def replay_plan(hooks: GpuHooks, kernels: StageKernels, plan: FrequencyPlan, timeline: Timeline,
                predicted_j: float, profile: Profile, iterations: int = 1,
                clocks: Callable[[int], int] = int, clock: Callable[[], float] = time.perf_counter,
                sleep: Callable[[float], None] = time.sleep) -> PlanReplay:
    """Replay every stage of ``plan`` in turn (its planned clocks mapped through ``clocks``; a
    different mapping is a deliberately wrong replay) and sum the measured energy."""
    if iterations < 1:
        raise ReplayError(f"replay: need at least one iteration, got {iterations}")
    stages = tuple(_replay_stage(hooks, kernels, plan, timeline, profile, s, iterations, clocks, clock, sleep)
                   for s in range(plan.schedule.num_stages))
    return PlanReplay(predicted_j, sum(s.energy_j for s in stages), timeline.iteration_time_s, stages)
