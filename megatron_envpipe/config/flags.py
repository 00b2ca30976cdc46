"""The ``--envpipe-*`` command-line flags: ``add_envpipe_args(parser)`` adds them to any argparse
parser (Megatron's included); :meth:`~megatron_envpipe.config.settings.EnvPipeConfig.from_args` reads them.
Pure Python.
"""

from __future__ import annotations

import argparse

from megatron_envpipe.config.settings import EnvPipeConfig
from megatron_envpipe.core.vocabulary import PLAN_TYPE_NAMES, RECONFIG_NAMES, SCHEDULING_NAMES
from megatron_envpipe.flag_types import fraction, int_list, max_inflight_arg, memory_model_arg, sim_straggler_arg
from megatron_envpipe.planning.deadline import DEADLINE_FROM_NAMES
from megatron_envpipe.planning.switching import DEFAULT_SWITCH_LATENCY_S

__all__ = ["add_envpipe_args"]

# argparse lists its choices with repr() in "invalid choice" errors: give it the plain names.


def add_envpipe_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the ``--envpipe-*`` flags; returns the parser (Megatron's extra_args_provider shape)."""
    d = EnvPipeConfig()
    g = parser.add_argument_group("EnvPipe", "energy-saving pipeline schedule and GPU clock plan")
    g.add_argument("--envpipe-type", dest="envpipe_plan_type", choices=PLAN_TYPE_NAMES, default=d.plan_type.value,
                   help="initial clock plan: all at f_max (baseline), each stage at its energy-valley clock "
                        "(uniform), outer envelope at f_max and the rest at the valley (envelope), or the "
                        "minimum-energy plan meeting the baseline's iteration time (optimal; needs highspy or scipy)")
    g.add_argument("--envpipe-scheduling", dest="envpipe_scheduling", choices=SCHEDULING_NAMES,
                   default=d.scheduling.value,
                   help="unit order: Megatron's 1F1B, or EnvPipe's extended warm-up (ours)")
    g.add_argument("--envpipe-reconfig", dest="envpipe_reconfig", choices=RECONFIG_NAMES, default=d.reconfig.value,
                   help="online reconfiguration from measured critical paths")
    g.add_argument("--envpipe-gpu", dest="envpipe_gpu", default=d.gpu,
                   help="auto (default: NVML on CUDA devices, else none), none, nvml, "
                        "simulated:<profile> (a GPU model on CPU driven by a profile), or a GPU table "
                        "entry of configs/gpus.toml (NVML with that table's steps and P2P power)")
    g.add_argument("--envpipe-profile", dest="envpipe_profile", default=d.profile,
                   help="Perseus-format time/energy profile CSV; default: measure at start-up")
    g.add_argument("--envpipe-max-inflight", dest="envpipe_max_inflight", type=max_inflight_arg,
                   default=d.max_inflight,
                   help="activation-memory budget for 'ours', in micro-batch activations: auto (default: from the "
                        "activation memory and free memory measured in the first 1F1B iterations on CUDA, or "
                        "--envpipe-sim-memory; no limit where neither exists), none, N for every stage, or one per "
                        "stage, e.g. 4,3,2,2")
    g.add_argument("--envpipe-sim-memory", dest="envpipe_sim_memory", type=memory_model_arg, default=None,
                   metavar="GIB_FREE,MIB_PER_MICROBATCH",
                   help="memory model for --envpipe-max-inflight auto in place of measuring the device (CPU, "
                        "simulated GPU): GiB free per stage at 1F1B's peak, MiB of activations per micro-batch")
    g.add_argument("--envpipe-extra-warmup", dest="envpipe_extra_warmup", type=int_list, default=None,
                   help="override EnvPipe's extra warm-up forwards per stage, e.g. 4,3,1,0 (clamped)")
    g.add_argument("--envpipe-p2p-power", dest="envpipe_p2p_power_w", type=float, default=d.p2p_power_w,
                   help="power of a GPU blocked in P2P, W (default: GPU table)")
    g.add_argument("--envpipe-reconfig-step", dest="envpipe_reconfig_step_mhz", type=int,
                   default=d.reconfig_step_mhz, help="MHz per reconfiguration step (default: GPU table)")
    g.add_argument("--envpipe-finish-limit", dest="envpipe_finish_limit", type=int, default=d.finish_limit,
                   help="stop reconfiguring after this many iterations without progress")
    g.add_argument("--envpipe-threshold-scale", dest="envpipe_threshold_scale", type=float,
                   default=d.threshold_scale, help="critical-path receive-wait threshold (x min last-stage wait)")
    g.add_argument("--envpipe-prefetch", dest="envpipe_prefetch", type=int, default=d.prefetch,
                   help="receives posted ahead of use per channel")
    g.add_argument("--envpipe-comm-timeout", dest="envpipe_comm_timeout_s", type=float, default=d.comm_timeout_s,
                   help="seconds before a stuck P2P transfer raises an error naming stage, instruction, peer")
    g.add_argument("--envpipe-measure-iterations", dest="envpipe_measure_iterations", type=int,
                   default=d.measure_iterations, help="iterations timed before planning when no profile is given")
    g.add_argument("--envpipe-on-no-permission", dest="envpipe_on_no_permission", choices=("fail", "monitor"),
                   default=d.on_no_permission,
                   help="without permission to lock clocks: fail at start-up (default) or only measure energy")
    g.add_argument("--envpipe-profile-step", dest="envpipe_profile_step_mhz", type=int, default=None,
                   help="start-up profiler: MHz between profiled clocks (default: GPU table, 90)")
    g.add_argument("--envpipe-profile-iterations", dest="envpipe_profile_iterations", type=int,
                   default=d.profile_iterations, help="start-up profiler: iterations per clock until two agree "
                   "(then one per clock, plus clocks near the valley); 1: one per clock, nothing more")
    g.add_argument("--envpipe-profile-cache", dest="envpipe_profile_cache", default=None,
                   help="profile cache directory, or 'off' (default ~/.cache/megatron-envpipe/profiles)")
    g.add_argument("--envpipe-sim-time", dest="envpipe_sim_time", choices=("virtual", "wall"), default=d.sim_time,
                   help="simulated GPU: virtual (default: each GPU's own clock, kept consistent by timestamps over "
                        "the pipeline; host speed takes no GPU time) or wall (scaled wall time)")
    g.add_argument("--envpipe-sim-time-scale", dest="envpipe_sim_time_scale", type=float, default=d.sim_time_scale,
                   help="simulated GPU with --envpipe-sim-time wall: wall seconds per simulated second (default 0.02)")
    g.add_argument("--envpipe-sim-jitter", dest="envpipe_sim_jitter", type=fraction, default=d.sim_jitter,
                   help="simulated GPU: unit-time noise as a fraction of the unit's time, e.g. 0.03 or 3%% "
                        "(normal, clipped at 3 sigma, seeded per stage; default 0)")
    g.add_argument("--envpipe-sim-unit-scale", dest="envpipe_sim_unit_scale", type=float, default=d.sim_unit_scale,
                   help="simulated GPU: every unit's time and energy times this, its power unchanged: a faster GPU "
                        "than the profile's, e.g. 0.25 for H100-class units from the A40 profiles (default 1)")
    g.add_argument("--envpipe-sim-dynamics", dest="envpipe_sim_dynamics", default=d.sim_dynamics,
                   help="simulated GPU: exact (default: clocks change at once, exact energy counter, no heat), "
                        "realistic (configs/realistic-gpu.toml: published A100/H100-class figures) or a TOML file "
                        "with a [dynamics] table; see docs/simulated-gpu.md")
    g.add_argument("--envpipe-sim-clock-latency-ms", dest="envpipe_sim_clock_latency_ms", type=float, default=None,
                   help="simulated GPU: ms from a clock-lock request until the SMs run at the new clock")
    g.add_argument("--envpipe-sim-counter-period-ms", dest="envpipe_sim_counter_period_ms", type=float,
                   default=None, help="simulated GPU: energy-counter update period, ms (0: exact at every read)")
    g.add_argument("--envpipe-sim-thermal-drift", dest="envpipe_sim_thermal_drift", type=fraction, default=None,
                   help="simulated GPU: a cold GPU draws this fraction less power than a hot one, e.g. 0.03")
    g.add_argument("--envpipe-clock-lead", dest="envpipe_clock_lead", choices=("on", "off"), default=d.clock_lead,
                   help="request a clock raise ahead of the unit boundary by the clock-change latency, so the "
                        "next unit starts at its clock (default on; off: every change at the boundary)")
    g.add_argument("--envpipe-timing-margin", dest="envpipe_timing_margin", type=fraction, default=None,
                   help="slack kept behind every unit planned below the maximum clock, as a fraction of its time, "
                        "so unit-time jitter does not slow the iteration (default 0.01 = 1%%; 0: none)")
    g.add_argument("--envpipe-reconfig-window", dest="envpipe_reconfig_window", type=int, default=d.reconfig_window,
                   help="online reconfiguration: iterations whose median decides each raise or lowering "
                        "(default 3; 1: EnvPipe's one-iteration rule)")
    g.add_argument("--envpipe-log-interval", dest="envpipe_log_interval", type=int, default=d.log_interval,
                   help="print the EnvPipe energy line (means over the window) every N iterations "
                        "(default: Megatron's --log-interval)")
    g.add_argument("--envpipe-baseline-iterations", dest="envpipe_baseline_iterations", type=int,
                   default=d.baseline_iterations,
                   help="1F1B iterations at the maximum clock measured before the plan, as the baseline the energy "
                        "lines compare with (those the profiler or memory measurement ran count; default 2; "
                        "0: compare with the planner's predicted baseline)")
    g.add_argument("--envpipe-energy-csv", dest="envpipe_energy_csv", default=d.energy_csv, metavar="PATH",
                   help="append one row per GPU per energy line to this CSV (J/iter, W, per stage and rank)")
    g.add_argument("--envpipe-verbose", dest="envpipe_verbose", action="store_true",
                   help="print each stage's instruction program")
    g.add_argument("--envpipe-max-slowdown", dest="envpipe_max_slowdown", type=fraction, default=d.max_slowdown,
                   help="--envpipe-type optimal: allowed iteration-time increase over 1F1B at f_max, "
                        "e.g. 0.05 or 5%%")
    g.add_argument("--envpipe-deadline-from", dest="envpipe_deadline_from", choices=DEADLINE_FROM_NAMES,
                   default=d.deadline_from,
                   help="--envpipe-type optimal: plan to 1F1B's iteration time at the maximum clock, predicted from "
                        "the profile: interleaved, faster at f_max, spends the difference on lower clocks "
                        "(docs/menu.md)")
    g.add_argument("--envpipe-target-time", dest="envpipe_target_time_s", type=float, default=None,
                   help="--envpipe-type optimal: plan for iterations lasting this many seconds anyway (e.g. a "
                        "straggler sets the pace); the GPUs block at P2P power until then")
    g.add_argument("--envpipe-switch-cost-j", dest="envpipe_switch_cost_j", type=float, default=None, help="joules a "
                   f"clock change must save to be kept (default 0: off; envpipe plan's: {DEFAULT_SWITCH_LATENCY_S * 1000:g} ms x P2P power)")
    g.add_argument("--envpipe-max-clock-changes", dest="envpipe_max_clock_changes", type=int, default=None,
                   help="at most this many clock changes per stage per iteration, where the deadline allows")
    g.add_argument("--envpipe-follow-stragglers", dest="envpipe_follow_stragglers",
                   action=argparse.BooleanOptionalAction, default=d.follow_stragglers,
                   help="with data parallelism, a pipeline faster than the slowest one runs the plan for the "
                        "slowest one's pace instead of waiting for it at the gradient sync (default on)")
    g.add_argument("--envpipe-straggler-threshold", dest="envpipe_straggler_threshold", type=fraction,
                   default=d.straggler_threshold,
                   help="follow when the slowest pipeline is more than this fraction slower (default 0.02 = 2%%; "
                        "back to the own plan within half of it)")
    g.add_argument("--envpipe-straggler-window", dest="envpipe_straggler_window", type=int,
                   default=d.straggler_window,
                   help="data-parallel pipelines agree on the slowest pace once every N iterations, over the "
                        "mean of those N (default 3)")
    g.add_argument("--envpipe-per-iteration-plans", dest="envpipe_per_iteration_plans",
                   action=argparse.BooleanOptionalAction, default=d.per_iteration_plans,
                   help="with variable sequence lengths: plan every iteration's clocks for its micro-batches' "
                        "sizes in the background, read one iteration ahead (default: on with --envpipe-type optimal)")
    g.add_argument("--envpipe-sim-straggler", dest="envpipe_sim_straggler", type=sim_straggler_arg, default=None,
                   metavar="REPLICA:FACTOR[@ITER]",
                   help="simulated GPU: the GPUs of data-parallel replica REPLICA run every unit FACTOR times longer "
                        "(1..4, power unchanged) from iteration ITER on (default 0), e.g. 1:1.15")
    return parser
