"""How much a GPU's power has drifted while it heated up, from the power of a fixed activity.

A cold GPU draws less than a hot one (ml.energy, "Thermally stable profiling",
2026): over the first minutes of a run the same work reads a few percent lower
energy, and a start-up profiler that measures the fastest clock first would
record it cheaper than it will be. Every power scales alike with temperature
(leakage rises with it), so the power of something that does not change between
iterations, the P2P blocking windows every profiling iteration has anyway, traces
the drift at no extra cost. :func:`_fit_heat_drift` fits
``P(t) = P_hot (1 + c exp(-(t - t0) / tau))`` to ``(time, power)`` points by least
squares over a grid of ``tau``; :meth:`HeatDrift.factor` is then the power at
``t`` relative to the hot state, by which the profiler divides that iteration's
energies. No correction (None) where the points show no drift beyond their own
noise, so an ideal GPU's profile is untouched. Pure Python.

A pipeline's GPUs start together and run the same kind of work, so they heat alike, while one
stage's blocking power can be biased for a while (short P2P waits on a fast GPU: counter steps
straddle them). :func:`fit_pipeline_heat_drift` therefore fits one drift to the median over the
stages of each iteration's power relative to that stage's own median, and gives every stage that
shape: one stage's bias cannot become its "heat" (on units of 17/42 ms one stage read 45 W for
nine iterations, then 70 W; fitted alone that was a 57 % drift).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, replace

__all__ = ["UNSEEN_HEAT_DRIFT", "HeatDrift", "fit_pipeline_heat_drift"]

# How much less a cold GPU may draw than a hot one ("a few percent": ml.energy, "Thermally stable
# profiling", 2026). A sweep that ends before the GPU has heated cannot see it: the profiler then
# states it as headroom (a hot GPU may draw up to this much more than the rows) instead of claiming
# the hot state.
UNSEEN_HEAT_DRIFT = 0.03
# Fewer points than this cannot tell a drift (3 parameters) from noise.
_MIN_POINTS = 4
# A drift smaller than this (relative) is left alone: below what any planner can use.
_MIN_AMPLITUDE = 1e-3
# Points that must lie measurably off the hot power for a drift to be believed.
_MIN_SHOWN_BY = 3
# Time constants tried, as multiples of the points' span: a GPU still heating at the end of the
# sweep gives no hot state to find (longer ones would only extrapolate it).
_TAU_GRID = tuple(0.02 * 1.15 ** k for k in range(32))  # 0.02 .. ~1.5 spans


@dataclass(frozen=True)
class HeatDrift:
    """A fitted drift: ``power(t) = hot_power_w * factor(t)``."""

    hot_power_w: float
    amplitude: float  # c: relative departure from the hot power at t0_s (negative: a cold start)
    tau_s: float
    t0_s: float
    points: int

    def factor(self, t_s: float) -> float:
        """Power at ``t_s`` relative to the hot state."""
        return 1.0 + self.amplitude * math.exp(-max(0.0, t_s - self.t0_s) / self.tau_s)


def _fit_heat_drift(points: Sequence[tuple[float, float]]) -> HeatDrift | None:
    """The drift of ``(time_s, power_w)`` points (see the module docstring); None when there is
    none to correct: too few points, no span, or a drift within 3 standard errors or under 0.1 %."""
    pts = sorted((float(t), float(p)) for t, p in points if math.isfinite(t) and math.isfinite(p) and p > 0)
    n = len(pts)
    if n < _MIN_POINTS:
        return None
    t0, span = pts[0][0], pts[-1][0] - pts[0][0]
    if not span > 0:
        return None
    best: tuple[float, float, float, float, float] | None = None  # rss, a, c_abs, tau, se_c
    for k in _TAU_GRID:
        tau = k * span
        xs = [math.exp(-(t - t0) / tau) for t, _ in pts]
        mx = math.fsum(xs) / n
        my = math.fsum(p for _, p in pts) / n
        sxx = math.fsum((x - mx) ** 2 for x in xs)
        if sxx <= 1e-12:
            continue
        c = math.fsum((x - mx) * (p - my) for x, (_, p) in zip(xs, pts)) / sxx
        a = my - c * mx
        rss = math.fsum((p - a - c * x) ** 2 for x, (_, p) in zip(xs, pts))
        se_c = math.sqrt(rss / (n - 2) / sxx) if n > 2 else math.inf
        if best is None or rss < best[0]:
            best = (rss, a, c, tau, se_c)
    if best is None:
        return None
    _, a, c, tau, se_c = best
    if not a > 0 or abs(c) / a < _MIN_AMPLITUDE or abs(c) <= 3 * se_c:
        return None
    drift = HeatDrift(hot_power_w=a, amplitude=c / a, tau_s=tau, t0_s=t0, points=n)
    # A drift only one or two points show is an outlier (a first iteration's edge effect), not heat.
    if sum(1 for t, _ in pts if abs(drift.factor(t) - 1) >= _MIN_AMPLITUDE) < _MIN_SHOWN_BY:
        return None
    return drift


def fit_pipeline_heat_drift(
    points: Sequence[Sequence[tuple[int, float, float | None]]],
) -> tuple[HeatDrift | None, ...]:
    """One drift for a pipeline (module docstring) from each stage's ``(iteration, time_s, power_w)``
    points (power None: no P2P wait that iteration); per stage, that drift on the stage's own clock
    (None for all where none is shown).

    Each stage's times count from its own first point (their clocks need not agree); an iteration
    enters the fit where at least half the stages with powers have one in it. A stage without any
    power point gets the drift too (its GPU heats as the others do), at the pipeline's median power."""
    stages = [[(k, float(t), p) for k, t, p in pts if math.isfinite(t)] for pts in points]
    powered = [[(k, t, float(p)) for k, t, p in pts if p is not None and math.isfinite(p) and p > 0]
               for pts in stages]
    medians = [statistics.median(p for _, _, p in pts) if pts else None for pts in powered]
    starts = [pts[0][1] if pts else None for pts in stages]
    by_iteration: dict[int, list[tuple[float, float]]] = {}
    for pts, start, median in zip(powered, starts, medians):
        for k, t, p in pts:
            by_iteration.setdefault(k, []).append((t - start, p / median))
    present = sum(1 for m in medians if m is not None)
    trace = [(statistics.median(t for t, _ in v), statistics.median(r for _, r in v))
             for _, v in sorted(by_iteration.items()) if present and 2 * len(v) >= present]
    shape = _fit_heat_drift(trace)
    if shape is None:
        return tuple(None for _ in stages)
    typical = statistics.median(m for m in medians if m is not None)
    return tuple(None if start is None else replace(
        shape, hot_power_w=shape.hot_power_w * (median if median is not None else typical),
        t0_s=start + shape.t0_s, points=len(pts)) for pts, start, median in zip(powered, starts, medians))
