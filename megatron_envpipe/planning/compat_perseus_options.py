"""Perseus's (Lowtime's) discrete clock options: quantised durations, the Pareto filter Lowtime applies,
each unit's start clock and the profile's clock step (:mod:`.compat_perseus` plans with them)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from megatron_envpipe.core.profile import Profile, ProfilePoint
from megatron_envpipe.core.vocabulary import INSTRUCTIONS
from megatron_envpipe.planning.basis import PlannerError


@dataclass(frozen=True)
class PerseusOption:
    """One profiled clock of one instruction, with its quantised duration."""

    freq_mhz: int
    time_s: float
    energy_j: float
    quant_time: int


def quantize(time_s: float, unit_time_s: float) -> int:
    """Perseus/Lowtime's integer duration: Python's float floor division."""
    return int(time_s // unit_time_s)


def candidate_options(
    points: Sequence[ProfilePoint], unit_time_s: float, noise_factor: float = 1.0
) -> tuple[PerseusOption, ...]:
    """Lowtime's candidate options, slowest (largest quantised time) first.

    1. Pareto filter on real (unquantised) time and energy: drop an option if
       another one takes less than ``noise_factor`` x its time *and* less than
       ``noise_factor`` x its energy (1.0, as the EnvPipe script uses it:
       strict dominance).
    2. Per quantised duration keep the most expensive option (ties: the slower).
    3. Sort by quantised duration, descending.
    """
    opts = [PerseusOption(p.freq_mhz, p.time_s, p.energy_j, quantize(p.time_s, unit_time_s)) for p in points]
    kept = [
        o
        for o in opts
        if not any(
            other.time_s < o.time_s * noise_factor and other.energy_j < o.energy_j * noise_factor
            for other in opts
        )
    ]
    # Most expensive first; among equal costs the slower (then the higher clock,
    # the CSV's usual order) comes first and wins its bucket.
    kept.sort(key=lambda o: (-o.energy_j, -o.time_s, -o.freq_mhz))
    seen: set[int] = set()
    unique = []
    for o in kept:
        if o.quant_time not in seen:
            seen.add(o.quant_time)
            unique.append(o)
    unique.sort(key=lambda o: -o.quant_time)
    return tuple(unique)


def start_clock(points: Sequence[ProfilePoint], unit_time_s: float) -> int:
    """The slowest candidate option's clock: where every non-envelope unit starts."""
    cands = candidate_options(points, unit_time_s)
    if not cands:
        raise PlannerError("no candidate clock (empty profile)")
    return cands[0].freq_mhz


def clock_step_mhz(profile: Profile) -> int:
    """The profile's own clock spacing: the most common gap between adjacent clocks.

    Gaps are pooled over every (stage, instruction); ties go to the smaller gap.
    15 MHz for the A40/A100 ladders; right for any regular ladder, and robust to
    a few missing or extra clocks.
    """
    gaps: Counter[int] = Counter()
    for s in range(profile.num_stages):
        for ins in INSTRUCTIONS:
            freqs = sorted(profile.frequencies(s, ins))
            gaps.update(b - a for a, b in zip(freqs, freqs[1:]) if b > a)
    if not gaps:
        raise PlannerError(
            f"{profile.source}: cannot derive the clock step from a profile with one clock per "
            "instruction; pass step_mhz"
        )
    return min(gaps, key=lambda g: (-gaps[g], g))
