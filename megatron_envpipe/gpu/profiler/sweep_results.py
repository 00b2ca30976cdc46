"""What the start-up profiler's clock sweep measures: Perseus rows, and one clock's result.

Split from :mod:`megatron_envpipe.gpu.profiler.sweep` (which re-exports both); pure data.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

from megatron_envpipe.core.length_costs import LengthSample
from megatron_envpipe.gpu.profiler.attribution import KindPowers


class ProfileRow(NamedTuple):
    """A Perseus CSV row."""

    stage: int
    instruction: str
    freq_mhz: int
    time_s: float
    energy_j: float
    chunk: int = 0  # the model chunk (Megatron's interleaved pipeline); 0 without


@dataclass(frozen=True)
class ClockResult:
    """What one clock's iterations gave: robust per-(stage, instruction) rows."""

    freq_mhz: int
    iterations: int
    rows: tuple[ProfileRow, ...]
    refined: bool = False  # measured after the coarse sweep, to fill a gap near the valley
    energy_se_j: tuple[float, ...] = ()  # per row: standard error of its energy (attribution and spread)
    at_s: tuple[float | None, ...] = ()  # per stage: when its iterations ran (device seconds; heat drift)
    # Sized units: a sample per unit type and size; rows at the sweep's reference size, averaged: all sizes.
    samples: tuple[LengthSample, ...] = ()
    averaged: tuple[ProfileRow, ...] = ()
    # Per stage, per iteration: the power fit of forwards and backwards (None: not by regression).
    kind_powers: tuple[tuple[KindPowers | None, ...], ...] = ()

    def energy_j(self) -> float:
        """Per-micro-batch F+B energy summed over stages."""
        return math.fsum(r.energy_j for r in self.rows)

    def time_s(self) -> float:
        return math.fsum(r.time_s for r in self.rows)
