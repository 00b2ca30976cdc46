"""Reading the text files users give (profiles, plans, GPU tables, configs) with errors that name the file and line.

A file that cannot be read, or is not UTF-8 text (a binary file, a
spreadsheet saved in another encoding), raises the caller's error class with
one line saying which file, where, and what to do.
"""

from __future__ import annotations

import os
from pathlib import Path


def read_text(path: str | os.PathLike[str], what: str, error: type[Exception]) -> str:
    """The UTF-8 text of ``path`` (a leading byte-order mark is dropped); ``error(message)`` if it cannot be.

    ``what`` names the file's role in the message, e.g. ``"profile"``.
    """
    path = Path(path)
    try:
        data = path.read_bytes()
    except IsADirectoryError:
        raise error(f"{path}: is a directory, not a {what} file") from None
    except OSError as exc:
        raise error(f"{path}: cannot read {what}: {exc.strerror or exc}") from None
    try:
        # utf-8-sig: spreadsheets and editors on Windows start UTF-8 files with a byte-order mark.
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        raise error(
            f"{path}:{line}: not UTF-8 text (byte 0x{data[exc.start]:02x} at offset {exc.start}): "
            f"give the {what} as a UTF-8 text file"
        ) from None
