"""One stage's, and one pipeline's, energy over a training iteration (plain values).

:class:`~megatron_envpipe.gpu.energy.iteration_meter.IterationEnergyMeter` makes the per-stage
values from an energy monitor; these are what it reports and how a pipeline's
stages add up (Perseus's accounting: time is the slowest stage's, energy the sum).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from megatron_envpipe.errors import InvalidValueError

__all__ = ["IterationEnergy", "PipelineIterationEnergy", "mean_iteration"]


@dataclass(frozen=True)
class IterationEnergy:
    """One stage's energy over one training iteration."""

    iteration: int
    stage: int
    start_s: float
    end_s: float
    energy_j: float

    @property
    def time_s(self) -> float:
        return self.end_s - self.start_s

    @property
    def average_power_w(self) -> float:
        return self.energy_j / self.time_s if self.time_s > 0 else 0.0


@dataclass(frozen=True)
class PipelineIterationEnergy:
    """A whole pipeline's iteration, as Perseus accounts it: time = max over stages, energy = sum."""

    iteration: int
    time_s: float
    energy_j: float
    stages: tuple[IterationEnergy, ...]

    @classmethod
    def combine(cls, parts: Sequence[IterationEnergy]) -> "PipelineIterationEnergy":
        if not parts:
            raise ValueError("no stages to combine")
        iterations = {p.iteration for p in parts}
        if len(iterations) != 1:
            raise ValueError(f"stages of different iterations {sorted(iterations)} cannot be combined")
        stages = sorted(p.stage for p in parts)
        if len(set(stages)) != len(stages):
            raise ValueError(f"a stage appears twice: {stages}")
        return cls(
            iteration=parts[0].iteration,
            time_s=max(p.time_s for p in parts),
            energy_j=sum(p.energy_j for p in parts),
            stages=tuple(sorted(parts, key=lambda p: p.stage)),
        )


def mean_iteration(parts: Sequence[PipelineIterationEnergy], skip_first: int = 0) -> tuple[float, float]:
    """Mean ``(time_s, energy_j)`` per iteration, after dropping ``skip_first`` warm-up iterations."""
    kept = list(parts)[skip_first:]
    if not kept:
        raise InvalidValueError(f"no iterations left after skipping {skip_first}")
    return sum(p.time_s for p in kept) / len(kept), sum(p.energy_j for p in kept) / len(kept)
