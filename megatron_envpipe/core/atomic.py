"""Atomic file writes: a temporary file in the target's directory, then a rename.

Readers (another rank, a later run, ``envpipe reset-clocks``) see the old file
or the new one, never half of one, whatever interrupts the writer.
:func:`write_all_atomic` writes several files all or none, even when
SIGINT/SIGTERM arrive mid-way (:func:`_signals_deferred`);
:func:`check_writable` tells before any work whether a path can be written,
:func:`same_file` whether an output would overwrite an input. New files get
``0o666 & ~umask``, as any program's; a replaced file keeps its mode.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import signal
import stat
import tempfile
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from megatron_envpipe.errors import UsageError


class OutputPathError(UsageError, ValueError):
    """An output path that cannot be written; the message names it and why."""


def check_writable(path: str | os.PathLike[str], what: str, *, directory: bool = False) -> Path:
    """Raise OutputPathError unless ``path`` can be written (a file, or with ``directory`` a folder to fill).

    Meant to run before any work, so a bad path fails fast and leaves nothing
    behind. Permission bits do not stop root, so the nearest existing folder
    is probed by creating (and removing) a temporary file in it: that catches
    read-only mounts, /proc and /sys too. ``what`` names the path in the
    message, e.g. ``"--out"``.
    """
    path = Path(path)
    try:
        return _check_writable(path, what, directory)
    except OSError as exc:  # e.g. a folder on the way that this user may not enter
        raise OutputPathError(f"{what} {path}: {exc.strerror or exc}") from None


def _check_writable(path: Path, what: str, directory: bool) -> Path:
    if directory:
        if path.is_symlink() and not path.exists():
            raise OutputPathError(f"{what} {path}: is a link to nothing: give a directory to write into")
        if path.exists() and not path.is_dir():
            kind = "a file" if path.is_file() else "not a file or directory (a FIFO, device or socket)"
            raise OutputPathError(f"{what} {path}: is {kind}, not a directory: give a directory to write into")
    else:
        if len(os.fsencode(path.name)) > 255:  # the limit of common file systems; checked first, stat() fails on it
            raise OutputPathError(f"{what} {path.parent / path.name[:40]}...: file name longer than 255 bytes: "
                                  "give a shorter name")
        if path.is_dir():
            raise OutputPathError(f"{what} {path}: is a directory: give a file name")
        if path.exists() and not stat.S_ISREG(path.stat().st_mode):
            # Renaming over a device or FIFO (/dev/null) would replace it, as root even in /dev.
            raise OutputPathError(f"{what} {path}: is not a regular file: give a file name")
    folder = path if directory else path.parent
    existing = next((p for p in (folder, *folder.parents) if p.exists() or p.is_symlink()), Path("."))
    if not existing.is_dir():
        raise OutputPathError(f"{what} {path}: {existing} is a file, not a directory: give a path in a directory")
    try:
        fd, probe = tempfile.mkstemp(prefix=".envpipe-probe-", dir=existing)
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        raise OutputPathError(f"{what} {path}: cannot write in {existing}: {exc.strerror or exc}") from None
    return path


def check_output(path: str | os.PathLike[str], what: str, others: Sequence[tuple[str, str | None]] = ()) -> Path:
    """:func:`check_writable` for a file that will be written (replaced or appended to), plus what a rename
    does not need: an existing file this user may write (a read-only one fails at start-up, not mid-run),
    no link to nothing, and none of ``others`` (``(what, path)``: the command's inputs and its other
    outputs; writing one would destroy it). Raises OutputPathError naming ``what``."""
    target = check_writable(path, what)
    if target.is_symlink() and not target.exists():
        raise OutputPathError(f"{what} {target}: is a link to nothing ({os.readlink(target)}): give a file name")
    if target.exists() and not os.access(target, os.W_OK):
        raise OutputPathError(f"{what} {target}: is read-only for this user: give a file you may write")
    for other, other_path in others:
        if other_path and same_file(target, other_path):
            raise OutputPathError(f"{what} {target} is also {other} {other_path}: writing it would destroy that; "
                                  f"give {what} a file name of its own")
    return target


def same_file(a: str | os.PathLike[str], b: str | os.PathLike[str]) -> bool:
    """Whether ``a`` and ``b`` name one file: the same path once symlinks and ``..`` are resolved, or
    (both existing) the same inode, as hard links are."""
    try:
        return os.path.realpath(a) == os.path.realpath(b) or os.path.samefile(a, b)
    except (OSError, ValueError):  # one does not exist (or a NUL in a name): not the same file
        return False


# Held back while an output set is committed: the signals that stop a command (Ctrl-C, kill,
# a closed terminal). SIGKILL cannot be held; a machine crash is what fsync is for.
_DEFERRED_SIGNALS = tuple(getattr(signal, name) for name in ("SIGINT", "SIGTERM", "SIGHUP") if hasattr(signal, name))


@contextlib.contextmanager
def _signals_deferred() -> Iterator[None]:
    """SIGINT, SIGTERM and SIGHUP arriving inside the block are delivered when it ends, as usual.

    So a Ctrl-C or a ``kill`` lands before or after an output set is committed,
    never between its writes and renames: no temporary file left, no half set.
    In the main thread the signals' handlers are swapped for ones that note them
    (then the notes are re-raised with the old handlers back); in another thread,
    where handlers cannot be set, the signals are blocked for that thread.
    """
    if threading.current_thread() is not threading.main_thread():
        old_mask = signal.pthread_sigmask(signal.SIG_BLOCK, _DEFERRED_SIGNALS)
        try:
            yield
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, old_mask)
        return
    caught: list[int] = []
    previous: dict[int, Any] = {}
    try:
        for sig in _DEFERRED_SIGNALS:
            handler = signal.getsignal(sig)
            if handler is not signal.SIG_IGN and handler is not None:  # None: a handler set outside Python
                previous[sig] = signal.signal(sig, lambda signum, frame: caught.append(signum))
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        for sig in dict.fromkeys(caught):  # once each, in arrival order; default actions end the process here
            signal.raise_signal(sig)


def write_all_atomic(files: Sequence[tuple[str | os.PathLike[str], str | bytes]],
                     mode: int | None = None) -> list[Path]:
    """Write every ``(path, data)`` or none: each goes to a temporary file next to its target first, and
    only once all are written are they renamed into place (a rename in one directory does not fail for
    want of space). On an error the temporary files and the folders made for them are removed, and
    targets already renamed are put back (an earlier version restored from a hard link made before the
    first rename, a new file removed). SIGINT/SIGTERM/SIGHUP wait until the set is committed
    (:func:`_signals_deferred`). ``mode``: None gives a new file ``0o666 & ~umask`` and a replaced file
    its old mode; an int sets it."""
    targets = [Path(target) for target, _ in files]
    for i, target in enumerate(targets):
        if any(same_file(target, other) for other in targets[:i]):
            raise OutputPathError(f"{target} is given twice: an output set names each file once")
    made: list[Path] = []  # folders created here, parents first
    staged: list[tuple[str, Path]] = []
    backups: dict[Path, str | None] = {}  # target -> hard link to its old version (None: it was new)
    done: list[Path] = []
    with _signals_deferred():
        try:
            for target, (_, data) in zip(targets, files):
                try:
                    missing = [p for p in (target.parent, *target.parent.parents) if not p.exists()]
                    made += reversed(missing)  # before mkdir: it may fail half-way
                    target.parent.mkdir(parents=True, exist_ok=True)
                    staged.append((_write_temp(target, data, fsync=False, mode=mode), target))
                except OSError as exc:
                    exc.filename = str(target)  # the file asked for, not a temporary name
                    raise
            if len(staged) > 1:
                for _, target in staged:
                    backups[target] = _backup(target)
            for tmp, target in staged:
                os.replace(tmp, target)
                done.append(target)
        except BaseException:
            _undo(staged, done, backups, made)
            raise
        finally:
            for backup in backups.values():
                if backup is not None:
                    _unlink_quietly(backup)
    return [target for _, target in staged]


def _backup(target: Path) -> str | None:
    """A hard link to ``target``'s current version (None when there is none to keep)."""
    if not target.is_file():
        return None
    for _ in range(100):
        name = str(target.parent / f".{_short(target.name)}.{secrets.token_hex(4)}.bak")
        try:
            os.link(target, name, follow_symlinks=False)
            return name
        except FileExistsError:
            continue
    raise FileExistsError(f"{target}: no free backup name")


def _undo(staged: list[tuple[str, Path]], done: list[Path], backups: dict[Path, str | None],
          made: list[Path]) -> None:
    """After a failed commit: every target as it was, no temporary file, no folder made for it."""
    for target in done:
        backup = backups.get(target)
        try:
            if backup is not None:
                os.replace(backup, target)
                backups[target] = None
            else:
                os.unlink(target)
        except OSError:
            pass
    for tmp, target in staged:
        if target not in done:
            _unlink_quietly(tmp)
    for folder in reversed(made):
        try:
            folder.rmdir()
        except OSError:
            pass


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def _short(name: str) -> str:
    """``name`` cut so that a dot, it and a 13-byte suffix still fit a 255-byte file name."""
    return name if len(os.fsencode(name)) <= 200 else "envpipe"


def _existing_mode(path: Path) -> int | None:
    """The permission bits of the regular file at ``path`` (followed), or None."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return stat.S_IMODE(st.st_mode) if stat.S_ISREG(st.st_mode) else None


def _write_temp(path: Path, data: str | bytes, *, fsync: bool, mode: int | None) -> str:
    """``data`` in a new temporary file in ``path``'s directory; returns its name (removed on error).

    Created 0o666 so that the kernel applies the umask, as for any new file; then
    given ``mode``, or the mode of the file it will replace."""
    keep = mode if mode is not None else _existing_mode(path)
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    for _ in range(100):
        tmp = str(path.parent / f".{_short(path.name)}.{secrets.token_hex(4)}.tmp")
        try:
            fd = os.open(tmp, flags, 0o666)
            break
        except FileExistsError:
            continue
    else:
        raise FileExistsError(f"{path}: no free temporary name")
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data.encode() if isinstance(data, str) else data)
            if keep is not None:
                os.fchmod(fh.fileno(), keep)
            if fsync:
                fh.flush()
                os.fsync(fh.fileno())
    except BaseException:
        os.unlink(tmp)
        raise
    return tmp


def write_atomic(path: str | os.PathLike[str], data: str | bytes, *, fsync: bool = False,
                 mode: int | None = None) -> Path:
    """Write ``data`` (text is UTF-8) to ``path``, creating its directory; returns the path.

    ``fsync`` also flushes the data to disk before the rename (state that must
    survive a machine crash, not just a process crash). ``mode`` as in
    :func:`write_all_atomic`: None respects the umask and an existing file's mode.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with _signals_deferred():
        tmp = _write_temp(path, data, fsync=fsync, mode=mode)
        try:
            os.replace(tmp, path)
        except BaseException:
            os.unlink(tmp)
            raise
    return path


def write_json_atomic(path: str | os.PathLike[str], data: Any, *, fsync: bool = False,
                      sort_keys: bool = False, indent: int | None = 1, mode: int | None = None) -> Path:
    """``data`` as standard JSON (with a final newline), atomically; ValueError before writing if it holds nan or
    infinity, which JSON has no words for (Python's ``NaN``/``Infinity`` are refused by other readers)."""
    text = json.dumps(data, indent=indent, sort_keys=sort_keys, allow_nan=False)
    return write_atomic(path, text + "\n", fsync=fsync, mode=mode)
