"""One stage's energy over a training iteration (plain values).

:class:`~megatron_envpipe.gpu.energy.iteration_meter.IterationEnergyMeter` makes them from an
energy monitor; this is what it reports.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["IterationEnergy"]


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
