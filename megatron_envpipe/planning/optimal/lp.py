"""LP/MILP backends: HiGHS through ``highspy`` (warm-started re-solves), or ``scipy.optimize``.

``numpy``, ``highspy`` and ``scipy`` are imported only when a backend is
built, so importing the planners costs nothing when no optimal plan is asked for.
"""

from __future__ import annotations

import math
import os
import sys
import threading
from collections.abc import Sequence
from typing import Any

from megatron_envpipe.planning.basis import PlannerError


class SolverUnavailable(PlannerError):
    """No LP solver (highspy or scipy) is installed."""


class LpBackend:
    """min c.x  s.t.  row_lo <= A x <= row_up,  col_lo <= x <= col_up (A in CSC arrays)."""

    status: Any
    optimal: bool
    cut_off: bool = False  # the last solve stopped once its bound passed set_objective_bound's
    warm_starts: bool = False  # set_start / set_basis / set_objective_bound do something
    mip_gap: float | None
    mip_dual_bound: float | None

    def set_col_bounds(self, cols: Sequence[int], lo: Sequence[float], up: Sequence[float]) -> None:
        raise NotImplementedError

    def set_costs(self, cols: Sequence[int], costs: Sequence[float]) -> None:
        raise NotImplementedError

    def solve(self) -> tuple[bool, Any, float]:
        raise NotImplementedError

    def set_objective_bound(self, bound: float) -> None:
        """Stop a solve (not ok, ``cut_off``) once the optimum is proven above ``bound`` (inf: never).

        The dual simplex's objective only rises towards the optimum, so a
        candidate that cannot beat the best one so far is dropped early. A
        backend without the option solves to the end (same answer, slower)."""

    def set_start(self, x: Any) -> None:
        """Start the next solve from column values ``x`` (a guess: feasible or not; the solve stays exact)."""

    def set_presolve(self, on: bool) -> None:
        """Presolve cold solves or not (a backend without the option always does what it does)."""

    def basis(self) -> Any:
        """The last solve's basis, to warm-start an LP of the same shape (None: this backend has none)."""
        return None

    def set_basis(self, basis: Any) -> None:
        """Start the next solve from ``basis`` (ignored where the backend or the shape does not fit)."""

    def mapped_basis(self, basis: Any, col_image: Any, row_image: Any) -> Any:
        """``basis`` of another LP seen through index maps: column ``j`` here takes the status of
        column ``col_image[j]`` there, row ``i`` that of row ``row_image[i]`` (None: no bases here)."""
        return None


# The first highspy.Highs() of a process prints a banner to the C-level stdout, before
# output_flag can be set; it would corrupt `envpipe plan --json`.
_highs_banner_pending = True


_highs_lock = threading.Lock()  # the planner builds LPs on two threads: one banner redirect at a time


def _new_highs(highspy: Any) -> Any:
    """``highspy.Highs()``, with fd 1 pointed at /dev/null while the first one prints its banner."""
    with _highs_lock:
        return _new_highs_unlocked(highspy)


def _new_highs_unlocked(highspy: Any) -> Any:
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


class _HighsBackend(LpBackend):
    warm_starts = True

    def __init__(self, np, highspy, c, start, index, value, row_lo, row_up, col_lo, col_up, integer=None,
                 time_limit_s=None, mip_rel_gap=None):
        self.np, self.highspy = np, highspy
        h = _new_highs(highspy)
        h.setOptionValue("output_flag", False)
        if time_limit_s is not None:
            h.setOptionValue("time_limit", float(time_limit_s))
        if mip_rel_gap is not None:
            h.setOptionValue("mip_rel_gap", float(mip_rel_gap))
        if integer is None:
            # Devex pricing: the planner's LPs (long chains of end times, dense basis updates) solve
            # 20-30 % faster than with dual steepest edge (P = 16 and 32 pipelines, same optimum).
            h.setOptionValue("simplex_dual_edge_weight_strategy", 1)
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

    def set_objective_bound(self, bound):
        self.h.setOptionValue("objective_bound", float(bound))

    def set_presolve(self, on):
        self.h.setOptionValue("presolve", "on" if on else "off")

    def set_start(self, x):
        sol = self.highspy.HighsSolution()
        sol.col_value = list(x)
        sol.value_valid = True
        self.h.setSolution(sol)

    def basis(self):
        b = self.h.getBasis()
        return b if b.valid else None

    def mapped_basis(self, basis, col_image, row_image):
        out = self.highspy.HighsBasis()
        col, row = list(basis.col_status), list(basis.row_status)
        out.col_status = [col[j] for j in col_image.tolist()]
        out.row_status = [row[i] for i in row_image.tolist()]
        out.valid = True  # a guess: HiGHS repairs a basis with too many or too few basic variables
        return out

    def set_basis(self, basis):
        h = self.h
        if len(basis.col_status) == h.getNumCol() and len(basis.row_status) == h.getNumRow():
            h.setBasis(basis)  # HiGHS checks it, and starts from scratch if it does not fit

    def solve(self):
        h = self.h
        h.run()
        status = h.getModelStatus()
        ms = self.highspy.HighsModelStatus
        sol = h.getSolution()
        info = h.getInfo()
        ok = status == ms.kOptimal
        self.cut_off = status == ms.kObjectiveBound
        self.status = h.modelStatusToString(status)
        if not ok and status in (ms.kTimeLimit, ms.kInterrupt) and sol.value_valid:
            ok = True  # MILP: best incumbent within the time limit
        self.mip_gap = getattr(info, "mip_gap", None)
        self.optimal = status == ms.kOptimal
        self.mip_dual_bound = getattr(info, "mip_dual_bound", None)
        return ok, self.np.asarray(sol.col_value), info.objective_function_value


class _ScipyBackend(LpBackend):
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

            return _HighsBackend(np, highspy, *args, **kwargs)
        except ImportError:
            pass
        try:
            import scipy.optimize  # noqa: F401

            return _ScipyBackend(np, *args, **kwargs)
        except ImportError:
            pass
    raise SolverUnavailable(
        "the optimal planner needs an LP solver: pip install highspy (or scipy); "
        "the EnvPipe plan types (baseline, uniform, envelope) need nothing"
    )
