"""Atomic file writes: a temporary file in the target's directory, then a rename.

Readers (another rank, a later run, ``envpipe reset-clocks``) see the old file
or the new one, never half of one, whatever interrupts the writer.
:func:`write_all_atomic` writes several files all or none, and
:func:`check_writable` tells before any work whether a path can be written.
"""

from __future__ import annotations

import json
import os
import stat
import tempfile
from collections.abc import Sequence
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
        if path.exists() and not path.is_dir():
            raise OutputPathError(f"{what} {path}: is a file, not a directory: give a directory to write into")
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


def write_all_atomic(files: Sequence[tuple[str | os.PathLike[str], str | bytes]], mode: int = 0o644) -> list[Path]:
    """Write every ``(path, data)`` or none: each goes to a temporary file next to its target first, and
    only once all are written are they renamed into place (a rename in one directory does not fail for
    want of space). On an error the temporary files and the folders made for them are removed."""
    made: list[Path] = []  # folders created here, parents first
    staged: list[tuple[str, Path]] = []
    try:
        for target, data in files:
            target = Path(target)
            try:
                missing = [p for p in (target.parent, *target.parent.parents) if not p.exists()]
                made += reversed(missing)  # before mkdir: it may fail half-way
                target.parent.mkdir(parents=True, exist_ok=True)
                staged.append((_write_temp(target, data, fsync=False, mode=mode), target))
            except OSError as exc:
                exc.filename = str(target)  # the file asked for, not a temporary name
                raise
        for tmp, target in staged:
            os.replace(tmp, target)
    except BaseException:
        for tmp, _ in staged:
            try:
                os.unlink(tmp)
            except FileNotFoundError:
                pass
        for folder in reversed(made):
            try:
                folder.rmdir()
            except OSError:
                pass
        raise
    return [target for _, target in staged]


def _write_temp(path: Path, data: str | bytes, *, fsync: bool, mode: int) -> str:
    """``data`` in a new temporary file in ``path``'s directory; returns its name (removed on error)."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data.encode() if isinstance(data, str) else data)
            if fsync:
                fh.flush()
                os.fsync(fh.fileno())
        os.chmod(tmp, mode)  # mkstemp creates 0600
    except BaseException:
        os.unlink(tmp)
        raise
    return tmp


def write_atomic(path: str | os.PathLike[str], data: str | bytes, *, fsync: bool = False,
                 mode: int = 0o644) -> Path:
    """Write ``data`` (text is UTF-8) to ``path``, creating its directory; returns the path.

    ``fsync`` also flushes the data to disk before the rename (state that must
    survive a machine crash, not just a process crash).
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = _write_temp(path, data, fsync=fsync, mode=mode)
    try:
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise
    return path


def write_json_atomic(path: str | os.PathLike[str], data: Any, *, fsync: bool = False,
                      sort_keys: bool = False, indent: int | None = 1) -> Path:
    """``data`` as JSON (with a final newline), atomically."""
    return write_atomic(path, json.dumps(data, indent=indent, sort_keys=sort_keys) + "\n", fsync=fsync)
