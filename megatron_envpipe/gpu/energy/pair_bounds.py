"""The period bounds of a tick grid's recent brackets, kept up to date as the brackets slide.

:class:`~megatron_envpipe.gpu.energy.counter_ticks.TickGrid` bounds the counter's period by every pair
of an old bracket ``(n0, lo0, hi0)`` (the first ``k`` of its window) and a new one ``(n1, lo1, hi1)``
(the last ``k``): ``max((lo1 - hi0) / (n1 - n0))`` and ``min((hi1 - lo0) / (n1 - n0))``. Recomputed from
scratch that is k * k quotients per bracket, and the simulated GPU's monitor adds a bracket every poll.
Once the window is full, one more bracket only shifts both ends by one: the pairs that stay keep their
quotients, so :class:`SlidingPairBounds` computes the ``2k - 1`` new ones and keeps, per step a pair
has left in the window, the max (min) of the pairs leaving then.

The answer is the same float as the plain max/min over all pairs: each quotient is the same IEEE
operations on the same operands, and the max of finite floats does not depend on the grouping except
between 0.0 and -0.0 (equal, yet told apart by their sign): :meth:`SlidingPairBounds.bounds` returns None
for a zero, and the caller then computes the plain way. Non-finite brackets never get here.

Pure Python; the caller holds its own lock.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from megatron_envpipe.errors import InvalidValueError

__all__ = ["SlidingPairBounds"]

Bracket = tuple[int, float, float]  # (tick number n, lo_s, hi_s)


class SlidingPairBounds:
    """Period bounds over the (old, new) pairs of a full window of brackets, numbered in increasing
    ``n``, whose ``pairs_from`` first are old and last are new (``window >= 2 * pairs_from``: every pair
    counts). ``low[j]``/``high[j]``: the bound over the pairs that stay exactly ``j`` more brackets."""

    def __init__(self, window: Sequence[Bracket], pairs_from: int) -> None:
        k = pairs_from
        if not 0 < 2 * k <= len(window):
            raise InvalidValueError(f"{len(window)} brackets cannot hold {k} old and {k} new ones apart")
        self.pairs_from = k
        old, new = window[:k], window[-k:]
        self.low = [-math.inf] * k
        self.high = [math.inf] * k
        # Old bracket r stays in the window r more brackets, new bracket c among the new ones c more.
        for r, (n0, lo0, hi0) in enumerate(old):
            for c, (n1, lo1, hi1) in enumerate(new):
                j = min(r, c)
                self.low[j] = max(self.low[j], (lo1 - hi0) / (n1 - n0))
                self.high[j] = min(self.high[j], (hi1 - lo0) / (n1 - n0))

    def slide(self, window: Sequence[Bracket]) -> None:
        """The window after one more bracket (the oldest left): its new pairs are the newest bracket
        with every old one, and the newest old bracket with every other new one."""
        k = self.pairs_from
        n1, lo1, hi1 = window[-1]
        m0, l0, h0 = window[k - 1]
        low, high = [], []
        # Old bracket j with the newest, and the newest old one with new bracket j, both stay j more
        # brackets, as the pairs that stayed j + 1 more before this one. (Plain comparisons: max() is slower.)
        for was_low, was_high, (n0, lo0, hi0), (n, lo, hi) in zip(self.low[1:], self.high[1:], window,
                                                                   window[len(window) - k:]):
            x, y = (lo1 - hi0) / (n1 - n0), (lo - h0) / (n - m0)
            low.append(was_low if was_low >= x and was_low >= y else x if x >= y else y)
            x, y = (hi1 - lo0) / (n1 - n0), (hi - l0) / (n - m0)
            high.append(was_high if was_high <= x and was_high <= y else x if x <= y else y)
        low.append((lo1 - h0) / (n1 - m0))  # the newest with the newest old one: stays k - 1 more
        high.append((hi1 - l0) / (n1 - m0))
        self.low, self.high = low, high

    def bounds(self) -> tuple[float, float] | None:
        """``(least, most)`` period over all pairs; None where either is zero (see the module docstring)."""
        t_low, t_high = max(self.low), min(self.high)
        return None if t_low == 0.0 or t_high == 0.0 else (t_low, t_high)
