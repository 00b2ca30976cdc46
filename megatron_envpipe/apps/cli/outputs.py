"""Where the ``envpipe`` commands write: paths checked before any work, every output written last, all or none.

A command first calls :func:`check_outputs` (before loading a profile or
planning), so a bad ``--out``/``--csv``/``--plot`` fails in a second, not
after minutes of planning; at the end :func:`write_outputs` writes the files
it made in memory together (pictures are rendered to bytes first), so a
failure leaves no output file at all, never a JSON without its picture.
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Sequence
from typing import Any

from megatron_envpipe.apps.cli.common import CliError
from megatron_envpipe.apps.plot import ImageFormatError, check_plot_path
from megatron_envpipe.core.atomic import check_writable, write_all_atomic


def check_outputs(args: argparse.Namespace, *flags: str) -> None:
    """Each of ``flags`` (``--out``, ``--csv``, ``--plot``) that was given names a distinct file we can write;
    ``--plot``'s suffix is an image format and matplotlib is installed."""
    seen: dict[str, str] = {}
    for flag in flags:
        path = getattr(args, flag.lstrip("-").replace("-", "_"))
        if path is None:
            continue
        if not path.strip():
            raise CliError(f"{flag}: empty file name: give a path, e.g. {flag} out/{flag.lstrip('-')}")
        check_writable(path, flag)
        if flag == "--plot":
            try:
                check_plot_path(path)
            except ImageFormatError as exc:
                raise CliError(f"--plot {exc}") from None
        key = os.path.realpath(path)
        if key in seen:
            raise CliError(f"{seen[key]} and {flag} both name {path}: give each its own file")
        seen[key] = flag


def json_text(data: Any) -> str:
    """The JSON files ``envpipe`` writes (as ``write_json_atomic`` does): indent 1, final newline."""
    return json.dumps(data, indent=1) + "\n"


def write_outputs(files: Sequence[tuple[str | None, str | bytes]]) -> None:
    """Write every ``(path, data)`` whose path was given, all or none; an OSError becomes one line."""
    try:
        write_all_atomic([(path, data) for path, data in files if path is not None])
    except OSError as exc:
        where = f"{exc.filename}: " if exc.filename else ""
        raise CliError(f"cannot write the output: {where}{exc.strerror or exc}; no output file was written") from None
