"""The Perseus CSV profile format: its columns, limits, the point and error types, and the parser.

:func:`parse_profile_csv` turns the text into the rows at the reference size and the length samples
(:class:`~megatron_envpipe.core.profile.Profile` is built from them; see its module for the format).
Split from core/profile.py by job: reading the format here, the profile's queries and transforms there.
"""

from __future__ import annotations

import collections
import csv
import difflib
import io
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from megatron_envpipe.core.length_costs import SIZE_COLUMNS, LengthSample, MicrobatchSize, parse_row_size, split_by_size
from megatron_envpipe.core.measurement_columns import MEASUREMENT_COLUMNS, check_measurement_cells
from megatron_envpipe.core.vocabulary import INSTRUCTIONS
from megatron_envpipe.errors import UsageError

__all__ = ["CHUNK_COLUMN", "KNOWN_COLUMNS", "MAX_CHUNKS", "MAX_ENERGY_J", "MAX_FREQUENCY_MHZ", "MAX_STAGES",
           "MAX_TIME_S", "MIN_ENERGY_J", "MIN_TIME_S", "RANK_COLUMNS", "REQUIRED_COLUMNS", "Key", "ProfileError",
           "ProfilePoint", "parse_profile_csv"]

REQUIRED_COLUMNS = ("stage", "instruction", "frequency", "time", "energy")
RANK_COLUMNS = ("rank", "dp_rank", "pp_rank", "tp_rank")
CHUNK_COLUMN = "chunk"  # optional: the model chunk of the row (interleaved pipeline)
# Beyond these a value is a unit mistake (ms for s, kHz for MHz) or garbage, and
# would overflow sums over an iteration: rejected naming the line.
MAX_STAGES = 10_000
MAX_CHUNKS = 1_000
MAX_FREQUENCY_MHZ = 100_000
MAX_TIME_S = 86_400.0  # one micro-batch's forward or backward: a day
MAX_ENERGY_J = 1e9  # a 1 kW GPU for ten days
# Below these a value is a unit mistake too, and the planners' arithmetic (sums of times over
# an iteration, the LP's tolerances) loses it: 1e-300 s made the LP bound -inf. Energy 0 stays allowed.
MIN_TIME_S = 1e-9
MIN_ENERGY_J = 1e-9
# Energy is per GPU: a row's mean power above this is a unit mistake (kJ for J, ms for s), not a GPU
# (the largest accelerators draw about 1.2 kW).
_MAX_POWER_W = 5_000.0


class ProfileError(UsageError, ValueError):
    """A profile that cannot be used; the message names the file and line."""


@dataclass(frozen=True)
class ProfilePoint:
    freq_mhz: int
    time_s: float
    energy_j: float

    @property
    def power_w(self) -> float:
        return self.energy_j / self.time_s if self.time_s > 0 else 0.0


# (stage, instruction, chunk): the key of one profiled unit type.
Key = tuple[int, str, int]



def parse_profile_csv(
    text: str, source: str
) -> tuple[dict[Key, list[ProfilePoint]], MicrobatchSize | None, tuple[LengthSample, ...]]:
    """The profile's points at the reference size, that size, and the rows at other sizes; every bad line is a
    ProfileError naming the file and line."""
    reader = csv.reader(io.StringIO(text))
    header: list[str] | None = None
    header_line = 0
    rows: dict[tuple[int, int, str, int, MicrobatchSize | None], list[tuple[float, float]]] = {}
    first_lines: dict[tuple[int, int, str, int, MicrobatchSize | None, tuple[str, ...]], int] = {}
    for lineno, raw in _csv_rows(reader, source):
        if not raw or all(not c.strip() for c in raw):
            continue
        if header is None:
            header = [c.strip() for c in raw]
            header_line = lineno
            missing = [c for c in REQUIRED_COLUMNS if c not in header]
            if missing:
                raise ProfileError(
                    f"{source}:{lineno}: header lacks column(s) {', '.join(missing)}; a profile "
                    f"needs the header {','.join(REQUIRED_COLUMNS)} (optionally after "
                    f"{','.join(RANK_COLUMNS)})"
                )
            _check_header(header, source, lineno)
            continue
        if len(raw) != len(header):
            raise ProfileError(
                f"{source}:{lineno}: {len(raw)} fields where the header (line {header_line}) "
                f"has {len(header)}"
            )
        row = dict(zip(header, (c.strip() for c in raw)))
        stage = _parse_int(row, "stage", source, lineno)
        if not 0 <= stage < MAX_STAGES:
            raise ProfileError(f"{source}:{lineno}: stage {row['stage']} is not a stage id 0..{MAX_STAGES - 1}")
        instruction = row["instruction"].lower()
        if instruction not in INSTRUCTIONS:
            raise ProfileError(
                f"{source}:{lineno}: instruction {row['instruction']!r} is not 'forward' or 'backward'"
            )
        chunk = 0
        if CHUNK_COLUMN in row:
            chunk = _parse_int(row, CHUNK_COLUMN, source, lineno)
            if not 0 <= chunk < MAX_CHUNKS:
                raise ProfileError(
                    f"{source}:{lineno}: chunk {row[CHUNK_COLUMN]} is not a model chunk id 0..{MAX_CHUNKS - 1}"
                )
        freq = _parse_int(row, "frequency", source, lineno)
        if not 0 < freq <= MAX_FREQUENCY_MHZ:
            raise ProfileError(
                f"{source}:{lineno}: frequency must be a positive MHz value up to {MAX_FREQUENCY_MHZ}, got {freq}"
            )
        time_s = _parse_float(row, "time", source, lineno)
        energy_j = _parse_float(row, "energy", source, lineno)
        if time_s <= 0:
            raise ProfileError(f"{source}:{lineno}: time must be > 0 seconds, got {row['time']}")
        if energy_j < 0:
            raise ProfileError(f"{source}:{lineno}: energy must be >= 0 joules, got {row['energy']}")
        if time_s < MIN_TIME_S or 0 < energy_j < MIN_ENERGY_J:
            raise ProfileError(
                f"{source}:{lineno}: time {row['time']} s / energy {row['energy']} J is below any micro-batch "
                f"(limits {MIN_TIME_S:g} s, {MIN_ENERGY_J:g} J or 0 J): give seconds and joules per micro-batch"
            )
        if time_s > MAX_TIME_S or energy_j > MAX_ENERGY_J:
            raise ProfileError(
                f"{source}:{lineno}: time {row['time']} s / energy {row['energy']} J is beyond any micro-batch "
                f"(limits {MAX_TIME_S:g} s, {MAX_ENERGY_J:g} J): give seconds and joules per micro-batch"
            )
        if energy_j > _MAX_POWER_W * time_s:
            raise ProfileError(
                f"{source}:{lineno}: energy {row['energy']} J in {row['time']} s is {energy_j / time_s:.4g} W, beyond "
                f"any GPU ({_MAX_POWER_W:g} W): give joules and seconds per micro-batch and per GPU"
            )
        check_measurement_cells(row, freq, f"{source}:{lineno}", ProfileError)  # gpu-check's, ranged
        ranks = tuple(row.get(c, "") for c in RANK_COLUMNS)
        size = parse_row_size(row, f"{source}:{lineno}", ProfileError)
        # One dict look-up per row: a scan of the rows seen so far made a 50 MB profile quadratic.
        first_line = first_lines.setdefault((stage, chunk, instruction, freq, size, ranks), lineno)
        if first_line != lineno:
            where = f"stage {stage}" + (f" chunk {chunk}" if CHUNK_COLUMN in row else "")
            raise ProfileError(
                f"{source}:{lineno}: duplicate row for {where} {instruction} at "
                f"{freq} MHz{f' at {size}' if size else ''} (first at line {first_line}); remove one of them"
            )
        rows.setdefault((stage, chunk, instruction, freq, size), []).append((time_s, energy_j))
    if header is None:
        raise ProfileError(f"{source}: empty profile (no header, no rows)")
    if not rows:
        raise ProfileError(f"{source}: profile has a header but no rows")
    # Several TP/DP ranks of one stage: the stage takes as long as its slowest
    # rank; energy stays per GPU (mean), matching the single-rank format.
    merged = {key: (max(e[0] for e in entries), sum(e[1] for e in entries) / len(entries))
              for key, entries in rows.items()}
    plain, reference, samples = split_by_size(merged, source, ProfileError)
    points: dict[Key, list[ProfilePoint]] = {}
    for (stage, chunk, instruction, freq), (time_s, energy_j) in plain.items():
        points.setdefault((stage, instruction, chunk), []).append(ProfilePoint(freq, time_s, energy_j))
    return points, reference, tuple(samples)


KNOWN_COLUMNS = (*RANK_COLUMNS, *REQUIRED_COLUMNS, CHUNK_COLUMN, *MEASUREMENT_COLUMNS, *SIZE_COLUMNS)


def _check_header(header: list[str], source: str, lineno: int) -> None:
    """Every column known and given once: a misspelled ``Chunk`` would otherwise be ignored, and its
    rows then reported as duplicates."""
    counts = collections.Counter(header)
    dupes = sorted(c for c, n in counts.items() if n > 1)
    if dupes:
        raise ProfileError(f"{source}:{lineno}: column(s) {dupes} appear twice")
    unknown = [c for c in header if c not in KNOWN_COLUMNS]
    if unknown:
        lower = {c.lower(): c for c in KNOWN_COLUMNS}
        hints = []
        for c in unknown[:5]:
            close = [lower[c.lower()]] if c.lower() in lower else [
                lower[m] for m in difflib.get_close_matches(c.lower(), lower, n=1, cutoff=0.6)]
            hints.append(f"{c!r} (did you mean {close[0]!r}?)" if close else repr(c))
        more = f" and {len(unknown) - 5} more" if len(unknown) > 5 else ""
        raise ProfileError(
            f"{source}:{lineno}: unknown column(s) {', '.join(hints)}{more}; a profile has the columns "
            f"{','.join(REQUIRED_COLUMNS)}, optionally {CHUNK_COLUMN}, Merak's {','.join(RANK_COLUMNS)}, "
            f"gpu-check's {','.join(MEASUREMENT_COLUMNS)} and the micro-batch size's {','.join(SIZE_COLUMNS)}"
        )


def _csv_rows(reader: Any, source: str) -> Iterable[tuple[int, list[str]]]:
    """(line number, fields) of every CSV record; the csv module's own errors (a field over its size
    limit, a stray quote in strict mode) become ProfileErrors naming the line."""
    while True:
        try:
            raw = next(reader)
        except StopIteration:
            return
        except csv.Error as exc:
            raise ProfileError(f"{source}:{reader.line_num}: not a CSV profile row: {exc}") from None
        yield reader.line_num, raw


def _parse_number(row: Mapping[str, str], column: str, source: str, lineno: int) -> tuple[str, float]:
    """The cell's text and its value; a missing or non-numeric cell names the file, line and column."""
    value = row[column]
    if value == "":
        raise ProfileError(f"{source}:{lineno}: missing {column}")
    try:
        return value, float(value)
    except ValueError:
        raise ProfileError(f"{source}:{lineno}: {column} {value!r} is not a number") from None


def _parse_int(row: Mapping[str, str], column: str, source: str, lineno: int) -> int:
    value, number = _parse_number(row, column, source, lineno)
    if not number.is_integer():
        raise ProfileError(f"{source}:{lineno}: {column} {value!r} must be a whole number")
    return int(number)


def _parse_float(row: Mapping[str, str], column: str, source: str, lineno: int) -> float:
    value, number = _parse_number(row, column, source, lineno)
    if not math.isfinite(number):
        raise ProfileError(f"{source}:{lineno}: {column} {value!r} is not finite")
    return number
