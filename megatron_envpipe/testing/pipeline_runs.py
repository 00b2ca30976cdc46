"""Whole training runs of a pipeline on simulated GPUs, in virtual time: profile, plan, train.

What ``bench/fast_gpus.py`` and the fast-GPU tests run. A :class:`SimulatedPipeline` keeps one
:class:`~megatron_envpipe.gpu.devices.simulated.SimulatedGpu` per stage (with its device dynamics: clock
latency, stepped energy counter, heat) and its energy poller across iterations, so the GPUs age
and heat as a run's do. Each iteration runs the schedule's units in dependency order as
:func:`~megatron_envpipe.testing.pipeline_sim.run_pipeline_sim` does (clock requests as the hooks
make them; every stage idles until the pipeline's last unit ends). A profiling iteration then
attributes energy exactly as the runtime's hooks do (device unit windows, P2P waits in between,
:func:`~megatron_envpipe.gpu.profiler.attribution.stage_samples` on the stage's poller), so the start-up
profiler is fed what it would be fed in training. Nothing reads the host's clock.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from megatron_envpipe.core.clock_lead import ClockLead
from megatron_envpipe.core.device_dynamics import DeviceDynamics
from megatron_envpipe.core.profile import Profile
from megatron_envpipe.core.timeline import PlanEvaluator
from megatron_envpipe.core.virtual_clock import VirtualClock
from megatron_envpipe.gpu.devices.simulated import SimulatedGpu
from megatron_envpipe.gpu.energy.monitor import EnergyMonitor
from megatron_envpipe.gpu.hooks import MIN_BLOCKING_WINDOW_S
from megatron_envpipe.gpu.profiler.attribution import StageSamples, UnitWindow, stage_samples
from megatron_envpipe.gpu.profiler.sweep import ClockSweep
from megatron_envpipe.testing.pipeline_sim import run_units

__all__ = ["PipelineIteration", "SimulatedPipeline", "sweep_on_pipeline"]

# The runtime's energy poller (GpuHooks' default): a 100 ms counter is read 50 times per update.
RUNTIME_POLL_INTERVAL_S = 0.002


@dataclass(frozen=True)
class PipelineIteration:
    """One iteration as the simulated devices ran it (true energy: the devices' exact integral)."""

    start_s: float
    iteration_time_s: float
    energy_j: float
    stage_energy_j: tuple[float, ...]
    samples: tuple[StageSamples | None, ...] | None  # profiling iterations: what the profiler is fed


class SimulatedPipeline:
    """P simulated GPUs with device dynamics, each on its own virtual clock, run iteration after iteration."""

    def __init__(self, truth: Profile, dynamics: DeviceDynamics, p2p_power_w: float, *,
                 poll_interval_s: float | None = None, settle_s: float = 1.0) -> None:
        if poll_interval_s is None:
            poll_interval_s = RUNTIME_POLL_INTERVAL_S
        self.truth = truth
        self.num_stages = truth.num_stages
        self.clocks = [VirtualClock(-settle_s) for _ in range(self.num_stages)]
        self.devices = [SimulatedGpu(truth, s, p2p_power_w=p2p_power_w, clock=vc.now, sleep=vc.sleep,
                                     dynamics=dynamics) for s, vc in enumerate(self.clocks)]
        self.monitors = [EnergyMonitor(dev, poll_interval_s=poll_interval_s, clock=vc.now).start_on(vc)
                         for dev, vc in zip(self.devices, self.clocks)]
        f_max = max(self.devices[0].supported_clocks_mhz())
        self._requested = [f_max] * self.num_stages
        for dev, vc in zip(self.devices, self.clocks):
            dev.set_locked_clocks(f_max)
            vc.sleep(-vc.now())  # to t = 0: the first clock has landed
        self.iterations = 0

    @property
    def now_s(self) -> float:
        return max(vc.now() for vc in self.clocks)

    def _request(self, stage: int, freq_mhz: int) -> None:
        if freq_mhz != self._requested[stage]:
            self.devices[stage].set_locked_clocks(int(freq_mhz))
            self._requested[stage] = int(freq_mhz)

    def iteration(self, evaluator: PlanEvaluator, freqs: Sequence[int], lead: ClockLead | None = None, *,
                  profiling: bool = False) -> PipelineIteration:
        """Run ``freqs`` (aligned with ``evaluator.graph.nodes``) once; ``profiling``: also attribute every
        stage's unit energies as the runtime does for the start-up profiler."""
        graph = evaluator.graph
        n = len(graph.nodes)
        if len(freqs) != n:
            raise ValueError(f"need {n} unit clocks, got {len(freqs)}")
        if graph.schedule.num_stages != self.num_stages:
            raise ValueError(f"a {graph.schedule.num_stages}-stage schedule on a {self.num_stages}-stage pipeline")
        t0 = self.now_s
        for vc in self.clocks:
            vc.sleep(t0 - vc.now())  # every stage starts the iteration together
        base_mj = [dev.true_energy_mj() for dev in self.devices]
        first = {}
        for v in range(n):
            first.setdefault(graph.stage_of[v], v)
        for s, v in first.items():
            self._request(s, freqs[v])  # at iteration begin: the first unit's clock
        start, end, _ = run_units(evaluator, freqs, self.devices, self.clocks, lead, self._request, t0)
        windows: list[list[tuple[str, float, float]]] = [[] for _ in range(self.num_stages)]
        for v in range(n):
            s, unit = graph.nodes[v]
            windows[s].append((unit.kind, start[v], end[v]))
        t_end = max(end, default=t0)
        stage_energy = []
        for dev, vc, base in zip(self.devices, self.clocks, base_mj):
            vc.sleep(t_end - vc.now())  # idles until the pipeline's last unit ends
            stage_energy.append((dev.true_energy_mj() - base) / 1000.0)
        samples = None
        if profiling:
            # After the energy: waiting for the counter to cover the window idles the stage, as the runtime's does.
            samples = tuple(self._samples(s, windows[s], (t0, t_end)) for s in range(self.num_stages))
        self.iterations += 1
        return PipelineIteration(t0, t_end - t0, math.fsum(stage_energy), tuple(stage_energy), samples)

    def _samples(self, stage: int, windows: list[tuple[str, float, float]],
                 span: tuple[float, float]) -> StageSamples | None:
        blocking = [(a[2], b[1]) for a, b in zip(windows, windows[1:]) if b[1] > a[2]]
        try:
            return stage_samples(self.monitors[stage], [UnitWindow(*w) for w in windows], blocking,
                                 min_blocking_s=MIN_BLOCKING_WINDOW_S, span=span)
        except Exception:  # noqa: BLE001 - an unmeasured iteration, as the hooks report it
            return None

    def close(self) -> None:
        for mon in self.monitors:
            mon.stop()
        for dev in self.devices:
            dev.close()


def sweep_on_pipeline(pipeline: SimulatedPipeline, sweep: ClockSweep, evaluator: PlanEvaluator) -> int:
    """Run the start-up profiler ``sweep`` to its end on ``pipeline``, in ``evaluator``'s order (the
    runtime profiles in 1F1B order), every stage at the sweep's clock; returns the iterations it took."""
    n = len(evaluator.graph.nodes)
    used = 0
    while not sweep.done:
        freq = sweep.next_clock()
        it = pipeline.iteration(evaluator, [freq] * n, profiling=True)
        sweep.record(freq, list(it.samples))
        used += 1
    return used
