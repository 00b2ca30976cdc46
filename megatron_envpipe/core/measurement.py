"""Per-unit timings of one executed training iteration, as the executor measured them."""

from __future__ import annotations

from dataclasses import dataclass

from megatron_envpipe.core.schedule import Unit


@dataclass(frozen=True)
class UnitTiming:
    """One unit as measured by the executor (seconds from the iteration's start)."""

    unit: Unit
    start_s: float
    end_s: float
    recv_wait_s: float  # time blocked waiting for this unit's input message


@dataclass(frozen=True)
class IterationMeasurement:
    """Per stage, its units in execution order, as one training iteration ran them."""

    stages: tuple[tuple[UnitTiming, ...], ...]

    def recv_wait_s(self) -> list[list[float]]:
        return [[t.recv_wait_s for t in stage] for stage in self.stages]

    def iteration_time_s(self) -> float:
        return max((t.end_s for stage in self.stages for t in stage), default=0.0)

