"""The start-up profiler at variable micro-batch sizes (issue 25): per-size rows and the length fit.

When the executor hands each unit's micro-batch size to the hooks (``iteration_sizes``), every unit
sample carries it, and the sweep must not average units of different sizes into one row. Per clock,
:func:`size_means` keeps one :class:`~megatron_envpipe.core.length_costs.LengthSample` per (stage,
chunk, instruction, size): the robust mean of that size's units. :func:`rows_at` brings a clock's
samples to one size (the sweep's stop metric compares clocks there), and :func:`sized_profile` turns
the whole sweep's samples into a profile whose plain rows are at the reference size (the largest
measured, as :func:`~megatron_envpipe.core.length_costs.split_by_size` reads it back) and whose
other sizes are its ``length_samples``: ``fit_length_costs(profile.size_samples(),
profile.reference_size)`` re-fits the model wherever the profile is read (the profile cache).
Fewer than 2 distinct token counts for some unit type and clock: no fit; the caller keeps today's
fixed-length rows and logs the reason.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import replace
from typing import Any

from megatron_envpipe.core.length_costs import (
    LengthCostError,
    LengthKey,
    LengthSample,
    MicrobatchSize,
    fit_length_costs,
    size_classes,
)
from megatron_envpipe.core.profile import Profile, ProfilePoint, instruction_of
from megatron_envpipe.gpu.energy.monitor import EnergyMonitor
from megatron_envpipe.gpu.profiler.attribution import StageSamples, UnitSample, UnitWindow, stage_samples
from megatron_envpipe.gpu.profiler.sweep_stats import robust_mean, robust_mean_se


def sized_stage_samples(monitor: EnergyMonitor, units: Sequence[UnitWindow], sizes: Sequence[MicrobatchSize],
                        blocking: Sequence[tuple[float, float]] = (), **options: Any) -> StageSamples:
    """:func:`~megatron_envpipe.gpu.profiler.attribution.stage_samples` of units whose micro-batches differ in size:
    the regression fits one power per kind AND size (a smaller micro-batch may draw another power; one
    power per kind would give every size the average), and each sample carries its unit's size."""
    if len(sizes) != len(units):
        raise ValueError(f"{len(sizes)} micro-batch sizes for {len(units)} unit windows")
    classes, _ = size_classes(sizes)
    labelled = [UnitWindow(f"{w.kind}@{c}", w.start_s, w.end_s) for w, c in zip(units, classes)]
    samples = stage_samples(monitor, labelled, blocking, **options)
    return replace(samples, units=tuple(replace(u, kind=w.kind, size=size)
                                        for u, w, size in zip(samples.units, units, sizes, strict=True)))


# (stage, chunk, instruction) -> that clock's units of it
UnitsByType = Mapping[tuple[int, int, str], Sequence[UnitSample]]


def size_means(units: UnitsByType, freq_mhz: int, trim_fraction: float) -> tuple[LengthSample, ...]:
    """One sample per (stage, chunk, instruction, size) at ``freq_mhz``: the robust means of its units."""
    out = []
    for (stage, chunk, instruction), group in units.items():
        by_size: dict[MicrobatchSize, list[UnitSample]] = {}
        for u in group:
            if u.size is None:
                raise ValueError(f"stage {stage} {instruction} at {freq_mhz} MHz: units with and without a "
                                 "micro-batch size in one clock (sizes are given every iteration or never)")
            by_size.setdefault(u.size, []).append(u)
        for size, same in sorted(by_size.items()):
            out.append(LengthSample(stage, chunk, instruction, freq_mhz, size,
                                    robust_mean([u.time_s for u in same], trim_fraction),
                                    robust_mean([u.energy_j for u in same], trim_fraction)))
    return tuple(out)


def _by_key(samples: Iterable[LengthSample]) -> dict[LengthKey, list[LengthSample]]:
    out: dict[LengthKey, list[LengthSample]] = {}
    for x in samples:
        out.setdefault(x.key, []).append(x)
    return out


def _why_no_fit(samples: Sequence[LengthSample]) -> str:
    """Why these samples cannot fit a length model ('' when they can): a unit type and clock seen at
    fewer than 2 distinct token counts."""
    for key, group in _by_key(samples).items():
        tokens = sorted({x.size.tokens for x in group})
        if len(tokens) < 2:
            stage, chunk, instruction, freq = key
            return (f"stage {stage}{f' chunk {chunk}' if chunk else ''} {instruction} at {freq} MHz was measured at "
                    f"{len(tokens)} distinct token count(s) ({', '.join(map(str, tokens))}); a length fit needs >= 2")
    return ""


def rows_at(samples: Sequence[LengthSample], size: MicrobatchSize) -> dict[LengthKey, tuple[float, float]] | None:
    """(time s, energy J) per key at ``size``: the measured mean where that size was measured, else the
    key's fit; None when some key cannot be fitted (the caller averages as without sizes)."""
    if _why_no_fit(samples):
        return None
    try:
        model = fit_length_costs(samples, size, source="the profiler's samples")
    except LengthCostError:
        return None
    out = {}
    for key, group in _by_key(samples).items():
        at = [x for x in group if x.size == size]
        if at:
            out[key] = (at[0].time_s, at[0].energy_j)
        else:
            cost = model.costs[key]
            out[key] = (cost.time.value(size), max(0.0, cost.energy.value(size)))
    return out


def sized_profile(samples: Sequence[LengthSample], source: str) -> tuple[Profile | None, str]:
    """The profile of a sweep's sized samples, or (None, why not): plain rows at the reference size (the
    largest measured: measured means where measured, else the fit's value) plus every other size's
    samples, from which the model is re-fitted when the profile is read."""
    why = _why_no_fit(samples)
    if why:
        return None, why
    reference = max(x.size for x in samples)
    try:
        plain = rows_at(samples, reference)
        fit_length_costs(samples, reference, source=source)  # the fit the profile's reader will make
    except LengthCostError as exc:
        return None, str(exc)
    if plain is None:
        return None, "the samples do not fit a length model"
    if any(not t > 0 for t, _ in plain.values()):
        return None, f"the fit extrapolates to a time <= 0 at the reference size {reference}"
    points: dict[tuple[int, str, int], list[ProfilePoint]] = {}
    for (stage, chunk, instruction, freq), (time_s, energy_j) in sorted(plain.items()):
        points.setdefault((stage, instruction, chunk), []).append(ProfilePoint(freq, time_s, energy_j))
    others = tuple(x for x in samples if x.size != reference)
    return Profile(points, source=source, reference_size=reference, length_samples=others), ""


def iteration_estimates(units: Sequence[UnitSample], reference: MicrobatchSize, trim_fraction: float
                        ) -> dict[tuple[str, str], tuple[float, float]] | None:
    """One iteration's (mean, standard error) per (kind, "time"/"energy") at ``reference``, for the sweep's
    check that two iterations agree when their micro-batches differ in size: each unit type's per-size
    means brought to ``reference`` by a fit of this iteration alone (averaged over model chunks); the
    error from the units' spread around their size's mean. None: the iteration cannot be fitted."""
    if any(u.size is None for u in units):
        return None  # this iteration's sizes were not known
    by_type: dict[tuple[int, int, str], list[UnitSample]] = {}
    for u in units:
        by_type.setdefault((0, u.chunk, instruction_of(u.kind)), []).append(u)
    samples = size_means(by_type, 0, trim_fraction)
    at = rows_at(samples, reference)
    if at is None:
        return None
    means = {(x.chunk, x.instruction, x.size): (x.time_s, x.energy_j) for x in samples}
    out = {}
    for kind in ("F", "B"):
        instruction = instruction_of(kind)
        values = [v for key, v in at.items() if key[2] == instruction]
        group = [u for u in units if u.kind == kind]
        for i, what in enumerate(("time", "energy")):
            residuals = [(u.time_s, u.energy_j)[i] - means[(u.chunk, instruction, u.size)][i] for u in group]
            out[(kind, what)] = (sum(v[i] for v in values) / len(values), robust_mean_se(residuals, trim_fraction)[1])
    return out
