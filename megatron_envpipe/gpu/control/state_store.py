"""The locked-clock state store: one JSON record per GPU whose clocks a run locked.

Root (or a ``CAP_SYS_ADMIN`` process) writes these records and root's
``envpipe reset-clocks`` acts on them, often from a SLURM epilog on a node other
users share, so the store is built like a privileged daemon's state folder
(docs/clock-state-store.md lists the guarantees):

* The folder is reached from ``/`` one component at a time through directory
  descriptors opened with ``O_NOFOLLOW``: every folder on the way must belong to
  root or to us and be writable by nobody else unless sticky (``/tmp``,
  ``/var/tmp``); a symbolic link is followed only where it sits in such a
  trusted folder and belongs to root or us. The store folder itself must belong
  to us, may not be writable by group or others, and is never a link; missing
  folders are created (0755 on the way, 0700 for the store) with the same checks.
  Anything else raises :class:`StateStoreError` naming the folder, why and what
  to do, and nothing in it is read.
* Every later operation goes through the verified folder's descriptor: files
  are opened relative to it with ``O_NOFOLLOW | O_NONBLOCK`` (a link is not
  followed, a FIFO cannot block), must be regular, ours, singly linked and at
  most :data:`_MAX_STATE_BYTES`; they are parsed into a :class:`LockRecord` whose
  every field is type- and range-checked; unlinking is relative to the same
  descriptor and only of the file that was read (same inode), so no path swapped
  in meanwhile can redirect a read, a write or an unlink.
* A bad file becomes a :class:`StateEntry` with a ``problem`` and never an
  exception: one bad file cannot stop the repair of the others, nor a training
  run. Strings from files pass through :func:`printable` before anyone prints them.

Pure Python (stdlib only).
"""

from __future__ import annotations

import json
import math
import os
import re
import stat
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from megatron_envpipe.gpu.devices.base import GpuError

__all__ = [
    "ClockStateStore",
    "LockRecord",
    "StateEntry",
    "StateFileError",
    "StateStoreError",
    "printable",
    "state_file_name",
]

_STATE_VERSION = 1
_MAX_STATE_BYTES = 64 * 1024  # a record is ~600 bytes; anything larger was not written by a guard
_MAX_PID = 2**31 - 1  # pid_t; Linux's pid_max is at most 2**22
_MAX_LOCKED_MHZ = 100_000
_MAX_LINK_HOPS = 40  # as the kernel's ELOOP limit
_UUID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:-]{0,127}")  # NVML: GPU-<hex...>, MIG-<...>
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC
_READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC


class StateStoreError(GpuError):
    """The state folder cannot be trusted or used; the message says which folder, why and what to do."""

    def __init__(self, message: str, *, permission: bool = False) -> None:
        super().__init__(message)
        self.permission = permission


class StateFileError(GpuError, ValueError):
    """One state file is unusable (kept inside :class:`StateEntry`; never escapes the store)."""


def printable(text: object, limit: int = 160) -> str:
    """``text`` safe to print on one terminal line: control and other non-printable characters
    escaped, at most ``limit`` characters (a planted name must not forge or hide lines)."""
    out = []
    for ch in str(text):
        out.append(ch if ch.isprintable() else ascii(ch)[1:-1])
    s = "".join(out)
    return s if len(s) <= limit else s[: limit - 3] + "..."


def state_file_name(uuid: str) -> str:
    """The file a GPU's record lives in: ``<uuid>.json`` with anything outside [A-Za-z0-9._-] as ``_``."""
    return (re.sub(r"[^A-Za-z0-9._-]", "_", uuid) or "unknown") + ".json"


# ---------------------------------------------------------------------------
# records
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class LockRecord:
    """What a guard records before it first locks a GPU: enough to find the GPU, tell whether the
    owner still runs (pid + start time + boot id), and say what happened."""

    uuid: str
    pid: int
    hostname: str
    locked_mhz: int
    pci_bus_id: str = "?"
    name: str = "?"
    backend: str = "nvml"
    pid_start_ticks: int | None = None
    boot_id: str | None = None
    time: str = "?"
    unix_time: float | None = None
    command: str = ""
    repair: str = ""
    version: int = _STATE_VERSION

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1, sort_keys=True, allow_nan=False) + "\n"

    @property
    def label(self) -> str:
        """``uuid (name, PCI bus)`` for messages, safe to print."""
        return printable(f"{self.uuid} ({self.name}, PCI {self.pci_bus_id})")

    @classmethod
    def from_json(cls, text: str) -> "LockRecord":
        """Parse and check one record; raises :class:`StateFileError` saying what is wrong."""
        try:
            data = json.loads(text, parse_constant=_reject_constant)
        except RecursionError:
            raise StateFileError("JSON nested too deeply") from None
        except ValueError as exc:  # JSONDecodeError, and NaN/Infinity from _reject_constant
            raise StateFileError(f"not JSON: {exc}") from None
        if not isinstance(data, dict):
            raise StateFileError(f"expected a JSON object, got {type(data).__name__}")
        for key in ("uuid", "pid", "hostname", "locked_mhz"):
            if key not in data:
                raise StateFileError(f"no {key!r}")
        unknown = sorted(set(data) - {f for f in cls.__dataclass_fields__})
        if unknown:
            raise StateFileError(f"unknown field {printable(unknown[0], 40)!r}")
        version = _int(data, "version", 1, _STATE_VERSION, default=_STATE_VERSION)
        uuid = _str(data, "uuid", 128)
        if not _UUID.fullmatch(uuid):
            raise StateFileError(f"'uuid' {printable(uuid, 60)!r} is not a GPU UUID")
        ticks = data.get("pid_start_ticks")
        unix_time = data.get("unix_time")
        if unix_time is not None and (not isinstance(unix_time, (int, float)) or isinstance(unix_time, bool)
                                      or not math.isfinite(unix_time) or unix_time < 0):
            raise StateFileError("'unix_time' must be a finite number of seconds >= 0")
        return cls(
            uuid=uuid,
            pid=_int(data, "pid", 1, _MAX_PID),
            hostname=_str(data, "hostname", 255),
            locked_mhz=_int(data, "locked_mhz", 1, _MAX_LOCKED_MHZ),
            pci_bus_id=_str(data, "pci_bus_id", 64, default="?"),
            name=_str(data, "name", 96, default="?"),
            backend=_str(data, "backend", 32, default="nvml"),
            pid_start_ticks=None if ticks is None else _int(data, "pid_start_ticks", 0, 2**63 - 1),
            boot_id=None if data.get("boot_id") is None else _str(data, "boot_id", 64),
            time=_str(data, "time", 64, default="?"),
            unix_time=None if unix_time is None else float(unix_time),
            command=_str(data, "command", 1024, default=""),
            repair=_str(data, "repair", 4096, default=""),
            version=version,
        )


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a number JSON allows")


def _int(data: dict[str, Any], key: str, low: int, high: int, default: int | None = None) -> int:
    value = data.get(key, default)
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
        raise StateFileError(f"{key!r} must be a whole number in [{low}, {high}], got {printable(value, 40)}")
    return value


def _str(data: dict[str, Any], key: str, limit: int, default: str | None = None) -> str:
    value = data.get(key, default)
    if not isinstance(value, str) or len(value) > limit:
        raise StateFileError(f"{key!r} must be a string of at most {limit} characters")
    return value


@dataclass(frozen=True)
class StateEntry:
    """One ``*.json`` in the store: its record, or why it cannot be used (``problem``)."""

    file_name: str
    record: LockRecord | None = None
    problem: str | None = None
    inode: tuple[int, int] | None = None  # (st_dev, st_ino) of the file read: only that one is unlinked
    denied: bool = False  # the problem is a permission: root would read it

    @property
    def shown_name(self) -> str:
        return printable(self.file_name, 80)


# ---------------------------------------------------------------------------
# the store
# ---------------------------------------------------------------------------


class ClockStateStore:
    """A verified state folder, held open by descriptor (``with`` closes it)."""

    def __init__(self, path: Path, fd: int) -> None:
        self.path = path
        self._fd = fd
        self.owner_uid = os.fstat(fd).st_uid

    @classmethod
    def open(cls, path: str | os.PathLike[str], *, create: bool) -> "ClockStateStore | None":
        """The store at ``path``, verified; None when it does not exist and ``create`` is False.

        Raises :class:`StateStoreError` when the folder, or one on the way to it, could let
        another user swap what root reads (see the module doc), or cannot be created.
        """
        path = Path(os.path.abspath(path))
        fd = _open_verified(path, create)
        return None if fd is None else cls(path, fd)

    def __enter__(self) -> "ClockStateStore":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __repr__(self) -> str:
        return f"ClockStateStore({str(self.path)!r})"

    # -- reading -------------------------------------------------------------------

    def file_names(self) -> list[str]:
        """The record files, sorted (temporary ``.*`` files of an interrupted write are not records)."""
        with os.scandir(self._fd) as it:
            return sorted(e.name for e in it if e.name.endswith(".json") and not e.name.startswith("."))

    def entries(self) -> list[StateEntry]:
        return [self.read(name) for name in self.file_names()]

    def read(self, file_name: str) -> StateEntry:
        """One file, checked; a problem instead of an exception whatever the file is."""
        try:
            fd = os.open(file_name, _READ_FLAGS, dir_fd=self._fd)
        except FileNotFoundError:
            return StateEntry(file_name, problem="gone")
        except OSError as exc:
            if _is_link(self._fd, file_name):
                return StateEntry(file_name, problem="a symbolic link: not followed")
            return StateEntry(file_name, problem=f"cannot open it: {exc.strerror or exc}",
                              denied=isinstance(exc, PermissionError))
        try:
            st = os.fstat(fd)
            inode = (st.st_dev, st.st_ino)
            why = self._file_problem(st)
            if why:
                return StateEntry(file_name, problem=why, inode=inode)
            data = _read_capped(fd, _MAX_STATE_BYTES)
        except OSError as exc:
            return StateEntry(file_name, problem=f"cannot read it: {exc.strerror or exc}")
        finally:
            os.close(fd)
        if len(data) > _MAX_STATE_BYTES:
            return StateEntry(file_name, problem=f"larger than {_MAX_STATE_BYTES} bytes", inode=inode)
        try:
            record = LockRecord.from_json(data.decode("utf-8"))
        except UnicodeDecodeError:
            return StateEntry(file_name, problem="not UTF-8 text", inode=inode)
        except StateFileError as exc:
            return StateEntry(file_name, problem=str(exc), inode=inode)
        if state_file_name(record.uuid) != file_name:
            return StateEntry(file_name, problem=f"records GPU {printable(record.uuid, 60)}, whose file is "
                                                 f"{state_file_name(record.uuid)}", inode=inode)
        return StateEntry(file_name, record=record, inode=inode)

    def _file_problem(self, st: os.stat_result) -> str | None:
        if not stat.S_ISREG(st.st_mode):
            return f"not a regular file ({_kind(st.st_mode)})"
        if st.st_uid != self.owner_uid:
            return f"owned by uid {st.st_uid}, not by the store's owner (uid {self.owner_uid})"
        if st.st_nlink != 1:
            return f"has {st.st_nlink} hard links"
        if st.st_size > _MAX_STATE_BYTES:
            return f"{st.st_size} bytes, larger than the {_MAX_STATE_BYTES} a state file may take"
        return None

    # -- writing and removing ---------------------------------------------------------

    def write(self, record: LockRecord) -> str:
        """Write ``record`` atomically and durably (temporary file, fsync, rename, fsync of the
        folder), mode 0600; returns its file name."""
        name = state_file_name(record.uuid)
        tmp = f".{name}.{os.getpid()}.{os.urandom(4).hex()}.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600,
                     dir_fd=self._fd)
        try:
            try:
                os.write(fd, record.to_json().encode())
                os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, name, src_dir_fd=self._fd, dst_dir_fd=self._fd)
        except BaseException:
            try:
                os.unlink(tmp, dir_fd=self._fd)
            except OSError:
                pass
            raise
        os.fsync(self._fd)
        return name

    def remove(self, entry: StateEntry) -> bool:
        """Unlink ``entry``'s file from this folder if it is still the file that was read;
        False (nothing removed) when it is gone or was replaced meanwhile."""
        try:
            st = os.stat(entry.file_name, dir_fd=self._fd, follow_symlinks=False)
        except FileNotFoundError:
            return False
        if entry.inode is not None and (st.st_dev, st.st_ino) != entry.inode:
            return False
        os.unlink(entry.file_name, dir_fd=self._fd)
        return True

    def remove_name(self, file_name: str) -> bool:
        """Unlink this folder's regular file ``file_name`` (the guard's own record); False if absent."""
        try:
            st = os.stat(file_name, dir_fd=self._fd, follow_symlinks=False)
        except FileNotFoundError:
            return False
        if not stat.S_ISREG(st.st_mode):
            return False
        os.unlink(file_name, dir_fd=self._fd)
        return True


def _read_capped(fd: int, cap: int) -> bytes:
    chunks, size = [], 0
    while size <= cap:
        chunk = os.read(fd, cap + 1 - size)
        if not chunk:
            break
        chunks.append(chunk)
        size += len(chunk)
    return b"".join(chunks)


def _is_link(dir_fd: int, name: str) -> bool:
    try:
        return stat.S_ISLNK(os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode)
    except OSError:
        return False


def _kind(mode: int) -> str:
    for test, what in ((stat.S_ISREG, "a regular file"), (stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"), (stat.S_ISLNK, "a link")):
        if test(mode):
            return what
    return "not a regular file"


# ---------------------------------------------------------------------------
# reaching the folder safely
# ---------------------------------------------------------------------------


def _refuse(where: Path, why: str, fix: str, *, permission: bool = False) -> StateStoreError:
    return StateStoreError(f"clock state folder {printable(where)}: {why}; {fix}", permission=permission)


_FIX_OWNER = ("the state folder must belong to root (or to the user who locks clocks) and be writable by no one "
              "else: remove the folder as root, or pass --state-dir / set ENVPIPE_STATE_DIR to one that is")


def _check_folder(where: Path, st: os.stat_result, *, final: bool) -> None:
    euid = os.geteuid()
    if final:
        if st.st_uid != euid:
            raise _refuse(where, f"owned by uid {st.st_uid}, not by this user (uid {euid}), so someone else could "
                                 "plant or swap the files root acts on", _FIX_OWNER)
        if st.st_mode & 0o022:
            raise _refuse(where, f"writable by group or others (mode {stat.S_IMODE(st.st_mode):04o})",
                          f"`chmod 700 {printable(where)}` as its owner, or {_FIX_OWNER.split(': ', 1)[1]}")
        return
    if st.st_uid not in (0, euid):
        raise _refuse(where, f"owned by uid {st.st_uid}, who could swap the state folder inside it", _FIX_OWNER)
    if st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX:
        raise _refuse(where, f"writable by group or others without the sticky bit (mode "
                             f"{stat.S_IMODE(st.st_mode):04o}), so anyone could swap the state folder inside it",
                      _FIX_OWNER)


def _trusted_for_links(st: os.stat_result) -> bool:
    """A folder whose links we may follow: root's or ours, writable by no one else."""
    return st.st_uid in (0, os.geteuid()) and not st.st_mode & 0o022


def _open_verified(path: Path, create: bool) -> int | None:
    """A descriptor of the verified folder ``path`` (see the module doc), or None when missing."""
    stack: list[tuple[int, Path]] = []  # (descriptor, path) from "/" down; ".." pops

    def close_all() -> None:
        for fd, _ in stack:
            os.close(fd)
        stack.clear()

    def reset_to_root() -> None:
        close_all()
        fd = os.open("/", _DIR_FLAGS)
        stack.append((fd, Path("/")))
        _check_folder(Path("/"), os.fstat(fd), final=False)

    pending = [p for p in reversed(path.parts[1:])]
    if not pending:
        raise _refuse(path, "is the root folder", "pass a folder of its own")
    hops = 0
    try:
        reset_to_root()
        while pending:
            name = pending.pop()
            if name in ("", "."):
                continue
            parent_fd, parent = stack[-1]
            if name == "..":
                if len(stack) > 1:
                    os.close(stack.pop()[0])
                continue
            last = not pending
            where = parent / name
            try:
                fd = os.open(name, _DIR_FLAGS | os.O_NOFOLLOW, dir_fd=parent_fd)
            except FileNotFoundError:
                if not create:
                    return None
                try:
                    os.mkdir(name, 0o700 if last else 0o755, dir_fd=parent_fd)
                except FileExistsError:
                    pass
                except PermissionError as exc:
                    raise _refuse(where, f"cannot create it ({exc.strerror})",
                                  "run as root, or set ENVPIPE_STATE_DIR to a folder you own on this node",
                                  permission=True) from None
                pending.append(name)  # open and check what is there now
                continue
            except PermissionError as exc:
                raise _refuse(where, f"cannot enter it ({exc.strerror})", "run as root (`sudo envpipe reset-clocks`)",
                              permission=True) from None
            except OSError as exc:
                try:
                    lst = os.stat(name, dir_fd=parent_fd, follow_symlinks=False)
                except OSError:
                    raise _refuse(where, f"cannot open it ({exc.strerror or exc})", _FIX_OWNER) from None
                if not stat.S_ISLNK(lst.st_mode):
                    raise _refuse(where, f"is {_kind(lst.st_mode)}, not a folder",
                                  "pass --state-dir the folder runs record locked clocks in (default "
                                  "$ENVPIPE_STATE_DIR, else /var/lib/megatron-envpipe/locked-clocks), or "
                                  "`sudo envpipe reset-clocks --all` to reset every GPU here") from None
                if last:
                    raise _refuse(where, "is a symbolic link (never followed for the store itself)",
                                  "pass the real folder") from None
                if not _trusted_for_links(os.fstat(parent_fd)):
                    raise _refuse(where, f"is a symbolic link (owned by uid {lst.st_uid}) in a folder others can "
                                         "write, so it is not followed", "pass a path without it") from None
                if lst.st_uid not in (0, os.geteuid()):  # the module doc: only root's links and ours
                    raise _refuse(where, f"is a symbolic link owned by uid {lst.st_uid}, not by root or this user "
                                         f"(uid {os.geteuid()}), so it is not followed",
                                  "pass a path without it") from None
                hops += 1
                if hops > _MAX_LINK_HOPS:
                    raise _refuse(where, "too many symbolic links", "pass the real folder") from None
                target = os.readlink(name, dir_fd=parent_fd)
                if target.startswith("/"):
                    reset_to_root()
                pending.extend(reversed(Path(target).parts[1:] if target.startswith("/") else Path(target).parts))
                continue
            stack.append((fd, where))
            _check_folder(where, os.fstat(fd), final=last)
        fd, _ = stack.pop()
        close_all()
        return fd
    except BaseException:
        close_all()
        raise

