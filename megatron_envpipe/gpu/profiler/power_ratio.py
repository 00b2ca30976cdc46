"""Telling forwards from backwards when both are shorter than the energy counter's period.

The start-up profiler fits one power per kind of unit to the counter's increments
(:mod:`megatron_envpipe.gpu.profiler.attribution`). Where units alternate faster than the counter updates (a
1F1B steady state of 20 / 40 ms units against a 100 ms counter), every increment holds about the same
mix of forward and backward time: their *time-weighted sum* is sharp, their *difference* is not, and a
few joules of stamp error move one kind's power by tens of percent (34 % seen on 28 / 69 ms units).

What does not change much is how a stage's backward power relates to its forward power: on the
shipped A40 profiles ``P_B / P_F`` stays within about 2.5 % (standard deviation) of its mean over
every clock of a stage. So each iteration's two powers are pulled towards that stage's pooled
ratio, as a Gaussian prior on ``P_B - rho P_F`` with the ratio's spread across clocks
(:data:`_RATIO_SPREAD`) plus the pooled ratio's own uncertainty. The pull is a Kalman update along the
fit's own covariance: it moves the estimate only along the direction the counter could not resolve,
keeps the sharp sum, and is negligible where the data tells the kinds apart (long units, warm-up and
cool-down phases), so profiles of long units are unchanged. The pooled ratio weights every iteration
by how well it resolved the ratio. Pure Python.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from megatron_envpipe.gpu.profiler.attribution import KindPowers

__all__ = ["PooledRatio", "RatioPull", "pool_ratio", "pull_towards"]

# The spread (relative standard deviation) of a stage's backward/forward power ratio across its clocks:
# 2.4-2.5 % on the shipped A40 profiles (tests/gpu/test_power_ratio.py measures it), rounded up.
_RATIO_SPREAD = 0.03


@dataclass(frozen=True)
class PooledRatio:
    """A stage's backward/forward power ratio, pooled over its iterations, and its variance."""

    ratio: float
    variance: float
    iterations: int


@dataclass(frozen=True)
class RatioPull:
    """One iteration's powers after the prior, as factors on the fitted ones (energies scale with them)
    and the posterior variances relative to the fitted ones (standard errors scale with their root)."""

    forward_factor: float
    backward_factor: float
    forward_variance_factor: float
    backward_variance_factor: float


def _ratio_and_variance(fit: KindPowers) -> tuple[float, float]:
    """``P_B / P_F`` and its variance by the delta method."""
    r = fit.backward_w / fit.forward_w
    var = (fit.var_backward - 2 * r * fit.cov + r * r * fit.var_forward) / fit.forward_w ** 2
    return r, max(var, 0.0)


def pool_ratio(fits: Sequence[KindPowers | None], spread: float = _RATIO_SPREAD) -> PooledRatio | None:
    """The stage's ratio from its iterations' fits (None without any): each weighted by
    ``1 / (its variance + (spread x ratio)^2)``, since clocks differ by ``spread`` anyway."""
    known = [_ratio_and_variance(f) for f in fits if f is not None]
    if not known:
        return None
    weights = [1.0 / (var + (spread * r) ** 2) for r, var in known]
    total = math.fsum(weights)
    ratio = math.fsum(w * r for w, (r, _) in zip(weights, known)) / total
    return PooledRatio(ratio, 1.0 / total, len(known))


def pull_towards(fit: KindPowers, pooled: PooledRatio, spread: float = _RATIO_SPREAD) -> RatioPull:
    """``fit`` after the prior ``P_B - rho P_F ~ N(0, P_F^2 (spread^2 rho^2 + var(rho)))`` (module docstring)."""
    rho = pooled.ratio
    cf, cb = -rho, 1.0  # c . (P_F, P_B) = P_B - rho P_F
    sigma_c_f = fit.var_forward * cf + fit.cov * cb  # (Sigma c)_F
    sigma_c_b = fit.cov * cf + fit.var_backward * cb  # (Sigma c)_B
    prior = fit.forward_w ** 2 * ((spread * rho) ** 2 + pooled.variance)
    denom = cf * sigma_c_f + cb * sigma_c_b + prior
    if not denom > 0:
        return RatioPull(1.0, 1.0, 1.0, 1.0)
    d = fit.backward_w - rho * fit.forward_w
    f_new = fit.forward_w - sigma_c_f * d / denom
    b_new = fit.backward_w - sigma_c_b * d / denom
    var_f = fit.var_forward - sigma_c_f * sigma_c_f / denom
    var_b = fit.var_backward - sigma_c_b * sigma_c_b / denom
    if not (f_new > 0 and b_new > 0):
        return RatioPull(1.0, 1.0, 1.0, 1.0)
    return RatioPull(f_new / fit.forward_w, b_new / fit.backward_w,
                     max(var_f, 0.0) / fit.var_forward if fit.var_forward > 0 else 1.0,
                     max(var_b, 0.0) / fit.var_backward if fit.var_backward > 0 else 1.0)
