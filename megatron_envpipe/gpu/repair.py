"""Repair after SIGKILL or a node crash: reset the GPUs a dead run left locked.

:class:`~megatron_envpipe.gpu.safety.ClockGuard` writes a state file per GPU
before it locks its clocks; ``envpipe reset-clocks`` (:func:`reset_clocks_from_state`)
reads them back and resets those GPUs through NVML, and ``--all``
(:func:`reset_all_gpus`) resets every GPU of the node. Pure Python; NVML is
reached through :mod:`megatron_envpipe.gpu.nvml`.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable

from megatron_envpipe.gpu.base import GpuDevice, GpuError, GpuNotSupportedError, GpuPermissionError
from megatron_envpipe.gpu.nvml import NvmlGpu, open_nvml_devices
from megatron_envpipe.gpu.safety import (
    REPAIR_COMMAND,
    REPAIR_HINT,
    device_label,
    hostname,
    pid_alive,
    resolve_state_dir,
)

__all__ = ["reset_all_gpus", "reset_clocks_from_state"]


def _default_factory(uuid: str) -> GpuDevice:
    return NvmlGpu.for_uuid(uuid, refuse_mig=False)


def _reset_one(device: GpuDevice, what: str) -> None:
    try:
        device.reset_locked_clocks()
    except GpuPermissionError as exc:
        raise GpuPermissionError(f"{what}: {REPAIR_HINT}") from exc


def reset_clocks_from_state(
    state_dir: str | os.PathLike[str] | None = None,
    device_factory: Callable[[str], GpuDevice] | None = None,
    force: bool = False,
) -> list[str]:
    """Reset the GPUs a crashed run left locked (``envpipe reset-clocks``).

    For each state file of this host: reset that GPU's locked clocks (found by
    UUID) and delete the file. Files of other hosts are skipped with a note; a
    file whose owner process is still running is reported and left alone unless
    ``force``. Returns one human-readable line per file. Raises
    :class:`GpuPermissionError` (with how to fix it) when resetting is not
    permitted.
    """
    directory = resolve_state_dir(state_dir)
    if not directory.is_dir():
        return [f"{directory}: no such directory: no GPU was left locked by megatron-envpipe here"]
    files = sorted(directory.glob("*.json"))
    if not files:
        return [f"{directory}: no state files: no GPU was left locked by megatron-envpipe here"]
    factory = device_factory or _default_factory
    me = hostname()
    lines: list[str] = []
    for path in files:
        try:
            data = json.loads(path.read_text())
            uuid = str(data["uuid"])
            pid = int(data["pid"])
        except (OSError, ValueError, KeyError, TypeError) as exc:
            lines.append(f"{path}: unreadable state file ({exc}): left in place; remove it by hand")
            continue
        host = data.get("hostname")
        what = f"{uuid} ({data.get('name', '?')}, PCI {data.get('pci_bus_id', '?')})"
        if host != me:
            lines.append(f"{what}: locked on host {host}, not this one ({me}): skipped; run {REPAIR_COMMAND} there")
            continue
        since = data.get("time", "?")
        alive = pid == os.getpid() or pid_alive(pid, data.get("pid_start_ticks"), data.get("boot_id"))
        if alive and not force:
            lines.append(f"{what}: its owner pid {pid} (since {since}) is still running: left alone "
                         "(--force resets it anyway)")
            continue
        try:
            device = factory(uuid)
        except GpuError as exc:
            lines.append(f"{what}: cannot open it ({exc}): state file {path} kept")
            continue
        try:
            _reset_one(device, what)
        except GpuPermissionError:
            raise
        except GpuError as exc:
            lines.append(f"{what}: reset failed ({exc}): state file {path} kept")
            continue
        finally:
            device.close()
        try:
            path.unlink()
        except FileNotFoundError:
            pass
        owner = "still running, reset forced" if alive else "no longer running"
        lines.append(f"{what}: locked clocks reset (locked at {data.get('locked_mhz', '?')} MHz since {since} "
                     f"by pid {pid}, {owner})")
    return lines


def reset_all_gpus(
    state_dir: str | os.PathLike[str] | None = None,
    devices: Callable[[], list[GpuDevice]] | None = None,
) -> list[str]:
    """Reset the locked clocks of every GPU on this node through NVML (``envpipe reset-clocks --all``).

    Ignores state files when choosing GPUs, then removes this host's state files
    of the GPUs it reset. Resets GPUs other jobs may have locked on purpose: the
    big hammer after a node-level mishap.
    """
    if devices is None:
        devices = open_nvml_devices
    lines: list[str] = []
    reset_uuids: set[str] = set()
    opened = devices()
    try:
        for i, device in enumerate(opened):
            what = device_label(device)
            try:
                _reset_one(device, what)
            except GpuPermissionError:
                raise
            except GpuNotSupportedError as exc:
                lines.append(f"GPU {i} {what}: not supported ({exc})")
                continue
            except GpuError as exc:
                lines.append(f"GPU {i} {what}: reset failed ({exc})")
                continue
            reset_uuids.add(device.info().uuid)
            lines.append(f"GPU {i} {what}: locked clocks reset")
    finally:
        for device in opened:
            device.close()
    directory = resolve_state_dir(state_dir)
    me = hostname()
    for path in sorted(directory.glob("*.json")) if directory.is_dir() else []:
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(data, dict) and data.get("hostname") == me and data.get("uuid") in reset_uuids:
            try:
                path.unlink()
                lines.append(f"removed state file {path}")
            except OSError:
                pass
    if not opened:
        lines.append("NVML sees no GPU on this node")
    return lines
