"""Per-stage time/energy profiles in the Perseus CSV format.

One row per (stage, instruction, SM clock): ``stage,instruction,frequency,time,energy``
with ``time`` in seconds and ``energy`` in joules per micro-batch for one GPU,
optionally preceded by Merak's ``rank,dp_rank,pp_rank,tp_rank`` columns (rows
of several TP/DP ranks of one stage are aggregated: max time, mean energy, as
the Perseus notes recommend). This is the format Perseus/Lowtime and the Zeus
pipeline-frequency optimizer read, so our profiles work with their tools.

Model chunks (Megatron's interleaved pipeline, V virtual stages per stage): an
optional ``chunk`` column (0..V-1, Megatron's model_chunk_id on the rank) gives
one row per (stage, chunk, instruction, clock); every stage must then have the
same V chunks. A profile without it describes whole stages (chunk 0 only);
:meth:`Profile.for_chunks` turns it into V equal chunks, each with 1/V of the
stage's time and energy at every clock, and a profile with a chunk column must
have exactly V chunks per stage. Written back, the column appears only for V > 1.

Micro-batch sizes (variable-length micro-batches): optional ``tokens,attention_tokens2`` columns give the
size a row was measured at (:mod:`~megatron_envpipe.core.length_costs`). The rows at the reference size
(the largest stated, or none stated) are the profile as planners use it; rows at other sizes are kept as
:attr:`Profile.length_samples` for a length fit and written back (the in-memory transforms below drop them).
"""

from __future__ import annotations

import csv
import io
import itertools
import math
import os
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any, TypeVar

from megatron_envpipe.core.atomic import write_atomic
from megatron_envpipe.core.length_costs import SIZE_COLUMNS, LengthSample, MicrobatchSize
from megatron_envpipe.core.profile_format import (
    CHUNK_COLUMN,
    KNOWN_COLUMNS,
    MAX_CHUNKS,
    MAX_ENERGY_J,
    MAX_FREQUENCY_MHZ,
    MAX_STAGES,
    MAX_TIME_S,
    MIN_ENERGY_J,
    MIN_TIME_S,
    RANK_COLUMNS,
    REQUIRED_COLUMNS,
    Key,
    ProfileError,
    ProfilePoint,
    parse_profile_csv,
)
from megatron_envpipe.core.textfile import read_text
from megatron_envpipe.core.vocabulary import INSTRUCTIONS, UnitKind

# The format's names stay importable from here, where every caller has found them.
__all__ = ["CHUNK_COLUMN", "KNOWN_COLUMNS", "MAX_CHUNKS", "MAX_ENERGY_J", "MAX_FREQUENCY_MHZ", "MAX_STAGES",
           "MAX_TIME_S", "MIN_ENERGY_J", "MIN_TIME_S", "RANK_COLUMNS", "REQUIRED_COLUMNS", "Key", "Profile",
           "ProfileError", "ProfilePoint", "instruction_of", "pareto_filter"]


def instruction_of(kind: str) -> str:
    """``F``/``B`` (schedule units) -> ``forward``/``backward`` (profile rows)."""
    try:
        return UnitKind(kind).instruction
    except ValueError:
        raise ProfileError(f"unknown unit kind {kind!r}") from None


class Profile:
    """Time and energy per (stage, chunk, instruction, clock); chunk 0 only without model chunks.

    ``points`` is keyed ``(stage, instruction)`` (chunk 0) or ``(stage, instruction, chunk)``.
    """

    def __init__(
        self,
        points: Mapping[tuple[int, str] | tuple[int, str, int], Iterable[ProfilePoint]],
        source: str = "<memory>",
        reference_size: MicrobatchSize | None = None,
        length_samples: Iterable[LengthSample] = (),
    ) -> None:
        self.source = source
        self.reference_size = reference_size  # None: the rows state no micro-batch size
        self.length_samples = tuple(length_samples)
        if self.length_samples and reference_size is None:
            raise ProfileError(f"{source}: length samples need the reference size the plain rows were measured at")
        table: dict[Key, dict[int, ProfilePoint]] = {}
        for key, pts in points.items():
            full: Key = (key[0], key[1], key[2] if len(key) > 2 else 0)  # type: ignore[misc]
            if full in table:
                raise ProfileError(f"{source}: stage {full[0]} chunk {full[2]} {full[1]} given twice")
            table[full] = {p.freq_mhz: p for p in pts}
        self._table = table
        self._check_complete()
        # Sorted fastest clock first, like NVML's supported-clock list.
        self._sorted = {
            key: tuple(sorted(pts.values(), key=lambda p: -p.freq_mhz)) for key, pts in table.items()
        }

    # -- construction ------------------------------------------------------------------
    @classmethod
    def from_csv(cls, path: str | os.PathLike[str]) -> "Profile":
        path = Path(path)
        return cls.from_csv_text(read_text(path, "profile", ProfileError), source=str(path))

    @classmethod
    def from_csv_text(cls, text: str, source: str = "<text>") -> "Profile":
        points, reference, samples = parse_profile_csv(text, source)
        return cls(points, source=source, reference_size=reference, length_samples=samples)

    def to_csv(self, path: str | os.PathLike[str]) -> None:
        """Write atomically (temp file + rename): a crash never leaves half a profile."""
        write_atomic(path, self.to_csv_text())

    def to_csv_text(self) -> str:
        out = io.StringIO()
        writer = csv.writer(out, lineterminator="\n")
        chunked = self.num_chunks > 1
        ref = self.reference_size  # stated on every row once the profile has one (none: today's columns)
        size_cells = [] if ref is None else [ref.tokens, ref.attention_tokens2]
        writer.writerow(REQUIRED_COLUMNS + ((CHUNK_COLUMN,) if chunked else ()) + (SIZE_COLUMNS if ref else ()))
        for stage in range(self.num_stages):
            for chunk in range(self.num_chunks):
                for point_f, point_b in _zip_longest_by_freq(
                    self.points(stage, "forward", chunk), self.points(stage, "backward", chunk)
                ):
                    for instruction, p in (("forward", point_f), ("backward", point_b)):
                        if p is not None:
                            row = [stage, instruction, p.freq_mhz, repr(p.time_s), repr(p.energy_j)]
                            writer.writerow(row + ([chunk] if chunked else []) + size_cells)
        for x in self.length_samples:
            writer.writerow([x.stage, x.instruction, x.freq_mhz, repr(x.time_s), repr(x.energy_j)]
                            + ([x.chunk] if chunked else []) + [x.size.tokens, x.size.attention_tokens2])
        return out.getvalue()

    def size_samples(self) -> tuple[LengthSample, ...]:
        """Every row as a length sample: the plain rows at :attr:`reference_size`, then :attr:`length_samples`
        (what :func:`~megatron_envpipe.core.length_costs.fit_length_costs` fits); none without a reference size."""
        if self.reference_size is None:
            return ()
        plain = [LengthSample(stage, chunk, ins, p.freq_mhz, self.reference_size, p.time_s, p.energy_j)
                 for (stage, ins, chunk), pts in self._sorted.items() for p in pts]
        return (*plain, *self.length_samples)

    # -- queries -----------------------------------------------------------------------
    @property
    def num_stages(self) -> int:
        return 1 + max(stage for stage, _, _ in self._table)

    @property
    def num_chunks(self) -> int:
        """Model chunks per stage: 1 for a profile of whole stages (no ``chunk`` column)."""
        return 1 + max(chunk for _, _, chunk in self._table)

    def points(self, stage: int, instruction: str, chunk: int = 0) -> tuple[ProfilePoint, ...]:
        """All points of (stage, chunk, instruction), fastest clock first."""
        try:
            return self._sorted[(stage, instruction, chunk)]
        except KeyError:
            chunks = f", chunks 0..{self.num_chunks - 1}" if self.num_chunks > 1 or chunk else ""
            raise ProfileError(
                f"{self.source}: no rows for stage {stage}{f' chunk {chunk}' if chunk else ''} {instruction} "
                f"(profile has stages 0..{self.num_stages - 1}{chunks})"
            ) from None

    def frequencies(self, stage: int, instruction: str, chunk: int = 0) -> tuple[int, ...]:
        return tuple(p.freq_mhz for p in self.points(stage, instruction, chunk))

    def common_frequencies(self) -> tuple[int, ...]:
        """Clocks profiled for every (stage, instruction), fastest first."""
        sets = [set(d) for d in self._table.values()]
        return tuple(sorted(set.intersection(*sets), reverse=True))

    def max_frequency(self) -> int:
        return max(max(d) for d in self._table.values())

    def point(self, stage: int, instruction: str, freq_mhz: int, chunk: int = 0) -> ProfilePoint:
        try:
            return self._table[(stage, instruction, chunk)][freq_mhz]
        except KeyError:
            if (stage, instruction, chunk) not in self._table:
                self.points(stage, instruction, chunk)  # raises the helpful error
            raise ProfileError(
                f"{self.source}: stage {stage}{f' chunk {chunk}' if chunk else ''} {instruction} was not profiled "
                f"at {freq_mhz} MHz; profiled clocks: {_clock_range(self.frequencies(stage, instruction, chunk))}"
            ) from None

    def time_s(self, stage: int, instruction: str, freq_mhz: int, chunk: int = 0) -> float:
        return self.point(stage, instruction, freq_mhz, chunk).time_s

    def energy_j(self, stage: int, instruction: str, freq_mhz: int, chunk: int = 0) -> float:
        return self.point(stage, instruction, freq_mhz, chunk).energy_j

    def min_energy_frequency(self, stage: int, instruction: str, chunk: int = 0) -> int:
        """The energy-valley clock of one instruction (ties: the faster clock)."""
        best = min(self.points(stage, instruction, chunk), key=lambda p: (p.energy_j, -p.freq_mhz))
        return best.freq_mhz

    def scaled(
        self, time_scale: float = 1.0, energy_scale: float = 1.0, names: tuple[str, str] = ("time scale", "energy scale")
    ) -> "Profile":
        """A copy with every time and energy multiplied (e.g. Perseus's emulation x10/x80).

        Every scaled value must stay within the limits a profile row has (:data:`MIN_TIME_S`..
        :data:`MAX_TIME_S`, :data:`MIN_ENERGY_J`..:data:`MAX_ENERGY_J`); ``names`` name the two
        scales in the error (the CLI's flags).
        """
        if not (0 < time_scale < math.inf and 0 < energy_scale < math.inf):
            raise ProfileError(f"scales must be positive and finite, got time x{time_scale}, energy x{energy_scale}")
        points = [p for pts in self._sorted.values() for p in pts]
        energies = [p.energy_j for p in points if p.energy_j > 0]
        for name, scale, values, low, high, unit in (
            (names[0], time_scale, [p.time_s for p in points], MIN_TIME_S, MAX_TIME_S, "s"),
            (names[1], energy_scale, energies, MIN_ENERGY_J, MAX_ENERGY_J, "J"),
        ):
            if values and not (low <= min(values) * scale and max(values) * scale <= high):
                raise ProfileError(
                    f"{name} {scale:g} makes the profile's {min(values):.4g}..{max(values):.4g} {unit} "
                    f"{min(values) * scale:.4g}..{max(values) * scale:.4g} {unit}, outside the {low:g}..{high:g} {unit} "
                    f"a micro-batch can be computed with: give a scale that keeps the values in it"
                )
        return Profile(
            {
                key: [ProfilePoint(p.freq_mhz, p.time_s * time_scale, p.energy_j * energy_scale) for p in pts]
                for key, pts in self._sorted.items()
            },
            source=f"{self.source} (time x{time_scale:g}, energy x{energy_scale:g})",
        )

    def with_timing_margin(self, fraction: float, below_mhz: int) -> "Profile":
        """A copy in which every unit run below ``below_mhz`` takes ``1 + fraction`` times as long.

        Planning on it keeps that much slack behind every slowed unit, so unit-time jitter
        of up to ``fraction`` does not reach the critical path; units at ``below_mhz`` and
        above (the baseline's clock) keep their times, so the deadline does not move.
        Energies are unchanged: the margin is a scheduling reserve, not a cost.
        """
        if not 0 <= fraction < math.inf:
            raise ProfileError(f"a timing margin must be a finite fraction >= 0, got {fraction}")
        if fraction == 0:
            return self
        grow = 1.0 + fraction
        return Profile(
            {
                key: [ProfilePoint(p.freq_mhz, p.time_s * grow if p.freq_mhz < below_mhz else p.time_s, p.energy_j)
                      for p in pts]
                for key, pts in self._sorted.items()
            },
            source=f"{self.source} (timing margin {100 * fraction:g}% below {below_mhz} MHz)",
        )

    def for_pipeline(self, num_stages: int) -> "Profile":
        """This profile reduced to ``num_stages`` stages: the first ``P-1`` and the last.

        For emulating a shorter pipeline with a longer pipeline's profile: the
        last stage (LM head, often the heaviest or lightest) keeps its own rows.
        """
        if num_stages == self.num_stages:
            return self
        if not 1 <= num_stages <= self.num_stages:
            raise ProfileError(
                f"{self.source}: cannot emulate {num_stages} stages with a {self.num_stages}-stage profile"
            )
        keep = list(range(num_stages - 1)) + [self.num_stages - 1]
        return Profile(
            {
                (new, ins, chunk): self._sorted[(old, ins, chunk)]
                for new, old in enumerate(keep)
                for ins in INSTRUCTIONS
                for chunk in range(self.num_chunks)
            },
            source=f"{self.source} (stages {keep})",
        )

    def for_chunks(self, num_chunks: int) -> "Profile":
        """This profile for ``num_chunks`` (V) model chunks per stage.

        A profile of whole stages (one chunk, no ``chunk`` column) is split
        evenly: every chunk of a stage gets the stage's row with time and
        energy divided by V, at every clock (the layers of a stage are split
        evenly over its chunks; real chunks differ a little, e.g. the
        embedding and LM head sit in the first and last virtual stage, which
        a profile with a chunk column captures). A profile with V chunks is
        returned as it is; one with another chunk count is an error.
        """
        whole = isinstance(num_chunks, int) and not isinstance(num_chunks, bool)
        if not whole or not 1 <= num_chunks <= MAX_CHUNKS:
            raise ProfileError(f"model chunks per stage must be a whole number 1..{MAX_CHUNKS}, got {num_chunks!r}")
        if num_chunks == self.num_chunks:
            return self
        if self.num_chunks != 1:
            raise ProfileError(
                f"{self.source}: profiled with {self.num_chunks} model chunks per stage but the pipeline has "
                f"{num_chunks}: profile it with {num_chunks} chunks, or give a profile of whole stages (no chunk "
                "column), which is split evenly"
            )
        return Profile(
            {
                (stage, ins, chunk): [
                    ProfilePoint(p.freq_mhz, p.time_s / num_chunks, p.energy_j / num_chunks) for p in pts
                ]
                for (stage, ins, _), pts in self._sorted.items()
                for chunk in range(num_chunks)
            },
            source=f"{self.source} (each stage split into {num_chunks} equal chunks)",
        )

    def restricted(self, frequencies: Iterable[int]) -> "Profile":
        """A copy keeping only the given clocks (e.g. a GPU table's candidates)."""
        keep = set(frequencies)
        return Profile(
            {key: [p for p in pts if p.freq_mhz in keep] for key, pts in self._sorted.items()},
            source=self.source,
        )

    def _check_complete(self) -> None:
        if not self._table:
            raise ProfileError(f"{self.source}: profile is empty")
        stages = sorted({stage for stage, _, _ in self._table})
        chunks = sorted({chunk for _, _, chunk in self._table})
        if chunks[0] < 0:
            raise ProfileError(f"{self.source}: negative model chunk id {chunks[0]}")
        if stages[0] < 0:
            raise ProfileError(f"{self.source}: negative stage id {stages[0]}")
        if stages[-1] + 1 != len(stages):
            # Only the first gaps: a stray stage id of 10**9 must not build a list of them all.
            present = set(stages)
            gaps = list(itertools.islice((s for s in range(stages[-1] + 1) if s not in present), 5))
            raise ProfileError(f"{self.source}: stage(s) {gaps}{' ...' if len(gaps) == 5 else ''} missing; "
                               f"stages must be 0..{stages[-1]}")
        if chunks[-1] >= MAX_CHUNKS:
            raise ProfileError(f"{self.source}: model chunk id {chunks[-1]} is beyond {MAX_CHUNKS - 1}")
        for stage in stages:
            for chunk in range(chunks[-1] + 1):
                for instruction in INSTRUCTIONS:
                    if not self._table.get((stage, instruction, chunk)):
                        where = f"stage {stage}" + (f" chunk {chunk}" if chunks[-1] else "")
                        every = f" (every stage needs chunks 0..{chunks[-1]})" if chunks[-1] else ""
                        raise ProfileError(f"{self.source}: {where} has no {instruction} rows{every}")
        # Whatever built the table (a CSV, scaled(), a measurement): nan or inf poisons every score.
        # Too small or too large values (a split into chunks, a scale) break the planners' arithmetic alike.
        for (stage, instruction, chunk), pts in self._table.items():
            for p in pts.values():
                if not (math.isfinite(p.time_s) and math.isfinite(p.energy_j)):
                    where = f"stage {stage}" + (f" chunk {chunk}" if chunk else "")
                    raise ProfileError(
                        f"{self.source}: {where} {instruction} at {p.freq_mhz} MHz has time {p.time_s} s, "
                        f"energy {p.energy_j} J: both must be finite numbers"
                    )
                if not (MIN_TIME_S <= p.time_s <= MAX_TIME_S and (p.energy_j == 0 or
                                                                  MIN_ENERGY_J <= p.energy_j <= MAX_ENERGY_J)):
                    where = f"stage {stage}" + (f" chunk {chunk}" if chunk else "")
                    raise ProfileError(
                        f"{self.source}: {where} {instruction} at {p.freq_mhz} MHz has time {p.time_s:g} s, "
                        f"energy {p.energy_j:g} J: a micro-batch needs {MIN_TIME_S:g}..{MAX_TIME_S:g} s and "
                        f"0 or {MIN_ENERGY_J:g}..{MAX_ENERGY_J:g} J"
                    )

    def __repr__(self) -> str:
        chunks = f", chunks={self.num_chunks}" if self.num_chunks > 1 else ""
        return f"Profile({self.source!r}, stages={self.num_stages}{chunks})"


_T = TypeVar("_T")


def pareto_filter(
    items: Iterable[_T], key: Callable[[_T], Any], cost: Callable[[_T], float], rtol: float = 0.0
) -> list[_T]:
    """The items in ``key`` order (fastest first), each kept only if it costs less than every kept one before it.

    With ``key`` sorting by time (ties: cheaper first), these are the
    time/cost trade-offs worth having: no kept item is slower *and* costlier
    than another. ``rtol``: a kept item must be cheaper by more than this fraction.
    """
    kept: list[_T] = []
    best = math.inf
    for item in sorted(items, key=key):
        c = cost(item)
        if c < best * (1 - rtol):
            kept.append(item)
            best = c
    return kept


def _clock_range(freqs: tuple[int, ...]) -> str:
    if not freqs:
        return "none"
    return f"{len(freqs)} clocks, {min(freqs)}..{max(freqs)} MHz"


def _zip_longest_by_freq(
    fwd: tuple[ProfilePoint, ...], bwd: tuple[ProfilePoint, ...]
) -> Iterable[tuple[ProfilePoint | None, ProfilePoint | None]]:
    by_f = {p.freq_mhz: p for p in fwd}
    by_b = {p.freq_mhz: p for p in bwd}
    for freq in sorted(set(by_f) | set(by_b), reverse=True):
        yield by_f.get(freq), by_b.get(freq)
