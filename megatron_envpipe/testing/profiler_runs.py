"""The start-up profiler on simulated GPUs: what it costs, how close it gets, what the plan loses.

Used by ``bench/profiler_cost.py`` and ``tests/gpu/test_profiler_cost.py``. The
pipeline is driven the way the runtime drives it per profiling iteration: lock
the sweep's clock on every stage, run each stage's forwards and backwards on
its :class:`~megatron_envpipe.gpu.devices.simulated.SimulatedGpu` (device-side unit
windows, as CUDA events give on GPUs), with P2P blocking windows of 2, 4, 6, ...
ms before the backwards, attribute energy from each stage's background counter
poller by the per-iteration regression, and record. Nothing is fed exact values.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from megatron_envpipe.core.device_dynamics import EXACT, DeviceDynamics
from megatron_envpipe.core.gpu_specs import GpuSpec
from megatron_envpipe.core.length_costs import LengthCostModel, MicrobatchSize
from megatron_envpipe.core.profile import Profile, ProfilePoint, instruction_of
from megatron_envpipe.core.resources import shipped_profile
from megatron_envpipe.core.timeline import PlanEvaluator
from megatron_envpipe.core.virtual_clock import VirtualClock
from megatron_envpipe.gpu.devices.simulated import SimulatedGpu
from megatron_envpipe.gpu.energy.monitor import EnergyMonitor
from megatron_envpipe.gpu.profiler.sweep import ClockSweep, ProfileRow, UnitWindow, stage_samples, sweep_candidates
from megatron_envpipe.gpu.profiler.sweep_lengths import sized_stage_samples
from megatron_envpipe.planning.basis import PlannerConfig
from megatron_envpipe.planning.planner import plan_envpipe

__all__ = ["PlanCheck", "a40_three_stages", "low_valley_profile", "plan_check", "profile_on_simulated_gpus", "relative_errors",
           "host_lost_time_s", "restrict_profile"]

INSTRUCTIONS = ("forward", "backward")
# A stepped counter is polled at least this often per update (NVML: 100 ms / a 2-10 ms poller).
POLLS_PER_COUNTER_UPDATE = 10


def profile_on_simulated_gpus(truth: Profile, sweep: ClockSweep, *, p2p_power_w: float, time_scale: float = 0.01,
                              microbatches: int = 4, poll_interval_s: float = 0.002, timing: str = "device",
                              virtual_time: bool = False,
                              host_delays: dict[tuple[int, str, int], list[float]] | None = None,
                              host_load: list[float] | None = None,
                              host_overhead_s: float = 0.0,
                              dynamics: DeviceDynamics = EXACT,
                              counter_periods_s: list[float | None] | None = None,
                              sizes: Sequence[Sequence[MicrobatchSize] | None] | None = None,
                              length_model: LengthCostModel | None = None) -> float:
    """Run ``sweep`` to the end on one simulated GPU per stage of ``truth``; returns the seconds it took.

    What the runtime does per profiling iteration, in real time: lock the sweep's clock on every
    stage, run each stage's units (stages one after another; a stage waits 2, 4, 6, ... ms for each
    gradient: the P2P blocking windows), attribute energy from each stage's poller, record.
    ``timing="device"``: unit windows as the device ran them (the simulated GPU's counterpart of
    CUDA events); ``"host"``: the host clock read around unit_begin/unit_end.
    ``virtual_time``: the same on a :class:`VirtualClock` (returns simulated seconds): every wait
    and unit lasts exactly its modelled time and each poller reads the counter at exact poll
    ticks, so what is measured cannot depend on the host's speed or load.
    ``host_delays``: filled with ``(stage, instruction, MHz) -> [seconds, windows]``: how much longer
    the host windows were than the device's own (modelled) unit windows inside them: the host's
    overhead plus every delay the host suffered (run queue, GIL, hypervisor steal), summed.
    ``host_load``: gets ``[lost seconds, wall seconds]`` of the run, the lost time as the kernel
    reports it (:func:`host_lost_time_s`), independent of the code measured; empty where unknown.
    ``host_overhead_s``: with ``timing="host"``, the host's own time on each side of a unit, between its
    clock read and unit_begin / after unit_end (a sleep: modelled exactly in virtual time).
    ``dynamics``: the simulated GPUs' (:mod:`megatron_envpipe.core.device_dynamics`): a stepped
    counter is polled at least ten times per update (as NVML's ~100 ms counter is by a 2-10 ms
    poller), and after each lock the run waits the clock latency before the first unit, so that
    every unit runs at the swept clock. The monitors measure the counter's period themselves;
    ``counter_periods_s`` gets each stage's as measured (device seconds; 0: exact).
    ``sizes``: variable-length micro-batches: iteration k's micro-batch m has size
    ``sizes[k % len(sizes)][m]`` (an entry None: that iteration's sizes are not known); the GPUs cost
    units by ``length_model`` and every sample carries its size, as the runtime's hooks do (``iteration_sizes``).
    """
    vc = VirtualClock() if virtual_time else None
    clock, sleep = (vc.now, vc.sleep) if vc is not None else (time.monotonic, time.sleep)
    if dynamics.counter_period_s > 0:
        poll_interval_s = min(poll_interval_s, dynamics.counter_period_s * time_scale / (POLLS_PER_COUNTER_UPDATE + 0.37))
    extra = {} if dynamics.exact else {"dynamics": dynamics}  # EXACT: the device exactly as before
    if length_model is not None:
        extra["length_model"] = length_model
    gpus = [SimulatedGpu(truth, s, time_scale=time_scale, p2p_power_w=p2p_power_w, clock=clock, sleep=sleep,
                         **extra)
            for s in range(truth.num_stages)]
    if vc is None:
        monitors = [EnergyMonitor(g, poll_interval_s=poll_interval_s).start() for g in gpus]
    else:
        monitors = [EnergyMonitor(g, poll_interval_s=poll_interval_s, clock=clock) for g in gpus]
        for mon in monitors:
            mon.sample()  # the trace starts now, as start() does
            vc.every(poll_interval_s, mon.sample)
    lost0 = host_lost_time_s() if host_load is not None else None
    t0 = clock()
    try:
        while not sweep.done:
            freq = sweep.next_clock()
            for g in gpus:
                g.set_locked_clocks(freq)
            if dynamics.clock_latency_s > 0:
                sleep(dynamics.clock_latency_s * time_scale)  # lock, then wait until the SMs run at it
            per_stage = []
            mb_sizes = sizes[sweep.iterations_used % len(sizes)] if sizes else None
            for s, g in enumerate(gpus):
                units, blocking = [], []
                for m in range(microbatches):
                    for kind in "FB":
                        if kind == "B":
                            w0 = clock()
                            sleep(0.002 * (m + 1))
                            blocking.append((w0, clock()))
                        t0_s = clock()
                        if mb_sizes is not None:
                            g.set_unit_size(mb_sizes[m])
                        if timing == "host" and host_overhead_s > 0:
                            sleep(host_overhead_s)
                        g.unit_begin(s, kind)
                        g.unit_end(s, kind)
                        if timing == "host" and host_overhead_s > 0:
                            sleep(host_overhead_s)
                        units.append((kind, t0_s, clock()) if timing == "host" else g.last_unit_window())
                        if host_delays is not None:
                            _, begin_s, end_s = g.last_unit_window()
                            row = host_delays.setdefault((s, instruction_of(kind), freq), [0.0, 0])
                            row[0] += (units[-1][2] - units[-1][1]) - (end_s - begin_s)
                            row[1] += 1
                if vc is not None:
                    # Until the poller's trace covers the last window (wait_covered): the next read, or
                    # with a stepped counter the first read after its next update.
                    end_s = max(w[2] for w in units)
                    vc.sleep(poll_interval_s)
                    for _ in range(4 * POLLS_PER_COUNTER_UPDATE):
                        if (monitors[s].covered_until() or -math.inf) >= end_s:
                            break
                        vc.sleep(poll_interval_s)
                if mb_sizes is None:
                    per_stage.append(stage_samples(monitors[s], units, blocking, time_scale=time_scale))
                else:  # units ran F, B per micro-batch
                    per_stage.append(sized_stage_samples(monitors[s], [UnitWindow(*w) for w in units],
                                                         [mb_sizes[i // 2] for i in range(len(units))], blocking,
                                                         time_scale=time_scale))
            sweep.record(freq, per_stage)
        lost1 = host_lost_time_s() if lost0 is not None else None  # before the pollers' threads end
        if lost0 is not None and lost1 is not None:
            host_load[:] = [lost1 - lost0, clock() - t0]
    finally:
        if counter_periods_s is not None:
            counter_periods_s[:] = [None if m.measured_period_s is None else m.measured_period_s / time_scale
                                    for m in monitors]
        for mon in monitors:
            mon.stop()
        for g in gpus:
            g.reset_locked_clocks()
    return clock() - t0


def host_lost_time_s() -> float | None:
    """CPU time this process was denied so far, as the kernel reports it (Linux): the run-queue wait
    of its live threads (runnable, no CPU; a poller preempted while holding the GIL stalls the main
    thread too) plus the hypervisor's steal time per CPU. None where /proc does not say."""
    try:
        wait_ns = 0
        for tid in os.listdir("/proc/self/task"):
            try:
                with open(f"/proc/self/task/{tid}/schedstat") as f:
                    wait_ns += int(f.read().split()[1])
            except FileNotFoundError:  # a thread that just ended
                continue
        with open("/proc/stat") as f:
            steal_ticks = int(f.readline().split()[8])  # "cpu user nice system idle iowait irq softirq steal"
    except (OSError, ValueError, IndexError):
        return None
    return wait_ns / 1e9 + steal_ticks / os.sysconf("SC_CLK_TCK") / (os.cpu_count() or 1)


def relative_errors(truth: Profile, rows: Iterable[ProfileRow]) -> tuple[float, float]:
    """Largest relative error of the rows' time and energy against ``truth`` at the same clocks."""
    worst_t = worst_e = 0.0
    for r in rows:
        worst_t = max(worst_t, abs(r.time_s / truth.time_s(r.stage, r.instruction, r.freq_mhz) - 1))
        worst_e = max(worst_e, abs(r.energy_j / truth.energy_j(r.stage, r.instruction, r.freq_mhz) - 1))
    return worst_t, worst_e


def restrict_profile(profile: Profile, clocks_mhz: Iterable[int]) -> Profile:
    """``profile`` at ``clocks_mhz`` only (what a profiler measuring just those would give, error-free)."""
    keep = set(clocks_mhz)
    points = {(s, ins): [p for p in profile.points(s, ins) if p.freq_mhz in keep]
              for s in range(profile.num_stages) for ins in INSTRUCTIONS}
    return Profile(points, source=f"{profile.source} at {len(keep)} clocks")


def low_valley_profile(num_stages: int = 8, clocks_mhz: Iterable[int] = range(1740, 854, -15)) -> Profile:
    """A synthetic profile whose energy valley (also after subtracting 70 W of P2P power x time) is the lowest
    clock, so a sweep never stops early: time ``t0 (0.3 + 0.7 f_max / f)``, power ``50 + 200 (f / f_max)^2`` W;
    stage ``s`` does ``1 + 0.08 s`` times the first stage's work."""
    clocks = sorted(set(int(f) for f in clocks_mhz), reverse=True)
    f_max = clocks[0]
    points = {}
    for s in range(num_stages):
        for ins, t0 in (("forward", 0.1), ("backward", 0.2)):
            pts = []
            for f in clocks:
                t = t0 * (1 + 0.08 * s) * (0.3 + 0.7 * f_max / f)
                pts.append(ProfilePoint(f, t, t * (50.0 + 200.0 * (f / f_max) ** 2)))
            points[(s, ins)] = pts
    return Profile(points, source="<synthetic: valley at the lowest clock>")


def a40_three_stages() -> Profile:
    """Three distinct real A40 stages (GPT-3 first and last, Bloom last), at every 180 MHz from 1740 down
    to the profiles' 855 MHz floor (6 clocks): the start-up profiler's accuracy test."""
    gpt3 = Profile.from_csv(shipped_profile("a40/gpt3-175b"))
    bloom = Profile.from_csv(shipped_profile("a40/bloom-176b"))
    clocks = sweep_candidates(gpt3.common_frequencies(), 180)
    sources = ((gpt3, 0), (gpt3, 7), (bloom, 7))
    points = {(s, ins): [src.point(st, ins, f) for f in clocks] for s, (src, st) in enumerate(sources)
              for ins in INSTRUCTIONS}
    return Profile(points, source="<A40 3 stages>")


@dataclass(frozen=True)
class PlanCheck:
    """A plan made from a measured profile, scored on the true one, against the plan made from the truth."""

    plan_type: str
    num_microbatches: int
    true_saving: float  # the truth's own plan
    measured_saving: float  # the measured profile's plan, scored on the truth
    measured_slowdown: float  # its iteration time on the truth vs the baseline's
    clocks_measured_only: bool  # every clock the measured plan uses is a measured clock

    @property
    def gap_points(self) -> float:
        return 100 * (self.true_saving - self.measured_saving)


def plan_check(measured: Profile, truth: Profile, num_microbatches: int, plan_type: str, gpu: GpuSpec,
               p2p_power_w: float) -> PlanCheck:
    """Plan ``ours``/``balanced`` of ``plan_type`` from each profile; score both on ``truth``."""
    cfg = PlannerConfig(plan_type=plan_type, scheduling="ours", reconfig="balanced", gpu=gpu,
                        p2p_power_w=p2p_power_w)
    ideal = plan_envpipe(truth, num_microbatches, cfg)
    got = plan_envpipe(measured, num_microbatches, cfg)
    flat = got.plan.flat()
    on_truth = PlanEvaluator(got.schedule, truth, p2p_power_w,
                             extra_dependencies=cfg.dependencies(got.schedule)).score(flat)
    measured_clocks = set(measured.common_frequencies())
    base = ideal.baseline
    saving = 1 - on_truth.energy_j / base.energy_j if base.energy_j > 0 else 0.0
    return PlanCheck(plan_type, num_microbatches, ideal.energy_saving, saving,
                     on_truth.iteration_time_s / base.iteration_time_s - 1,
                     all(f in measured_clocks for f in flat) and math.isfinite(saving))
