"""LP/MILP backends: HiGHS through ``highspy`` (warm-started re-solves), or ``scipy.optimize``.

``numpy``, ``highspy`` and ``scipy`` are imported only when a backend is
built, so importing the planners costs nothing when no optimal plan is asked for.
"""

from __future__ import annotations

import math
import os
import sys
from collections.abc import Sequence
from typing import Any

from megatron_envpipe.planning.basis import PlannerError


class SolverUnavailable(PlannerError):
    """No LP solver (highspy or scipy) is installed."""


class LpBackend:
    """min c.x  s.t.  row_lo <= A x <= row_up,  col_lo <= x <= col_up (A in CSC arrays)."""

    status: Any
    optimal: bool
    mip_gap: float | None
    mip_dual_bound: float | None

    def set_col_bounds(self, cols: Sequence[int], lo: Sequence[float], up: Sequence[float]) -> None:
        raise NotImplementedError

    def set_costs(self, cols: Sequence[int], costs: Sequence[float]) -> None:
        raise NotImplementedError

    def solve(self) -> tuple[bool, Any, float]:
        raise NotImplementedError


# The first highspy.Highs() of a process prints a banner to the C-level stdout, before
# output_flag can be set; it would corrupt `envpipe plan --json`.
_highs_banner_pending = True


def new_highs(highspy: Any) -> Any:
    """``highspy.Highs()``, with fd 1 pointed at /dev/null while the first one prints its banner."""
    global _highs_banner_pending
    if not _highs_banner_pending:
        return highspy.Highs()
    _highs_banner_pending = False
    try:
        sys.stdout.flush()  # what Python already buffered belongs before, not in /dev/null
    except (AttributeError, OSError, ValueError):
        pass
    try:
        saved_fd = os.dup(1)
    except OSError:  # no fd 1 (closed, or an embedded interpreter): nothing to protect
        return highspy.Highs()
    try:
        try:
            null_fd = os.open(os.devnull, os.O_WRONLY)
        except OSError:
            return highspy.Highs()
        try:
            os.dup2(null_fd, 1)
        finally:
            os.close(null_fd)
        return highspy.Highs()
    finally:
        os.dup2(saved_fd, 1)
        os.close(saved_fd)


class HighsBackend(LpBackend):
    def __init__(self, np, highspy, c, start, index, value, row_lo, row_up, col_lo, col_up, integer=None,
                 time_limit_s=None, mip_rel_gap=None):
        self.np, self.highspy = np, highspy
        h = new_highs(highspy)
        h.setOptionValue("output_flag", False)
        if time_limit_s is not None:
            h.setOptionValue("time_limit", float(time_limit_s))
        if mip_rel_gap is not None:
            h.setOptionValue("mip_rel_gap", float(mip_rel_gap))
        lp = highspy.HighsLp()
        lp.num_col_ = len(c)
        lp.num_row_ = len(row_lo)
        lp.col_cost_ = c
        lp.col_lower_ = col_lo
        lp.col_upper_ = col_up
        lp.row_lower_ = row_lo
        lp.row_upper_ = row_up
        lp.a_matrix_.format_ = highspy.MatrixFormat.kColwise
        lp.a_matrix_.start_ = start
        lp.a_matrix_.index_ = index
        lp.a_matrix_.value_ = value
        if integer is not None:
            kint, kcont = highspy.HighsVarType.kInteger, highspy.HighsVarType.kContinuous
            lp.integrality_ = [kint if i else kcont for i in integer]
        h.passModel(lp)
        self.h = h
        self.mip_gap = None

    def set_col_bounds(self, cols, lo, up):
        np = self.np
        self.h.changeColsBounds(len(cols), np.asarray(cols, dtype=np.int32), np.asarray(lo, float), np.asarray(up, float))

    def set_costs(self, cols, costs):
        np = self.np
        self.h.changeColsCost(len(cols), np.asarray(cols, dtype=np.int32), np.asarray(costs, float))

    def solve(self):
        h = self.h
        h.run()
        status = h.getModelStatus()
        ms = self.highspy.HighsModelStatus
        sol = h.getSolution()
        info = h.getInfo()
        ok = status == ms.kOptimal
        self.status = h.modelStatusToString(status)
        if not ok and status in (ms.kTimeLimit, ms.kInterrupt) and sol.value_valid:
            ok = True  # MILP: best incumbent within the time limit
        self.mip_gap = getattr(info, "mip_gap", None)
        self.optimal = status == ms.kOptimal
        self.mip_dual_bound = getattr(info, "mip_dual_bound", None)
        return ok, self.np.asarray(sol.col_value), info.objective_function_value


class ScipyBackend(LpBackend):
    """scipy.optimize.linprog / milp with method HiGHS: no warm start, re-solved each time."""

    def __init__(self, np, c, start, index, value, row_lo, row_up, col_lo, col_up, integer=None,
                 time_limit_s=None, mip_rel_gap=None):
        import scipy.sparse as sp

        self.np = np
        self.c = np.array(c, float)
        self.A = sp.csc_matrix((value, index, start), shape=(len(row_lo), len(c))).tocsr()
        self.row_lo, self.row_up = np.asarray(row_lo, float), np.asarray(row_up, float)
        self.col_lo, self.col_up = np.array(col_lo, float), np.array(col_up, float)
        self.integer = integer
        self.time_limit_s, self.mip_rel_gap = time_limit_s, mip_rel_gap
        self.mip_gap = None
        self.optimal = False

    def set_col_bounds(self, cols, lo, up):
        self.col_lo[list(cols)] = lo
        self.col_up[list(cols)] = up

    def set_costs(self, cols, costs):
        self.c[list(cols)] = costs

    def solve(self):
        np = self.np
        from scipy.optimize import Bounds, LinearConstraint, linprog, milp

        if self.integer is not None:
            options = {}
            if self.time_limit_s is not None:
                options["time_limit"] = float(self.time_limit_s)
            if self.mip_rel_gap is not None:
                options["mip_rel_gap"] = float(self.mip_rel_gap)
            res = milp(self.c, constraints=LinearConstraint(self.A, self.row_lo, self.row_up),
                       integrality=np.asarray(self.integer, dtype=int), bounds=Bounds(self.col_lo, self.col_up),
                       options=options)
            self.optimal = res.status == 0
            self.status = res.message
            self.mip_gap = getattr(res, "mip_gap", None)
            self.mip_dual_bound = getattr(res, "mip_dual_bound", None)
            ok = res.x is not None
            return ok, (res.x if ok else None), (float(res.fun) if ok else math.inf)
        import scipy.sparse as sp

        ge = np.isfinite(self.row_lo)
        le = np.isfinite(self.row_up)
        a_ub = sp.vstack([-self.A[ge], self.A[le]]).tocsr()
        b_ub = np.concatenate([-self.row_lo[ge], self.row_up[le]])
        res = linprog(self.c, A_ub=a_ub, b_ub=b_ub, bounds=np.column_stack([self.col_lo, self.col_up]),
                      method="highs")
        self.optimal = res.status == 0
        self.status = res.message
        return res.status == 0, res.x, (float(res.fun) if res.status == 0 else math.inf)


def lp_backend(*args: Any, **kwargs: Any) -> LpBackend:
    """The first backend whose packages are installed: HiGHS (``highspy``), then SciPy.

    Arguments: ``(c, start, index, value, row_lo, row_up, col_lo, col_up)`` and
    optionally ``integer`` (a 0/1 per column), ``time_limit_s``, ``mip_rel_gap``.
    Raises :class:`SolverUnavailable` with the install hint when neither is.
    """
    try:
        import numpy as np
    except ImportError:
        np = None
    if np is not None:
        try:
            import highspy

            return HighsBackend(np, highspy, *args, **kwargs)
        except ImportError:
            pass
        try:
            import scipy.optimize  # noqa: F401

            return ScipyBackend(np, *args, **kwargs)
        except ImportError:
            pass
    raise SolverUnavailable(
        "the optimal planner needs an LP solver: pip install highspy (or scipy); "
        "the EnvPipe plan types (baseline, uniform, envelope) need nothing"
    )
