"""Sparse LP constraint rows, and the rows of an iteration DAG: row by row (:class:`ConstraintRows`) or,
for the LP at scale, all at once in numpy arrays (:func:`schedule_csc`: the same rows, in the same order)."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

# A unit's duration as LP terms: ([(column, coefficient), ...], constant seconds).
_DurationTerms = tuple[Sequence[tuple[int, float]], float]


class ConstraintRows:
    """Sparse constraint rows ``lo <= sum(coef * x[col]) <= up``, gathered as triplets."""

    def __init__(self) -> None:
        self.rows: list[int] = []
        self.cols: list[int] = []
        self.vals: list[float] = []
        self.lo: list[float] = []
        self.up: list[float] = []

    def add(self, terms: Sequence[tuple[int, float]], lo: float, up: float) -> None:
        r = len(self.lo)
        for col, coef in terms:
            self.rows.append(r)
            self.cols.append(col)
            self.vals.append(coef)
        self.lo.append(lo)
        self.up.append(up)

    def add_schedule(
        self,
        preds: Sequence[Sequence[tuple[int, float]]],
        t_col: int,
        duration: Callable[[int], _DurationTerms],
        unit_rows: Callable[[int], None] | None = None,
    ) -> None:
        """The iteration DAG over end-time columns ``0..n-1`` and the makespan column ``t_col``.

        ``end_v - duration_v - end_u >= latency`` for every edge ``u -> v`` (a
        unit without predecessors starts at 0) and ``end_v <= T`` for every
        sink. ``duration(v)`` gives ``(terms, seconds)``: the unit's duration
        is the terms' sum plus a constant. ``unit_rows(v)``, if given, adds a
        unit's own rows right after its edges.
        """
        n = len(preds)
        has_succ = [False] * n
        # Appended straight into the triplet lists (no per-row term lists): the
        # same rows, in the same order, as ``add`` would make.
        rows, cols, vals, lo, up = self.rows, self.cols, self.vals, self.lo, self.up
        inf = math.inf
        for v in range(n):
            terms, const_s = duration(v)
            for u, lat in preds[v] or ((-1, 0.0),):
                r = len(lo)
                rows.append(r)
                cols.append(v)
                vals.append(1.0)
                for col, coef in terms:
                    rows.append(r)
                    cols.append(col)
                    vals.append(-coef)
                if u >= 0:
                    rows.append(r)
                    cols.append(u)
                    vals.append(-1.0)
                    has_succ[u] = True
                lo.append(lat + const_s)
                up.append(inf)
            if unit_rows is not None:
                unit_rows(v)
        for v in range(n):
            if not has_succ[v]:
                self.add([(v, 1.0), (t_col, -1.0)], -inf, 0.0)

    def csc(self, np: Any, num_cols: int) -> tuple[Any, Any, Any]:
        """The matrix in compressed sparse columns: (column starts, row indices, values) as numpy arrays."""
        return _csc_arrays(np, self.rows, self.cols, self.vals, num_cols)


def _csc_arrays(
    np: Any, triplets_rows: Sequence[int], triplets_cols: Sequence[int], triplets_vals: Sequence[float], num_cols: int
) -> tuple[Any, Any, Any]:
    """Triplets -> (column starts, row indices, values), sorted by column then row."""
    rows = np.asarray(triplets_rows, dtype=np.int32)
    cols = np.asarray(triplets_cols, dtype=np.int32)
    vals = np.asarray(triplets_vals, dtype=float)
    order = np.lexsort((rows, cols))
    rows, cols, vals = rows[order], cols[order], vals[order]
    start = np.zeros(num_cols + 1, dtype=np.int32)
    np.cumsum(np.bincount(cols, minlength=num_cols), out=start[1:])
    return start, rows, vals


def schedule_csc(
    np: Any,
    preds: Sequence[Sequence[tuple[int, float]]],
    t_col: int,
    seg_first: Any,
    seg_count: Any,
    const_s: Any,
    num_cols: int,
) -> tuple[Any, Any, Any, Any, Any]:
    """:meth:`ConstraintRows.add_schedule`'s rows for durations ``const_s[v] + sum(x[seg_first[v] + j])``
    (``j < seg_count[v]``), built in one go: (column starts, row indices, values, row lower, row upper).

    One Python pass lists the edges; everything else is array arithmetic (the
    row-by-row build was most of the LP's set-up time at P = 32).
    """
    n = len(preds)
    edge_v: list[int] = []
    edge_u: list[int] = []
    edge_lat: list[float] = []
    for v, ps in enumerate(preds):
        for u, lat in ps or ((-1, 0.0),):
            edge_v.append(v)
            edge_u.append(u)
            edge_lat.append(lat)
    ev = np.asarray(edge_v, dtype=np.int64)
    eu = np.asarray(edge_u, dtype=np.int64)
    num_edges = len(ev)
    has_succ = np.zeros(n, dtype=bool)
    has_succ[eu[eu >= 0]] = True
    sinks = np.flatnonzero(~has_succ)
    edge_rows = np.arange(num_edges, dtype=np.int64)
    with_u = eu >= 0
    count = np.asarray(seg_count, dtype=np.int64)[ev]
    seg_rows = np.repeat(edge_rows, count)
    offsets = np.arange(int(count.sum()), dtype=np.int64) - np.repeat(np.cumsum(count) - count, count)
    seg_cols = np.repeat(np.asarray(seg_first, dtype=np.int64)[ev], count) + offsets
    sink_rows = num_edges + np.arange(len(sinks), dtype=np.int64)
    rows = np.concatenate([edge_rows, edge_rows[with_u], seg_rows, sink_rows, sink_rows])
    cols = np.concatenate([ev, eu[with_u], seg_cols, sinks, np.full(len(sinks), t_col, dtype=np.int64)])
    vals = np.concatenate([np.ones(num_edges), -np.ones(int(with_u.sum())), -np.ones(len(seg_rows)),
                           np.ones(len(sinks)), -np.ones(len(sinks))])
    row_lo = np.concatenate([np.asarray(edge_lat, dtype=float) + np.asarray(const_s, dtype=float)[ev],
                             np.full(len(sinks), -math.inf)])
    row_up = np.concatenate([np.full(num_edges, math.inf), np.zeros(len(sinks))])
    start, index, value = _csc_arrays(np, rows, cols, vals, num_cols)
    return start, index, value, row_lo, row_up
