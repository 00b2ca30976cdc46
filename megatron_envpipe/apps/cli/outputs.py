"""Where the ``envpipe`` commands write: paths checked before any work, every output written last, all or none.

A command first calls :func:`check_outputs` (before loading a profile or
planning), so a bad ``--out``/``--csv``/``--plot`` fails in a second, not
after minutes of planning; at the end :func:`write_outputs` writes the files
it made in memory together (pictures are rendered to bytes first), so a
failure, a Ctrl-C or a SIGTERM leaves no output file at all, never a JSON
without its picture. An output that is one of the command's inputs (the
profile, the plan, the GPU table; also through a symlink or a hard link) is
refused: writing it would destroy the input.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any

from megatron_envpipe.apps.cli.common import CliError
from megatron_envpipe.apps.cli.render import strict_json
from megatron_envpipe.apps.plot import ImageFormatError, check_plot_path
from megatron_envpipe.core.atomic import check_writable, same_file, write_all_atomic
from megatron_envpipe.core.gpu_specs import GpuSpecError, default_table_path
from megatron_envpipe.core.resources import shipped_profile


def _inputs(args: argparse.Namespace) -> list[tuple[str, str]]:
    """``(what, path)`` of the files the command reads: --profile (a path or a shipped name), --plan,
    the GPU table. One that does not exist is left out (reading it fails later, with its own message)."""
    found = []
    profile = getattr(args, "profile", None)
    if isinstance(profile, str) and profile.strip():
        try:
            found.append(("--profile", str(shipped_profile(profile))))
        except FileNotFoundError:
            pass
    plan = getattr(args, "plan", None)
    if isinstance(plan, str) and plan.strip():
        found.append(("--plan", plan))
    try:
        found.append(("the GPU table", str(default_table_path())))
    except GpuSpecError:
        pass
    return found


def check_outputs(args: argparse.Namespace, *flags: str) -> None:
    """Each of ``flags`` (``--out``, ``--csv``, ``--plot``) that was given names a distinct file we can write,
    none of the command's inputs; ``--plot``'s suffix is an image format and matplotlib is installed."""
    seen: list[tuple[str, str]] = []
    inputs = _inputs(args)
    for flag in flags:
        path = getattr(args, flag.lstrip("-").replace("-", "_"))
        if path is None:
            continue
        if not path.strip():
            raise CliError(f"{flag}: empty file name: give a path, e.g. {flag} out/{flag.lstrip('-')}")
        check_writable(path, flag)
        for what, source in inputs:
            if same_file(path, source):
                raise CliError(f"{flag} {path} is the {what} input {source}: writing it would destroy the input; "
                               f"give {flag} another file name")
        for other, other_path in seen:
            if same_file(path, other_path):
                raise CliError(f"{other} and {flag} both name {path}: give each its own file")
        seen.append((flag, path))
        if flag == "--plot":
            try:
                check_plot_path(path)
            except ImageFormatError as exc:
                raise CliError(f"--plot {exc}") from None


def json_text(data: Any) -> str:
    """The JSON files ``envpipe`` writes (as ``write_json_atomic`` does): indent 1, final newline, standard JSON."""
    return strict_json(data) + "\n"


def write_outputs(files: Sequence[tuple[str | None, str | bytes]]) -> None:
    """Write every ``(path, data)`` whose path was given, all or none; an OSError becomes one line."""
    try:
        write_all_atomic([(path, data) for path, data in files if path is not None])
    except OSError as exc:
        where = f"{exc.filename}: " if exc.filename else ""
        raise CliError(f"cannot write the output: {where}{exc.strerror or exc}; no output file was written") from None
