"""One case of ``bench/fast_gpus.py``: a shipped profile with its unit times scaled, profiled at start-up,
planned and trained on simulated GPUs with realistic dynamics, in virtual time.

What a run does (:class:`~megatron_envpipe.testing.pipeline_runs.SimulatedPipeline`): the start-up
sweep in 1F1B order at every stage's swept clock, exactly as the runtime feeds it; an ``optimal``
plan from the measured profile (the measured P2P power, the runtime's planner settings); then
planned iterations with the hooks' clock lead. A second pipeline of fresh GPUs runs 1F1B at the
maximum clock for as many iterations (the baseline run of the same length); both are compared
over their last iterations, at the same GPU age. The offline plan from the true profile, with the
same planner settings, is the reference for what profiling lost.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from dataclasses import dataclass

from megatron_envpipe.core.clock_transitions import predict_with_latency
from megatron_envpipe.core.device_dynamics import DeviceDynamics
from megatron_envpipe.core.gpu_specs import GpuSpec
from megatron_envpipe.core.profile import Profile
from megatron_envpipe.core.timeline import PlanEvaluator
from megatron_envpipe.gpu.profiler.sweep import ClockSweep, startup_sweep
from megatron_envpipe.planning.basis import PlannerConfig
from megatron_envpipe.planning.planner import plan_envpipe
from megatron_envpipe.testing.pipeline_runs import SimulatedPipeline, sweep_on_pipeline

__all__ = ["FastGpuCase", "run_fast_gpu_case", "row_coverage"]


@dataclass(frozen=True)
class FastGpuCase:
    """What one case measured (savings are fractions against 1F1B at the maximum clock)."""

    offline_saving: float  # the plan from the true profile, as it predicts itself
    startup_saving: float  # the plan from the start-up profile, scored on the true profile
    startup_predicted: float  # ... as it predicts itself (what the run's log would promise)
    measured_saving: float  # the run's last iterations vs the baseline run's, same age
    time_vs_plan: float  # the run's iteration time vs the start-up plan's prediction, minus 1
    profiling_iterations: int
    clocks_swept: int
    budget_iterations: int
    rows: int
    rows_outside_2se: int
    worst_z: float  # the largest |row error| / its stated standard error
    worst_row_error: float  # relative
    sweep: ClockSweep


def row_coverage(sweep: ClockSweep, truth: Profile) -> tuple[int, int, float, float]:
    """(rows, rows whose energy lies more than 2 stated standard errors from ``truth``, the largest
    error in standard errors, the largest relative error). What the profiler states: a standard error
    per row and, per stage, a heat headroom (the hot GPU may draw up to that much more)."""
    se = sweep.row_uncertainties()
    headroom = sweep.heat_headroom()
    outside, worst_z, worst_rel = 0, 0.0, 0.0
    rows = sweep.rows()
    for r in rows:
        true_j = truth.energy_j(r.stage, r.instruction, r.freq_mhz, r.chunk)
        high_j = r.energy_j * (1 + headroom[r.stage])
        err = r.energy_j - true_j if true_j < r.energy_j else max(0.0, true_j - high_j)
        z = err / se[(r.stage, r.instruction, r.freq_mhz, r.chunk)] if err > 0 else 0.0
        err = abs(r.energy_j - true_j)
        outside += z > 2
        worst_z, worst_rel = max(worst_z, z), max(worst_rel, err / true_j)
    return len(rows), outside, worst_z, worst_rel


def run_fast_gpu_case(truth: Profile, num_microbatches: int, scheduling: str, gpu: GpuSpec, p2p_power_w: float,
                      dynamics: DeviceDynamics, *, planned_iterations: int = 20, compared: int = 10) -> FastGpuCase:
    """Profile, plan and train ``truth`` (one case of the bench; module docstring)."""
    if not 1 <= compared <= planned_iterations:
        raise ValueError(f"compared ({compared}) must be in 1..planned_iterations ({planned_iterations})")
    # The runtime's planner settings on a simulated GPU (megatron/runtime.py): the default switch cost of
    # optimal plans, plans scored with the device's clock latency, raises led ahead of their boundary.
    latency = dynamics.clock_latency
    cfg = PlannerConfig(plan_type="optimal", scheduling=scheduling, reconfig="default", gpu=gpu,
                        p2p_power_w=p2p_power_w, switch_cost_j=None, clock_latency_s=latency.request_to_clock_s,
                        clock_call_s=latency.call_s, clock_lead=True)
    offline = plan_envpipe(truth, num_microbatches, cfg)
    one_f_one_b = PlanEvaluator(offline.baseline_plan.schedule, truth, p2p_power_w)
    run = SimulatedPipeline(truth, dynamics, p2p_power_w)
    f_max = max(run.devices[0].supported_clocks_mhz())
    sweep = startup_sweep(run.devices[0].supported_clocks_mhz(), gpu.profile_step_mhz, gpu.reconfig_step_mhz)
    used = sweep_on_pipeline(run, sweep, one_f_one_b)
    measured_p2p = sweep.p2p_power_w()
    got = plan_envpipe(sweep.profile(), num_microbatches,
                       dataclasses.replace(cfg, p2p_power_w=measured_p2p if measured_p2p is not None else p2p_power_w))
    freqs = got.plan.flat()
    on_truth = PlanEvaluator(got.schedule, truth, p2p_power_w, extra_dependencies=cfg.dependencies(got.schedule))
    lead = cfg.clock_lead_rule
    # Scored on the truth as the offline plan is scored (late clock changes, the switch cost charged).
    truth_j = (predict_with_latency(on_truth, freqs, lead, nvml_call_s=cfg.clock_call_s).score.energy_j
               if lead is not None else on_truth.score(freqs).energy_j)
    startup_saving = 1 - (truth_j + got.switch_energy_j) / offline.baseline_energy_j
    planned = [run.iteration(on_truth, freqs, lead) for _ in range(planned_iterations)]
    run.close()
    reference = SimulatedPipeline(truth, dynamics, p2p_power_w)
    base = [reference.iteration(one_f_one_b, [f_max] * len(one_f_one_b.graph.nodes))
            for _ in range(used + planned_iterations)]
    reference.close()
    energy = statistics.fmean(it.energy_j for it in planned[-compared:])
    base_energy = statistics.fmean(it.energy_j for it in base[-compared:])
    time_s = statistics.fmean(it.iteration_time_s for it in planned[-compared:])
    rows, outside, worst_z, worst_rel = row_coverage(sweep, truth)
    return FastGpuCase(
        offline_saving=offline.energy_saving, startup_saving=startup_saving, startup_predicted=got.energy_saving,
        measured_saving=1 - energy / base_energy if base_energy > 0 else math.nan,
        time_vs_plan=time_s / got.score.iteration_time_s - 1, profiling_iterations=used,
        clocks_swept=len(sweep.results), budget_iterations=sweep.budget_iterations(), rows=rows,
        rows_outside_2se=outside, worst_z=worst_z, worst_row_error=worst_rel, sweep=sweep)
