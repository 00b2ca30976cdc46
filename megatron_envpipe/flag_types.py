"""argparse types of the ``--envpipe-*`` flags and the ``envpipe`` command: text in, checked value out.

Also what ``config`` reads Megatron's flags and shows values with: the training flags'
ranges (``TRAINING_NUMBERS``, from the one table in :mod:`megatron_envpipe.core.flag_ranges`),
the model chunks and micro-batches Megatron's flags imply, and :class:`EnvPipeConfigError`.
"""

from __future__ import annotations

import argparse
import math
import os
from dataclasses import dataclass
from typing import Any

from megatron_envpipe.core.flag_ranges import RANGES, FlagRange
from megatron_envpipe.core.memory import MaxInflight, MemoryModel, parse_max_inflight
from megatron_envpipe.errors import UsageError


class EnvPipeConfigError(UsageError, ValueError):
    """An impossible or inconsistent EnvPipe setting."""


def fraction(text: str) -> float:
    """argparse type of the fraction flags: ``0.05`` or ``5%`` -> 0.05; finite and >= 0.

    Shared by ``--envpipe-max-slowdown`` and the ``envpipe`` command's ``--max-slowdown``.
    """
    body = text.strip()
    percent = body.endswith("%")
    try:
        value = float(body[:-1]) / 100 if percent else float(body)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected a fraction like 0.05 or a percentage like 5%, got {text!r}") from None
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(
            f"must be a finite fraction >= 0 (0.05 or 5% for 5%), got {text!r}")
    return value


def _check_no_empty_entry(text: str) -> None:
    """A list flag's entries: ``4,4,,4`` is refused naming the empty entry (it was once silently dropped,
    shifting every later stage's value onto the stage before). Only blank text (or only commas) passes,
    for the caller to report as empty."""
    parts = [p.strip() for p in text.split(",")]
    if any(parts) and not all(parts):
        n = parts.index("") + 1
        raise argparse.ArgumentTypeError(f"entry {n} of {text!r} is empty: give one value per entry "
                                         f"(e.g. 4,3,1,0), no empty entries")


def int_list(text: str) -> list[int]:
    """argparse type: ``4,3,1,0`` -> ``[4, 3, 1, 0]``; blank text or only commas -> ``[]``."""
    _check_no_empty_entry(text)
    try:
        return [int(x) for x in text.replace(" ", "").split(",") if x]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def max_inflight_arg(text: str) -> MaxInflight:
    """argparse type of the activation-budget flags: ``auto``, ``none``/``unlimited``, ``8``, ``4,3,2,2``."""
    _check_no_empty_entry(text)
    try:
        return parse_max_inflight(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def memory_model_arg(text: str) -> MemoryModel:
    """argparse type of ``--envpipe-sim-memory``: ``GIB_FREE,MIB_PER_MICROBATCH`` (each bounded, core.flag_ranges)."""
    _check_no_empty_entry(text)
    try:
        return MemoryModel.parse(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None



# The simulated straggler's slowdown: 1 (none) to 4 (a GPU throttled to a quarter of its speed); core.flag_ranges.
_STRAGGLER_FACTOR_RANGE = (RANGES["straggler_factor"].low, RANGES["straggler_factor"].high)
_STRAGGLER_EXAMPLE = "give REPLICA:FACTOR[@ITER], e.g. 1:1.15 or 1:1.2@10"


@dataclass(frozen=True)
class SimStraggler:
    """``--envpipe-sim-straggler``: the simulated GPUs of data-parallel replica ``replica`` run every unit
    ``factor`` times longer (at unchanged power, so energy x factor) from iteration ``start_iteration`` on."""

    replica: int
    factor: float
    start_iteration: int = 0

    def problem(self) -> str | None:
        """What is wrong with it alone (the replica's range needs the data-parallel size), or None."""
        low, high = _STRAGGLER_FACTOR_RANGE
        if not is_whole(self.replica) or self.replica < 0:
            return f"replica {show(self.replica)} must be a whole number >= 0 (a data-parallel rank)"
        if RANGES["straggler_factor"].problem(self.factor):
            return f"factor {show(self.factor)} must be in [{low:g}, {high:g}] (1.15: 15 % slower)"
        if self.factor == low:  # no straggler at all: the flag would do nothing
            return f"factor {show(self.factor)} slows nothing: give a factor above {low:g} (1.15: 15 % slower)"
        if not is_whole(self.start_iteration) or self.start_iteration < 0:
            return f"start iteration {show(self.start_iteration)} must be a whole number >= 0"
        return None

    def __str__(self) -> str:
        at = f"@{self.start_iteration}" if self.start_iteration else ""
        return f"{self.replica}:{self.factor:g}{at}"


def sim_straggler_arg(text: str) -> SimStraggler:
    """argparse type of ``--envpipe-sim-straggler``: ``REPLICA:FACTOR[@ITER]``, e.g. ``1:1.15@10``."""
    body, sep, at = text.strip().partition("@")
    replica, colon, factor = body.partition(":")
    try:
        if not colon or sep and not at:  # "1:1.15@" names no iteration: not silently iteration 0
            raise ValueError
        value = SimStraggler(int(replica), float(factor), int(at) if at else 0)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not REPLICA:FACTOR[@ITER]: {_STRAGGLER_EXAMPLE}") from None
    problem = value.problem()
    if problem:
        raise argparse.ArgumentTypeError(f"{text!r}: {problem}; {_STRAGGLER_EXAMPLE}")
    return value


# -- the training flags' numbers ------------------------------------------------------

# EnvPipeConfig field -> (flag, its range in core.flag_ranges, example).
TRAINING_NUMBERS: dict[str, tuple[str, FlagRange, str]] = {
    "p2p_power_w": ("--envpipe-p2p-power", RANGES["p2p_power_w"], "70"),
    "reconfig_step_mhz": ("--envpipe-reconfig-step", RANGES["clock_mhz"], "30"),
    "finish_limit": ("--envpipe-finish-limit", RANGES["finish_limit"], "10"),
    "threshold_scale": ("--envpipe-threshold-scale", RANGES["threshold_scale"], "4"),
    "prefetch": ("--envpipe-prefetch", RANGES["prefetch"], "2"),
    "comm_timeout_s": ("--envpipe-comm-timeout", RANGES["comm_timeout_s"], "300"),
    "measure_iterations": ("--envpipe-measure-iterations", RANGES["measure_iterations"], "1"),
    "profile_step_mhz": ("--envpipe-profile-step", RANGES["clock_mhz"], "90"),
    "profile_iterations": ("--envpipe-profile-iterations", RANGES["profile_iterations"], "2"),
    "sim_time_scale": ("--envpipe-sim-time-scale", RANGES["sim_time_scale"], "0.02"),
    "sim_jitter": ("--envpipe-sim-jitter", RANGES["sim_jitter"], "0.03 (3 %)"),
    "sim_unit_scale": ("--envpipe-sim-unit-scale", RANGES["sim_unit_scale"], "0.25"),
    "sim_clock_latency_ms": ("--envpipe-sim-clock-latency-ms", RANGES["sim_clock_latency_ms"], "15"),
    "sim_counter_period_ms": ("--envpipe-sim-counter-period-ms", RANGES["sim_counter_period_ms"], "100"),
    "sim_thermal_drift": ("--envpipe-sim-thermal-drift", RANGES["sim_thermal_drift"], "0.03 (3 %)"),
    "timing_margin": ("--envpipe-timing-margin", RANGES["timing_margin"], "0.01 (1 %)"),
    "reconfig_window": ("--envpipe-reconfig-window", RANGES["reconfig_window"], "3"),
    "straggler_window": ("--envpipe-straggler-window", RANGES["straggler_window"], "3"),
    "log_interval": ("--envpipe-log-interval", RANGES["log_interval"], "1"),
    "baseline_iterations": ("--envpipe-baseline-iterations", RANGES["baseline_iterations"], "2"),
    "max_slowdown": ("--envpipe-max-slowdown", RANGES["max_slowdown"], "0.05 (or 5%)"),
    "target_time_s": ("--envpipe-target-time", RANGES["target_time_s"], "8.5"),
    "switch_cost_j": ("--envpipe-switch-cost-j", RANGES["switch_cost_j"], "0.7"),
    "max_clock_changes": ("--envpipe-max-clock-changes", RANGES["max_clock_changes"], "40"),
}
OPTIONAL_NUMBERS = frozenset({"p2p_power_w", "reconfig_step_mhz", "profile_step_mhz",
                              "target_time_s", "switch_cost_j", "max_clock_changes", "sim_clock_latency_ms",
                              "sim_counter_period_ms", "sim_thermal_drift", "log_interval"})


def is_whole(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def show(value: Any) -> str:
    """A flag value as the user would type it: 0.05, 300, nan, inf, 'text'."""
    if isinstance(value, float):
        return f"{value:g}"
    return str(value) if is_whole(value) else repr(value)


def show_list(values: Any) -> str:
    return ",".join(show(v) for v in values)


# -- Megatron's flags -----------------------------------------------------------------

# Megatron's flags that turn on the interleaved schedule (names differ across releases).
VIRTUAL_PIPELINE_ARGS = ("virtual_pipeline_model_parallel_size", "num_layers_per_virtual_pipeline_stage",
                         "num_virtual_stages_per_pipeline_rank")


def virtual_stages_of(args: Any) -> int:
    """Model chunks per rank (1 without a virtual pipeline) from Megatron's flags, as Megatron derives it."""
    given = getattr(args, "virtual_pipeline_model_parallel_size", None)
    if is_whole(given):
        return given
    per_stage = getattr(args, "num_layers_per_virtual_pipeline_stage", None)
    layers, pp = getattr(args, "num_layers", None), getattr(args, "pipeline_model_parallel_size", None)
    if is_whole(per_stage) and per_stage >= 1:
        if not (is_whole(layers) and is_whole(pp) and pp >= 1 and layers % (pp * per_stage) == 0):
            raise EnvPipeConfigError(
                f"--num-layers-per-virtual-pipeline-stage {per_stage}: --num-layers {layers} must split into "
                f"--pipeline-model-parallel-size {pp} ranks of whole virtual stages of {per_stage} layers")
        return layers // (pp * per_stage)
    return ranks if is_whole(ranks := getattr(args, "num_virtual_stages_per_pipeline_rank", None)) and ranks >= 1 else 1


def num_microbatches_of(args: Any, pipeline_size: int) -> int | None:
    """Micro-batches per iteration from Megatron's flags, or None when they do not fix it.

    ``num_microbatches`` if the namespace has it (the tiny GPT example), else
    ``--global-batch-size / (--micro-batch-size x DP)`` with DP from
    ``data_parallel_size`` or ``WORLD_SIZE / (TP x PP x CP)``; a batch-size
    ramp-up changes it during training: None.
    """
    given = getattr(args, "num_microbatches", None)
    if is_whole(given) and given >= 1:
        return given
    if getattr(args, "rampup_batch_size", None):
        return None
    mbs = getattr(args, "micro_batch_size", None)
    gbs = getattr(args, "global_batch_size", None)
    dp = data_parallel_size_of(args, pipeline_size)
    if not (is_whole(mbs) and mbs >= 1 and is_whole(dp) and dp >= 1):
        return None
    if gbs is None:
        return 1  # Megatron's default: one micro-batch per data-parallel rank
    if not is_whole(gbs) or gbs < 1 or gbs % (mbs * dp):
        return None
    return gbs // (mbs * dp)


def data_parallel_size_of(args: Any, pipeline_size: int) -> int | None:
    """Data-parallel replicas, as Megatron derives them before any rank starts: ``data_parallel_size`` if the
    namespace has it, else ``WORLD_SIZE / (TP x PP x CP)`` (the launcher's world size); None when unknown."""
    dp = getattr(args, "data_parallel_size", None)
    if is_whole(dp):
        return dp
    world = getattr(args, "world_size", None)
    if not is_whole(world):
        world = int(os.environ["WORLD_SIZE"]) if os.environ.get("WORLD_SIZE", "").isdigit() else None
    tp = getattr(args, "tensor_model_parallel_size", None) or 1
    cp = getattr(args, "context_parallel_size", None) or 1
    per_replica = tp * pipeline_size * cp if is_whole(tp) and is_whole(cp) else 0
    return world // per_replica if world and per_replica and world % per_replica == 0 else None
