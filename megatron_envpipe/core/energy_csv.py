"""``--envpipe-energy-csv PATH``: one row per GPU per energy line, appended as training goes.

Each window's rows go out in one ``write`` on a file opened ``O_APPEND``, flushed
to disk: a reader (or a crash) sees whole windows only, never a torn row, and a
rerun appends below the rows of the last run (the header is written once, to an
empty file). The figures are those of the energy line
(:mod:`megatron_envpipe.core.energy_report`). Pure Python.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

from megatron_envpipe.core.atomic import OutputPathError, check_output
from megatron_envpipe.core.energy_report import EnergyReport

__all__ = ["CSV_COLUMNS", "append_report", "check_energy_csv"]

CSV_COLUMNS = ("iteration", "iterations", "stage", "rank", "energy_j_per_iteration", "power_w",
               "time_s_per_iteration", "pipeline_energy_j_per_iteration", "pipeline_time_s_per_iteration",
               "planned_time_s", "saving", "simulated")
_HEADER = (",".join(CSV_COLUMNS) + "\n").encode()


def _fmt(value: object) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:.6g}"
    return str(value)


def _report_rows(report: EnergyReport) -> list[Sequence[object]]:
    """One row per GPU of the report (none when its window has no GPU counter figures yet)."""
    return [(report.iteration, report.iterations, g.stage, g.rank, g.energy_j, g.power_w, g.time_s,
             report.energy_j, report.time_s, report.planned_time_s, report.saving, int(report.simulated))
            for g in report.gpus]


def check_energy_csv(path: str | os.PathLike[str], others: Sequence[tuple[str, str | None]] = ()) -> None:
    """At start-up: ``path`` can be appended to (:func:`~megatron_envpipe.core.atomic.check_output`: writable,
    none of the run's inputs or other outputs) and is empty, absent or an energy CSV already (its first
    line is :data:`CSV_COLUMNS`): rows are never appended to another file. Raises OutputPathError."""
    target = check_output(path, "--envpipe-energy-csv", others)
    try:
        with open(target, "rb") as f:
            head = f.read(len(_HEADER))
    except FileNotFoundError:
        return
    except OSError as exc:
        raise OutputPathError(f"--envpipe-energy-csv {target}: cannot read it: {exc.strerror or exc}") from None
    if head and head != _HEADER:  # append_report writes the header and its first rows in one write
        raise OutputPathError(f"--envpipe-energy-csv {target}: exists and is not an energy CSV (its first line is "
                              "not the energy CSV header): rows are only appended to one; give a new file name")


def append_report(path: str | os.PathLike[str], report: EnergyReport) -> int:
    """Append the report's rows (header first into an empty file); returns the rows written."""
    rows = _report_rows(report)
    if not rows:
        return 0
    text = "".join(",".join(_fmt(v) for v in row) + "\n" for row in rows)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        if os.fstat(fd).st_size == 0:
            text = ",".join(CSV_COLUMNS) + "\n" + text
        data = text.encode()
        written = os.write(fd, data)
        if written != len(data):  # a full disk: say so rather than leave half a window
            raise OSError(f"wrote {written} of {len(data)} bytes")
        os.fsync(fd)
    finally:
        os.close(fd)
    return len(rows)
