"""The fast tick grid (gpu/energy/counter_ticks.py, issue 37) against the plain one it replaced
(tests/gpu/tick_grid_reference.py, a frozen copy): fed the same bracket streams, every public output
must be the same float after every bracket (``==``, no tolerance), so no simulated energy figure moves.

The streams are seeded and cover what the fit meets: periodic counters with driver jitter, starved
(wide) polls, counter restarts (phase jumps, a new period), polls aliased near the period, and a
continuous counter (every poll a change, the simulated GPU's case), plus degenerate brackets.
"""

from __future__ import annotations

import math
import random
import statistics

import pytest
from tick_grid_reference import ReferenceTickGrid

from megatron_envpipe.errors import InvalidValueError
from megatron_envpipe.gpu.energy.counter_ticks import TickGrid
from megatron_envpipe.gpu.energy.pair_bounds import SlidingPairBounds

KINDS = ("periodic", "jitter", "starved", "restarts", "aliased", "continuous", "mixed")


def brackets(kind: str, seed: int, count: int):
    """``count`` brackets ``(lo, hi)`` a poller of a counter of this kind would add (lo: the read before
    the change, hi: the read that saw it), plus a degenerate one now and then."""
    rng = random.Random(f"{kind}|{seed}")
    period = rng.uniform(0.002, 0.2)
    phase = rng.uniform(0.0, period)
    jitter = {"jitter": 0.05, "mixed": 0.02}.get(kind, 0.0) * period
    if kind == "aliased":
        poll = period * rng.choice([0.999, 1.001, 0.5005, 0.3334, 1.0])
    elif kind == "continuous":
        poll, period = rng.uniform(0.001, 0.003), 0.0
    else:
        poll = period * rng.uniform(0.02, 0.4)
    t = rng.uniform(0.0, 10.0)
    k_seen = math.floor((t - phase) / period) if period else 0
    out = []
    while len(out) < count:
        starved = kind in ("starved", "mixed") and rng.random() < 0.03
        t_next = t + (rng.uniform(1.0, 4.5) * max(period, poll) if starved else poll * rng.uniform(0.9, 1.1))
        if kind in ("restarts", "mixed") and rng.random() < 0.004:
            phase = rng.uniform(0.0, period)  # a driver reset: the ticks move
            if rng.random() < 0.3:
                period *= rng.uniform(0.9, 1.1)
        if period == 0.0:
            changed = True
        else:
            k = math.floor((t_next - phase) / period)
            # a jittered tick: the update of tick k lands up to ``jitter`` late
            changed = k > k_seen and (t_next - (phase + k * period) >= rng.uniform(0.0, jitter) or k > k_seen + 1)
            if changed:
                k_seen = k
        if changed:
            out.append((t, t_next))
        if rng.random() < 0.002:
            out.append((t_next, t_next))  # no bracket: the grid must ignore it
        t = t_next
    return out


def outputs(grid, lo: float, hi: float, probes: list[float], edges: list[float]) -> tuple:
    """Every public answer of ``grid``, for the bracket just added and for probes: times to find the
    nearest tick of, and left edges of brackets ending at ``hi`` (wide or not by a hair)."""
    mid = 0.5 * (lo + hi)
    return (grid.period_s, grid.updates, grid.restarts, grid.wide, grid.min_updates,
            grid.tick_near(mid), *map(grid.tick_near, probes),
            grid.stamp(lo, hi), grid.stamp_bound_s(lo, hi) if hi > lo else None,
            *(grid.stamp(edge, hi) for edge in edges), *(grid.stamp_bound_s(edge, hi) for edge in edges))


def edges_near_wide(plain: ReferenceTickGrid, hi: float) -> list[float]:
    """Left edges of brackets ending at ``hi`` about three periods wide, and about as wide as a bracket
    must be to be wide (1.5 x the recent brackets' median, by the frozen copy), one ulp either way."""
    period = plain.period_s or 0.01
    edges = [hi - 3.0 * period]
    if plain._recent:  # the frozen copy's own state: what it took the usual bracket to be
        edge = hi - 1.5 * statistics.median(b - a for _, a, b in plain._recent)
        edges += [math.nextafter(edge, -math.inf), edge, math.nextafter(edge, math.inf)]
    return edges


def check_same(kind: str, seed: int, count: int) -> int:
    fast, plain = TickGrid(), ReferenceTickGrid()
    rng = random.Random(seed)
    for i, (lo, hi) in enumerate(brackets(kind, seed, count)):
        fast.add(lo, hi)
        plain.add(lo, hi)
        probes, edges = [hi + rng.uniform(-1.0, 1.0), hi + rng.uniform(0.0, 0.01)], edges_near_wide(plain, hi)
        got, want = outputs(fast, lo, hi, probes, edges), outputs(plain, lo, hi, probes, edges)
        assert got == want, f"{kind} seed {seed}: bracket {i} ({lo!r}, {hi!r}): {got} != {want}"
    return plain.restarts + plain.wide


@pytest.mark.parametrize("kind", KINDS)
def test_the_fast_grid_gives_the_plain_grids_floats_after_every_bracket(kind):
    # enough brackets to fill the recent window (64) several times over, from two starts
    for seed in range(2):
        check_same(kind, seed, 300)


def test_the_streams_reach_the_rules_the_grid_has():
    """The streams above are worth comparing on: they do restart the fit and leave wide brackets out."""
    plain = ReferenceTickGrid()
    for lo, hi in brackets("starved", 0, 400):
        plain.add(lo, hi)
    assert plain.wide > 3 and plain.period_s is not None
    plain = ReferenceTickGrid()
    for lo, hi in brackets("restarts", 1, 1500):
        plain.add(lo, hi)
    assert plain.restarts > 0 and plain.period_s is not None


def plain_bounds(window, k):
    pairs = [(n1 - n0, lo1 - hi0, hi1 - lo0) for n0, lo0, hi0 in window[:k] for n1, lo1, hi1 in window[-k:]]
    return max(a / dn for dn, a, _ in pairs), min(b / dn for dn, _, b in pairs)


@pytest.mark.parametrize("seed", range(4))
def test_sliding_pair_bounds_equal_the_plain_max_and_min_after_every_slide(seed):
    rng, k, size = random.Random(seed), 16, 64
    n, t, window = 0, 0.0, []
    def step():
        nonlocal n, t
        n += rng.choice([1, 1, 1, 2, 5])
        t += rng.uniform(0.5, 3.0)
        window.append((n, t, t + rng.uniform(0.001, 2.0)))
    for _ in range(size):
        step()
    bounds = SlidingPairBounds(window, k)
    assert bounds.bounds() == plain_bounds(window, k)
    for _ in range(300):
        step()
        del window[0]
        bounds.slide(window)
        assert bounds.bounds() == plain_bounds(window, k)


def test_sliding_pair_bounds_leave_a_zero_bound_to_the_plain_way_and_want_old_and_new_apart():
    # a zero bound could be 0.0 or -0.0 depending on which pair max() met first: the caller decides
    window = [(i, 10.0 if i >= 48 else 0.0, 20.0 if i >= 48 else 10.0) for i in range(64)]  # lo1 - hi0 = 0
    assert SlidingPairBounds(window, 16).bounds() is None
    with pytest.raises(InvalidValueError, match="cannot hold 16 old and 16 new"):
        SlidingPairBounds(window[:31], 16)
