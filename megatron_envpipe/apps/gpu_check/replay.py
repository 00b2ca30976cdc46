"""Replay a plan's per-stage unit sequence on one device and measure its energy (``envpipe gpu-check`` step 6).

With P identical stages, stage ``s`` of a P-stage plan can be run on one GPU in turn. Each
unit runs the stage's real forward or backward kernels, with the planned clock requested
before it through the executor's own :class:`GpuHooks` (its clock worker), and starts at its
planned start time. Until then the stage WAITS AS IN TRAINING: ``wait(seconds)`` is a GPU
spinning on a flag (:class:`megatron_envpipe.apps.gpu_check.spin_wait.FlagSpin`, as a GPU does waiting on
NCCL P2P) at the clock already requested for the next unit, so the energy of a wait is the
blocking power AT THAT LOCKED CLOCK times its length. The prediction charges exactly that
(:func:`_predicted_stage_energy_j`: profile energy of the units plus ``blocking_w_at(f)`` times
each wait, ``f`` the clock locked during it), with ``blocking_w_at`` from the measured blocking
power per clock (step 4, interpolated), never a power measured at another clock.

Energy comes from counter-aligned windows (:func:`megatron_envpipe.apps.gpu_check.energy_window.measure_window`):
each stage's iteration is repeated back to back until the window is ``window_s`` long (sized from
the counter's measured period), and the idle edges of the window (``edge_wait_s``, the GPU
synchronised at the last unit's clock) are taken off at ``idle_w_at`` of that clock. The
tolerance of a comparison is the measurement's own uncertainty (windows, profile), not a fixed 1 %.

Every function takes the device's ``clock`` and ``sleep``: a simulated GPU on a
:class:`~megatron_envpipe.core.virtual_clock.VirtualClock` replays in simulated time (its waits
are sleeps at the simulated GPU's clock-dependent blocking power), so host load cannot bias it.
Pure Python: the kernels come in through :class:`StageKernels`.
"""

from __future__ import annotations

import bisect
import math
import statistics
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Protocol

from megatron_envpipe.apps.gpu_check.energy_window import measure_window
from megatron_envpipe.core.plan import FrequencyPlan
from megatron_envpipe.core.profile import Profile
from megatron_envpipe.core.schedule import Unit
from megatron_envpipe.core.timeline import Timeline
from megatron_envpipe.errors import EnvPipeError
from megatron_envpipe.gpu.hooks import GpuHooks

__all__ = [
    "PlanReplay",
    "ReplayError",
    "ReplaySetup",
    "StageKernels",
    "StageReplay",
    "interpolated_power",
    "replay_plan",
]

_IDLE_EDGE_REL_UNC = 0.10  # bound on the idle power charged to a window's edges


class ReplayError(EnvPipeError, RuntimeError):
    """The replay could not measure what it needs (bad arguments, a plan the device cannot run)."""


class StageKernels(Protocol):
    """The stage's compute: ``run(unit)`` issues a forward or backward (a backward needs its
    micro-batch's forward first), ``sync()`` waits for the device, ``reset()`` drops stored activations."""

    def run(self, unit: Unit) -> None: ...

    def sync(self) -> None: ...

    def reset(self) -> None: ...


def interpolated_power(by_clock_w: Mapping[int, float]) -> Callable[[int], float]:
    """Power at any clock from measurements at some (linear between them, the nearest end's outside)."""
    points = sorted((int(f), float(w)) for f, w in by_clock_w.items())
    if not points or any(not (math.isfinite(w) and w >= 0) for _, w in points):
        raise ReplayError(f"power by clock: need at least one clock with a finite power >= 0 W, got {dict(by_clock_w)}")
    clocks = [f for f, _ in points]

    def at(freq_mhz: int) -> float:
        i = bisect.bisect_left(clocks, freq_mhz)
        if i == 0:
            return points[0][1]
        if i == len(points):
            return points[-1][1]
        (f0, w0), (f1, w1) = points[i - 1], points[i]
        return w0 + (w1 - w0) * (freq_mhz - f0) / (f1 - f0)

    return at


@dataclass(frozen=True)
class ReplaySetup:
    """How to replay on this device: its hooks and kernels, how it waits, how energy windows are sized."""

    hooks: GpuHooks                         # clock requests through the executor's clock worker
    kernels: StageKernels
    wait: Callable[[float, int], None]      # (seconds, locked MHz): spin (GPU) or sleep (simulated GPU)
    counter_period_s: float                 # the energy counter's update period (step 2), 0: exact
    window_s: float                         # shortest energy window (window_length_s of the tolerance)
    idle_w_at: Callable[[int], float]       # the GPU synchronised and idle at a clock (window edges)
    clock: Callable[[], float] = time.perf_counter
    sleep: Callable[[float], None] = time.sleep


@dataclass(frozen=True)
class StageReplay:
    stage: int
    energy_j: float            # measured, per iteration
    predicted_j: float         # per iteration, blocking power at each wait's clock
    uncertainty_j: float       # bound on the measurement error, per iteration
    wall_s: float              # device seconds per iteration
    late_s: float              # how far past the planned iteration time it finished
    iterations: int            # repeated back to back in one window
    switch_excess_s: tuple[float, ...]  # unit time minus profiled time, units right after a clock change
    steady_excess_s: tuple[float, ...]  # the same, units that kept the clock


@dataclass(frozen=True)
class PlanReplay:
    predicted_j: float
    measured_j: float
    uncertainty_j: float       # of the measurement (stages in quadrature)
    predicted_time_s: float
    stages: tuple[StageReplay, ...]

    @property
    def error(self) -> float:
        """Measured over predicted, minus one."""
        return self.measured_j / self.predicted_j - 1.0 if self.predicted_j > 0 else math.inf

    @property
    def measured_time_s(self) -> float:
        return max(s.wall_s for s in self.stages)

    @property
    def time_error(self) -> float:
        return self.measured_time_s / self.predicted_time_s - 1.0 if self.predicted_time_s > 0 else math.inf

    @property
    def rel_uncertainty(self) -> float:
        return self.uncertainty_j / self.measured_j if self.measured_j > 0 else math.inf

    @property
    def switch_excess_s(self) -> float:
        """Median extra unit time right after a clock change, beyond the steady units' median."""
        after = [x for s in self.stages for x in s.switch_excess_s]
        steady = [x for s in self.stages for x in s.steady_excess_s]
        if not after:
            return 0.0
        return statistics.median(after) - (statistics.median(steady) if steady else 0.0)


def _predicted_stage_energy_j(plan: FrequencyPlan, timeline: Timeline, profile: Profile, stage: int,
                             blocking_w_at: Callable[[int], float], clocks: Callable[[int], int] = int) -> float:
    """Stage ``stage``'s energy per iteration as the replay runs it: each unit's profile energy at its
    clock, and every wait (before each unit, and the bubble to the iteration's end) at the blocking
    power of the clock locked during it (the next unit's; the last unit's for the final bubble)."""
    graph = timeline.graph
    freqs = [clocks(f) for f in plan.freqs_mhz[stage]]
    energy_j, free_at = 0.0, 0.0
    for unit, f in zip(plan.schedule.orders[stage], freqs):
        v = graph.node(stage, unit)
        energy_j += blocking_w_at(f) * max(0.0, timeline.start_s[v] - free_at)
        energy_j += profile.energy_j(stage, "forward" if unit.kind == "F" else "backward", f)
        free_at = timeline.end_s[v]
    last = freqs[-1] if freqs else profile.max_frequency()
    return energy_j + blocking_w_at(last) * max(0.0, timeline.iteration_time_s - free_at)


def _wait_until(target_s: float, freq_mhz: int, setup: ReplaySetup) -> None:
    remaining = target_s - setup.clock()
    if remaining > 0:
        setup.wait(remaining, freq_mhz)


def _stage_iteration(setup: ReplaySetup, order: tuple[Unit, ...], freqs: list[int], starts: list[float],
                     period_s: float, stage: int, profile: Profile, switch: list[float],
                     steady: list[float]) -> None:
    hooks, kernels, device = setup.hooks, setup.kernels, setup.hooks.device
    base = setup.clock()
    previous = None
    for unit, f, start in zip(order, freqs, starts):
        hooks.set_frequency(f)  # before the wait: the worker switches during it, as in training
        kernels.sync()  # the wait spins alone: no kernels of the last unit still queued
        _wait_until(base + start, f, setup)
        begin = setup.clock()
        hooks.unit_begin(unit)
        kernels.run(unit)
        hooks.unit_end(unit)
        window = device.last_unit_window()
        if window is None:  # a real GPU: host time around a synchronized unit
            kernels.sync()
            took_s = setup.clock() - begin
        else:
            took_s = window[2] - window[1]
        excess = took_s - profile.time_s(stage, "forward" if unit.kind == "F" else "backward", f)
        (switch if previous is not None and previous != f else steady).append(excess)
        previous = f
    kernels.sync()
    _wait_until(base + period_s, freqs[-1], setup)


def _replay_stage(setup: ReplaySetup, plan: FrequencyPlan, timeline: Timeline, profile: Profile, stage: int,
                  blocking_w_at: Callable[[int], float], clocks: Callable[[int], int]) -> StageReplay:
    graph = timeline.graph
    order = plan.schedule.orders[stage]
    freqs = [clocks(f) for f in plan.freqs_mhz[stage]]
    starts = [timeline.start_s[graph.node(stage, u)] for u in order]
    period_s = timeline.iteration_time_s
    if not period_s > 0:
        raise ReplayError(f"replay of stage {stage}: the plan's iteration time is {period_s} s")
    iterations = max(1, math.ceil(setup.window_s / period_s))
    switch: list[float] = []
    steady: list[float] = []
    kernels = setup.kernels
    kernels.reset()
    setup.hooks.set_frequency(freqs[0])  # the window's first edge waits at the first wait's clock

    def body() -> None:
        for _ in range(iterations):
            _stage_iteration(setup, order, freqs, starts, period_s, stage, profile, switch, steady)

    w = measure_window(setup.hooks.device, body, counter_period_s=setup.counter_period_s, clock=setup.clock,
                       sleep=setup.sleep)
    kernels.reset()
    edge_j = setup.idle_w_at(freqs[-1]) * w.edge_wait_s  # the window's edges: synchronised, idle
    wall_s = w.body_s / iterations
    return StageReplay(stage, (w.energy_j - edge_j) / iterations,
                       _predicted_stage_energy_j(plan, timeline, profile, stage, blocking_w_at),  # as planned
                       (w.uncertainty_j + _IDLE_EDGE_REL_UNC * edge_j) / iterations, wall_s,
                       max(0.0, wall_s - period_s), iterations, tuple(switch), tuple(steady))


def replay_plan(setup: ReplaySetup, plan: FrequencyPlan, timeline: Timeline, profile: Profile,
                blocking_w_at: Callable[[int], float], clocks: Callable[[int], int] = int) -> PlanReplay:
    """Replay every stage of ``plan`` in turn (its planned clocks mapped through ``clocks``; another
    mapping is a deliberately wrong replay, which the comparison must report) and sum the energy."""
    if not (math.isfinite(setup.window_s) and setup.window_s > 0):
        raise ReplayError(f"replay: window length must be a finite number of seconds > 0, got {setup.window_s}")
    stages = tuple(_replay_stage(setup, plan, timeline, profile, s, blocking_w_at, clocks)
                   for s in range(plan.schedule.num_stages))
    return PlanReplay(sum(s.predicted_j for s in stages), sum(s.energy_j for s in stages),
                      math.sqrt(sum(s.uncertainty_j ** 2 for s in stages)), timeline.iteration_time_s, stages)
