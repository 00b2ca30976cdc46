#!/usr/bin/env python3
"""What clock latency costs a plan, with and without the clock-lead rule (issue 21, item 2).

For the shipped A40 profiles (GPT-3 175B, BLOOM 176B), P = 4 and 8 (``Profile.for_pipeline``), plan types
``envelope`` and ``optimal`` (zero slowdown), orders ``1f1b``, ``ours`` and ``interleaved`` V = 2, M
micro-batches (default 16), P2P power from the GPU table: each plan is made once (as ``envpipe plan``
makes it, ``--switch-cost-j 0``: every clock change it keeps is in the table, none is priced away), then
for clock latency 0/5/15/30 ms:

* **measured**: one iteration on P simulated GPUs with that latency (``testing/pipeline_sim.py``: real
  ``SimulatedGpu`` devices on virtual clocks; NVML call time ``min(10 ms, latency)`` of it, as the
  realistic preset; no counter steps or heat, so energy is the devices' exact integral), the clocks
  requested as the executor's hooks request them, with the lead rule (``on``) and without (``off``);
* **predicted**: the planner's latency-aware prediction (``core/clock_transitions.py``, what
  ``PlannerConfig(clock_latency_s=...)`` reports); the bench fails if it is not the measured run
  (relative 1e-9);
* **planned**: the plan as made, without latency (what a run is promised).

Columns: time vs the deadline (the baseline's iteration time at f_max: zero slowdown), saving
measured and planned (each against its baseline run the same way: every unit at f_max, no change),
and whether the cell holds: measured time within +0.5 % of the deadline and measured saving within
1 point of the planned one. Everything runs in simulated time: results do not depend on the host.

    python3 bench/clock_latency.py [--microbatches 16] [--latencies-ms 0,5,15,30] [--quick]

``--quick``: GPT-3, P = 4, optimal, ``ours``, 0 and 15 ms (the tests run it).
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass

from megatron_envpipe.core.clock_lead import ClockLead
from megatron_envpipe.core.clock_transitions import predict_with_latency
from megatron_envpipe.core.device_dynamics import EXACT, DeviceDynamics
from megatron_envpipe.core.gpu_specs import get_gpu_spec
from megatron_envpipe.core.profile import Profile
from megatron_envpipe.core.resources import shipped_profile
from megatron_envpipe.core.timeline import PlanEvaluator
from megatron_envpipe.planning.basis import PlannerConfig, PlanResult
from megatron_envpipe.planning.planner import plan_envpipe
from megatron_envpipe.testing.pipeline_sim import run_pipeline_sim

TIME_TOLERANCE = 0.005  # measured iteration time may exceed the deadline by this fraction
SAVING_TOLERANCE = 0.01  # measured saving may differ from the planned one by this (1 point)
PREDICTION_RTOL = 1e-9
NVML_CALL_S = 0.010  # the realistic preset's call time (configs/realistic-gpu.toml)
ORDERS = (("1f1b", 1), ("ours", 1), ("interleaved", 2))


@dataclass(frozen=True)
class Cell:
    profile: str
    stages: int
    plan_type: str
    order: str
    latency_ms: float
    rule: str
    time_vs_deadline: float
    planned_saving: float
    measured_saving: float
    changes: int  # lock requests per iteration, all ranks
    led: int

    @property
    def holds(self) -> bool:
        return (self.time_vs_deadline <= TIME_TOLERANCE
                and abs(self.measured_saving - self.planned_saving) <= SAVING_TOLERANCE)


def dynamics_for(latency_s: float) -> DeviceDynamics:
    if latency_s == 0:
        return EXACT
    return DeviceDynamics(clock_latency_s=latency_s, nvml_call_s=min(NVML_CALL_S, latency_s),
                          source=f"bench/clock_latency.py: latency {1000 * latency_s:g} ms")


def flat(plan) -> list[int]:
    return [f for row in plan.freqs_mhz for f in row]


def measure(result: PlanResult, profile: Profile, latencies_s: list[float], name: str, stages: int) -> list[Cell]:
    """Every (latency, rule) cell of one plan."""
    p2p = result.config.effective_p2p_power_w
    evaluator = PlanEvaluator(result.schedule, profile, p2p, graph=result.timeline.graph)
    base_eval = PlanEvaluator(result.baseline_plan.schedule, profile, p2p, graph=result.baseline_timeline.graph)
    freqs, base_freqs = flat(result.plan), flat(result.baseline_plan)
    deadline_s = result.baseline.iteration_time_s
    planned = 1.0 - result.score.energy_j / result.baseline.energy_j
    cells = []
    for latency_s in latencies_s:
        dynamics = dynamics_for(latency_s)
        base = run_pipeline_sim(base_eval, base_freqs, dynamics, None)
        for enabled in ((True,) if latency_s == 0 else (True, False)):
            lead = ClockLead(latency_s, enabled)
            run = run_pipeline_sim(evaluator, freqs, dynamics, lead)
            pred = predict_with_latency(evaluator, freqs, lead, nvml_call_s=dynamics.nvml_call_s)
            for what, got, want in (("time", run.iteration_time_s, pred.score.iteration_time_s),
                                     ("energy", run.energy_j, pred.score.energy_j)):
                if abs(got - want) > PREDICTION_RTOL * abs(want):
                    raise SystemExit(f"{name} P={stages} {result.config.plan_type} {result.config.scheduling} "
                                     f"{1000 * latency_s:g} ms rule {enabled}: measured {what} {got!r} is not the "
                                     f"prediction {want!r}")
            cells.append(Cell(name, stages, str(result.config.plan_type), order_label(result.config),
                              1000 * latency_s, "-" if latency_s == 0 else ("on" if enabled else "off"),
                              run.iteration_time_s / deadline_s - 1.0, planned, 1.0 - run.energy_j / base.energy_j,
                              run.requests, run.led))
    return cells


def order_label(cfg: PlannerConfig) -> str:
    return f"interleaved V={cfg.virtual_stages}" if cfg.virtual_stages > 1 else str(cfg.scheduling)


def table(cells: list[Cell]) -> str:
    lines = ["| profile | P | type | order | latency | rule | time vs deadline | saving planned | saving measured "
             "| lock requests | led | holds |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for c in cells:
        lines.append(f"| {c.profile} | {c.stages} | {c.plan_type} | {c.order} | {c.latency_ms:g} ms | {c.rule} | "
                     f"{100 * c.time_vs_deadline:+.3f} % | {100 * c.planned_saving:.2f} % | "
                     f"{100 * c.measured_saving:.2f} % | {c.changes} | {c.led} | {'yes' if c.holds else 'NO'} |")
    return "\n".join(lines)


def summary(cells: list[Cell]) -> list[str]:
    out = []
    for rule in ("on", "off"):
        these = [c for c in cells if c.rule == rule]
        if not these:
            continue
        worst = max(these, key=lambda c: c.time_vs_deadline)
        lost = max(these, key=lambda c: c.planned_saving - c.measured_saving)
        out.append(f"rule {rule}: {sum(c.holds for c in these)}/{len(these)} cells hold; worst time "
                   f"{100 * worst.time_vs_deadline:+.3f} % ({worst.profile} P={worst.stages} {worst.plan_type} "
                   f"{worst.order} {worst.latency_ms:g} ms); largest saving lost "
                   f"{100 * (lost.planned_saving - lost.measured_saving):.2f} points")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--microbatches", type=int, default=16)
    ap.add_argument("--latencies-ms", default="0,5,15,30")
    ap.add_argument("--quick", action="store_true", help="GPT-3, P = 4, optimal, ours, 0 and 15 ms")
    args = ap.parse_args(argv)
    try:
        latencies_s = [float(x) / 1000 for x in args.latencies_ms.split(",")]
    except ValueError:
        ap.error(f"--latencies-ms {args.latencies_ms!r}: give milliseconds separated by commas, e.g. 0,5,15,30")
    profiles, stage_counts, types, orders = ("gpt3-175b", "bloom-176b"), (4, 8), ("envelope", "optimal"), ORDERS
    if args.quick:
        profiles, stage_counts, types, orders, latencies_s = ("gpt3-175b",), (4,), ("optimal",), (("ours", 1),), \
            [0.0, 0.015]
    gpu = get_gpu_spec("a40")
    t0 = time.perf_counter()
    cells: list[Cell] = []
    for name in profiles:
        source = Profile.from_csv(shipped_profile(f"a40/{name}"))
        for stages in stage_counts:
            profile = source.for_pipeline(stages)
            for plan_type in types:
                for order, v in orders:
                    cfg = PlannerConfig(plan_type, order, "balanced" if plan_type != "optimal" else "default",
                                        gpu=gpu, virtual_stages=v, switch_cost_j=0.0)
                    result = plan_envpipe(profile, args.microbatches, cfg)
                    cells.extend(measure(result, profile, latencies_s, name, stages))
    print(f"Clock latency vs the plan: A40 profiles, M = {args.microbatches}, one simulated iteration per cell "
          f"(measured = the latency-aware prediction within {PREDICTION_RTOL:g} everywhere)\n")
    print(table(cells))
    print()
    for line in summary(cells):
        print(line)
    print(f"\n{len(cells)} cells in {time.perf_counter() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
