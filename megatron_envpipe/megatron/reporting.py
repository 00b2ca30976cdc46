"""Every log interval: the pipeline's energy and time, in the log and in TensorBoard.

Each stage's energy is summed over its tensor/context-parallel GPUs, gathered
over the pipeline and turned into an
:class:`~megatron_envpipe.megatron.runtime.EnergyReport` by the run-time; the
last rank (where Megatron prints training progress) logs it and writes it to
Megatron's TensorBoard writer when ``megatron.training`` set one up. Intervals
whose energy was not measured (:mod:`megatron_envpipe.gpu.hooks`) are counted in
every line, by reason.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import torch.distributed as dist

from megatron_envpipe.core.hooks import ExecutionHooks
from megatron_envpipe.gpu.hooks import EnergyStatus, GpuHooks
from megatron_envpipe.megatron.groups import StageGroups
from megatron_envpipe.megatron.runtime import EnergyReport, EnvPipeRuntime

__all__ = ["report_energy", "stage_energy", "tensorboard_writer", "unmeasured_summary", "write_tensorboard"]

log = logging.getLogger("megatron_envpipe")


def report_energy(runtime: EnvPipeRuntime, hooks: ExecutionHooks, groups: StageGroups,
                  iteration: int) -> EnergyReport | None:
    """After iteration ``iteration`` (0-based): collective over the pipeline, on every rank.

    A stage whose energy was not measured this iteration gets no pipeline sum: the
    line names it and why. Every line ends with how many intervals (one GPU's
    iteration) went unmeasured so far, by reason, and which GPUs lost clock control.
    """
    if not runtime.measures_energy:
        return None
    if (iteration + 1) % runtime.config.log_interval:
        return None
    # Energy is measured only where the executor set up GPU hooks.
    mine = stage_energy(groups, hooks.energy_status() if isinstance(hooks, GpuHooks) else None)
    everyone = groups.gather_stages(mine)
    if any(e is None for e in everyone):
        return None
    measured = all(e.energy is not None for e in everyone)
    report = runtime.report_energy(iteration + 1, [e.energy for e in everyone]) if measured else None
    # Megatron prints training progress on the last rank (print_rank_last).
    if dist.get_rank() != dist.get_world_size() - 1:
        return report
    if report is not None:
        line = report.line()
    else:
        label = " (simulated)" if runtime.device.simulated else ""
        missing = ", ".join(f"{s} ({e.reason})" for s, e in enumerate(everyone) if e.energy is None)
        line = f"EnvPipe energy{label} | iteration {iteration + 1} | not measured on stage {missing}"
    log.info("%s%s", line, unmeasured_summary(everyone))
    writer = tensorboard_writer()
    if writer is not None:
        try:
            write_tensorboard(writer, report, iteration + 1, everyone)
        except (OSError, RuntimeError, ValueError) as exc:  # a full disk must not stop training
            if "tensorboard" not in _WARNED:
                _WARNED.add("tensorboard")
                log.warning("EnvPipe: writing the energy to TensorBoard failed: %s", exc)
    return report


_WARNED: set[str] = set()


def unmeasured_summary(everyone: Sequence[EnergyStatus]) -> str:
    """`` | N of M intervals unmeasured (reason: n, ...)`` and lost clock control; '' when all is well."""
    total = sum(e.intervals for e in everyone)
    counts: dict[str, int] = {}
    for e in everyone:
        for why, n in e.unmeasured:
            counts[why] = counts.get(why, 0) + n
    parts = []
    if counts:
        reasons = ", ".join(f"{why}: {n}" for why, n in sorted(counts.items()))
        parts.append(f"{sum(counts.values())} of {total} intervals unmeasured ({reasons})")
    lost = [f"{s} ({e.clock_control_lost})" for s, e in enumerate(everyone) if e.clock_control_lost]
    if lost:
        parts.append(f"clock control lost on stage {', '.join(lost)}: monitor-only")
    return "".join(f" | {p}" for p in parts)


def stage_energy(groups: StageGroups, mine: EnergyStatus | None) -> EnergyStatus | None:
    """A stage's energy is that of all its GPUs: sum over its TP/CP ranks (unmeasured if any is)."""
    for group in groups.model_parallel:
        parts: list[Any] = [None] * group.size()
        dist.all_gather_object(parts, mine, group=group)
        if any(p is None for p in parts):
            return None
        energies = [p.energy for p in parts]
        energy = None
        if all(e is not None for e in energies):
            energy = replace(energies[0], energy_j=sum(e.energy_j for e in energies),
                             start_s=min(e.start_s for e in energies), end_s=max(e.end_s for e in energies))
        counts: dict[str, int] = {}
        for p in parts:
            for why, n in p.unmeasured:
                counts[why] = counts.get(why, 0) + n
        mine = EnergyStatus(
            energy=energy,
            reason=next((p.reason for p in parts if p.reason), None),
            intervals=sum(p.intervals for p in parts),
            unmeasured=tuple(sorted(counts.items())),
            clock_control_lost=next((p.clock_control_lost for p in parts if p.clock_control_lost), None),
        )
    return mine


def write_tensorboard(writer: Any, report: EnergyReport | None, step: int,
                      everyone: Sequence[EnergyStatus] = ()) -> None:
    if report is not None:
        writer.add_scalar("envpipe/iteration-energy-J", report.energy_j, step)
        writer.add_scalar("envpipe/iteration-time-s", report.time_s, step)
        if report.saving is not None:
            writer.add_scalar("envpipe/energy-saving", report.saving, step)
        for s, p in enumerate(report.stage_power_w):
            writer.add_scalar(f"envpipe/stage{s}-power-W", p, step)
    if everyone:
        writer.add_scalar("envpipe/unmeasured-intervals", sum(n for e in everyone for _, n in e.unmeasured), step)


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
