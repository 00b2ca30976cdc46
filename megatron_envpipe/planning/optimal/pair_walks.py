"""The clock search's slack-pass walks over zero-latency pairs, resumable (:mod:`.retiming`).

With every latency +0.0 (the planners' default: no P2P latency, no extra
dependencies) a built graph hands out its walk as pairs ``(v, a, b)``
(:meth:`megatron_envpipe.core.graph.EdgeLists.pairs`, the absent edge pointing
at slot n). These walks run over them in place from ``pairs[first]`` on: the
arrays hold the times and choices of the units walked before (with the absent
edge's slot at the end), so a walk resumed after a few durations changed gives
the floats of a whole one. ``ready_pair_s`` / ``due_pair_s`` are inlined as
core.graph's own pair walks inline them (``earliest_pairs_from``, ``latest_pairs_from``, which the
re-timing resumes directly):
``x + 0.0`` is ``x`` but for -0.0, which wins no comparison from 0.0, and
``x - 0.0`` is ``x``: the same floats as the kernel's calls, without a call per
unit (tests/planning/test_search_scale.py holds them to the kernel's walks).

Pure Python, like :mod:`megatron_envpipe.core.graph`.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Sequence
from itertools import islice

from megatron_envpipe.core.graph import Pair


def forward_pairs(pairs: Sequence[Pair], lf: Sequence[float], eps: float, option_times: Sequence[Sequence[float]],
                  out: list[int], end: list[float], first: int = 0) -> None:
    """Topological order: each unit's slowest option (index into ``option_times[v]``) that finishes by
    ``lf[v]`` (+ ``eps``) into ``out``, its end into ``end``."""
    for v, a, b in pairs if first == 0 else islice(pairs, first, None):
        t = end[a]
        if not t > 0.0:
            t = 0.0
        ready = end[b]
        if ready > t:
            t = ready
        ts = option_times[v]
        k = bisect_right(ts, lf[v] - t + eps) - 1
        if k < 0:
            k = 0
        out[v] = k
        end[v] = t + ts[k]


def backward_pairs(pairs: Sequence[Pair], es: Sequence[float], deadline: float, eps: float,
                   option_times: Sequence[Sequence[float]], out: list[int], latest_start: list[float],
                   first: int = 0) -> None:
    """Reverse topological order (``pairs`` of the successor lists): each unit's slowest option that starts
    after ``es[v]`` (- ``eps``) into ``out``, its latest start into ``latest_start``."""
    for v, a, b in pairs if first == 0 else islice(pairs, first, None):
        t = deadline
        by = latest_start[a]
        if by < t:
            t = by
        by = latest_start[b]
        if by < t:
            t = by
        ts = option_times[v]
        k = bisect_right(ts, t - es[v] + eps) - 1
        if k < 0:
            k = 0
        out[v] = k
        latest_start[v] = t - ts[k]
