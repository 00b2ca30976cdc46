"""The demo's errors, and what a failed training run of the demo tells: the cause a rank's log ends with
(its exception line, not the peers' "connection closed"), read from each rank's log.

Split from apps/demo.py by job.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from megatron_envpipe.errors import EnvPipeError

__all__ = ["DemoError", "DemoTrainingError", "training_failure"]


class DemoError(EnvPipeError, RuntimeError):
    """The demo could not run; the message says why."""


class DemoTrainingError(EnvPipeError, RuntimeError):
    """A training process of the demo failed; the message is its rank, its error line and its log."""


# The line a failing rank ends with: a Python exception ("ValueError: ...", "pkg.mod.SomeError: ...")
# or an argparse / SystemExit message ("train_tiny_gpt.py: error: ..."); torch may prefix "[rank0]: ".
_ERROR_LINE = re.compile(r"^(?:\[rank\d+\]:\s*)?((?:[A-Za-z_][\w.]*(?:Error|Exception|Exit)|[\w./-]+: error): \S.*)$")


# What a rank reports when another one died first: never the cause while a rank has a cause of its own.
_PEER_GONE = re.compile(r"Connection closed by peer|Connection reset by peer|remote worker crash|Broken pipe|"
                        r"SIGTERM|Signal 15|DistNetworkError", re.IGNORECASE)


_RANK_PREFIX = re.compile(r"^\[default(\d+)\]:(.*)$")  # torchrun --tee's prefix on each rank's line


_ROOT_CAUSE = re.compile(r"Root Cause \(first observed failure\):.*?rank\s*:\s*(\d+).*?exitcode\s*:\s*(-?\d+)",
                         re.DOTALL)


_LOG_TAIL_BYTES = 1 << 20  # a rank's log can be long; its error is at its end


def _tail_lines(path: Path) -> list[str]:
    try:
        with open(path, "rb") as fh:
            fh.seek(max(0, os.fstat(fh.fileno()).st_size - _LOG_TAIL_BYTES))
            return fh.read().decode("utf-8", "replace").splitlines()
    except OSError:
        return []


def _last_error(lines: list[str]) -> str | None:
    found = [m.group(1) for m in map(_ERROR_LINE.match, (line.strip() for line in lines)) if m]
    if not found:
        return None
    shown = "".join(ch if ch.isprintable() else " " for ch in found[-1]).strip()  # one line, whatever it held
    return shown if len(shown) <= 400 else shown[:400] + "..."


def _rank_errors(log_lines: list[str], ranks: Path) -> dict[int, tuple[str, str]]:
    """``{rank: (its last error line, the log it is in)}``: from each rank's own log under ``ranks``
    (torchrun --log-dir), else from its prefixed lines in the combined log."""
    errors: dict[int, tuple[str, str]] = {}
    for stderr in sorted(ranks.glob("*/attempt_*/*/stderr.log"), key=lambda p: p.stat().st_mtime):
        if stderr.parent.name.isdigit():  # the latest attempt wins
            cause = _last_error(_tail_lines(stderr)) or _last_error(_tail_lines(stderr.with_name("stdout.log")))
            if cause:
                errors[int(stderr.parent.name)] = (cause, str(stderr))
    if not errors:
        by_rank: dict[int, list[str]] = {}
        for line in log_lines:
            match = _RANK_PREFIX.match(line)
            if match:
                by_rank.setdefault(int(match.group(1)), []).append(match.group(2))
        errors = {r: (cause, "") for r, lines in by_rank.items() if (cause := _last_error(lines))}
    return errors


def training_failure(name: str, code: int, log: Path, ranks: Path) -> DemoTrainingError:
    """The one-line cause of a failed torchrun, instead of its multi-line summary: the rank whose own
    error is the cause (torchrun's "first observed failure" is often a rank that lost its peer), that
    error line, and that rank's log."""
    lines = _tail_lines(log)
    root = _ROOT_CAUSE.search("\n".join(lines))
    errors = _rank_errors(lines, ranks)
    # Ranks in order of blame: torchrun's root cause first, then the others; a lost-peer error last.
    order = sorted(errors, key=lambda r: (bool(_PEER_GONE.search(errors[r][0])), not root or r != int(root.group(1)), r))
    if order:
        rank = order[0]
        cause, where = errors[rank]
        return DemoTrainingError(f"rank {rank}: {cause} (log: {where or log})")
    exited = f"rank {root.group(1)} exited with code {root.group(2)}" if root else f"torchrun exited with code {code}"
    return DemoTrainingError(f"the {name} run failed: {exited}, with no error message (log: {log})")
