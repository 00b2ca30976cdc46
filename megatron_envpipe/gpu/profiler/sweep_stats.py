"""The start-up profiler's statistics: robust means of unit samples, and P2P blocking power.

Used by :mod:`megatron_envpipe.gpu.profiler.sweep`, which re-exports them. Pure Python.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from megatron_envpipe.gpu.profiler.attribution import BlockingSample

__all__ = ["blocking_power_w", "robust_mean", "robust_mean_se"]


def _trimmed(values: Sequence[float], trim_fraction: float) -> list[float]:
    if not values:
        raise ValueError("no values")
    ordered = sorted(values)
    k = int(math.floor(len(ordered) * trim_fraction))
    return ordered[k : len(ordered) - k] or ordered


def robust_mean(values: Sequence[float], trim_fraction: float = 0.2) -> float:
    """Mean after dropping ``floor(n * trim_fraction)`` values at each end.

    Drops the odd unit out (the first micro-batch's data loading, the last
    backward's gradient all-reduce, a clock-switch transient) without needing
    many samples.
    """
    kept = _trimmed(values, trim_fraction)
    return math.fsum(kept) / len(kept)


def robust_mean_se(values: Sequence[float], trim_fraction: float = 0.2) -> tuple[float, float]:
    """:func:`robust_mean` and its standard error from the kept values' spread (0 with one value)."""
    kept = _trimmed(values, trim_fraction)
    mean = math.fsum(kept) / len(kept)
    if len(kept) < 2:
        return mean, 0.0
    var = math.fsum((v - mean) ** 2 for v in kept) / (len(kept) - 1)
    return mean, math.sqrt(var / len(kept))


def blocking_power_w(windows: Sequence[BlockingSample]) -> float | None:
    """P2P blocking power from blocking windows, free of the edge bias when it can be.

    Interpolating the counter across a window's edges, where power jumps from
    compute to blocking and back, adds about the same energy to every window
    regardless of its length (jump x sample spacing / 3). With windows of
    varied lengths, the slope of a least-squares line ``E = P t + c`` is P
    without that bias; otherwise (or if the fit is not sane) total energy over
    total time.
    """
    ws = [w for w in windows if w.time_s > 0]
    if not ws:
        return None
    total_t = math.fsum(w.time_s for w in ws)
    ratio = math.fsum(w.energy_j for w in ws) / total_t
    n = len(ws)
    if n >= 3:
        mean_t = total_t / n
        mean_e = math.fsum(w.energy_j for w in ws) / n
        var_t = math.fsum((w.time_s - mean_t) ** 2 for w in ws) / n
        if var_t > (0.25 * mean_t) ** 2:  # lengths spread enough for a slope
            cov = math.fsum((w.time_s - mean_t) * (w.energy_j - mean_e) for w in ws) / n
            slope = cov / var_t
            if 0 < slope <= ratio * 1.5:
                return slope
    return ratio
