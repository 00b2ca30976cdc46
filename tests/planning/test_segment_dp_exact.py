"""The segment DP's fast per-rank search (planning/switching_dp._stage_dp, issue 34 speed) returns what the plain
search it replaced returns, to the bit: the same clocks and the same total, on random ranks with inputs that wait
(many candidates ending at the same time), equal costs (ties resolved in the same order), tight caps, clock
latency segments and small ``keep``. The plain search is written out here as the specification."""

from __future__ import annotations

import random
from operator import itemgetter

import pytest

from megatron_envpipe.planning import switching_dp

_END_COST = itemgetter(0, 1)


def _plain_pareto(entries: list[tuple], keep: int) -> list[tuple]:
    if len(entries) < 2:
        return entries
    entries.sort(key=_END_COST)
    out, best = [], float("inf")
    for e in entries:
        if e[1] < best - 1e-12:
            out.append(e)
            best = e[1]
    if len(out) > keep:
        out = out[:1] + out[len(out) - keep + 1:]
    return out


def _plain_dp(units, allowed, at, ready, cap, switch_cost_j, keep, min_segment_s):
    """Every candidate built, sorted and filtered: the search as first written (commit 600523c's successor)."""
    prev, layers = None, []
    for i, v in enumerate(units):
        r, c_lim, tab = ready[i], cap[i], at[v]
        cur = {}
        if prev is None:
            for f in allowed[i]:
                t, eff = tab[f]
                if r + t <= c_lim:
                    cur[f] = [(r + t, eff, f, t, None)]
        else:
            pool = [(e[0], e[1], e[2], pf, k) for pf, lst in prev.items() for k, e in enumerate(lst)
                    if e[3] >= min_segment_s]
            glob = _plain_pareto(pool, keep)
            for f in allowed[i]:
                t, eff = tab[f]
                cands = []
                for k, e in enumerate(prev.get(f, ())):
                    s = e[0] if e[0] > r else r
                    if s + t <= c_lim:
                        cands.append((s + t, e[1] + eff, e[2], e[3] + t, (f, k)))
                for e_end, e_cost, first, pf, k in glob:
                    if pf == f:
                        continue
                    s = e_end if e_end > r else r
                    if s + t <= c_lim:
                        cands.append((s + t, e_cost + switch_cost_j + eff, first, t, (pf, k)))
                if cands:
                    cur[f] = _plain_pareto(cands, keep)
        if not cur:
            return None
        layers.append(cur)
        prev = cur
    best = None
    for f, lst in prev.items():
        for k, e in enumerate(lst):
            total = e[1] + (switch_cost_j if f != e[2] else 0.0)
            if best is None or total < best[0]:
                best = (total, f, k)
    total, f, k = best
    clocks = [0] * len(layers)
    for i in range(len(layers) - 1, -1, -1):
        clocks[i] = f
        back = layers[i][f][k][4]
        if back is not None:
            f, k = back
    return total, clocks


class _At:
    def __init__(self, at):
        self.at = at


def _instance(rng: random.Random):
    n = rng.randint(1, 40)
    clocks = [1410, 1200, 1050, 900, 750, 600][:rng.randint(2, 6)]
    # Times and energies on a binary grid (sums exact: different paths often cost exactly the same, and end at
    # the same time), some energies off it by less than _pareto's 1e-12 J tolerance (near ties).
    kinds = []
    for _ in range(rng.randint(1, 3)):
        kinds.append({f: (rng.randint(2, 8) / 128, rng.randint(1, 40) / 16 + rng.choice([0.0, 0.0, 3e-13]))
                      for f in clocks})
    at = [kinds[rng.randrange(len(kinds))] for _ in range(n)]
    allowed = [rng.sample(clocks, rng.randint(1, len(clocks))) for _ in range(n)]
    ready, cap, t = [], [], 0.0
    for v in range(n):
        fastest = min(at[v][f][0] for f in clocks)
        # Inputs that arrive late (units wait: candidates collapse onto r + t), or not at all.
        t = t + rng.choice([0.0, 0.0, fastest, 3 * fastest])
        ready.append(rng.choice([0.0, t, t]))
        cap.append(t + fastest * rng.choice([1, 2, 3, 8]) * (1 + v % 3))
        t += fastest
    return range(n), allowed, at, ready, cap


@pytest.mark.parametrize("seed", range(150))
def test_fast_segment_search_returns_the_plain_searchs_plan(seed):
    rng = random.Random(seed)
    units, allowed, at, ready, cap = _instance(rng)
    cost = rng.choice([0.0, 0.125, 0.75, 3.0])
    keep = rng.choice([1, 2, 3, 16])
    min_segment = rng.choice([0.0, 0.0, 0.05, 0.1])
    want = _plain_dp(units, allowed, at, ready, cap, cost, keep, min_segment)
    got = switching_dp._stage_dp(units, allowed, _At(at), ready, cap, cost, keep, min_segment)
    assert got == want
    if want is not None:  # the totals are bit-equal floats, not only close
        assert got[0].hex() == want[0].hex()


def test_the_random_ranks_exercise_waiting_ties_and_infeasible_ones():
    """The instances above reach the cases the fast search handles differently (else the comparison is idle)."""
    found = none = waits = 0
    for seed in range(150):
        rng = random.Random(seed)
        units, allowed, at, ready, cap = _instance(rng)
        waits += sum(1 for v in units if ready[v] > 0)
        result = _plain_dp(units, allowed, at, ready, cap, 0.7, 16, 0.0)
        found += result is not None
        none += result is None
    assert found >= 20 and none >= 1 and waits >= 100
