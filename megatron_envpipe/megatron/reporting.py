"""Every log interval: the pipeline's energy and time, in the log and in TensorBoard.

Each stage's energy is summed over its tensor/context-parallel GPUs, gathered
over the pipeline and turned into an
:class:`~megatron_envpipe.megatron.runtime.EnergyReport` by the run-time; the
last rank (where Megatron prints training progress) logs it and writes it to
Megatron's TensorBoard writer when ``megatron.training`` set one up.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import Any

import torch.distributed as dist

from megatron_envpipe.core.hooks import ExecutionHooks
from megatron_envpipe.gpu.energy import IterationEnergy
from megatron_envpipe.gpu.hooks import GpuHooks
from megatron_envpipe.megatron.groups import StageGroups
from megatron_envpipe.megatron.runtime import EnergyReport, EnvPipeRuntime

__all__ = ["report_energy", "stage_energy", "tensorboard_writer", "write_tensorboard"]

log = logging.getLogger("megatron_envpipe")


def report_energy(runtime: EnvPipeRuntime, hooks: ExecutionHooks, groups: StageGroups,
                  iteration: int) -> EnergyReport | None:
    """After iteration ``iteration`` (0-based): collective over the pipeline, on every rank."""
    if runtime.device is None or not runtime.device.energy:
        return None
    if (iteration + 1) % runtime.config.log_interval:
        return None
    # Energy is measured only where the executor set up GPU hooks.
    mine = stage_energy(groups, hooks.last_energy if isinstance(hooks, GpuHooks) else None)
    everyone = groups.gather_stages(mine)
    if any(e is None for e in everyone):
        return None
    report = runtime.report_energy(iteration + 1, everyone)
    # Megatron prints training progress on the last rank (print_rank_last).
    if report is None or dist.get_rank() != dist.get_world_size() - 1:
        return report
    log.info("%s", report.line())
    writer = tensorboard_writer()
    if writer is not None:
        write_tensorboard(writer, report)
    return report


def stage_energy(groups: StageGroups, mine: IterationEnergy | None) -> IterationEnergy | None:
    """A stage's energy is that of all its GPUs: sum over its TP/CP ranks."""
    for group in groups.model_parallel:
        parts: list[Any] = [None] * group.size()
        dist.all_gather_object(parts, mine, group=group)
        if any(p is None for p in parts):
            return None
        mine = replace(parts[0], energy_j=sum(p.energy_j for p in parts),
                       start_s=min(p.start_s for p in parts), end_s=max(p.end_s for p in parts))
    return mine


def write_tensorboard(writer: Any, report: EnergyReport) -> None:
    step = report.iteration
    writer.add_scalar("envpipe/iteration-energy-J", report.energy_j, step)
    writer.add_scalar("envpipe/iteration-time-s", report.time_s, step)
    if report.saving is not None:
        writer.add_scalar("envpipe/energy-saving", report.saving, step)
    for s, p in enumerate(report.stage_power_w):
        writer.add_scalar(f"envpipe/stage{s}-power-W", p, step)


def tensorboard_writer() -> Any:
    """Megatron's TensorBoard writer when megatron.training set one up."""
    try:
        # megatron.training is optional (absent below megatron-core 0.17, or on Python < 3.12).
        from megatron.training.global_vars import get_tensorboard_writer
    except Exception:  # noqa: BLE001 - no megatron.training here
        return None
    try:
        return get_tensorboard_writer()
    except Exception:  # noqa: BLE001 - not initialised
        return None
