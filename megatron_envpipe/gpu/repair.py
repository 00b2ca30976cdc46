"""Repair after SIGKILL or a node crash: reset the GPUs a dead run left locked.

:class:`~megatron_envpipe.gpu.safety.ClockGuard` writes a state file per GPU
before it locks its clocks; ``envpipe reset-clocks`` (:func:`reset_clocks_from_state`)
reads them back and resets those GPUs through NVML, and ``--all``
(:func:`reset_all_gpus`) resets every GPU of the node. Both return a
:class:`RepairReport` whose ``problems`` name every recorded GPU left locked,
so the command can fail loudly (a SLURM epilog trusts its exit status). Pure
Python; NVML is reached through :mod:`megatron_envpipe.gpu.nvml`.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from megatron_envpipe.gpu.base import GpuDevice, GpuError, GpuNotSupportedError, GpuPermissionError
from megatron_envpipe.gpu.nvml import NvmlGpu, open_nvml_devices
from megatron_envpipe.gpu.safety import (
    DEFAULT_STATE_DIR,
    REPAIR_COMMAND,
    STATE_DIR_ENV,
    device_label,
    hostname,
    pid_alive,
    resolve_state_dir,
)

__all__ = ["RepairReport", "reset_all_gpus", "reset_clocks_from_state"]


@dataclass
class RepairReport:
    """What a repair did: one line per state file or GPU, and what it could not reset.

    ``problems`` are the lines of recorded GPUs (or state files) left unreset:
    a repair with problems must not pass for a success (a SLURM epilog trusts
    the exit status); ``no_permission`` says one of them needs root.
    """

    lines: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    no_permission: bool = False

    @property
    def ok(self) -> bool:
        return not self.problems

    def note(self, line: str) -> None:
        self.lines.append(line)

    def problem(self, line: str, *, permission: bool = False) -> None:
        self.lines.append(line)
        self.problems.append(line)
        self.no_permission = self.no_permission or permission


def _default_factory(uuid: str) -> GpuDevice:
    return NvmlGpu.for_uuid(uuid, refuse_mig=False)


def _state_files(directory: Path, report: RepairReport) -> list[Path] | None:
    """This state directory's ``*.json`` files, or None when there is nothing to go through
    (the report says why: no directory, a note; not a directory or unlistable, a problem)."""
    if not directory.exists():
        report.note(f"{directory}: no such directory: no GPU was left locked by megatron-envpipe here")
        return None
    if not directory.is_dir():
        report.problem(f"{directory}: not a directory, so no state file could be read: pass --state-dir "
                       f"the directory runs record locked clocks in (default {DEFAULT_STATE_DIR}, or "
                       f"${STATE_DIR_ENV}), or `sudo {REPAIR_COMMAND} --all` to reset every GPU here")
        return None
    try:
        files = sorted(p for p in directory.iterdir() if p.suffix == ".json")
    except OSError as exc:
        report.problem(f"{directory}: cannot list the state files ({exc.strerror or exc}): run `sudo "
                       f"{REPAIR_COMMAND}`", permission=isinstance(exc, PermissionError))
        return None
    if not files:
        report.note(f"{directory}: no state files: no GPU was left locked by megatron-envpipe here")
        return None
    return files


def _read_state(path: Path) -> dict[str, Any]:
    data = json.loads(path.read_text())
    if not isinstance(data, dict):
        raise ValueError(f"expected a JSON object, got {type(data).__name__}")
    data["uuid"] = str(data["uuid"])
    data["pid"] = int(data["pid"])
    return data


def reset_clocks_from_state(
    state_dir: str | os.PathLike[str] | None = None,
    device_factory: Callable[[str], GpuDevice] | None = None,
    force: bool = False,
) -> RepairReport:
    """Reset the GPUs a crashed run left locked (``envpipe reset-clocks``).

    For each state file of this host: reset that GPU's locked clocks (found by
    UUID) and delete the file. Files of other hosts are skipped with a note (not
    a problem: that host's repair handles them). A problem, with why and what to
    do, for every recorded GPU left locked: a state file that cannot be read
    (or a state directory that is not one), a GPU that cannot be opened (no
    driver, gone), a failed or forbidden reset, an owner process still running
    (unless ``force``). Problems keep their state file, so the repair can be
    run again.
    """
    report = RepairReport()
    directory = resolve_state_dir(state_dir)
    files = _state_files(directory, report)
    if files is None:
        return report
    factory = device_factory or _default_factory
    me = hostname()
    for path in files:
        try:
            data = _read_state(path)
        except (OSError, ValueError, KeyError, TypeError) as exc:
            why = exc.strerror if isinstance(exc, OSError) and exc.strerror else f"{type(exc).__name__}: {exc}"
            report.problem(
                f"{path}: unreadable state file ({why}): its GPU may still be locked; run `sudo {REPAIR_COMMAND} "
                "--all` to reset every GPU of this node (or `sudo nvidia-smi -rgc`), then remove the file",
                permission=isinstance(exc, PermissionError),
            )
            continue
        uuid, pid = data["uuid"], data["pid"]
        host = data.get("hostname")
        what = f"{uuid} ({data.get('name', '?')}, PCI {data.get('pci_bus_id', '?')})"
        if host != me:
            report.note(f"{what}: locked on host {host}, not this one ({me}): skipped; run {REPAIR_COMMAND} there")
            continue
        since = data.get("time", "?")
        alive = pid == os.getpid() or pid_alive(pid, data.get("pid_start_ticks"), data.get("boot_id"))
        if alive and not force:
            report.problem(f"{what}: its owner pid {pid} (since {since}) is still running: left locked; stop it, "
                           f"or `{REPAIR_COMMAND} --force` resets it anyway (state file {path})")
            continue
        try:
            device = factory(uuid)
        except GpuError as exc:
            report.problem(f"{what}: cannot open it ({exc}): not reset, state file {path} kept; fix the driver "
                           "and run the repair again, or `sudo nvidia-smi -rgc` once it works",
                           permission=isinstance(exc, GpuPermissionError))
            continue
        try:
            device.reset_locked_clocks()
        except GpuPermissionError as exc:
            report.problem(f"{what}: not reset, no permission ({exc}); state file {path} kept",
                           permission=True)
            continue
        except GpuError as exc:
            report.problem(f"{what}: reset failed ({exc}): state file {path} kept; run the repair again, "
                           "or `sudo nvidia-smi -rgc`")
            continue
        finally:
            device.close()
        try:
            path.unlink()
        except FileNotFoundError:
            pass
        except OSError as exc:  # reset done; a stale file only makes the next repair reset it again
            report.note(f"{what}: could not remove the state file {path} ({exc.strerror or exc})")
        owner = "still running, reset forced" if alive else "no longer running"
        report.note(f"{what}: locked clocks reset (locked at {data.get('locked_mhz', '?')} MHz since {since} "
                    f"by pid {pid}, {owner})")
    return report


def reset_all_gpus(
    state_dir: str | os.PathLike[str] | None = None,
    devices: Callable[[], list[GpuDevice]] | None = None,
) -> RepairReport:
    """Reset the locked clocks of every GPU on this node through NVML (``envpipe reset-clocks --all``).

    Ignores state files when choosing GPUs, then removes this host's state files
    of the GPUs it reset. Resets GPUs other jobs may have locked on purpose: the
    big hammer after a node-level mishap. A GPU that cannot lock clocks at all
    (not supported) is a note; a failed or forbidden reset is a problem. Raises
    :class:`GpuError` when NVML itself cannot start (no driver).
    """
    if devices is None:
        devices = open_nvml_devices
    report = RepairReport()
    reset_uuids: set[str] = set()
    opened = devices()
    try:
        for i, device in enumerate(opened):
            what = device_label(device)
            try:
                device.reset_locked_clocks()
            except GpuPermissionError as exc:
                report.problem(f"GPU {i} {what}: not reset, no permission ({exc})", permission=True)
                continue
            except GpuNotSupportedError as exc:
                report.note(f"GPU {i} {what}: not supported ({exc})")
                continue
            except GpuError as exc:
                report.problem(f"GPU {i} {what}: reset failed ({exc}): run the repair again, or "
                               "`sudo nvidia-smi -rgc`")
                continue
            reset_uuids.add(device.info().uuid)
            report.note(f"GPU {i} {what}: locked clocks reset")
    finally:
        for device in opened:
            device.close()
    directory = resolve_state_dir(state_dir)
    me = hostname()
    for path in sorted(directory.glob("*.json")) if directory.is_dir() else []:
        try:
            data = _read_state(path)
        except (OSError, ValueError, KeyError, TypeError):
            continue  # every GPU was just reset; a file naming none of them is not ours to judge
        if data.get("hostname") == me and data["uuid"] in reset_uuids:
            try:
                path.unlink()
                report.note(f"removed state file {path}")
            except OSError:
                pass
    if not opened:
        report.note("NVML sees no GPU on this node")
    return report
