"""Per-iteration energy of one stage: :class:`IterationEnergyMeter` brackets iterations on an energy monitor.

Split from gpu/energy/monitor.py (the monitor itself); the values it reports live in gpu/energy/iteration_energy.py.
"""

from __future__ import annotations

from collections.abc import Callable

from megatron_envpipe.errors import OutOfOrderError
from megatron_envpipe.gpu.energy.iteration_energy import IterationEnergy
from megatron_envpipe.gpu.energy.monitor import EnergyMonitor

__all__ = ["IterationEnergyMeter"]


# -- per-iteration energy ------------------------------------------------------------------
class IterationEnergyMeter:
    """Brackets iterations of one stage: ``begin(i)`` ... ``end()`` -> :class:`IterationEnergy`.

    Each edge reads the counter directly (Zeus's way): exact for the simulated
    GPU's exact counter, and for NVML stale by at most one counter update at each
    edge (~100 ms of power on A100, which averages out over iterations: the edges
    fall at random phases of the update), with no waiting for the next update. An edge given as ``t`` is
    interpolated from the trace instead. The iteration is unmeasured (an
    :class:`EnergyMonitorError` naming why) if an edge read fails or the
    iteration overlaps a gap of the trace (stall, counter reset).
    """

    def __init__(self, monitor: EnergyMonitor, stage: int, clock: Callable[[], float] | None = None) -> None:
        self.monitor = monitor
        self.stage = stage
        self._clock = clock or monitor.clock
        self._open: tuple[int, float, float | None] | None = None
        self.history: list[IterationEnergy] = []

    def begin(self, iteration: int, t: float | None = None) -> None:
        if self._open is not None:
            raise OutOfOrderError(f"iteration {self._open[0]} is still open; end() it first")
        if t is None:
            t, e = self.monitor.read()
            self._open = (iteration, t, e)
        else:
            self._open = (iteration, t, None)

    def cancel(self) -> None:
        """Forget an open iteration (one that will not be measured)."""
        self._open = None

    def end(self, t: float | None = None, wait_timeout_s: float = 1.0) -> IterationEnergy:
        if self._open is None:
            raise OutOfOrderError("end() without begin()")
        iteration, start_s, e0 = self._open
        self._open = None
        e1: float | None = None
        if t is None:
            end_s, e1 = self.monitor.read()
        else:
            end_s = t
        self.monitor.check_window(start_s, end_s)
        if e0 is None or e1 is None:
            self.monitor.wait_covered(end_s, timeout_s=wait_timeout_s)
            e0 = self.monitor.energy_mj_at(start_s) if e0 is None else e0
            e1 = self.monitor.energy_mj_at(end_s) if e1 is None else e1
        result = IterationEnergy(iteration, self.stage, start_s, end_s, (e1 - e0) / 1000.0)
        self.history.append(result)
        return result
