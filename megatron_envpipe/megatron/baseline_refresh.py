"""When the energy log measures its baseline again: at the GPU age of the iterations it is compared with.

The log's saving compares planned iterations with a measured baseline (Megatron's order at the maximum
clock). Measured only before the plan, that baseline comes from a cold GPU (a cold GPU draws a few
percent less: ml.energy, "Thermally stable profiling", 2026) and from iterations next to the start-up
profiler's (which wait for the energy counter between iterations): on fast GPUs, whose short runs never
reach the warm state, the logged saving erred by 3 points (12.7 % logged where a baseline run of the same
length measured 15.7 %, units of 17/42 ms). So the baseline is measured again after the plan has run a
while, over ``--envpipe-baseline-iterations`` iterations or as many as last 5 s (each iteration's energy is
read at its edges off a counter that steps every ~100 ms), and every line from then on compares with it:
after ``first_after`` planned iterations, then after twice as many each time, until two measurements in
a row agree within ``settled`` (the GPU has stopped heating). Over a long run that costs a few dozen
iterations at the maximum clock at most; the log says which baseline each line uses.

Pure bookkeeping, identical on every rank (it sees only iteration counts).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from megatron_envpipe.errors import InvalidValueError

__all__ = ["BaselineRefresh"]

_FIRST_AFTER = 8  # planned iterations before the first repeat (the README's 40-iteration runs see one)
_SETTLED = 0.005  # two baselines this close (relative energy): the GPU is warm, stop repeating
# A repeat lasts at least this long: an iteration's energy is read off the counter at its edges, each off
# by up to a counter period's worth (100 ms), so short iterations need more of them (0.66 s ones: 8).
_MIN_SPAN_S = 5.0
_MAX_ITERATIONS = 16


@dataclass
class BaselineRefresh:
    """Which iterations repeat the baseline (module docstring)."""

    iterations: int  # per measurement (--envpipe-baseline-iterations), at least (_MIN_SPAN_S)
    first_after: int = _FIRST_AFTER
    settled: float = _SETTLED
    span: int = 0  # iterations per repeat: set when the plan starts, from its iteration time
    _next_at: int | None = None  # iteration the next repeat starts at (0-based)
    _gap: int = _FIRST_AFTER
    _running: list[int] = field(default_factory=list)  # iterations of the repeat under way
    _repeats: set[int] = field(default_factory=set)  # every repeated iteration so far
    _last_energy_j: float | None = None
    generation: int = 0  # repeats begun: the reporting keeps one generation's sums
    done: bool = False

    def __post_init__(self) -> None:
        if self.iterations < 0 or self.first_after < 1 or not 0 < self.settled < 1:
            raise InvalidValueError(f"baseline refresh: iterations >= 0, first_after >= 1, settled in (0, 1); got "
                             f"{self.iterations}, {self.first_after}, {self.settled}")
        self._gap = self.first_after
        self.done = self.iterations == 0
        self.span = self.iterations

    def plan_started(self, at_iteration: int, iteration_time_s: float | None = None) -> None:
        """The plan takes over at ``at_iteration``: the first repeat comes ``first_after`` later and lasts
        ``iterations``, or as many as span :data:`_MIN_SPAN_S` at the plan's ``iteration_time_s`` (at most
        :data:`_MAX_ITERATIONS`)."""
        if not self.done and self._next_at is None:
            self._next_at = at_iteration + self.first_after
            if iteration_time_s is not None and iteration_time_s > 0:
                wanted = math.ceil(_MIN_SPAN_S / iteration_time_s - 1e-9)
                self.span = max(self.iterations, min(wanted, _MAX_ITERATIONS))

    def due(self, iteration: int) -> bool:
        """Whether ``iteration`` (0-based, about to run) repeats the baseline; marks it so."""
        if self.done or self._next_at is None:
            return False
        if iteration in self._repeats:
            return True
        if iteration < self._next_at or len(self._running) >= self.span:
            return False
        if not self._running:
            self.generation += 1
        self._running.append(iteration)
        self._repeats.add(iteration)
        return True

    def is_repeat(self, iteration: int) -> bool:
        return iteration in self._repeats

    def measured(self, energy_j: float, last_iteration: int) -> None:
        """The repeat under way was measured (mean pipeline energy per iteration): schedule the next one,
        or stop once two in a row agree within ``settled``."""
        if not self._running or last_iteration < self._running[-1] or len(self._running) < self.span:
            return
        previous, self._last_energy_j = self._last_energy_j, energy_j
        self._running = []
        if previous is not None and abs(energy_j / previous - 1) <= self.settled:
            self.done = True
            return
        self._gap *= 2
        self._next_at = last_iteration + 1 + self._gap
