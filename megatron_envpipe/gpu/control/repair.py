"""Repair after SIGKILL or a node crash: reset the GPUs a dead run left locked.

:class:`~megatron_envpipe.gpu.control.safety.ClockGuard` writes a state file per GPU
before it locks its clocks; ``envpipe reset-clocks`` (:func:`reset_clocks_from_state`)
reads them back and resets those GPUs through NVML, and ``--all``
(:func:`reset_all_gpus`) resets every GPU of the node. Both go through
:class:`~megatron_envpipe.gpu.control.state_store.ClockStateStore` (a folder another user
could tamper with is refused; a bad file is named and skipped) and return a
:class:`RepairReport` whose ``problems`` name every recorded GPU left locked,
so the command can fail loudly (a SLURM epilog trusts its exit status). Pure
Python; NVML is reached through :mod:`megatron_envpipe.gpu.devices.nvml`.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from megatron_envpipe.gpu.control.safety import (
    REPAIR_COMMAND,
    device_label,
    hostname,
    pid_alive,
    resolve_state_dir,
)
from megatron_envpipe.gpu.control.state_store import ClockStateStore, StateEntry, StateStoreError, printable
from megatron_envpipe.gpu.devices.base import GpuDevice, GpuError, GpuNotSupportedError, GpuPermissionError
from megatron_envpipe.gpu.devices.nvml import NvmlGpu, open_nvml_devices

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


def _open_store(directory: Path, report: RepairReport) -> ClockStateStore | None:
    """The verified store, or None when there is nothing to go through (the report says why: no
    folder, a note; a folder that is not one, or that cannot be trusted, raises StateStoreError)."""
    store = ClockStateStore.open(directory, create=False)
    if store is None:
        report.note(f"{printable(directory)}: no such directory: no GPU was left locked by megatron-envpipe here")
    return store


def _bad_file(report: RepairReport, directory: Path, entry: StateEntry) -> None:
    report.problem(
        f"{printable(directory)}/{entry.shown_name}: unreadable state file ({printable(entry.problem)}): skipped; "
        f"its GPU may still be locked: `sudo {REPAIR_COMMAND} --all` resets every GPU of this node, then remove "
        "the file",
        permission=entry.denied,
    )


def reset_clocks_from_state(
    state_dir: str | os.PathLike[str] | None = None,
    device_factory: Callable[[str], GpuDevice] | None = None,
    force: bool = False,
) -> RepairReport:
    """Reset the GPUs a crashed run left locked (``envpipe reset-clocks``).

    For each state file of this host: reset that GPU's locked clocks (found by
    UUID) and delete the file. Files of other hosts are skipped with a note (not
    a problem: that host's repair handles them). A problem, with why and what to
    do, for every recorded GPU left locked: a state file that cannot be used
    (named, skipped, the others still repaired), a GPU that cannot be opened (no
    driver, gone), a failed or forbidden reset, an owner process still running
    (unless ``force``). Problems keep their state file, so the repair can be
    run again. Raises :class:`StateStoreError` (nothing read) when the state
    folder could be tampered with by another user or is not a folder.
    """
    report = RepairReport()
    directory = resolve_state_dir(state_dir)
    store = _open_store(directory, report)
    if store is None:
        return report
    with store:
        try:
            entries = store.entries()
        except OSError as exc:
            report.problem(f"{printable(directory)}: cannot list the state files ({exc.strerror or exc}): run "
                           f"`sudo {REPAIR_COMMAND}`", permission=isinstance(exc, PermissionError))
            return report
        if not entries:
            report.note(f"{printable(directory)}: no state files: no GPU was left locked by megatron-envpipe here")
        factory = device_factory or _default_factory
        for entry in entries:
            _repair_one(store, entry, factory, force, report)
    return report


def _repair_one(store: ClockStateStore, entry: StateEntry, factory: Callable[[str], GpuDevice], force: bool,
                report: RepairReport) -> None:
    directory = store.path
    data = entry.record
    if data is None:
        _bad_file(report, directory, entry)
        return
    path = f"{printable(directory)}/{entry.shown_name}"
    me = hostname()
    what = data.label
    if data.hostname != me:
        report.note(f"{what}: locked on host {printable(data.hostname, 80)}, not this one ({printable(me, 80)}): "
                    f"skipped; run {REPAIR_COMMAND} there")
        return
    since = printable(data.time, 40)
    pid = data.pid
    alive = pid == os.getpid() or pid_alive(pid, data.pid_start_ticks, data.boot_id)
    if alive and not force:
        report.problem(f"{what}: its owner pid {pid} (since {since}) is still running: left locked; stop it, "
                       f"or `{REPAIR_COMMAND} --force` resets it anyway (state file {path})")
        return
    try:
        device = factory(data.uuid)
    except GpuError as exc:
        report.problem(f"{what}: cannot open it ({exc}): not reset, state file {path} kept; fix the driver "
                       "and run the repair again, or `sudo nvidia-smi -rgc` once it works",
                       permission=isinstance(exc, GpuPermissionError))
        return
    try:
        device.reset_locked_clocks()
    except GpuPermissionError as exc:
        report.problem(f"{what}: not reset, no permission ({exc}); state file {path} kept", permission=True)
        return
    except GpuError as exc:
        report.problem(f"{what}: reset failed ({exc}): state file {path} kept; run the repair again, "
                       "or `sudo nvidia-smi -rgc`")
        return
    finally:
        device.close()
    try:
        if not store.remove(entry):
            report.note(f"{what}: the state file {path} changed while the GPU was reset: left in place")
    except OSError as exc:  # reset done; a stale file only makes the next repair reset it again
        report.note(f"{what}: could not remove the state file {path} ({exc.strerror or exc})")
    owner = "still running, reset forced" if alive else "no longer running"
    report.note(f"{what}: locked clocks reset (locked at {data.locked_mhz} MHz since {since} "
                f"by pid {pid}, {owner})")


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
    _forget_reset(resolve_state_dir(state_dir), reset_uuids, report)
    if not opened:
        report.note("NVML sees no GPU on this node")
    return report


def _forget_reset(directory: Path, reset_uuids: set[str], report: RepairReport) -> None:
    """Remove this host's records of the GPUs ``--all`` just reset; leave everything else alone."""
    try:
        store = ClockStateStore.open(directory, create=False)
    except StateStoreError as exc:
        report.note(f"state files not removed: {exc}")
        return
    if store is None:
        return
    me = hostname()
    with store:
        for entry in store.entries():
            record = entry.record  # a file naming no GPU just reset is not ours to judge
            if record is None or record.hostname != me or record.uuid not in reset_uuids:
                continue
            try:
                if store.remove(entry):
                    report.note(f"removed state file {printable(directory)}/{entry.shown_name}")
            except OSError:
                pass
