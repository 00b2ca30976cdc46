"""Which clocks the start-up profiler (:mod:`megatron_envpipe.gpu.profiler.sweep`) measures.

A coarse ladder from the true maximum down (:func:`sweep_candidates`, the
clocks EnvPipe's cost is counted on), then a few clocks that fill the gaps
next to the energy valley (:func:`refinement_clocks`). Pure functions of the
supported clocks and the measured valleys, so every rank chooses the same.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

from megatron_envpipe.errors import InvalidValueError

__all__ = ["refinement_clocks", "sweep_candidates"]


def sweep_candidates(supported_mhz: Iterable[int], step_mhz: float, min_mhz: int | None = None) -> tuple[int, ...]:
    """Clocks to profile, fastest first: the supported clock nearest each ``max - k*step``.

    The true maximum is always first (never EnvPipe's ``% 90`` filter, which made
    A100's "maximum" 1350 MHz). Ladders off the grid (V100's 7.5 MHz) snap to
    the nearest supported clock.
    """
    supported = sorted({int(f) for f in supported_mhz}, reverse=True)
    if not supported:
        raise InvalidValueError("no supported clocks to sweep")
    if not step_mhz > 0:
        raise InvalidValueError(f"step_mhz must be > 0, got {step_mhz}")
    floor = supported[-1] if min_mhz is None else min_mhz
    top = supported[0]
    chosen: list[int] = []
    k = 0
    while True:
        target = top - k * step_mhz
        if target < floor - step_mhz / 2:
            break
        nearest = min(supported, key=lambda f: (abs(f - target), -f))
        if nearest >= floor and nearest not in chosen:
            chosen.append(nearest)
        k += 1
    return tuple(sorted(chosen, reverse=True))


def refinement_clocks(
    measured_mhz: Iterable[int], valleys_mhz: Iterable[int], supported_mhz: Iterable[int], step_mhz: float, limit: int
) -> tuple[int, ...]:
    """Up to ``limit`` supported clocks that split the measured gaps nearest the valleys into ``step_mhz`` steps.

    The planner picks per-unit clocks just above the energy valley most often, so
    the coarse sweep's gaps there are filled in first (closest to a valley first),
    at the reconfiguration step, the finest step online correction takes. Only
    between measured clocks: nothing below where an early stop left off.
    """
    measured = sorted(set(int(f) for f in measured_mhz))
    valleys = sorted(set(int(f) for f in valleys_mhz))
    supported = sorted(set(int(f) for f in supported_mhz))
    if limit <= 0 or len(measured) < 2 or not valleys or not step_mhz > 0:
        return ()

    def distance(f: float) -> float:
        return min(abs(f - v) for v in valleys)

    gaps = sorted(zip(measured, measured[1:]), key=lambda g: (distance((g[0] + g[1]) / 2), -g[1]))
    chosen: list[int] = []
    for lo, hi in gaps:
        inside = [f for f in supported if lo < f < hi]
        parts = math.ceil((hi - lo) / step_mhz - 1e-9)
        picks = []
        for j in range(1, parts):
            target = lo + (hi - lo) * j / parts
            f = min(inside, key=lambda c: (abs(c - target), -c), default=None)
            if f is not None and f not in picks:
                picks.append(f)
        for f in sorted(picks, key=lambda c: (distance(c), -c)):
            if len(chosen) < limit:
                chosen.append(f)
    return tuple(chosen)
