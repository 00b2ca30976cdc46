"""Atomic file writes: a temporary file in the target's directory, then a rename.

Readers (another rank, a later run, ``envpipe reset-clocks``) see the old file
or the new one, never half of one, whatever interrupts the writer.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any


def write_atomic(path: str | os.PathLike[str], data: str | bytes, *, fsync: bool = False,
                 mode: int = 0o644) -> Path:
    """Write ``data`` (text is UTF-8) to ``path``, creating its directory; returns the path.

    ``fsync`` also flushes the data to disk before the rename (state that must
    survive a machine crash, not just a process crash).
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data.encode() if isinstance(data, str) else data)
            if fsync:
                fh.flush()
                os.fsync(fh.fileno())
        os.chmod(tmp, mode)  # mkstemp creates 0600
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    return path


def write_json_atomic(path: str | os.PathLike[str], data: Any, *, fsync: bool = False,
                      sort_keys: bool = False, indent: int | None = 1) -> Path:
    """``data`` as JSON (with a final newline), atomically."""
    return write_atomic(path, json.dumps(data, indent=indent, sort_keys=sort_keys) + "\n", fsync=fsync)
