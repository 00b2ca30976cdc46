"""EnvPipe's run-time settings, and the ``--envpipe-*`` command-line flags.

``add_envpipe_args(parser)`` adds the flags to any argparse parser (Megatron's
included); ``EnvPipeConfig.from_args(args)`` turns them into a validated
config, failing at start-up with one clear message on impossible
combinations; ``EnvPipeConfig.planner_config(gpu)`` is the planner's view of
it. Pure Python.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from megatron_envpipe.core.gpu_specs import GpuSpec, GpuSpecError, get_gpu_spec
from megatron_envpipe.core.resources import shipped_profiles
from megatron_envpipe.core.vocabulary import (
    PLAN_TYPES,
    RECONFIG_POLICIES,
    SCHEDULINGS,
    PlanType,
    ReconfigPolicy,
    Scheduling,
    coerce_enum,
)
from megatron_envpipe.errors import UsageError
from megatron_envpipe.planning.basis import PlannerConfig


class EnvPipeConfigError(UsageError, ValueError):
    """An impossible or inconsistent EnvPipe setting."""


@dataclass(frozen=True)
class EnvPipeConfig:
    plan_type: PlanType = PlanType.BASELINE
    scheduling: Scheduling = Scheduling.ONE_F_ONE_B
    reconfig: ReconfigPolicy = ReconfigPolicy.DEFAULT
    # "auto" (NVML when this rank drives a CUDA device, else none), "none", "nvml",
    # "simulated:<profile>" (a GPU model on CPU), or a GPU table key (NVML + that table).
    gpu: str | None = None
    profile: str | None = None  # Perseus CSV; None: measure at start-up
    max_inflight: int | None = None  # activation budget per stage for "ours"
    extra_warmup: tuple[int, ...] | None = None
    p2p_power_w: float | None = None
    reconfig_step_mhz: int | None = None
    finish_limit: int = 10
    threshold_scale: float = 4.0
    prefetch: int = 2  # receives posted ahead per channel
    comm_timeout_s: float = 300.0  # a stuck P2P raises instead of hanging
    measure_iterations: int = 1  # iterations measured before the plan is fixed (no profile, no clock control)
    on_no_permission: str = "fail"  # or "monitor": measure energy, never touch clocks
    profile_step_mhz: int | None = None  # start-up profiler clock spacing (default: GPU table)
    profile_iterations: int = 2  # profiled iterations per clock
    profile_cache: str | None = None  # cache dir ("off" disables); default ~/.cache/megatron-envpipe
    sim_time_scale: float = 0.02  # simulated GPU: wall seconds per simulated second
    log_interval: int = 1
    verbose: bool = False
    max_slowdown: float = 0.0  # --envpipe-type optimal: allowed iteration-time increase (fraction)
    target_time_s: float | None = None  # --envpipe-type optimal: plan for iterations lasting this long

    def __post_init__(self) -> None:
        # Flag strings become the vocabulary's members (equal to them); unknown names stay for validate().
        for name, enum in (("plan_type", PlanType), ("scheduling", Scheduling), ("reconfig", ReconfigPolicy)):
            object.__setattr__(self, name, coerce_enum(enum, getattr(self, name)))

    def validate(self) -> "EnvPipeConfig":
        def bad(msg: str) -> None:
            raise EnvPipeConfigError(msg)

        if self.plan_type not in PLAN_TYPES:
            bad(f"--envpipe-type {self.plan_type!r}: choose one of {', '.join(PLAN_TYPES)}")
        if self.scheduling not in SCHEDULINGS:
            bad(f"--envpipe-scheduling {self.scheduling!r}: choose one of {', '.join(SCHEDULINGS)}")
        if self.reconfig not in RECONFIG_POLICIES:
            bad(f"--envpipe-reconfig {self.reconfig!r}: choose one of {', '.join(RECONFIG_POLICIES)}")
        if self.extra_warmup is not None and self.scheduling != Scheduling.OURS:
            bad("--envpipe-extra-warmup only applies to --envpipe-scheduling ours")
        if self.max_inflight is not None and self.max_inflight < 1:
            bad(f"--envpipe-max-inflight must be >= 1, got {self.max_inflight}")
        if self.gpu is not None and self.gpu not in ("auto", "none", "nvml"):
            if self.gpu.startswith("simulated"):
                _, _, source = self.gpu.partition(":")
                if not source:
                    bad("--envpipe-gpu simulated needs a profile: simulated:<profile.csv or a40/gpt3-175b>")
                if source not in shipped_profiles() and not Path(source).is_file():
                    bad(f"--envpipe-gpu {self.gpu}: no such profile (give a Perseus-format CSV or a shipped name)")
            else:
                try:
                    get_gpu_spec(self.gpu)
                except GpuSpecError as exc:
                    bad(f"--envpipe-gpu: {exc}; or use auto, none, nvml, simulated:<profile>")
        if self.profile is not None and not Path(self.profile).is_file():
            if self.profile not in shipped_profiles():
                bad(f"--envpipe-profile {self.profile}: no such file (give a Perseus-format CSV)")
        if self.p2p_power_w is not None and self.p2p_power_w < 0:
            bad("--envpipe-p2p-power must be >= 0 W")
        if self.reconfig_step_mhz is not None and self.reconfig_step_mhz <= 0:
            bad("--envpipe-reconfig-step must be > 0 MHz")
        if self.finish_limit < 0:
            bad("--envpipe-finish-limit must be >= 0")
        if self.threshold_scale <= 0:
            bad("--envpipe-threshold-scale must be > 0")
        if self.prefetch < 1:
            bad("--envpipe-prefetch must be >= 1")
        if self.comm_timeout_s <= 0:
            bad("--envpipe-comm-timeout must be > 0 seconds")
        if self.measure_iterations < 1:
            bad("--envpipe-measure-iterations must be >= 1")
        if self.log_interval < 1:
            bad("--envpipe-log-interval must be >= 1")
        if self.on_no_permission not in ("fail", "monitor"):
            bad("--envpipe-on-no-permission must be fail or monitor")
        if self.profile_step_mhz is not None and self.profile_step_mhz <= 0:
            bad("--envpipe-profile-step must be > 0 MHz")
        if self.profile_iterations < 1:
            bad("--envpipe-profile-iterations must be >= 1")
        if not 0 < self.sim_time_scale <= 10:
            bad("--envpipe-sim-time-scale must be in (0, 10]")
        if not self.max_slowdown >= 0:
            bad("--envpipe-max-slowdown must be >= 0 (a fraction: 0.05 = 5 %)")
        if self.target_time_s is not None and not self.target_time_s > 0:
            bad("--envpipe-target-time must be > 0 seconds")
        if (self.max_slowdown or self.target_time_s is not None) and self.plan_type != PlanType.OPTIMAL:
            bad("--envpipe-max-slowdown and --envpipe-target-time need --envpipe-type optimal")
        return self

    def validate_with_megatron_args(self, args: Any) -> "EnvPipeConfig":
        """Checks that need Megatron's own flags (virtual pipelines, PP size)."""
        self.validate()
        vpp = getattr(args, "virtual_pipeline_model_parallel_size", None)
        if vpp is not None and (self.scheduling != Scheduling.ONE_F_ONE_B or self.plan_type != PlanType.BASELINE):
            raise EnvPipeConfigError(
                "EnvPipe has no interleaved (virtual-pipeline) schedule: drop "
                "--virtual-pipeline-model-parallel-size / --num-layers-per-virtual-pipeline-stage, "
                "or run --envpipe-type baseline --envpipe-scheduling 1f1b"
            )
        pp = getattr(args, "pipeline_model_parallel_size", None)
        if pp is not None and pp < 2 and self.scheduling == Scheduling.OURS:
            raise EnvPipeConfigError(
                "--envpipe-scheduling ours needs pipeline parallelism: set --pipeline-model-parallel-size >= 2"
            )
        return self

    @property
    def is_stock(self) -> bool:
        """baseline + 1f1b + default: exactly what Megatron does on its own."""
        return (
            self.plan_type == PlanType.BASELINE
            and self.scheduling == Scheduling.ONE_F_ONE_B
            and self.reconfig == ReconfigPolicy.DEFAULT
        )

    def planner_config(self, gpu: GpuSpec | None = None, **overrides: Any) -> PlannerConfig:
        """The planner's config for these flags on ``gpu`` (what the run-time plans with).

        Plan type, scheduling, reconfiguration policy, P2P power, reconfiguration
        step, activation budget, extra warm-up, maximum slowdown and target time
        carry over; everything else keeps the planner's default. ``overrides``
        replace single fields, e.g. ``p2p_power_w`` measured by the profiler when
        no ``--envpipe-p2p-power`` was given.
        """
        values: dict[str, Any] = {
            "plan_type": self.plan_type,
            "scheduling": self.scheduling,
            "reconfig": self.reconfig,
            "gpu": gpu,
            "p2p_power_w": self.p2p_power_w,
            "reconfig_step_mhz": self.reconfig_step_mhz,
            "max_inflight": self.max_inflight,
            "extra_warmup": self.extra_warmup,
            "max_slowdown": self.max_slowdown,
            "target_time_s": self.target_time_s,
        }
        values.update(overrides)
        return PlannerConfig(**values)

    @classmethod
    def from_args(cls, args: Any) -> "EnvPipeConfig":
        values = {}
        for f in fields(cls):
            key = f"envpipe_{f.name}"
            if hasattr(args, key):
                values[f.name] = getattr(args, key)
        if values.get("extra_warmup") is not None:
            values["extra_warmup"] = tuple(values["extra_warmup"])
        return cls(**values).validate()


# argparse lists its choices with repr() in "invalid choice" errors: give it the plain names.
_PLAN_TYPE_NAMES = tuple(t.value for t in PLAN_TYPES)
_SCHEDULING_NAMES = tuple(s.value for s in SCHEDULINGS)
_RECONFIG_NAMES = tuple(r.value for r in RECONFIG_POLICIES)


def int_list(text: str) -> list[int]:
    """argparse type: ``4,3,1,0`` -> ``[4, 3, 1, 0]``."""
    try:
        return [int(x) for x in text.replace(" ", "").split(",") if x]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def add_envpipe_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the ``--envpipe-*`` flags; returns the parser (Megatron's extra_args_provider shape)."""
    d = EnvPipeConfig()
    g = parser.add_argument_group("EnvPipe", "energy-saving pipeline schedule and GPU clock plan")
    g.add_argument("--envpipe-type", dest="envpipe_plan_type", choices=_PLAN_TYPE_NAMES, default=d.plan_type.value,
                   help="initial clock plan: all at f_max (baseline), each stage at its energy-valley clock "
                        "(uniform), outer envelope at f_max and the rest at the valley (envelope), or the "
                        "minimum-energy plan meeting the baseline's iteration time (optimal; needs highspy or scipy)")
    g.add_argument("--envpipe-scheduling", dest="envpipe_scheduling", choices=_SCHEDULING_NAMES,
                   default=d.scheduling.value,
                   help="unit order: Megatron's 1F1B, or EnvPipe's extended warm-up (ours)")
    g.add_argument("--envpipe-reconfig", dest="envpipe_reconfig", choices=_RECONFIG_NAMES, default=d.reconfig.value,
                   help="online reconfiguration from measured critical paths")
    g.add_argument("--envpipe-gpu", dest="envpipe_gpu", default=d.gpu,
                   help="auto (default: NVML on CUDA devices, else none), none, nvml, "
                        "simulated:<profile> (a GPU model on CPU driven by a profile), or a GPU table "
                        "entry of configs/gpus.toml (NVML with that table's steps and P2P power)")
    g.add_argument("--envpipe-profile", dest="envpipe_profile", default=d.profile,
                   help="Perseus-format time/energy profile CSV; default: measure at start-up")
    g.add_argument("--envpipe-max-inflight", dest="envpipe_max_inflight", type=int, default=d.max_inflight,
                   help="activation-memory budget per stage (micro-batch activations) for 'ours'")
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
                   default=d.profile_iterations, help="start-up profiler: iterations per clock")
    g.add_argument("--envpipe-profile-cache", dest="envpipe_profile_cache", default=None,
                   help="profile cache directory, or 'off' (default ~/.cache/megatron-envpipe/profiles)")
    g.add_argument("--envpipe-sim-time-scale", dest="envpipe_sim_time_scale", type=float, default=d.sim_time_scale,
                   help="simulated GPU: wall seconds per simulated second (default 0.02)")
    g.add_argument("--envpipe-log-interval", dest="envpipe_log_interval", type=int, default=d.log_interval,
                   help="print the EnvPipe plan/energy line every N iterations")
    g.add_argument("--envpipe-verbose", dest="envpipe_verbose", action="store_true",
                   help="print each stage's instruction program")
    g.add_argument("--envpipe-max-slowdown", dest="envpipe_max_slowdown", type=float, default=d.max_slowdown,
                   help="--envpipe-type optimal: allowed iteration-time increase over 1F1B at f_max (0.05 = 5 %%)")
    g.add_argument("--envpipe-target-time", dest="envpipe_target_time_s", type=float, default=None,
                   help="--envpipe-type optimal: plan for iterations lasting this many seconds anyway (e.g. a "
                        "straggler sets the pace); the GPUs block at P2P power until then")
    return parser
