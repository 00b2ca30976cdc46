"""Telling forwards from backwards on units shorter than the counter's period (gpu/profiler/power_ratio.py) and one
heat drift for a pipeline (gpu/profiler/heat_drift.fit_pipeline_heat_drift): the two corrections of issue 33."""

from __future__ import annotations

import math
import statistics

import pytest

from megatron_envpipe.core.profile import Profile
from megatron_envpipe.core.resources import shipped_profile
from megatron_envpipe.gpu.profiler.attribution import KindPowers
from megatron_envpipe.gpu.profiler.heat_drift import _fit_heat_drift, fit_pipeline_heat_drift
from megatron_envpipe.gpu.profiler.power_ratio import _RATIO_SPREAD, pool_ratio, pull_towards


@pytest.mark.parametrize("name", ["a40/gpt3-175b", "a40/bloom-176b"])
def test_the_ratio_spread_covers_the_shipped_profiles(name):
    """The prior's spread is what real stages show: B/F power ratios vary this little across clocks."""
    prof = Profile.from_csv(shipped_profile(name))
    for s in range(prof.num_stages):
        ratios = []
        for f in prof.common_frequencies():
            pf = prof.energy_j(s, "forward", f) / prof.time_s(s, "forward", f)
            pb = prof.energy_j(s, "backward", f) / prof.time_s(s, "backward", f)
            ratios.append(pb / pf)
        assert statistics.pstdev(ratios) / statistics.fmean(ratios) <= _RATIO_SPREAD


def _collinear(f_w: float, b_w: float, tf: float = 0.03, tb: float = 0.06, sharp: float = 1e-4,
               loose: float = 1e5) -> KindPowers:
    """A fit that resolves tf P_F + tb P_B sharply and their difference loosely (covariance in W^2)."""
    # Directions: u ~ (tf, tb) (sharp), v ~ (tb, -tf) (loose); Sigma = sharp u u' + loose v v'.
    nu, nv = math.hypot(tf, tb), math.hypot(tb, tf)
    u, v = (tf / nu, tb / nu), (tb / nv, -tf / nv)
    var_f = sharp * u[0] ** 2 + loose * v[0] ** 2
    var_b = sharp * u[1] ** 2 + loose * v[1] ** 2
    cov = sharp * u[0] * u[1] + loose * v[0] * v[1]
    return KindPowers(f_w, b_w, var_f, var_b, cov)


def test_a_sharp_fit_is_left_alone():
    fit = KindPowers(300.0, 280.0, 1e-6, 1e-6, 0.0)
    pooled = pool_ratio([fit, KindPowers(300.0, 300.0, 1e-6, 1e-6, 0.0)])
    pull = pull_towards(fit, pooled)
    assert pull.forward_factor == pytest.approx(1, abs=1e-6) and pull.backward_factor == pytest.approx(1, abs=1e-6)


def test_a_collinear_fit_is_pulled_along_its_loose_direction_only():
    """A fit that split 300 W units 330 / 285 W (the counter could not tell them apart) is pulled to the stage's
    ratio (1.0 here), keeping what the counter resolved: the time-weighted sum."""
    tf, tb = 0.03, 0.06
    true_w = 300.0
    # Off by +30 W on F along the loose direction (tb, -tf): B off by -15 W.
    wrong = _collinear(true_w + 30.0, true_w - 15.0, tf, tb)
    sharp_fits = [KindPowers(true_w, true_w, 1.0, 1.0, 0.0) for _ in range(5)]  # clocks that resolved the ratio
    pooled = pool_ratio([wrong, *sharp_fits])
    assert pooled.ratio == pytest.approx(1.0, abs=0.002)
    pull = pull_towards(wrong, pooled)
    f_new, b_new = wrong.forward_w * pull.forward_factor, wrong.backward_w * pull.backward_factor
    assert abs(f_new - true_w) < 3.0 and abs(b_new - true_w) < 3.0  # from 30 and 15 W off
    assert tf * f_new + tb * b_new == pytest.approx(tf * wrong.forward_w + tb * wrong.backward_w, rel=1e-4)
    assert pull.forward_variance_factor < 0.05 and pull.backward_variance_factor < 0.05


def test_pooled_ratio_weights_iterations_by_what_they_resolved():
    loose = _collinear(400.0, 250.0)  # ratio 0.625, barely resolved
    sharp = KindPowers(300.0, 294.0, 1.0, 1.0, 0.0)  # ratio 0.98
    assert pool_ratio([loose, sharp]).ratio == pytest.approx(0.98, abs=0.01)
    assert pool_ratio([None, None]) is None


def test_one_drift_for_the_pipeline_ignores_one_stage_s_bias():
    """Three stages heat alike (3 % cold, 60 s); stage 2's blocking power reads 35 % low for nine iterations
    (short P2P waits on a fast GPU), then right. Alone it would fit a huge drift; pooled, the pipeline's."""
    def power(t: float) -> float:
        return 70.0 * (1 - 0.03 * math.exp(-t / 60.0))
    times = [1.0 + 1.5 * k for k in range(20)]
    stages = [[(k, t, power(t)) for k, t in enumerate(times)] for _ in range(2)]
    biased = [(k, t, power(t) * (0.65 if k < 9 else 1.0)) for k, t in enumerate(times)]
    alone = _fit_heat_drift([(t, p) for _, t, p in biased])
    assert alone is not None and alone.amplitude < -0.2
    drifts = fit_pipeline_heat_drift([*stages, biased, [(k, t, None) for k, t in enumerate(times)]])
    assert all(d is not None for d in drifts)  # the stage without P2P waits gets the drift too
    assert all(-0.04 < d.amplitude < -0.005 for d in drifts), drifts
    assert drifts[3].t0_s == pytest.approx(times[0] + drifts[0].t0_s - times[0])
    # No drift anywhere: none for anyone.
    flat = [[(k, t, 70.0) for k, t in enumerate(times)] for _ in range(3)]
    assert fit_pipeline_heat_drift(flat) == (None, None, None)
