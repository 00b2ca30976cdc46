"""A frequency plan: one SM clock per unit of a schedule, plus its printouts."""

from __future__ import annotations

import re
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from megatron_envpipe.core.gpu_specs import MAX_CLOCK_MHZ
from megatron_envpipe.core.profile import MAX_STAGES
from megatron_envpipe.core.schedule import Schedule, ScheduleError, Unit, check_extra_warmup


@dataclass(frozen=True)
class FrequencyPlan:
    """``freqs_mhz[s][i]`` is the clock of ``schedule.orders[s][i]``."""

    schedule: Schedule
    freqs_mhz: tuple[tuple[int, ...], ...]

    def __post_init__(self) -> None:
        if len(self.freqs_mhz) != self.schedule.num_stages:
            raise ScheduleError(
                f"plan has clocks for {len(self.freqs_mhz)} stages, schedule has {self.schedule.num_stages}"
            )
        for s, (order, freqs) in enumerate(zip(self.schedule.orders, self.freqs_mhz)):
            if len(order) != len(freqs):
                raise ScheduleError(f"stage {s}: {len(freqs)} clocks for {len(order)} units")
            for f in freqs:
                if not isinstance(f, int) or f <= 0:
                    raise ScheduleError(f"stage {s}: clock {f!r} is not a positive MHz integer")

    @classmethod
    def from_flat(cls, schedule: Schedule, flat: Sequence[int]) -> "FrequencyPlan":
        rows, k = [], 0
        for order in schedule.orders:
            rows.append(tuple(int(f) for f in flat[k : k + len(order)]))
            k += len(order)
        if k != len(flat):
            raise ScheduleError(f"{len(flat)} clocks for {k} units")
        return cls(schedule, tuple(rows))

    @classmethod
    def constant(cls, schedule: Schedule, freq_per_stage: Sequence[int]) -> "FrequencyPlan":
        return cls(
            schedule,
            tuple((int(freq_per_stage[s]),) * len(order) for s, order in enumerate(schedule.orders)),
        )

    def check_clock_range(self, low_mhz: int, high_mhz: int, what: str) -> None:
        """ScheduleError naming the first unit whose clock lies outside ``[low_mhz, high_mhz]``, ``what``
        (e.g. "the a40's clock range")."""
        for s, (order, freqs) in enumerate(zip(self.schedule.orders, self.freqs_mhz)):
            for unit, f in zip(order, freqs):
                if not low_mhz <= f <= high_mhz:
                    raise ScheduleError(f"stage {s}, unit {unit}: clock {f} MHz is outside {what} "
                                        f"{low_mhz}..{high_mhz} MHz")

    def flat(self) -> list[int]:
        return [f for row in self.freqs_mhz for f in row]

    def freq(self, stage: int, unit: Unit) -> int:
        return self.freqs_mhz[stage][self.schedule.position(stage, unit)]

    def clock_changes(self) -> tuple[int, ...]:
        """Clock changes per stage per iteration (the first unit's lock counts once)."""
        return tuple(1 + sum(1 for a, b in zip(row, row[1:]) if a != b) for row in self.freqs_mhz)

    def to_dict(self) -> dict[str, Any]:
        return {
            "schedule": self.schedule.name,
            "num_stages": self.schedule.num_stages,
            "num_microbatches": self.schedule.num_microbatches,
            "extra_warmup": list(self.schedule.extra_warmup),
            "stages": [
                [[str(u), f] for u, f in zip(order, freqs)]
                for order, freqs in zip(self.schedule.orders, self.freqs_mhz)
            ],
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "FrequencyPlan":
        """The inverse of :meth:`to_dict`; ScheduleError naming the stage and unit of anything malformed."""
        if not isinstance(data, Mapping):
            raise ScheduleError(f"not a frequency plan: expected a JSON object, got {type(data).__name__}")
        stages = data.get("stages")
        if not isinstance(stages, list) or not stages:
            raise ScheduleError('not a frequency plan: "stages" must be a non-empty list, one row per stage')
        if len(stages) > MAX_STAGES:
            raise ScheduleError(f"not a frequency plan: {len(stages)} stages, more than the {MAX_STAGES} a pipeline may have")
        sizes = [0, 0]  # the micro-batch and chunk counts the unit ids imply
        for s, row in enumerate(stages):
            if not isinstance(row, list):
                raise ScheduleError(f'stage {s}: expected a list of [unit, MHz] pairs like ["F0", 1740], got {row!r}')
            for i, cell in enumerate(row):
                if not (isinstance(cell, list | tuple) and len(cell) == 2 and isinstance(cell[0], str)):
                    raise ScheduleError(f'stage {s}, unit {i}: expected a [unit, MHz] pair like ["F0", 1740], '
                                        f"got {cell!r}")
                _check_unit_cell(s, len(row), cell, sizes)
        # Every stage runs F and B of every (micro-batch, chunk): checked here, before anything is built
        # from the ids, so a 57-byte plan naming micro-batch 99,999,999 cannot allocate gigabytes.
        num_mb, num_chunks = sizes
        for s, row in enumerate(stages):
            if len(row) != 2 * num_mb * num_chunks:
                chunks = f" x {num_chunks} chunks" if num_chunks > 1 else ""
                raise ScheduleError(f"stage {s}: {len(row)} units, but the plan's ids (micro-batches 0..{num_mb - 1}"
                                    f"{chunks}) need F and B of each: {2 * num_mb * num_chunks}")
        text = "\n".join(f"S{s}: " + " ".join(u for u, _ in row) for s, row in enumerate(stages))
        try:
            schedule = Schedule.parse(text, name=str(data.get("schedule", "custom")))
        except ScheduleError as exc:  # "line k" of the text built above is stage k-1 of the plan
            raise ScheduleError(re.sub(r"^line (\d+):", lambda m: f"stage {int(m.group(1)) - 1}:", str(exc))) from None
        warmup = data.get("extra_warmup")
        if isinstance(warmup, list) and any(isinstance(r, int | float) and r > num_mb * num_chunks for r in warmup):
            raise ScheduleError(f"extra warm-up {warmup} has values above the plan's {num_mb * num_chunks} micro-batches")
        if warmup:
            schedule = Schedule(schedule.num_microbatches, schedule.orders, schedule.name,
                                check_extra_warmup(schedule.num_stages, warmup), num_chunks=schedule.num_chunks)
        return cls(schedule, tuple(tuple(int(f) for _, f in row) for row in stages))


_UNIT = re.compile(r"([FB])(\d{1,9})(?:v(\d{1,9}))?")


def _check_unit_cell(stage: int, units: int, cell: Sequence[Any], sizes: list[int]) -> None:
    """One ``[unit, MHz]`` cell of a plan file: a unit whose ids fit the stage's ``units`` and a clock within
    1..MAX_CLOCK_MHZ; ``sizes`` grows to the micro-batch and chunk counts seen so far."""
    name, f = cell
    match = _UNIT.fullmatch(name.strip())
    if not match:
        raise ScheduleError(f"stage {stage}: cannot parse unit {name[:40]!r}: expected F<id> or B<id>, "
                            "optionally v<chunk>, e.g. F3 or B3v1")
    mb, chunk = int(match.group(2)), int(match.group(3) or 0)
    # A stage of n units runs n/2 (micro-batch, chunk) pairs: no id can reach n/2.
    if 2 * max(mb, chunk) >= units:
        raise ScheduleError(f"stage {stage}: {name} names {'micro-batch' if mb >= chunk else 'chunk'} "
                            f"{max(mb, chunk)}, but the stage has only {units} units (F and B of each micro-batch)")
    sizes[0], sizes[1] = max(sizes[0], mb + 1), max(sizes[1], chunk + 1)
    # JSON has no int type of its own: 1740.0 is fine, 1740.5, nan, "1740" or true are not.
    if isinstance(f, bool) or not (isinstance(f, int) or (isinstance(f, float) and f.is_integer())):
        raise ScheduleError(f"stage {stage}, unit {name}: clock {f!r} is not a whole number of MHz")
    if not 0 < f <= MAX_CLOCK_MHZ:
        raise ScheduleError(f"stage {stage}, unit {name}: clock {f:g} MHz is not a clock (1..{MAX_CLOCK_MHZ} MHz)")


def format_envpipe(
    plan: FrequencyPlan,
    recv_wait_ms: Sequence[Sequence[float]] | None = None,
    critical: Collection[tuple[int, Unit]] = (),
) -> str:
    """EnvPipe's plan printout: ``Stage 0 | [F0 1740 0.0]  F1 1050 0.0  ...``.

    Each unit shows kind+micro-batch, clock (MHz) and receive wait (ms) where the waits are
    known (a simulated timeline); without them the wait is left out rather than shown as 0.0.
    Units on the critical path are bracketed, the others padded to line up.
    """
    crit = set(critical)
    lines = []
    for s, (order, freqs) in enumerate(zip(plan.schedule.orders, plan.freqs_mhz)):
        cells = []
        for i, (unit, f) in enumerate(zip(order, freqs)):
            body = f"{unit} {f} {recv_wait_ms[s][i]:.1f}" if recv_wait_ms is not None else f"{unit} {f}"
            cells.append(f"[{body}]" if (s, unit) in crit else f" {body} ")
        lines.append(f"Stage {s} | " + " ".join(cells))
    return "\n".join(lines)
