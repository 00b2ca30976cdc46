"""Reading the text files users give (profiles, plans, GPU tables, configs) with errors that name the file and line.

Every read is bounded and from a regular file only: a FIFO (which would block
the open, or the read, forever), a device such as ``/dev/zero`` (endless), a
socket or a directory, also behind a symlink, is refused before a byte is
read, and a file larger than its role's limit (:data:`_MAX_BYTES`) is refused
without reading more than the limit plus one byte. A file that cannot be read,
or is not UTF-8 text (a binary file, a spreadsheet saved in another encoding),
raises the caller's error class with one line saying which file, where, and
what to do.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

MIB = 1 << 20
# The largest file of each role, in bytes. A profile of 10,000 stages x 100 clocks is ~100 MB of rows
# only in theory; real ones (8 stages, ~70 clocks, a few ranks) are under 1 MB. A plan of 1.8 M units
# (beyond what the planners serve) is 64 MB of indented JSON. Tables and configs are a few kB.
_PROFILE_MAX_BYTES = 64 * MIB
_PLAN_MAX_BYTES = 64 * MIB
_TABLE_MAX_BYTES = 4 * MIB
_CONFIG_MAX_BYTES = 4 * MIB
_CORPUS_MAX_BYTES = 256 * MIB
_MAX_BYTES = {
    "profile": _PROFILE_MAX_BYTES,
    "plan": _PLAN_MAX_BYTES,
    "GPU table": _TABLE_MAX_BYTES,
    "demo config": _CONFIG_MAX_BYTES,
    "corpus": _CORPUS_MAX_BYTES,
}
_DEFAULT_MAX_BYTES = 4 * MIB  # any other role
_READ_CHUNK = 1 * MIB


def read_text(path: str | os.PathLike[str], what: str, error: type[Exception], max_bytes: int | None = None) -> str:
    """The UTF-8 text of ``path`` (a leading byte-order mark is dropped); ``error(message)`` if it cannot be.

    ``what`` names the file's role in the message, e.g. ``"profile"``, and picks its size limit
    from :data:`_MAX_BYTES` unless ``max_bytes`` is given.
    """
    path = Path(path)
    data = read_bytes(path, what, error, max_bytes)
    try:
        # utf-8-sig: spreadsheets and editors on Windows start UTF-8 files with a byte-order mark.
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        raise error(
            f"{path}:{line}: not UTF-8 text (byte 0x{data[exc.start]:02x} at offset {exc.start}): "
            f"give the {what} as a UTF-8 text file"
        ) from None


def read_bytes(path: str | os.PathLike[str], what: str, error: type[Exception], max_bytes: int | None = None) -> bytes:
    """The bytes of the regular file ``path``, at most ``max_bytes`` (default: the role's limit); else ``error``."""
    path = Path(path)
    limit = max_bytes if max_bytes is not None else _MAX_BYTES.get(what, _DEFAULT_MAX_BYTES)
    try:
        # stat first, so a device or FIFO is never even opened (opening one can have effects of its own).
        _check_kind(path, os.stat(path).st_mode, what, error)
        # O_NONBLOCK: should the path become a FIFO between stat and open, the open returns at once
        # (it would wait for a writer); fstat below then refuses it. It changes nothing for regular files.
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY)
    except OSError as exc:
        raise error(f"{path}: cannot read {what}: {exc.strerror or exc}") from None
    try:
        info = os.fstat(fd)
        _check_kind(path, info.st_mode, what, error)
        if info.st_size > limit:
            raise error(_too_big(path, what, limit))
        chunks: list[bytes] = []
        size = 0
        while size <= limit:  # at most limit + 1 bytes: a file that grows while read is caught too
            chunk = os.read(fd, min(_READ_CHUNK, limit + 1 - size))
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
    except OSError as exc:
        raise error(f"{path}: cannot read {what}: {exc.strerror or exc}") from None
    finally:
        os.close(fd)
    if size > limit:
        raise error(_too_big(path, what, limit))
    return b"".join(chunks)


def _check_kind(path: Path, mode: int, what: str, error: type[Exception]) -> None:
    if stat.S_ISREG(mode):
        return
    if stat.S_ISDIR(mode):
        raise error(f"{path}: is a directory, not a {what} file")
    kind = ("a FIFO" if stat.S_ISFIFO(mode) else "a character device" if stat.S_ISCHR(mode)
            else "a block device" if stat.S_ISBLK(mode) else "a socket" if stat.S_ISSOCK(mode) else "not a file")
    raise error(f"{path}: is {kind}, not a regular file: give the {what} as a file")


def _too_big(path: Path, what: str, limit: int) -> str:
    size = f"{limit // MIB} MiB" if limit % MIB == 0 else f"{limit} bytes"
    return f"{path}: larger than {size}, the limit of a {what} file: is it the right file?"
