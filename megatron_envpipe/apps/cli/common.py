"""What the ``envpipe`` commands share: the user-error class, profiles, GPUs, plan files, planner configs."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from megatron_envpipe.config import EnvPipeConfig
from megatron_envpipe.core.gpu_specs import GpuSpec, get_gpu_spec
from megatron_envpipe.core.plan import FrequencyPlan
from megatron_envpipe.core.profile import Profile
from megatron_envpipe.core.resources import shipped_profile, shipped_profiles
from megatron_envpipe.core.schedule import ScheduleError
from megatron_envpipe.core.vocabulary import PlanType, ReconfigPolicy
from megatron_envpipe.errors import UsageError
from megatron_envpipe.planning.basis import PlannerConfig


class CliError(UsageError):
    """An error for the user: printed as one line, exit status 2."""


def gpu_for(args: argparse.Namespace) -> GpuSpec | None:
    """--gpu, or for a shipped profile the GPU it was measured on (``a40/...``)."""
    if args.gpu:
        return get_gpu_spec(args.gpu)
    if args.profile in shipped_profiles():
        return get_gpu_spec(args.profile.split("/")[0])
    return None


def p2p_power(args: argparse.Namespace, gpu: GpuSpec | None) -> float:
    """--p2p-power, else the GPU table's P2P blocking power (0 W without a GPU)."""
    if args.p2p_power is not None:
        return args.p2p_power
    return gpu.p2p_power_w if gpu else 0.0


def load_profile(name: str, time_scale: float = 1.0, energy_scale: float = 1.0) -> Profile:
    """A Perseus-format CSV or a shipped profile name, scaled (Perseus emulation)."""
    try:
        path = shipped_profile(name)
    except FileNotFoundError as exc:
        raise CliError(str(exc)) from None
    profile = Profile.from_csv(path)
    if time_scale != 1.0 or energy_scale != 1.0:
        profile = profile.scaled(time_scale, energy_scale)
    return profile


def plan_from_file(path: str) -> tuple[dict[str, Any], FrequencyPlan]:
    """The JSON of ``envpipe plan --out`` (or a bare plan) and the frequency plan in it."""
    try:
        data = json.loads(Path(path).read_text())
    except OSError as exc:
        raise CliError(f"{path}: cannot read plan: {exc.strerror or exc}") from None
    except json.JSONDecodeError as exc:
        raise CliError(f"{path}:{exc.lineno}: not valid JSON: {exc.msg}") from None
    try:
        body = data["plan"] if "plan" in data else data
        plan = FrequencyPlan.from_dict(
            {
                "stages": body["frequencies"] if "frequencies" in body else body["stages"],
                "schedule": body.get("scheduling", body.get("schedule", "custom")),
                "extra_warmup": body.get("extra_warmup", []),
            }
        )
    except (KeyError, TypeError, ScheduleError) as exc:
        raise CliError(f"{path}: not a plan written by 'envpipe plan --out': {exc}") from None
    return data, plan


def planner_config(
    args: argparse.Namespace, gpu: GpuSpec | None, plan_type: PlanType, reconfig: ReconfigPolicy, **more: Any
) -> PlannerConfig:
    """The one place the CLI builds a planner config: from the flags 'plan' and 'frontier' share
    (``parser.add_pipeline_args`` and ``--p2p-power``/``--p2p-latency``); ``more`` sets or replaces fields."""
    # The same mapping as training's --envpipe-* flags (EnvPipeConfig.planner_config), plus
    # the knobs only offline planning has (P2P latency, communication model). Not validated
    # here: PlannerConfig.validate() reports bad values in the planner's own words.
    flags = EnvPipeConfig(
        plan_type=plan_type,
        scheduling=args.scheduling,
        reconfig=reconfig,
        p2p_power_w=args.p2p_power,
        max_inflight=args.max_inflight,
        extra_warmup=tuple(args.extra_warmup) if args.extra_warmup else None,
    )
    return flags.planner_config(gpu, **{"p2p_latency_s": args.p2p_latency, "comm": args.comm, **more})
