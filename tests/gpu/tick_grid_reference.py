"""The tick grid of gpu/energy/counter_ticks.py as it was before issue 37 made it faster: the
specification test_counter_ticks_exact.py holds the fast one to, output for output, bit for bit.
A frozen copy: do not edit (only this docstring and the class name differ from the original).
"""

from __future__ import annotations

import math
import statistics
from collections import deque

from megatron_envpipe.errors import InvalidValueError

__all__ = ["ReferenceTickGrid"]

# Changes seen before a period is trusted: the first estimate is their median spacing.
_MIN_UPDATES = 4
# Recent brackets whose intersection pins the phase (hard bounds: the tick lies inside every one).
_PHASE_BRACKETS = 64
# The newest of them pin the phase (few periods: the period's own error cannot add up).
_PHASE_FROM = 12
# A bracket is wide (a starved poll) when it spans a period (before a fit: this many times the first
# estimate) and this many times the poller's usual bracket: polls aliased near the period are not starved.
_WIDE = 1.5


class ReferenceTickGrid:
    """Online least-squares tick grid of a stepped counter (see the module docstring)."""

    def __init__(self, min_updates: int = _MIN_UPDATES) -> None:
        if min_updates < 2:
            raise InvalidValueError(f"min_updates must be >= 2, got {min_updates}")
        self.min_updates = min_updates
        self.restarts = 0  # brackets the fitted grid missed: the fit began again there
        self.wide = 0  # brackets that may hold several updates (a starved poller): left out of the fit
        self._first: list[tuple[float, float]] = []  # brackets before the first estimate
        self._first_cut: list[bool] = []  # per bracket there: a wide one was left out just before it
        self._reset_sums()

    def _reset_sums(self) -> None:
        self._m0 = 0.0  # middles are taken relative to the first, for a well-conditioned fit
        self._n_last = 0
        self._m_last = 0.0
        self._count = 0
        self._sn = self._sm = self._snn = self._snm = 0.0
        self._period_s: float | None = getattr(self, "_period_s", None)
        self._phase_s = 0.0
        self._recent: deque[tuple[int, float, float]] = deque(maxlen=_PHASE_BRACKETS)  # (n, lo, hi)
        self._period_bounds: tuple[float, float] | None = None  # periods all recent brackets allow
        self._after_wide = False  # a wide bracket was left out since the last one fitted

    @property
    def period_s(self) -> float | None:
        """The fitted update period (None until ``min_updates`` changes were seen)."""
        return self._period_s

    @property
    def updates(self) -> int:
        """Changes the current fit rests on."""
        return self._count or len(self._first)

    def add(self, lo_s: float, hi_s: float) -> None:
        """A change seen by the read at ``hi_s``; the read before it was at ``lo_s``."""
        if not hi_s > lo_s:
            return  # no bracket (the first read): nothing to learn
        mid = 0.5 * (lo_s + hi_s)
        if self._count and self._period_s is not None and self._is_wide(hi_s - lo_s, self._period_s):
            self.wide += 1  # may hold several updates: which tick its middle is near says nothing
            self._after_wide = True
            return
        if self._count == 0:
            self._first.append((lo_s, hi_s))
            self._first_cut.append(self._after_wide)
            self._after_wide = False
            if len(self._first) < self.min_updates:
                return
            mids = [0.5 * (a + b) for a, b in self._first]
            steps = [b - a for a, b in zip(mids, mids[1:]) if b > a]
            if not steps:
                self._first, self._first_cut = self._first[-1:], self._first_cut[-1:]
                return
            # A starved poll among the first (wider than the poller's usual and than a gap): wait for
            # narrow ones; a gap across it spans several periods, so it does not estimate the period.
            usual = max(self._period_s or statistics.median(steps), statistics.median(b - a for a, b in self._first))
            wide = [b - a >= _WIDE * usual for a, b in self._first]
            if any(wide):
                self.wide += sum(wide)
                kept = [i for i, w in enumerate(wide) if not w]
                self._first_cut = [self._first_cut[i] or (i > 0 and wide[i - 1]) for i in kept]
                self._first = [self._first[i] for i in kept]
                return
            gaps = [b - a for a, b, cut in zip(mids, mids[1:], self._first_cut[1:]) if b > a and not cut]
            if not gaps:
                self._first, self._first_cut = self._first[-1:], self._first_cut[-1:]
                return
            # Under load the counter moves every period: most gaps are one period.
            period = self._period_s or statistics.median(gaps)
            self._m0 = mids[0]
            self._n_last, self._m_last = 0, mids[0]
            self._put(0, mids[0])
            self._recent.append((0, *self._first[0]))
            for m, (lo, hi) in zip(mids[1:], self._first[1:]):
                self._advance(m, period)
                self._recent.append((self._n_last, lo, hi))
            self._first, self._first_cut = [], []
            self._fit()
            return
        predicted = self.tick_near(mid)
        slack = 0.5 * (hi_s - lo_s)  # a tick on the bracket's edge, give or take rounding and poll jitter
        missed = predicted is None or not lo_s - slack <= predicted <= hi_s + slack
        if missed and self._after_wide and predicted is not None:
            # Across a starved poll the fit extrapolates further: missed only beyond its own bounds.
            interval = self._tick_interval(round((predicted - self._phase_s) / (self._period_s or 1.0)))
            missed = interval is None or interval[0] > hi_s + slack or interval[1] < lo_s - slack
        if missed:
            # The grid missed this change: start again from it, keeping the period as the first guess.
            self.restarts += 1
            self._reset_sums()
            self._first, self._first_cut = [(lo_s, hi_s)], [False]
            return
        self._advance(mid, self._period_s or 0.0)
        self._recent.append((self._n_last, lo_s, hi_s))
        self._after_wide = False
        self._fit()

    def _is_wide(self, width_s: float, period_s: float) -> bool:
        """Whether a bracket may hold several updates and is a starved poll, not the poller's usual."""
        if width_s < period_s:
            return False
        usual = statistics.median(hi - lo for _, lo, hi in self._recent) if self._recent else 0.0
        return width_s >= _WIDE * usual

    def _advance(self, mid: float, period: float) -> None:
        # Local rounding: a gap of a few periods rounds safely even with a rough period.
        steps = max(1, round((mid - self._m_last) / period)) if period > 0 else 1
        self._n_last += steps
        self._m_last = mid
        self._put(self._n_last, mid)

    def _put(self, n: int, mid: float) -> None:
        m = mid - self._m0
        self._count += 1
        self._sn += n
        self._sm += m
        self._snn += n * n
        self._snm += n * m

    def _fit(self) -> None:
        k = self._count
        det = k * self._snn - self._sn * self._sn
        if k < 2 or det <= 0:
            return
        period = (k * self._snm - self._sn * self._sm) / det
        if not period > 0:
            return
        self._phase_s = self._m0 + (self._sm - period * self._sn) / k
        # Every tick lies inside its bracket: the periods and phases that all recent brackets allow,
        # if they agree, pin both far tighter than the middles' average (polls not locked to the
        # period sweep the phase; a period is bounded by the oldest and newest brackets' spans).
        recent = list(self._recent)
        old, new = recent[:16], recent[-16:]
        pairs = [(n1 - n0, lo1 - hi0, hi1 - lo0) for n0, lo0, hi0 in old for n1, lo1, hi1 in new if n1 > n0]
        if pairs:
            t_low = max(a / dn for dn, a, _ in pairs)
            t_high = min(b / dn for dn, _, b in pairs)
            if t_low <= t_high:
                period = min(max(period, t_low), t_high)
        self._period_bounds = (t_low, t_high) if pairs and t_low <= t_high else None
        self._period_s = period
        newest = recent[-_PHASE_FROM:]
        low = max(lo - n * period for n, lo, _ in newest)
        high = min(hi - n * period for n, _, hi in newest)
        if low <= high:
            self._phase_s = 0.5 * (low + high)
        else:  # brackets that disagree (jitter): the middles' average, over a few periods only
            self._phase_s = math.fsum(0.5 * (lo + hi) - n * period for n, lo, hi in newest) / len(newest)

    def tick_near(self, t_s: float) -> float | None:
        """The fitted tick nearest ``t_s`` (None before a fit)."""
        if self._count < 2 or self._period_s is None:
            return None
        n = round((t_s - self._phase_s) / self._period_s)
        return self._phase_s + n * self._period_s

    def stamp(self, lo_s: float, hi_s: float) -> float:
        """Best estimate of when the change bracketed by ``(lo_s, hi_s]`` happened: the fitted
        tick inside the bracket (the last one, in a wide bracket), else its middle."""
        mid = 0.5 * (lo_s + hi_s)
        if self._count >= 2 and self._period_s is not None and self._is_wide(hi_s - lo_s, self._period_s):
            last = self._phase_s + self._last_index(hi_s) * self._period_s
            return last if lo_s <= last else mid
        tick = self.tick_near(mid)
        if tick is None or abs(tick - mid) > hi_s - lo_s:
            return mid
        return min(max(tick, lo_s), hi_s)

    def _last_index(self, t_s: float) -> int:
        """Index of the last fitted tick at or before ``t_s`` (a fit is there)."""
        return math.floor((t_s - self._phase_s) / (self._period_s or 1.0))

    def _tick_interval(self, n: int) -> tuple[float, float] | None:
        """Where tick ``n`` can lie, given that every recent tick lay inside its bracket and the
        period lies within the bounds the brackets allow (None: no such bounds, or they disagree)."""
        if self._period_bounds is None or not self._recent:
            return None
        t_low, t_high = self._period_bounds
        low, high = -math.inf, math.inf
        for nk, lo, hi in self._recent:
            d = n - nk
            low = max(low, lo + d * (t_low if d >= 0 else t_high))
            high = min(high, hi + d * (t_high if d >= 0 else t_low))
        return (low, high) if low <= high else None

    def stamp_bound_s(self, lo_s: float, hi_s: float) -> float:
        """A bound on how far ``stamp(lo_s, hi_s)`` is from the update it stands for (the last one in
        the bracket): from the hard bounds the recent brackets put on each tick that can be that update
        (in a wide bracket: the fitted last tick or a neighbour whose bounds straddle ``hi_s``); the
        bracket's width where the fit is young (fewer than ``_PHASE_FROM`` brackets) or the bounds disagree."""
        stamp = self.stamp(lo_s, hi_s)
        width = hi_s - lo_s
        if self._count < _PHASE_FROM or self._period_s is None or stamp == 0.5 * (lo_s + hi_s):
            return width  # a young fit may still be misnumbered; a middle is within the bracket
        n = round((stamp - self._phase_s) / self._period_s)
        wide = self._is_wide(width, self._period_s)
        bound = -1.0
        for j in [n - 1, n, n + 1] if wide else [n]:
            here = self._tick_interval(j)
            after = self._tick_interval(j + 1) if wide else here
            if here is None or after is None:
                return width
            if wide and (here[0] > hi_s or after[1] <= hi_s):
                continue  # tick j surely came after the read, or tick j + 1 surely before it
            low, high = max(here[0], lo_s), min(here[1], hi_s)
            if low <= high:
                bound = max(bound, stamp - low, high - stamp)
        return width if bound < 0 else bound
