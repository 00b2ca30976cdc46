"""Timing a stage's units: marks at unit boundaries, turned into a measurement.

:class:`UnitTimer` records, per compute unit, three marks: when the stage began
waiting for the unit's input (the receive's finish), when its compute began and
when it ended. At the end of the iteration they become the
:class:`~megatron_envpipe.core.measurement.IterationMeasurement` the runtime
plans from, and in profiling iterations the absolute windows the energy
monitor attributes energy to.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from megatron_envpipe.core.measurement import IterationMeasurement, UnitTiming
from megatron_envpipe.core.schedule import Unit

__all__ = ["UnitTimer"]


class _UnitClock:
    """Marks of unit boundaries.

    CUDA: events on the compute stream (no synchronization), except in
    profiling iterations, where each mark synchronizes and reads the host clock
    so that windows line up with the energy monitor's samples. CPU: the host
    clock. Host marks are absolute ``time.perf_counter()`` values. With ``clock``
    (a simulated GPU in virtual time) every mark reads it instead.
    """

    def __init__(self, device: torch.device, host_sync: bool = False,
                 clock: Callable[[], float] | None = None) -> None:
        self.cuda = device.type == "cuda"
        self.host = not self.cuda or host_sync or clock is not None
        self.marks: list[Any] = []
        self._device_clock = clock  # a simulated GPU's virtual clock: marks in device time

    def mark(self) -> int:
        if self._device_clock is not None:
            self.marks.append(self._device_clock())
        elif not self.host:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.marks.append(event)
        else:
            if self.cuda:
                torch.cuda.synchronize()
            self.marks.append(time.perf_counter())
        return len(self.marks) - 1

    @property
    def origin(self) -> float | None:
        """Absolute host time of the first mark (host marks only)."""
        return self.marks[0] if self.host and self.marks else None

    def seconds(self) -> list[float]:
        """Every mark relative to the first one (synchronizes once on GPU)."""
        if not self.marks:
            return []
        if not self.host:
            self.marks[-1].synchronize()
            first = self.marks[0]
            return [first.elapsed_time(e) / 1000.0 for e in self.marks]
        return [t - self.marks[0] for t in self.marks]


class UnitTimer:
    """Per unit: (wait begin, compute begin, compute end) marks on a :class:`_UnitClock`."""

    def __init__(self, device: torch.device, host_sync: bool = False,
                 clock: Callable[[], float] | None = None) -> None:
        self.clock = _UnitClock(device, host_sync=host_sync, clock=clock)
        self.marks: list[tuple[int, int, int]] = []
        self._wait: int | None = None
        self._seconds: list[float] | None = None

    def wait_begins(self) -> None:
        """The stage starts waiting for the next unit's input."""
        self._wait = self.clock.mark()

    def compute_begins(self) -> int:
        return self.clock.mark()

    def compute_ends(self, begin: int) -> None:
        end = self.clock.mark()
        self.marks.append((self._wait if self._wait is not None else begin, begin, end))
        self._wait = None

    def seconds(self) -> list[float]:
        """Every mark relative to the first (read once, after the last unit)."""
        if self._seconds is None:
            self._seconds = self.clock.seconds()
        return self._seconds

    def measurement(self, order: Sequence[Unit]) -> IterationMeasurement:
        """This stage's unit timings, in ``order`` (the stage's units as they ran)."""
        t = self.seconds()
        return IterationMeasurement(
            (tuple(UnitTiming(u, t[c0], t[c1], t[c0] - t[w]) for u, (w, c0, c1) in zip(order, self.marks)),)
        )

    def host_windows(
        self, order: Sequence[Unit]
    ) -> tuple[list[tuple[str, float, float]], list[tuple[float, float]]]:
        """Absolute host-clock windows: (kind, start, end) per unit, and (start, end) per
        wait that blocked (host marks only: profiling iterations)."""
        t = self.seconds()
        o = self.clock.origin
        windows = [(u.kind, o + t[c0], o + t[c1]) for u, (w, c0, c1) in zip(order, self.marks)]
        blocking = [(o + t[w], o + t[c0]) for (w, c0, c1) in self.marks if c0 != w and t[c0] > t[w]]
        return windows, blocking
