"""The exchange searches' candidate moves (:mod:`.search`): pure functions of the option tables, the current
options, each unit's slack and its neighbours; every candidate's energy gain is known up front (costs are
separable), whether it fits is checked by the search."""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from typing import Any

# A move: (energy gain, unit w, w's new option, ((unit u, steps faster), ...)).
Move = tuple[float, int, int, tuple[tuple[int, int], ...]]


def pair_moves(times: list[list[float]], costs: list[list[float]], cur: list[int], slack: list[float],
               nbrs: list[list[int]], eps: float) -> list[Move]:
    """:meth:`.ClockSearch.pair_search`'s candidates: each speed-up of a unit by 1-3 steps, with each neighbour's
    slowest option that fits in its slack plus the time freed."""
    cands: list[Move] = []
    for u in range(len(cur)):
        ku = cur[u]
        tu, cu = times[u], costs[u]
        for k in range(1, min(3, ku) + 1):
            freed = tu[ku] - tu[ku - k]
            extra = cu[ku - k] - cu[ku]
            for w in nbrs[u]:
                kw, tw = cur[w], times[w]
                if kw + 1 >= len(tw):
                    continue
                room = freed + slack[w]
                j = bisect_right(tw, tw[kw] + room + eps) - 1
                if j > kw:
                    gain = extra + costs[w][j] - costs[w][kw]
                    if gain < -1e-9:
                        cands.append((gain, w, j, ((u, k),)))
    return cands


def exchange_moves(times: list[list[float]], costs: list[list[float]], cur: list[int], slack: list[float],
                   nbrs: list[list[int]], eps: float) -> list[Move]:
    """:meth:`.ClockSearch.exchange_search`'s candidates: each slow-down of a unit, its missing time bought from
    one neighbour or up to three, cheapest energy per second first."""
    cands: list[Move] = []
    for w in range(len(cur)):
        kw, tw, cw = cur[w], times[w], costs[w]
        if kw + 1 >= len(tw):
            continue
        slack_w = slack[w]
        # Speed-up offers of the neighbours: (energy per second, unit, steps, seconds, energy).
        offers = []
        for u in nbrs[w]:
            ku = cur[u]
            for k in range(1, min(3, ku) + 1):
                freed = times[u][ku] - times[u][ku - k]
                if freed > 0:
                    extra = costs[u][ku - k] - costs[u][ku]
                    offers.append((extra / freed, u, k, freed, extra))
        if not offers:
            continue
        # One neighbour covering it all: by seconds freed, with the cheapest from there on.
        by_freed = sorted(offers, key=lambda o: (o[3], o[4]))
        freed_keys = [o[3] for o in by_freed]
        suffix: list[Any] = [None] * len(by_freed)  # (energy, unit, steps): cheapest from i on
        best = None
        for i in range(len(by_freed) - 1, -1, -1):
            o = by_freed[i]
            if best is None or o[4] < best[0]:
                best = (o[4], o[1], o[2])
            suffix[i] = best
        # Up to three neighbours, cheapest energy per second first (prefix sums).
        offers.sort()
        chosen: list[tuple[int, int]] = []
        got_prefix: list[float] = []
        spent_prefix: list[float] = []
        got = spent = 0.0
        for _, u, k, freed, extra in offers:
            if any(u == c for c, _ in chosen):
                continue
            chosen.append((u, k))
            got += freed
            spent += extra
            got_prefix.append(got)
            spent_prefix.append(spent)
            if len(chosen) == 3:
                break
        most = max(got_prefix[-1], freed_keys[-1])
        for j in range(kw + 1, len(tw)):
            need = tw[j] - tw[kw] - slack_w
            if need > most + eps:
                break
            if need <= eps:
                continue  # a plain slow-down: the settle passes take those
            saving = cw[kw] - cw[j]
            i = bisect_left(freed_keys, need - eps)
            if i < len(by_freed) and suffix[i][0] < saving - 1e-9:
                extra, u, k = suffix[i]
                cands.append((extra - saving, w, j, ((u, k),)))
            i = bisect_left(got_prefix, need - eps)
            if 0 < i < len(got_prefix) and spent_prefix[i] < saving - 1e-9:
                cands.append((spent_prefix[i] - saving, w, j, tuple(sorted(chosen[: i + 1]))))
    return cands
