"""A frequency plan: one SM clock per unit of a schedule, plus its printouts."""

from __future__ import annotations

import re
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

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

    def flat(self) -> list[int]:
        return [f for row in self.freqs_mhz for f in row]

    def freq(self, stage: int, unit: Unit) -> int:
        return self.freqs_mhz[stage][self.schedule.position(stage, unit)]

    def clock_changes(self) -> tuple[int, ...]:
        """Clock changes per stage per iteration (the first unit's lock counts once)."""
        return tuple(1 + sum(1 for a, b in zip(row, row[1:]) if a != b) for row in self.freqs_mhz)

    def busy_share_below(self, freq_mhz: int, durations_s: Sequence[float]) -> float:
        """Fraction of compute time run below ``freq_mhz`` (durations flat, aligned)."""
        total = sum(durations_s)
        low = sum(d for d, f in zip(durations_s, self.flat()) if f < freq_mhz)
        return low / total if total > 0 else 0.0

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
        for s, row in enumerate(stages):
            if not isinstance(row, list):
                raise ScheduleError(f'stage {s}: expected a list of [unit, MHz] pairs like ["F0", 1740], got {row!r}')
            for i, cell in enumerate(row):
                if not (isinstance(cell, list | tuple) and len(cell) == 2 and isinstance(cell[0], str)):
                    raise ScheduleError(f'stage {s}, unit {i}: expected a [unit, MHz] pair like ["F0", 1740], '
                                        f"got {cell!r}")
                f = cell[1]
                # JSON has no int type of its own: 1740.0 is fine, 1740.5, nan, "1740" or true are not.
                if isinstance(f, bool) or not (isinstance(f, int) or (isinstance(f, float) and f.is_integer())):
                    raise ScheduleError(f"stage {s}, unit {cell[0]}: clock {f!r} is not a whole number of MHz")
        text = "\n".join(f"S{s}: " + " ".join(u for u, _ in row) for s, row in enumerate(stages))
        try:
            schedule = Schedule.parse(text, name=str(data.get("schedule", "custom")))
        except ScheduleError as exc:  # "line k" of the text built above is stage k-1 of the plan
            raise ScheduleError(re.sub(r"^line (\d+):", lambda m: f"stage {int(m.group(1)) - 1}:", str(exc))) from None
        warmup = data.get("extra_warmup")
        if warmup:
            schedule = Schedule(schedule.num_microbatches, schedule.orders, schedule.name,
                                check_extra_warmup(schedule.num_stages, warmup), num_chunks=schedule.num_chunks)
        return cls(schedule, tuple(tuple(int(f) for _, f in row) for row in stages))


def format_envpipe(
    plan: FrequencyPlan,
    recv_wait_ms: Sequence[Sequence[float]] | None = None,
    critical: Collection[tuple[int, Unit]] = (),
) -> str:
    """EnvPipe's plan printout: ``Stage 0 | [F0 1740 0.0]  F1 1050 0.0  ...``.

    Each unit shows kind+micro-batch, clock (MHz) and receive wait (ms);
    units on the critical path are bracketed, the others padded to line up.
    """
    crit = set(critical)
    lines = []
    for s, (order, freqs) in enumerate(zip(plan.schedule.orders, plan.freqs_mhz)):
        cells = []
        for i, (unit, f) in enumerate(zip(order, freqs)):
            wait = recv_wait_ms[s][i] if recv_wait_ms is not None else 0.0
            body = f"{unit} {f} {wait:.1f}"
            cells.append(f"[{body}]" if (s, unit) in crit else f" {body} ")
        lines.append(f"Stage {s} | " + " ".join(cells))
    return "\n".join(lines)
