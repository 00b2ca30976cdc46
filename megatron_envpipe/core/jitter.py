"""Seeded unit-time jitter: the noise a real GPU adds to every unit (NCCL, thermals, data loading).

A unit that the profile says takes ``t`` takes ``t * factor``; the factor is
``1 + fraction * z`` with ``z`` standard normal, clipped to 3 standard deviations
so no unit ever runs backwards in time. The simulated GPU and the offline noisy
runs draw from it with a seed per stage, so a run is reproducible.
"""

from __future__ import annotations

import math
import random

from megatron_envpipe.errors import UsageError

# Up to a quarter of a unit's time: with 3-sigma clipping every factor stays >= 0.25.
MAX_JITTER = 0.25
_CLIP_SIGMAS = 3.0


class JitterError(UsageError, ValueError):
    """A jitter fraction out of range."""


class UnitJitter:
    """Multiplicative noise on unit durations, reproducible from ``seed``."""

    def __init__(self, fraction: float, seed: int | str = 0) -> None:
        if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not (
                math.isfinite(fraction) and 0 <= fraction <= MAX_JITTER):
            raise JitterError(f"unit-time jitter must be a fraction between 0 and {MAX_JITTER:g} "
                              f"(0.03 = 3 % of a unit's time), got {fraction!r}")
        self.fraction = float(fraction)
        self._rng = random.Random(f"envpipe-jitter|{seed}")  # str seeds hash the same in every process

    def factor(self) -> float:
        """The next unit's duration factor (1.0 exactly when the fraction is 0)."""
        if self.fraction == 0:
            return 1.0
        z = max(-_CLIP_SIGMAS, min(_CLIP_SIGMAS, self._rng.gauss(0.0, 1.0)))
        return 1.0 + self.fraction * z
