"""When a stepped energy counter updates, measured from the polls that saw it change.

NVML's total-energy counter moves only every ~100 ms on A100 (ml.energy,
"Thermally stable profiling", 2026; docs/energy-measurement.md): a poll sees a
new value some time after the driver's update. Each change is known to lie in
the *bracket* between the previous read and the read that saw it. Updates are
periodic, so :class:`TickGrid` fits ``tick_n = phase + n * period`` to the
brackets' middles by least squares (the middles scatter uniformly, the fit
averages them out) and stamps each change at the fitted tick inside its bracket:
an estimate far tighter than the bracket, which is what makes per-unit energy
exact again with a counter ten times coarser than the units. A change whose
fitted tick falls outside its bracket (the counter is not periodic after all:
driver jitter, a reset) restarts the fit and is stamped at its bracket's middle.

A poller starved for a while (a busy host) leaves a *wide* bracket, one period or more, that may
hold several updates: its middle says nothing about which tick it is, so it neither feeds nor tests
the fit (ticks are numbered from the last narrow bracket, by whole periods), and its change is
stamped at the last fitted tick inside it (the value read is the counter at that update). Where no
bracket is wide the fit is what it was without this rule, bit for bit. :meth:`TickGrid.stamp_bound_s`
states how far a stamp can be off: the hard bounds every recent bracket puts on that tick.

Pure Python on the monitor's clock; the caller holds its own lock. The simulated GPU's monitor adds a
bracket every poll, so per bracket the grid does little: the period bounds slide with the brackets
(:mod:`~megatron_envpipe.gpu.energy.pair_bounds`) and the brackets' widths stay sorted for their median,
each with the same IEEE operations on the same operands as the plain comprehensions, hence the same
floats (tests/gpu/test_counter_ticks_exact.py holds the grid to the plain version it replaced, bit for bit).
"""

from __future__ import annotations

import bisect
import math
import statistics
from collections import deque

from megatron_envpipe.errors import InvalidValueError
from megatron_envpipe.gpu.energy.pair_bounds import SlidingPairBounds

__all__ = ["TickGrid"]

# Changes seen before a period is trusted: the first estimate is their median spacing.
_MIN_UPDATES = 4
# Recent brackets whose intersection pins the phase (hard bounds: the tick lies inside every one).
_PHASE_BRACKETS = 64
# The newest of them pin the phase (few periods: the period's own error cannot add up).
_PHASE_FROM = 12
# The oldest and the newest this many bound the period (every pair of one old and one new bracket).
_PERIOD_FROM = 16
# A bracket is wide (a starved poll) when it spans a period (before a fit: this many times the first
# estimate) and this many times the poller's usual bracket: polls aliased near the period are not starved.
_WIDE = 1.5


class TickGrid:
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
        self._widths: list[float] = []  # hi - lo of each recent bracket, sorted (their median, at no sort)
        self._pairs: SlidingPairBounds | None = None  # the period bounds, while the window is full
        self._unfit_left = 0  # brackets to come before a non-finite or out-of-order one has left the window
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
            self._remember(0, *self._first[0])
            for m, (lo, hi) in zip(mids[1:], self._first[1:]):
                self._advance(m, period)
                self._remember(self._n_last, lo, hi)
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
        self._remember(self._n_last, lo_s, hi_s)
        self._after_wide = False
        self._fit()

    def _is_wide(self, width_s: float, period_s: float) -> bool:
        """Whether a bracket may hold several updates and is a starved poll, not the poller's usual."""
        if width_s < period_s:
            return False
        return width_s >= _WIDE * self._usual_width_s()

    def _remember(self, n: int, lo_s: float, hi_s: float) -> None:
        """Append a fitted bracket to the recent ones (the oldest drops out), widths sorted, bounds slid."""
        recent, widths = self._recent, self._widths
        was_full = len(recent) == recent.maxlen
        if was_full:
            _, lo, hi = recent[0]
            del widths[bisect.bisect_left(widths, hi - lo)]  # that very float is there: no rounding
        # SlidingPairBounds wants finite brackets in increasing n (always so: numbers only grow in a fit)
        fits = (not recent or n > recent[-1][0]) and math.isfinite(lo_s) and math.isfinite(hi_s)
        self._unfit_left = max(0, self._unfit_left - 1) if fits else _PHASE_BRACKETS
        recent.append((n, lo_s, hi_s))
        bisect.insort(widths, hi_s - lo_s)
        if len(recent) < _PHASE_BRACKETS or self._unfit_left:
            self._pairs = None
        elif was_full and self._pairs is not None:
            self._pairs.slide(list(recent))
        else:
            self._pairs = SlidingPairBounds(list(recent), _PERIOD_FROM)

    def _usual_width_s(self) -> float:
        """The median width of the recent brackets (0 without any): statistics.median's arithmetic."""
        widths = self._widths
        k = len(widths)
        if k == 0:
            return 0.0
        if k % 2 == 1:
            return widths[k // 2]
        return (widths[k // 2 - 1] + widths[k // 2]) / 2

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
        bounds = self._pairs.bounds() if self._pairs is not None else None
        if bounds is None:
            bounds = _period_bounds(recent[:_PERIOD_FROM], recent[-_PERIOD_FROM:])
        if bounds is not None:
            t_low, t_high = bounds
            if t_low <= t_high:
                period = min(max(period, t_low), t_high)
        self._period_bounds = bounds if bounds is not None and bounds[0] <= bounds[1] else None
        self._period_s = period
        newest = recent[-_PHASE_FROM:]
        # max(lo - n * period) and min(hi - n * period) over the newest, as max()/min() pick (first wins)
        n, lo, hi = newest[0]
        low, high = lo - n * period, hi - n * period
        for n, lo, hi in newest[1:]:
            shift = n * period
            if lo - shift > low:
                low = lo - shift
            if hi - shift < high:
                high = hi - shift
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


def _period_bounds(old: list[tuple[int, float, float]],
                   new: list[tuple[int, float, float]]) -> tuple[float, float] | None:
    """The least and the most period every pair of an old bracket and a later new one allows (None
    without such a pair): the plain way, for a window that is not full (or a zero bound)."""
    pairs = [(n1 - n0, lo1 - hi0, hi1 - lo0) for n0, lo0, hi0 in old for n1, lo1, hi1 in new if n1 > n0]
    if not pairs:
        return None
    return max(a / dn for dn, a, _ in pairs), min(b / dn for dn, _, b in pairs)
