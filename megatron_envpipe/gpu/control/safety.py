"""GPU safety: locked clocks are always undone.

:class:`ClockGuard` is the process-wide registry of devices whose clocks this
process locked. When it first locks a device it

1. writes ``<state_dir>/<uuid>.json`` (atomically, before touching the clock) so
   that a run killed by SIGKILL or a node crash can be repaired with one
   command, ``envpipe reset-clocks`` (:mod:`megatron_envpipe.gpu.control.repair`);
2. makes sure the clocks are reset at normal exit (``atexit``), after exceptions
   (the caller's ``try/finally`` or ``with``, then ``atexit``), and on SIGTERM and
   SIGINT: a handler, installed from the main thread, resets every guarded GPU and
   then chains to the handler that was there before (Python's default SIGINT
   handler raises KeyboardInterrupt; ``SIG_DFL`` is re-raised, so SIGTERM still
   ends the process with the conventional status). When the last guard that
   handles signals is closed, the handlers it chained to are put back (a
   long-lived process, a test session, keeps no retired guard's handlers).

Resetting removes the state file. After a termination signal or at exit the
guard is *released*: it never locks again in this process (a worker thread with
queued clock changes cannot re-lock a GPU behind the reset); ``rearm()`` undoes
that for interactive use.

The default state directory is ``/var/lib/megatron-envpipe/locked-clocks``
(node-local, root's, like any daemon's state); override with
``ENVPIPE_STATE_DIR`` or the ``state_dir`` argument. Only the ``nvml`` backend
writes state files, through :class:`~megatron_envpipe.gpu.control.state_store.ClockStateStore`,
which refuses a folder another user could tamper with and never lets a bad
file it finds there stop the run.
Pure Python: the guard drives whatever :class:`~megatron_envpipe.gpu.devices.base.GpuDevice` it is given.
"""

from __future__ import annotations

import atexit
import os
import signal
import socket
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megatron_envpipe.gpu.control.state_store import (
    ClockStateStore,
    LockRecord,
    StateStoreError,
    printable,
    state_file_name,
)
from megatron_envpipe.gpu.devices.base import GpuDevice, GpuError

__all__ = [
    "ClockGuard",
    "REPAIR_COMMAND",
    "REPAIR_HINT",
    "default_guard",
    "device_label",
    "hostname",
    "pid_alive",
    "resolve_state_dir",
]

_DEFAULT_STATE_DIR = "/var/lib/megatron-envpipe/locked-clocks"
_STATE_DIR_ENV = "ENVPIPE_STATE_DIR"
REPAIR_COMMAND = "envpipe reset-clocks"
REPAIR_HINT = (
    "resetting GPU clocks needs root or CAP_SYS_ADMIN: run `sudo envpipe reset-clocks` "
    "(keep --state-dir if you used one), or `sudo nvidia-smi -rgc`"
)


def resolve_state_dir(state_dir: str | os.PathLike[str] | None = None) -> Path:
    """``state_dir``, else ``$ENVPIPE_STATE_DIR``, else the default."""
    if state_dir is not None:
        return Path(state_dir)
    return Path(os.environ.get(_STATE_DIR_ENV) or _DEFAULT_STATE_DIR)


# ---------------------------------------------------------------------------
# small helpers
# ---------------------------------------------------------------------------


def hostname() -> str:
    return socket.gethostname()


def _boot_id() -> str | None:
    try:
        with open("/proc/sys/kernel/random/boot_id") as fh:
            return fh.read().strip() or None
    except OSError:
        return None


def _proc_start_ticks(pid: int) -> int | None:
    """Start time of ``pid`` in clock ticks since boot (tells a reused pid apart)."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            stat = fh.read()
    except OSError:
        return None
    try:
        return int(stat[stat.rindex(")") + 2:].split()[19])
    except (ValueError, IndexError):
        return None


def pid_alive(pid: int, start_ticks: int | None = None, boot_id: str | None = None) -> bool:
    if boot_id is not None and _boot_id() is not None and boot_id != _boot_id():
        return False  # the node rebooted since
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # exists, owned by someone else
    if start_ticks is not None:
        now = _proc_start_ticks(pid)
        if now is not None and now != start_ticks:
            return False  # the pid was reused by another process
        if now is None and os.path.isdir("/proc"):
            return False  # a zombie reaped meanwhile, or gone
    return True


def _say(text: str) -> None:
    try:
        print(f"envpipe: {text}", file=sys.stderr, flush=True)
    except (OSError, ValueError):
        pass


# ---------------------------------------------------------------------------
# the guard
# ---------------------------------------------------------------------------


@dataclass
class _Entry:
    device: GpuDevice
    state_file: str | None  # its record in the guard's store (nvml devices only)
    first_mhz: int


_REGISTRY_LOCK = threading.RLock()
_GUARDS: list["ClockGuard"] = []
_PREVIOUS: dict[int, Any] = {}
_INSTALLED: set[int] = set()
_ATEXIT_REGISTERED = False
_DEFAULT: "ClockGuard | None" = None


class ClockGuard:
    """Registry of the devices this process locked; resets them whatever happens.

    Lock through :meth:`lock` (or a :class:`~megatron_envpipe.gpu.control.clocks.ClockController`),
    never by calling ``device.set_locked_clocks`` directly: only then is a state
    file written first and the reset guaranteed.
    """

    def __init__(self, state_dir: str | os.PathLike[str] | None = None, *, install_handlers: bool = True) -> None:
        self.state_dir = resolve_state_dir(state_dir)
        self._store: ClockStateStore | None = None  # opened (verified, created) at the first nvml lock
        self._lock = threading.RLock()
        self._entries: dict[int, _Entry] = {}
        self._pid = os.getpid()
        self._released: str | None = None
        self._warned_refused = False
        self.refused = 0  # lock requests ignored after release
        self.handles_signals = install_handlers
        with _REGISTRY_LOCK:
            _GUARDS.append(self)
        _ensure_atexit()
        self.ensure_signal_handlers()

    def ensure_signal_handlers(self) -> bool:
        """Install the SIGTERM/SIGINT handlers if this guard wants them and this is the main
        thread (idempotent); True when they are in place."""
        if not self.handles_signals:
            return False
        return _install_signal_handlers() or bool(_INSTALLED)

    # -- context manager: reset on the way out, whatever happened --------------

    def __enter__(self) -> "ClockGuard":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = f"released ({self._released})" if self._released else "armed"
        return f"ClockGuard({str(self.state_dir)!r}, {len(self._entries)} locked, {state})"

    # -- queries ----------------------------------------------------------------

    def locked_devices(self) -> list[GpuDevice]:
        with self._lock:
            return [e.device for e in self._entries.values()]

    def state_path(self, device: GpuDevice) -> Path | None:
        entry = self._entries.get(id(device))
        return self.state_dir / entry.state_file if entry and entry.state_file else None

    @property
    def released(self) -> str | None:
        """Why the guard stopped locking (``"SIGTERM"``, ``"exit"``, ``"closed"``), or None."""
        return self._released

    # -- locking ----------------------------------------------------------------

    def lock(self, device: GpuDevice, freq_mhz: int) -> bool:
        """Lock ``device``'s SM clock; False (nothing done) once the guard is released."""
        with self._lock:
            if os.getpid() != self._pid:
                raise GpuError(f"this clock guard belongs to pid {self._pid}: a forked child must not lock GPU clocks")
            if self._released is not None:
                self.refused += 1
                if not self._warned_refused:
                    self._warned_refused = True
                    _say(f"GPU clocks stay at the driver's default: clock locking was switched off in this "
                         f"process by {self._released}")
                return False
            key = id(device)
            entry = self._entries.get(key)
            first = entry is None
            if entry is None:
                name = self._write_state(device, int(freq_mhz)) if device.backend == "nvml" else None
                entry = _Entry(device, name, int(freq_mhz))
                self._entries[key] = entry
            try:
                device.set_locked_clocks(freq_mhz)
            except BaseException:
                if first and device.locked_clock_mhz() is None:
                    self._forget(entry)
                raise
            return True

    def reset(self, device: GpuDevice) -> None:
        """Reset ``device``'s locked clocks and remove its state file.

        On failure the state file stays (``envpipe reset-clocks`` can repair it)
        and the error is raised.
        """
        with self._lock:
            if os.getpid() != self._pid:
                return
            device.reset_locked_clocks()
            entry = self._entries.get(id(device))
            if entry is not None:
                self._forget(entry)

    def reset_all(self) -> list[str]:
        """Reset every guarded device; returns a line per failure (never raises)."""
        problems: list[str] = []
        with self._lock:
            if os.getpid() != self._pid:
                return problems
            for entry in list(self._entries.values()):
                try:
                    entry.device.reset_locked_clocks()
                except Exception as exc:  # keep going: the other GPUs must be reset too
                    where = f" (state file {self.state_dir / entry.state_file})" if entry.state_file else ""
                    problems.append(f"{device_label(entry.device)}: {exc}{where}")
                    continue
                self._forget(entry)
        return problems

    def release(self, reason: str) -> list[str]:
        """Reset everything and stop locking for good (exit, termination signal)."""
        with self._lock:
            if os.getpid() != self._pid:
                return []
            if self._released is None:
                self._released = reason
            return self.reset_all()

    def rearm(self) -> None:
        """Allow locking again after a SIGINT was handled (interactive sessions)."""
        with self._lock:
            if self._released != "closed":
                self._released = None
                self._warned_refused = False

    def close(self) -> None:
        """Reset every guarded device and retire the guard; raises if a reset failed."""
        problems = self.release("closed")
        with _REGISTRY_LOCK:
            if self in _GUARDS and not self._entries:
                _GUARDS.remove(self)
                _restore_signal_handlers_if_unused()
        with self._lock:
            if self._store is not None and not self._entries:
                self._store.close()
                self._store = None
        if problems:
            raise GpuError(
                "could not reset GPU clocks: " + "; ".join(problems) + f"; repair with: {REPAIR_COMMAND}"
            )

    # -- state files --------------------------------------------------------------

    def _write_state(self, device: GpuDevice, freq_mhz: int) -> str:
        """Record ``device`` in the store before its clock is locked; returns the file name."""
        info = device.info()
        pid = os.getpid()
        now = time.time()
        record = LockRecord(
            uuid=info.uuid,
            pid=pid,
            hostname=hostname(),
            locked_mhz=freq_mhz,
            pci_bus_id=info.pci_bus_id,
            name=info.name,
            backend=info.backend,
            pid_start_ticks=_proc_start_ticks(pid),
            boot_id=_boot_id(),
            time=time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(now)),
            unix_time=now,
            command=" ".join(sys.argv)[:300],
            repair=REPAIR_COMMAND + ("" if self.state_dir == Path(_DEFAULT_STATE_DIR)
                                     else f" --state-dir {self.state_dir}"),
        )
        path = self.state_dir / state_file_name(info.uuid)
        tail = (f"it lets `{REPAIR_COMMAND}` repair the GPU after a crash: set {_STATE_DIR_ENV} to a folder of "
                "this node that only root (or you) can write")
        try:
            if self._store is None:
                self._store = ClockStateStore.open(self.state_dir, create=True)
            assert self._store is not None  # create=True never gives None
            _note_previous(self._store, state_file_name(info.uuid))
            return self._store.write(record)
        except StateStoreError as exc:
            raise GpuError(f"cannot write the locked-clock state file {path}: {exc}; {tail}") from exc
        except OSError as exc:
            raise GpuError(f"cannot write the locked-clock state file {path} ({exc.strerror or exc}); {tail}") from exc

    def _forget(self, entry: _Entry) -> None:
        self._entries.pop(id(entry.device), None)
        if entry.state_file is not None and self._store is not None:
            try:
                self._store.remove_name(entry.state_file)
            except OSError as exc:
                _say(f"could not remove {self.state_dir / entry.state_file}: {exc}")


def device_label(device: GpuDevice) -> str:
    try:
        return device.info().label()
    except Exception:
        return repr(device)


def _note_previous(store: ClockStateStore, file_name: str) -> None:
    """Say what an earlier record of this GPU was: another live run's lock, or an unusable file.

    Whatever the file holds, this only prints (sanitised): a planted or broken record is replaced,
    never trusted, and never stops the lock.
    """
    entry = store.read(file_name)
    if entry.problem == "gone":
        return
    if entry.record is None:
        _say(f"{store.path / entry.shown_name}: replacing an unusable state file ({printable(entry.problem)})")
        return
    old = entry.record
    if old.pid != os.getpid() and old.hostname == hostname() and pid_alive(old.pid, old.pid_start_ticks, old.boot_id):
        _say(f"{store.path / entry.shown_name}: pid {old.pid} ({printable(old.command or '?', 120)}) also holds "
             "this GPU's clocks locked; taking over")


# ---------------------------------------------------------------------------
# process-wide: atexit, signals, fork
# ---------------------------------------------------------------------------


def _release_all(reason: str) -> None:
    with _REGISTRY_LOCK:
        guards = list(_GUARDS)
    for guard in guards:
        for problem in guard.release(reason):
            _say(f"could not reset GPU clocks ({reason}): {problem}; repair with: {REPAIR_COMMAND}")


def _at_exit() -> None:
    _release_all("exit")


def _ensure_atexit() -> None:
    global _ATEXIT_REGISTERED
    with _REGISTRY_LOCK:
        if not _ATEXIT_REGISTERED:
            atexit.register(_at_exit)
            _ATEXIT_REGISTERED = True


def _on_signal(signum: int, frame: Any) -> Any:
    try:
        name = signal.Signals(signum).name
    except ValueError:
        name = f"signal {signum}"
    _release_all(name)
    previous = _PREVIOUS.get(signum, signal.SIG_DFL)
    if callable(previous):
        return previous(signum, frame)
    if previous == signal.SIG_IGN:
        return None
    # SIG_DFL (or a handler installed outside Python): the default action, i.e. die by the
    # signal, so the exit status is the conventional one (143 for SIGTERM in a shell).
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)
    time.sleep(1.0)
    os._exit(128 + signum)


def _install_signal_handlers(signals: tuple[int, ...] = (signal.SIGTERM, signal.SIGINT)) -> bool:
    """Install the reset-then-chain handlers (once per process; main thread only).

    Returns False when called from another thread (nothing installed). A signal
    whose current disposition is ``SIG_IGN`` is left ignored.
    """
    if threading.current_thread() is not threading.main_thread():
        return False
    with _REGISTRY_LOCK:
        for sig in signals:
            if sig in _INSTALLED:
                continue
            current = signal.getsignal(sig)
            if current == signal.SIG_IGN:
                continue
            _PREVIOUS[sig] = current
            signal.signal(sig, _on_signal)
            _INSTALLED.add(sig)
    return True


def _restore_signal_handlers_if_unused() -> None:
    """Put back the handlers ours chained to once no guard that handles signals is left (main thread
    only; call with ``_REGISTRY_LOCK`` held). A handler set on top of ours since stays, and so does ours
    under it: that handler may chain to it. A later guard installs again, over what is there then."""
    if threading.current_thread() is not threading.main_thread():
        return
    if any(guard.handles_signals for guard in _GUARDS):
        return
    for sig in sorted(_INSTALLED):
        previous = _PREVIOUS.get(sig, signal.SIG_DFL)
        if signal.getsignal(sig) is _on_signal and previous is not None:  # None: set outside Python, no way back
            signal.signal(sig, previous)
            _PREVIOUS.pop(sig, None)
            _INSTALLED.discard(sig)


def _after_fork_in_child() -> None:
    # A forked child (a DataLoader worker, say) owns no clocks: it must not reset the
    # parent's GPU when it exits or gets SIGTERM.
    global _DEFAULT
    with _REGISTRY_LOCK:
        _GUARDS.clear()
        _DEFAULT = None


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def default_guard() -> ClockGuard:
    """The process's shared guard (state directory from ``ENVPIPE_STATE_DIR`` or the default)."""
    global _DEFAULT
    with _REGISTRY_LOCK:
        if _DEFAULT is None or _DEFAULT.released == "closed":
            _DEFAULT = ClockGuard()
        return _DEFAULT
