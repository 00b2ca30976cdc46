"""Following a straggler: the pure StragglerFollower state machine (issue 24, part 2). Simulated paces."""

from __future__ import annotations

import random

import pytest

from megatron_envpipe.errors import EnvPipeError
from megatron_envpipe.planning.straggler import (
    FollowSettings,
    StragglerError,
    StragglerFollower,
    natural_time_s,
)


def run(follower, pairs):
    return [follower.update(own, slowest) for own, slowest in pairs]


def test_the_slowest_pipeline_and_small_gaps_keep_their_own_plan():
    f = StragglerFollower(FollowSettings(), 1.0)
    for d in run(f, [(1.0, 1.0), (1.2, 1.1), (1.0, 1.02), (1.0, 1.015)]):
        assert not d.follow and d.target_time_s is None and d.pace_ratio == 1.0 and not d.changed
    assert "slowest" in f.update(1.3, 1.3).reason  # the straggler itself says why it keeps its plan
    assert not f.following


def test_follows_above_the_threshold_never_slower_than_the_slowest():
    s = FollowSettings(threshold=0.02, release=0.01, headroom=0.005)
    f = StragglerFollower(s, 2.0)
    d = f.update(2.0, 2.2)
    assert d.follow and d.changed
    assert d.target_time_s == pytest.approx(2.2 * 0.995)
    assert d.target_time_s <= 2.2
    assert d.pace_ratio == pytest.approx(2.2 * 0.995 / 2.0)
    assert "10.00 %" in d.reason


def test_hysteresis_band_keeps_the_current_state():
    f = StragglerFollower(FollowSettings(threshold=0.02, release=0.01), 1.0)
    assert not f.update(1.0, 1.015).follow  # in the band, not following: stays off
    assert f.update(1.0, 1.05).follow
    d = f.update(1.0, 1.015)  # in the band while following: keeps following (lowered, never slower)
    assert d.follow and d.target_time_s <= 1.015
    d = f.update(1.0, 1.005)  # within release: back to the own plan
    assert not d.follow and d.changed and "recovered" in d.reason
    assert not f.update(1.0, 1.015).follow


def test_windows_to_switch_needs_consecutive_windows():
    f = StragglerFollower(FollowSettings(windows_to_switch=3), 1.0)
    seq = [(1.0, 1.1), (1.0, 1.1), (1.0, 1.0), (1.0, 1.1), (1.0, 1.1)]  # streak broken at the 3rd window
    assert not any(d.follow for d in run(f, seq))
    d = f.update(1.0, 1.1)
    assert d.follow and d.changed
    assert [d.follow for d in run(f, [(1.0, 1.0), (1.0, 1.0)])] == [True, True]
    assert not f.update(1.0, 1.0).follow


def test_target_moves_with_the_straggler_but_not_with_noise():
    f = StragglerFollower(FollowSettings(), 1.0)
    f.update(1.0, 1.10)
    t0 = f.target_time_s
    d = f.update(1.0, 1.11)  # 1 % slower than before: within the threshold, keep the plan
    assert not d.changed and f.target_time_s == t0
    d = f.update(1.0, 1.20)  # slowed by much more: follow the new pace
    assert d.changed and f.target_time_s == pytest.approx(1.2 * 0.995)
    d = f.update(1.0, 1.15)  # sped up: lower at once
    assert d.changed and f.target_time_s == pytest.approx(1.15 * 0.995)


def noisy_paces(seed, phases, noise):
    rng = random.Random(seed)
    for ratio, n in phases:
        for _ in range(n):
            yield ratio, 1.0 * (1 + rng.uniform(-noise, noise)), ratio * (1 + rng.uniform(-noise, noise))


@pytest.mark.parametrize("seed", range(5))
def test_noise_does_not_oscillate_and_never_slower_than_the_slowest(seed):
    phases = [(1.0, 20), (1.10, 30), (1.0, 20), (1.02, 30)]
    f = StragglerFollower(FollowSettings(), 1.0)
    switches, following_at = 0, {1.0: 0, 1.10: 0}
    for ratio, own, slowest in noisy_paces(seed, phases, noise=0.006):
        d = f.update(own, slowest)
        assert d.target_time_s is None or d.target_time_s <= max(own, slowest)
        assert d.follow == f.following
        following_at[ratio] = following_at.get(ratio, 0) + d.follow
        switches += d.changed
    assert following_at[1.10] == 30  # from the first straggler window on
    assert following_at[1.0] <= 2  # released within the first windows after the straggler recovered
    # start (+ at most a few noise-driven lowerings while the pace settles), release, one start at 1.02
    assert switches <= 8


def test_natural_time_rescales_a_following_window():
    assert natural_time_s(2.2, 2.2, 2.0) == pytest.approx(2.0)
    assert natural_time_s(2.0, 2.0, 2.0) == 2.0
    with pytest.raises(StragglerError, match="measured iteration time"):
        natural_time_s(0.0, 1.0, 1.0)


@pytest.mark.parametrize("kwargs,words", [
    (dict(threshold=0.0), "threshold"),
    (dict(threshold=1.5), "threshold"),
    (dict(release=0.03), "release"),
    (dict(release=-0.01), "release"),
    (dict(windows_to_switch=0), "windows_to_switch"),
    (dict(windows_to_switch=1.5), "windows_to_switch"),
    (dict(headroom=0.05), "headroom"),
    (dict(threshold=float("nan")), "threshold"),
])
def test_bad_settings_say_what(kwargs, words):
    with pytest.raises(StragglerError, match=words) as exc:
        FollowSettings(**kwargs)
    assert isinstance(exc.value, EnvPipeError) and "\n" not in str(exc.value)


@pytest.mark.parametrize("own,slowest", [(0.0, 1.0), (1.0, float("inf")), (-1.0, 1.0), (1.0, float("nan"))])
def test_bad_measurements_say_what(own, slowest):
    with pytest.raises(StragglerError, match="must be a finite time > 0 s"):
        StragglerFollower().update(own, slowest)


@pytest.mark.parametrize("threshold", [0.001, 0.005, 0.02, 0.5, 0.99])
def test_every_flag_threshold_gives_valid_settings(threshold):
    # Training derives release = threshold / 2; the default headroom scales with the threshold.
    s = FollowSettings(threshold=threshold, release=threshold / 2)
    assert 0 < s.headroom_fraction < s.release
    d = StragglerFollower(s, 1.0).update(1.0, 1.0 + 2 * threshold)
    assert d.follow and 1.0 < d.target_time_s <= 1.0 + 2 * threshold
