"""One pipeline iteration measured on P simulated GPUs with device dynamics, in simulated time.

The *measured* side that ``bench/clock_latency.py`` and the tests hold a plan's prediction against:
every stage is a real :class:`~megatron_envpipe.gpu.devices.simulated.SimulatedGpu` with the given
:class:`~megatron_envpipe.core.device_dynamics.DeviceDynamics` (clock latency, NVML call time), on
its own :class:`~megatron_envpipe.core.virtual_clock.VirtualClock`. Units run in a dependency order
of the schedule's graph: a unit begins at ``max(its stage's clock, each producer's end on the other
stage's clock + P2P latency)``. Clocks are requested as the executor's hooks request them
(gpu/hooks.py): at iteration start the first unit's clock (t = 0), at each boundary the next unit's
(before the wait for its input), and with a :class:`ClockLead` raises from inside the unit before,
``request_after_begin_s`` after its begin (the device waits there: ``SimulatedGpu.wait_until``),
skipping that boundary's request. Energy is the devices' exact integral
(``SimulatedGpu.true_energy_mj``) from t = 0 until the iteration's last unit ends, P2P blocking
power included. Nothing here reads the host's clock: results are deterministic.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from megatron_envpipe.core.clock_lead import ClockLead
from megatron_envpipe.core.device_dynamics import DeviceDynamics
from megatron_envpipe.core.graph import ready_s
from megatron_envpipe.core.timeline import PlanEvaluator
from megatron_envpipe.core.virtual_clock import VirtualClock
from megatron_envpipe.gpu.devices.simulated import SimulatedGpu

__all__ = ["MeasuredIteration", "run_pipeline_sim", "run_units"]

# Simulated seconds before t = 0 in which each device's initial clock is locked and lands.
_SETTLE_BEFORE_S = 1.0


@dataclass(frozen=True)
class MeasuredIteration:
    """One iteration as the simulated devices ran it."""

    iteration_time_s: float
    energy_j: float
    stage_energy_j: tuple[float, ...]
    start_s: tuple[float, ...]  # per unit, aligned with the graph's nodes
    end_s: tuple[float, ...]
    requests: int  # lock requests made
    led: int  # raises requested ahead of their boundary


def run_pipeline_sim(
    evaluator: PlanEvaluator,
    freqs: Sequence[int],
    dynamics: DeviceDynamics,
    lead: ClockLead | None = None,
    *,
    initial_mhz: Sequence[int] | None = None,
) -> MeasuredIteration:
    """Run ``freqs`` (aligned with ``evaluator.graph.nodes``) once on simulated GPUs with ``dynamics``.

    ``lead``: the clock-lead rule the hooks apply (its ``latency_s`` is what the rule *expects*; the
    devices' latency is ``dynamics``'); None: every change at its boundary. ``initial_mhz``: per stage,
    the clock its SMs run at when the iteration starts (default: its last planned clock)."""
    graph = evaluator.graph
    n = len(graph.nodes)
    if len(freqs) != n:
        raise ValueError(f"need {n} unit clocks, got {len(freqs)}")
    num_stages = graph.schedule.num_stages
    stage_nodes: list[list[int]] = [[] for _ in range(num_stages)]
    for v in range(n):
        stage_nodes[graph.stage_of[v]].append(v)
    if initial_mhz is None:
        initial_mhz = [freqs[nodes[-1]] for nodes in stage_nodes]
    elif len(initial_mhz) != num_stages:
        raise ValueError(f"need one initial clock per stage ({num_stages}), got {len(initial_mhz)}")

    clocks = [VirtualClock(-_SETTLE_BEFORE_S) for _ in range(num_stages)]
    devices = [SimulatedGpu(evaluator.profile, s, p2p_power_w=evaluator.p2p_power_w, clock=vc.now,
                            sleep=vc.sleep, dynamics=dynamics) for s, vc in enumerate(clocks)]
    for dev, vc, mhz in zip(devices, clocks, initial_mhz):
        dev.set_locked_clocks(int(mhz))
        vc.sleep(-vc.now())  # to t = 0: the initial clock has landed
    base_mj = [dev.true_energy_mj() for dev in devices]
    requests = led = 0
    for s, nodes in enumerate(stage_nodes):
        if nodes and freqs[nodes[0]] != initial_mhz[s]:
            devices[s].set_locked_clocks(freqs[nodes[0]])
            requests += 1

    changed = [0]

    def request(stage: int, mhz: int) -> None:
        devices[stage].set_locked_clocks(mhz)
        changed[0] += 1

    start, end, led = run_units(evaluator, freqs, devices, clocks, lead, request)
    requests += changed[0]
    t_end = max(end, default=0.0)
    stage_energy = []
    for dev, vc, base in zip(devices, clocks, base_mj):
        vc.sleep(t_end - vc.now())  # blocking at P2P power until the iteration's end
        stage_energy.append((dev.true_energy_mj() - base) / 1000.0)
    for dev in devices:
        dev.close()
    return MeasuredIteration(t_end, sum(stage_energy), tuple(stage_energy), tuple(start), tuple(end), requests, led)


def run_units(evaluator: PlanEvaluator, freqs: Sequence[int], devices: Sequence[SimulatedGpu],
              clocks: Sequence[VirtualClock], lead: ClockLead | None, request: Callable[[int, int], None],
              t0: float = 0.0) -> tuple[list[float], list[float], int]:
    """Every unit of ``evaluator``'s graph once, in dependency order, on the stages' ``devices`` (each on its
    ``clocks``), from ``t0``: a unit waits for its inputs (idling at P2P power), and each clock change is
    asked for with ``request(stage, mhz)`` as the hooks ask: at the unit boundary, or with ``lead`` from
    inside the unit before a raise. Returns each unit's start and end (device seconds) and the raises led."""
    graph = evaluator.graph
    planned_s = evaluator.durations(freqs)
    stage_nodes: list[list[int]] = [[] for _ in range(graph.schedule.num_stages)]
    for v in range(len(graph.nodes)):
        stage_nodes[graph.stage_of[v]].append(v)
    position = {v: k for nodes in stage_nodes for k, v in enumerate(nodes)}
    start = [0.0] * len(graph.nodes)
    end = [0.0] * len(graph.nodes)
    led = 0
    for v in graph.order:
        s, unit = graph.nodes[v]
        dev, vc = devices[s], clocks[s]
        cross = graph.cross_preds[v]
        ready = ready_s(cross, end) if cross else t0  # ends are >= 0: the kernel's max from 0 is the inputs' max
        vc.sleep(ready - vc.now())  # waits for the input at P2P power (no-op when it is there)
        nodes, k = stage_nodes[s], position[v]
        nxt = nodes[k + 1] if k + 1 < len(nodes) else None
        changes = nxt is not None and freqs[nxt] != freqs[v]
        offset = None
        if changes and lead is not None:
            offset = lead.request_after_begin_s(freqs[v], freqs[nxt], planned_s[v])
        dev.unit_begin(s, unit.kind)
        if offset is not None:
            dev.wait_until(dev.open_unit_begin_s() + offset)
            request(s, freqs[nxt])
            led += 1
        dev.unit_end(s, unit.kind)
        _, start[v], end[v] = dev.last_unit_window()
        if changes and offset is None:
            request(s, freqs[nxt])  # at the boundary, before the wait for the next input
    return start, end, led
