"""Sparse LP constraint rows, and the rows of an iteration DAG shared by the LP and the exact MILP."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

# A unit's duration as LP terms: ([(column, coefficient), ...], constant seconds).
DurationTerms = tuple[Sequence[tuple[int, float]], float]


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
        duration: Callable[[int], DurationTerms],
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
        for v in range(n):
            terms, const_s = duration(v)
            minus = [(col, -coef) for col, coef in terms]
            for u, lat in preds[v] or ((-1, 0.0),):
                row = [(v, 1.0), *minus]
                if u >= 0:
                    row.append((u, -1.0))
                    has_succ[u] = True
                self.add(row, lat + const_s, math.inf)
            if unit_rows is not None:
                unit_rows(v)
        for v in range(n):
            if not has_succ[v]:
                self.add([(v, 1.0), (t_col, -1.0)], -math.inf, 0.0)

    def csc(self, np: Any, num_cols: int) -> tuple[Any, Any, Any]:
        """The matrix in compressed sparse columns: (column starts, row indices, values) as numpy arrays."""
        return csc_arrays(np, self.rows, self.cols, self.vals, num_cols)


def csc_arrays(
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
