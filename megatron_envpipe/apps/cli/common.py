"""What the ``envpipe`` commands share: the user-error class, profiles, GPUs, plan files, planner configs."""

from __future__ import annotations

import argparse
import math
import sys
from typing import Any

from megatron_envpipe.config import EnvPipeConfig
from megatron_envpipe.config.flag_table import BY_NAME, CLI_NAMES, Facts, inert_problem, refuse_inert
from megatron_envpipe.core.file_numbers import loads_json
from megatron_envpipe.core.gpu_specs import GpuSpec, GpuSpecError, get_gpu_spec
from megatron_envpipe.core.plan import FrequencyPlan
from megatron_envpipe.core.profile import Profile
from megatron_envpipe.core.resources import shipped_profile, shipped_profiles
from megatron_envpipe.core.schedule import (
    ClampedWarmup,
    ScheduleError,
    check_extra_warmup,
)
from megatron_envpipe.core.textfile import read_text
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
    """--p2p-power, else the GPU table's P2P blocking power (0 W without a GPU; an error where unknown)."""
    if args.p2p_power is not None:
        return args.p2p_power
    return gpu.known_p2p_power_w() if gpu else 0.0


def load_profile(name: str, time_scale: float = 1.0, energy_scale: float = 1.0) -> Profile:
    """A Perseus-format CSV or a shipped profile name, scaled (Perseus emulation)."""
    try:
        path = shipped_profile(name)
    except FileNotFoundError as exc:
        raise CliError(str(exc)) from None
    profile = Profile.from_csv(path)
    if time_scale != 1.0 or energy_scale != 1.0:
        profile = profile.scaled(time_scale, energy_scale, names=("--time-scale", "--energy-scale"))
    return profile


def check_stages(args: argparse.Namespace, profile: Profile) -> int:
    """The pipeline's stage count: the profile's, which ``--stages`` (when given) must match."""
    if getattr(args, "stages", None) is not None and args.stages != profile.num_stages:
        raise CliError(f"--stages {args.stages} does not match the profile's {profile.num_stages} stages "
                       f"({profile.source}): drop --stages or give {profile.num_stages}")
    return profile.num_stages


def check_extra_warmup_flag(args: argparse.Namespace, num_stages: int, scheduling: str | None = None) -> None:
    """--extra-warmup only with --scheduling ours (1F1B would ignore it), one value >= 0 per stage."""
    if args.extra_warmup is None:
        return
    text = ",".join(str(v) for v in args.extra_warmup)
    facts = Facts(scheduling=scheduling or args.scheduling, offline=True)
    problem = inert_problem(BY_NAME["extra_warmup"], args.extra_warmup, facts, CLI_NAMES, "--extra-warmup")
    if problem:
        raise CliError(problem)
    try:
        check_extra_warmup(num_stages, args.extra_warmup)
    except ScheduleError as exc:
        raise CliError(f"--extra-warmup {text}: {exc}") from None


def given_flags(args: argparse.Namespace) -> frozenset[str]:
    """The flags of ``parser.Given`` the user wrote on the command line (not left at their defaults)."""
    return getattr(args, "given_flags", None) or frozenset()


def note(args: argparse.Namespace, text: str) -> None:
    """One line on stderr, ``envpipe <command>: note: ...``: the command runs, but not quite as asked."""
    print(f"envpipe {args.command}: note: {text}", file=sys.stderr)


def _warmup_clamp_text(num_stages: int, num_microbatches: int, clamp: ClampedWarmup) -> str | None:
    """Why ``clamp_extra_warmup`` lowered ``--extra-warmup`` (None where it did not), stage by stage, on one
    line: the reasons the clamp itself gives (core.schedule.clamp_extra_warmup_explained), stages with
    one reason grouped."""
    if not clamp.lowered:
        return None
    reasons: list[tuple[str, list[str]]] = []  # (why, ["stage s r->c", ...])
    for s, why in enumerate(clamp.reasons):
        if why is None:
            continue
        cell = f"stage {s} {clamp.raw[s]}->{clamp.clamped[s]}"
        if reasons and reasons[-1][0] == why:
            reasons[-1][1].append(cell)
        else:
            reasons.append((why, [cell]))
    return (f"--extra-warmup {','.join(map(str, clamp.raw))} runs as {','.join(map(str, clamp.clamped))} "
            f"({num_microbatches} micro-batches, {num_stages} stages): "
            + "; ".join(f"{', '.join(cells)}: {why}" for why, cells in reasons))


def note_warmup_clamp(args: argparse.Namespace, num_stages: int, num_microbatches: int,
                      clamp: ClampedWarmup | None) -> None:
    """Say on stderr when --extra-warmup is clamped (the plan, simulation or schedule runs the clamped r).
    ``clamp``: the clamp the command (or its planner: PlanResult.warmup_clamp) ran; None where none was
    given or the scheduling takes none."""
    if args.extra_warmup is None or clamp is None:
        return
    text = _warmup_clamp_text(num_stages, num_microbatches, clamp)
    if text is not None:
        note(args, text)


# The envpipe command's twins whose "when it acts" is checked here (the others: by the command itself):
# field -> (the twin's flag in the table, attribute of the parsed arguments: argparse's dest of it).
_TWINS = {name: (BY_NAME[name].cli_flag, BY_NAME[name].cli_flag.removeprefix("--").replace("-", "_"))
          for name in ("max_inflight", "switch_cost_j", "max_clock_changes", "timing_margin", "reconfig_step_mhz")}


def check_flags_apply(args: argparse.Namespace) -> None:
    """A flag that would do nothing next to the others is refused (one line), never silently ignored:
    the same table as the training flags (config/flag_table.py), with this command's flag names.

    Reads only the flags the command has (getattr): 'plan', 'frontier' and 'schedule' share it.
    Flags with no default (None) count only when the user gave them; 'frontier' plans optimal plans.
    """
    values = {name: getattr(args, attr) for name, (_, attr) in _TWINS.items() if getattr(args, attr, None) is not None}
    facts = Facts(plan_type=getattr(args, "type", None) or PlanType.OPTIMAL, scheduling=args.scheduling,
                  reconfig=getattr(args, "reconfig", None) or ReconfigPolicy.DEFAULT,
                  deadline_from=getattr(args, "deadline_from", None), offline=True)
    refuse_inert(values, values, facts, CLI_NAMES, {name: flag for name, (flag, _) in _TWINS.items()}, CliError)


def plan_from_file(path: str) -> tuple[dict[str, Any], FrequencyPlan]:
    """The JSON of ``envpipe plan --out`` (or a bare plan) and the frequency plan in it, all checked before use."""
    # Numbers bounded while parsing (NaN, Infinity, a 400-digit integer: one line naming the key, no traceback).
    data = loads_json(read_text(path, "plan", CliError), path, CliError)
    if not isinstance(data, dict):
        raise CliError(f"{path}: expected a JSON object (a plan written by 'envpipe plan --out'), "
                       f"got {type(data).__name__}")
    body = data["plan"] if "plan" in data else data
    freqs = body.get("frequencies", body.get("stages")) if isinstance(body, dict) else None
    if freqs is None:
        raise CliError(f"{path}: no \"frequencies\" (or \"stages\") found: not a plan written by 'envpipe plan --out'")
    try:
        plan = FrequencyPlan.from_dict(
            {
                "stages": freqs,
                "schedule": body.get("scheduling", body.get("schedule", "custom")),
                "extra_warmup": body.get("extra_warmup", []),
            }
        )
    except ScheduleError as exc:
        raise CliError(f"{path}: not a valid plan: {exc}") from None
    _check_plan_summary(path, data, plan)
    _check_plan_clocks(path, data, plan)
    return data, plan


def _check_plan_clocks(path: str, data: dict[str, Any], plan: FrequencyPlan) -> None:
    """The plan's clocks lie in the range of the GPU it names (``"gpu": "a40"``): 5000 MHz on an A40 is no plan."""
    gpu = data.get("gpu")
    if gpu is None:
        return  # planned without a GPU table entry: only the 1..MAX_CLOCK_MHZ of every plan applies
    if not isinstance(gpu, str):
        raise CliError(f"{path}: gpu {gpu!r} is not a GPU name: write the plan again with 'envpipe plan --out'")
    try:
        spec = get_gpu_spec(gpu)
        if spec.min_clock_mhz is not None and spec.max_clock_mhz is not None:  # unknown: NVML's list decides
            plan.check_clock_range(spec.min_clock_mhz, spec.max_clock_mhz, f"the clock range of its GPU {spec.key}")
    except (GpuSpecError, ScheduleError) as exc:
        raise CliError(f"{path}: not a valid plan: {exc}") from None


# What 'envpipe show' prints of a plan file's summary: (section, key), None = top level.
_SUMMARY_NUMBERS = (("baseline", "iteration_time_s"), ("baseline", "energy_j"), ("plan", "iteration_time_s"),
                    ("plan", "energy_j"), (None, "energy_saving"), (None, "slowdown"))


def _check_plan_summary(path: str, data: dict[str, Any], plan: FrequencyPlan) -> None:
    """The sizes a plan file states match its plan; a summary ('baseline' and 'plan') has every number 'show' prints."""
    fix = "write the plan again with 'envpipe plan --out'"
    schedule = plan.schedule
    for key, actual in (("num_stages", schedule.num_stages), ("num_microbatches", schedule.num_microbatches)):
        if key in data and data[key] != actual:
            raise CliError(f"{path}: {key} is {data[key]!r} but the plan's clocks are for {actual}: {fix}")
    if "baseline" not in data or "plan" not in data:
        return  # a bare plan: clocks only
    for section, key in _SUMMARY_NUMBERS:
        where = data if section is None else data[section]
        name = key if section is None else f"{section}.{key}"
        if not isinstance(where, dict):
            raise CliError(f"{path}: \"{section}\" must be a JSON object: {fix}")
        value = where.get(key)
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
            got = "missing" if key not in where else f"{value!r}, not a finite number"
            raise CliError(f"{path}: {name} is {got}: {fix}")
    warnings = data.get("warnings", [])
    if not isinstance(warnings, list) or not all(isinstance(w, str) for w in warnings):
        raise CliError(f"{path}: warnings must be a list of strings: {fix}")


def planner_config(
    args: argparse.Namespace, gpu: GpuSpec | None, plan_type: PlanType, reconfig: ReconfigPolicy, **more: Any
) -> PlannerConfig:
    """The one place the CLI builds a planner config: from the flags 'plan' and 'frontier' share
    (``parser._add_pipeline_args`` and ``--p2p-power``/``--p2p-latency``); ``more`` sets or replaces fields."""
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
        # Offline plans are the ideal ones unless asked: training keeps its 1 % default margin.
        timing_margin=getattr(args, "timing_margin", None) or 0.0,
    )
    return flags.planner_config(gpu, **{"p2p_latency_s": args.p2p_latency, "comm": args.comm,
                                        "virtual_stages": args.virtual_stages or 1, **more})
