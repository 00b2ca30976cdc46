"""Simulated time for single-process simulations that are compared with predictions.

A :class:`VirtualClock` stands in for ``time.perf_counter``/``time.sleep``: ``now()``
reads it and ``sleep(dt)`` advances it by ``dt`` at once. A simulated GPU driven by
it (``SimulatedGpu(..., clock=vc.now, sleep=vc.sleep)``) charges each unit exactly its
modelled time, and the host's own work (real kernels on a busy CPU, thread switches)
takes no simulated time at all, so a replay's measured time and energy cannot depend
on how fast or how loaded the host is. Only one thread should drive it (sleep); any
thread may read it. What a background thread would do every so often (an energy
poller) is registered with :meth:`VirtualClock.every` and runs inside the sleeps, at
its exact simulated times.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable

from megatron_envpipe.errors import EnvPipeError

__all__ = ["VirtualClock", "VirtualClockError"]


class VirtualClockError(EnvPipeError, ValueError):
    """A virtual clock asked to start at, or sleep for, a time that is not a finite number."""


class VirtualClock:
    """Seconds of simulated time: ``now()`` reads, ``sleep(seconds)`` advances at once."""

    def __init__(self, start_s: float = 0.0) -> None:
        if not math.isfinite(start_s):
            raise VirtualClockError(f"virtual clock: start time must be a finite number of seconds, got {start_s}")
        self._now_s = float(start_s)
        self._lock = threading.Lock()  # readers on other threads (an energy poller) see whole updates
        self.sleeps = 0  # calls to sleep() that advanced the clock
        self._tickers: list[list] = []  # [next due time, period, callback]

    def now(self) -> float:
        with self._lock:
            return self._now_s

    def every(self, period_s: float, callback: Callable[[], object]) -> None:
        """Call ``callback()`` every ``period_s`` simulated seconds from now on, with the clock
        reading the tick's time, whenever a sleep passes a tick (a poller thread, in simulated time)."""
        if not (math.isfinite(period_s) and period_s > 0):
            raise VirtualClockError(f"virtual clock: a tick period must be a finite number of seconds > 0, "
                                    f"got {period_s}")
        with self._lock:
            self._tickers.append([self._now_s + period_s, float(period_s), callback])

    def sleep(self, seconds: float) -> None:
        """Advance by ``seconds`` (never backwards: a negative or zero sleep is a no-op, as time.sleep(0)),
        running the ticks it passes in time order."""
        if not math.isfinite(seconds):
            raise VirtualClockError(f"virtual clock: cannot sleep {seconds} s (need a finite number of seconds)")
        if seconds <= 0:
            return
        with self._lock:
            target = self._now_s + seconds
            self.sleeps += 1
        while True:
            with self._lock:
                due = None  # the earliest tick due by the target (the first registered, on a tie)
                for ticker in self._tickers:  # (a loop: a poller ticks every few ms, min() costs more)
                    if ticker[0] <= target and (due is None or ticker[0] < due[0]):
                        due = ticker
                if due is None:
                    self._now_s = target
                    return
                self._now_s = due[0]
                due[0] += due[1]
            due[2]()  # outside the lock: the callback reads the clock

    def __call__(self) -> float:
        return self.now()

    def __repr__(self) -> str:
        return f"VirtualClock(now_s={self.now():.6f})"
