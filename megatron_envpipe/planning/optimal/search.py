"""From LP durations to real clocks: rounding, local search and critical-path repair.

Every move keeps the plan feasible by construction (slack passes) or is
checked by simulating the iteration. Work is bounded by counts of unit
visits, never by a clock, so plans are the same on every machine. At scale a
trial changes a few units' times: the local search's settles and the moves'
checks re-time only the units a change reaches (:mod:`.retiming`), with the
answers of whole passes and whole simulations, bit for bit.
"""

from __future__ import annotations

import math
from bisect import bisect_right
from collections.abc import Callable, Sequence
from itertools import compress, count
from operator import ne
from typing import Protocol

from megatron_envpipe.core.graph import earliest_times, latest_times, successors
from megatron_envpipe.core.timeline import PipelineGraph
from megatron_envpipe.planning.optimal.deadline import FEASIBILITY_RTOL, InfeasibleDeadline
from megatron_envpipe.planning.optimal.moves import Move, exchange_moves, pair_moves
from megatron_envpipe.planning.optimal.retiming import Retimer, SlackPass

# Local search: about this many unit visits in total (a settle visits every unit ~4 times,
# a feasibility check once), half for single moves, half for exchanges. A count, not a
# clock, so plans are reproducible on any machine.
DEFAULT_SEARCH_WORK = 800_000
MIN_SEARCH_TRIALS = 8
# The searches are skipped when the rounded plan is within this fraction of the LP bound (all
# they could gain); 0.03 %, below the planner's 0.05 % tolerance against the P = 8 reference.
SEARCH_SKIP_GAP = 3e-4
MAX_SEARCH_ROUNDS = 6  # exchange searches: candidate lists rebuilt at most this often
MAX_FAILED_CHECKS = 150  # ... and a round ends after this many infeasible candidates in a row (best first)



class ClockModel(Protocol):
    """What the search needs of a :class:`~megatron_envpipe.planning.optimal.model.TimeEnergyModel`."""

    n: int
    graph: PipelineGraph
    times: list[list[float]]  # per unit: its options' times, fastest first
    costs: list[list[float]]  # ... and effective energies
    hulls: list[tuple[int, ...]]  # per unit: option indices on the lower convex hull

    def durations(self, idx: Sequence[int]) -> list[float]: ...

    def cost(self, idx: Sequence[int]) -> float: ...


class ClockSearch:
    """Option indices per unit (``idx``, aligned with ``graph.nodes``) for one model, made feasible and cheap."""

    def __init__(self, model: ClockModel) -> None:
        self.model = model
        self.n = model.n
        self.graph = model.graph
        self.times, self.costs, self.hulls = model.times, model.costs, model.hulls
        self.preds = model.graph.preds
        self.succs = successors(self.preds)
        self.order = model.graph.order  # the graph's own: core.graph's walks take it flat
        self.retimer = Retimer(self.order, self.preds, self.succs, self.times, FEASIBILITY_RTOL)
        # Per unit, as tuples shared by units of one option list (hashable: the dithering's keys).
        shared: dict[int, tuple[float, ...]] = {}
        self.hull_times = []
        for ts, hull in zip(model.times, self.hulls):
            key = id(ts)
            if key not in shared:  # built once per option list (the keys hold their lists alive: model.times)
                shared[key] = tuple(ts[i] for i in hull)
            self.hull_times.append(shared[key])
        self._nbrs: list[list[int]] = []
        self._nbrs_window: int | None = None

    # -- slack passes ------------------------------------------------------------------
    def slack_times(self, d: Sequence[float], deadline: float) -> tuple[list[float], list[float]]:
        """(earliest start, latest finish) of every unit with durations ``d``."""
        return earliest_times(self.order, self.preds, d)[0], latest_times(self.order, self.succs, d, deadline)[1]

    def forward_pass(self, idx: list[int], d_target: Sequence[float], deadline: float,
                     hull_only: bool = False) -> list[int]:
        """Topological order: each unit takes the slowest option that finishes by its latest finish.

        ``hull_only``: only the LP's hull vertices (the first rounding: a unit
        that rounds down leaves its successors the time to round up to the
        next vertex instead of spending it on small steps in between).
        """
        lf = latest_times(self.order, self.succs, d_target, deadline)[1]
        if hull_only:
            return self.retimer.choose_forward(lf, deadline, self.hull_times, self.hulls)[0]
        return self.retimer.choose_forward(lf, deadline, self.times)[0]

    def backward_pass(self, idx: list[int], d_target: Sequence[float], deadline: float,
                      hull_only: bool = False) -> list[int]:
        """Reverse topological order: each unit takes the slowest option that starts after its earliest start."""
        es = earliest_times(self.order, self.preds, d_target)[0]
        if hull_only:
            return self.retimer.choose_backward(es, deadline, self.hull_times, self.hulls)[0]
        return self.retimer.choose_backward(es, deadline, self.times)[0]

    def settle(self, idx: list[int], deadline: float, first: str = "f", max_passes: int = 6) -> list[int]:
        """Alternate forward/backward slow-down passes until the cost stops falling."""

        def one_pass(i: int, cur: list[int]) -> tuple[list[int], None]:
            d = self.model.durations(cur)
            if (i % 2 == 0) == (first == "f"):
                return self.forward_pass(cur, d, deadline), None
            return self.backward_pass(cur, d, deadline), None

        return self._cheapest_of_passes(idx, one_pass, max_passes)[0]

    def _cheapest_of_passes(self, idx: list[int], one_pass: Callable[[int, list[int]], tuple[list[int], float | None]],
                            max_passes: int) -> tuple[list[int], float]:
        """The settle rule, shared by :meth:`settle` and :meth:`_settle_near`: apply ``one_pass(i, cur)``
        up to ``max_passes`` times, keep the cheapest plan, stop at the first pass after the second
        that does not lower the cost; (that plan, its cost). ``one_pass`` gives its plan and, when it
        knows it (the plan of a pass already costed), that plan's cost, else None."""
        cost = self.model.cost
        best_idx, best = idx, cost(idx)
        cur = idx
        for i in range(max_passes):
            cur, c = one_pass(i, cur)
            if c is None:
                c = cost(cur)
            if c < best - 1e-12 * abs(best):
                best_idx, best = cur, c
            elif i >= 1:
                break
        return best_idx, best

    # -- rounding ----------------------------------------------------------------------
    def dithered(self, d_lp: Sequence[float], deadline: float) -> list[float]:
        """LP durations rounded onto hull vertices by error diffusion along each stage.

        Per (stage, instruction), in execution order, the fractions of the way
        from the faster to the slower vertex are accumulated and a unit rounds
        up whenever the sum reaches 1/2: identical units whose LP duration sits
        between two far-apart vertices alternate between them in the LP's
        proportion, instead of all rounding down. (Not feasible by itself: used
        as the target durations of a rounding pass.)
        """
        stage_of = self.graph.stage_of
        # One sum per stage and set of hull times: per (stage, instruction), and per chunk
        # too where a profile's chunks differ (equal chunks share one, as identical units).
        acc: dict[tuple[int, tuple[float, ...]], float] = {}
        out = []
        for v in range(self.n):  # graph nodes are stage by stage, in execution order
            ts, d = self.hull_times[v], d_lp[v]
            k = max(0, bisect_right(ts, d + FEASIBILITY_RTOL * deadline) - 1)
            frac = (d - ts[k]) / (ts[k + 1] - ts[k]) if k + 1 < len(ts) and d > ts[k] else 0.0
            key = (stage_of[v], ts)
            a = acc.get(key, 0.0) + frac
            if a >= 0.5 and k + 1 < len(ts):
                k += 1
                a -= 1.0
            acc[key] = a
            out.append(ts[k])
        return out

    def round(self, d_lp: Sequence[float], deadline: float) -> list[int]:
        """LP durations -> real options: the best of six roundings, each settled.

        Forward-first and backward-first passes onto the hull's vertices or
        onto every option, with the LP's durations as targets; and forward
        passes with the dithered durations (:meth:`dithered`) as targets.
        """
        zero = [0] * self.n
        dithered = self.dithered(d_lp, deadline)
        candidates = (
            (d_lp, "f", True), (d_lp, "b", True), (d_lp, "f", False), (d_lp, "b", False),
            (dithered, "f", True), (dithered, "f", False),
        )
        best, best_cost = None, math.inf
        for target, direction, hull_only in candidates:
            if direction == "f":
                cand = self.settle(self.forward_pass(zero, target, deadline, hull_only), deadline, first="b")
            else:
                cand = self.settle(self.backward_pass(zero, target, deadline, hull_only), deadline, first="f")
            c = self.model.cost(cand)
            if c < best_cost - 1e-12 * abs(c):
                best, best_cost = cand, c
        assert best is not None
        return best

    # -- local search ------------------------------------------------------------------
    def marginal(self, v: int, k: int) -> float:
        """Energy per second saved by moving unit v from option k to k-1."""
        ts, cs = self.times[v], self.costs[v]
        dt = ts[k] - ts[k - 1]
        return (cs[k - 1] - cs[k]) / dt if dt > 0 else math.inf

    def local_search(self, idx: list[int], deadline: float, max_trials: int) -> tuple[list[int], int, int]:
        """Speed one unit up by 1-3 clock steps, settle, keep the move if the plan got cheaper.

        Candidates are visited round-robin, tightest slack first (ties: the
        cheapest speed-up per second), so every unit gets a turn before any
        gets a second; stops after a full round without improvement or after
        ``max_trials`` settles (a count, not a clock: the result is reproducible).
        """
        cost = self.model.cost
        cur, cur_cost = list(idx), cost(idx)
        trials = accepted = 0
        since_improvement = 0
        d = self.model.durations(cur)
        es, lf = self.slack_times(d, deadline)
        queue = sorted(
            (v for v in range(self.n) if cur[v] > 0),
            key=lambda v: (lf[v] - es[v] - d[v], self.marginal(v, cur[v]), v),
        )
        chain = self._pass_chain(cur, deadline)
        pos = 0
        while trials < max_trials and queue and since_improvement < len(queue):
            v = queue[pos % len(queue)]
            pos += 1
            since_improvement += 1
            if cur[v] == 0:
                continue
            for steps in range(1, min(3, cur[v]) + 1):
                if trials >= max_trials:
                    break
                trials += 1
                trial = list(cur)
                trial[v] -= steps
                trial, c = self._settle_near(chain, trial, [v])
                if c < cur_cost - 1e-9 * abs(cur_cost):
                    chain = self._moved_chain(chain, trial)
                    cur, cur_cost = trial, c
                    accepted += 1
                    since_improvement = 0
                    break
        return cur, trials, accepted

    # The local search's settles: forward first, at most this many passes.
    LOCAL_PASSES = 4

    def _pass_chain(self, idx: list[int], deadline: float) -> "_PassChain":
        """The settle passes of ``idx``, computed whole as they are asked for."""
        return _PassChain(self.retimer, idx, deadline)

    def _moved_chain(self, chain: "_PassChain", idx: list[int]) -> "_PassChain":
        """The chain of ``idx``, its passes re-timed from ``chain``'s (another plan's) as they are asked for."""
        return _PassChain(self.retimer, idx, chain.deadline, chain)

    def _settle_near(self, chain: "_PassChain", idx: list[int], diff: list[int]) -> tuple[list[int], float]:
        """:meth:`settle` (forward first, :attr:`LOCAL_PASSES` passes at most) of ``idx``, which differs
        from ``chain.idx`` only at ``diff``: each pass re-times only what moves against ``chain``'s;
        (the plan, its cost)."""
        moved = diff
        cost = self.model.cost

        def one_pass(i: int, cur: list[int]) -> tuple[list[int], float | None]:
            nonlocal moved
            cur, moved = self.retimer.next_pass(chain.get(i), cur, moved)
            # A pass that ends on the chain's own plan (most do) costs what that plan costs, summed once per chain.
            return cur, None if moved else chain.out_cost(i, cost)

        return self._cheapest_of_passes(idx, one_pass, self.LOCAL_PASSES)

    def neighbours(self, window: int) -> list[list[int]]:
        """Per unit: the units within ``window`` places on its stage, and its cross-stage neighbours."""
        if self._nbrs_window != window:
            rows: dict[int, list[int]] = {}
            for v, s in enumerate(self.graph.stage_of):
                rows.setdefault(s, []).append(v)  # graph.nodes are stage by stage, in order
            pos = {}
            for s, row in rows.items():
                for i, v in enumerate(row):
                    pos[v] = (s, i)
            nbrs = []
            for v in range(self.n):
                s, i = pos[v]
                row = rows[s]
                near = [row[j] for j in range(max(0, i - window), min(len(row), i + window + 1)) if j != i]
                near += [u for u, _ in self.graph.cross_preds[v]] + [w for w, _ in self.succs[v] if pos[w][0] != s]
                nbrs.append(sorted(set(near)))
            self._nbrs, self._nbrs_window = nbrs, window
        return self._nbrs

    def _search(self, idx: list[int], deadline: float, max_checks: int, window: int,
                propose: Callable[[list[int], list[float], list[list[int]], float], list[Move]]
                ) -> tuple[list[int], int, int]:
        """Rounds of local moves: ``propose`` lists candidates, the best are checked by simulation, then settle.

        ``propose(cur, slack, nbrs, eps)`` gets the current option indices, each
        unit's slack (latest finish - earliest start - duration) and the
        neighbour lists, and returns moves for :meth:`_apply_moves`.

        The work is counted in unit visits like the rest of the search: a
        check visits every unit once (``max_checks`` x units in all), and
        listing the candidates visits each unit's ``2 window`` stage neighbours'
        1-3 step speed-ups. A search whose listing alone would take more than
        its checks' share is not run (at P = 32, M = 256 the listing took 3/4
        of the searches' time, and no move was taken on any profile measured; issue 24).
        """
        if max_checks < 6 * window:  # listing: ~6 x window visits per unit; a check: one
            return list(idx), 0, 0
        nbrs = self.neighbours(window)
        cur = list(idx)
        limit = deadline * (1 + FEASIBILITY_RTOL)
        eps = FEASIBILITY_RTOL * deadline
        checks = accepted = 0
        for _round in range(MAX_SEARCH_ROUNDS):
            if checks >= max_checks:
                break
            d = self.model.durations(cur)
            es, end = earliest_times(self.order, self.preds, d)
            lf = latest_times(self.order, self.succs, d, deadline)[1]
            slack = [max(0.0, lf[v] - es[v] - d[v]) for v in range(self.n)]
            cands = propose(cur, slack, nbrs, eps)
            cur, n_checks, n_moves, moved = self._apply_moves(cur, cands, limit, max_checks - checks, d, end)
            checks += n_checks
            accepted += n_moves
            if not moved:
                break
            cur = self.settle(cur, deadline, first="f", max_passes=4)
        return cur, checks, accepted

    def pair_search(self, idx: list[int], deadline: float, max_checks: int, window: int = 4
                    ) -> tuple[list[int], int, int]:
        """Speed one unit up by 1-3 steps and slow one neighbour down as far as the time allows.

        Like :meth:`exchange_search` from the other side: for every speed-up,
        each neighbour's slowest option that fits in its slack plus the time
        freed; candidates checked best first by simulation, several per round.
        """
        return self._search(idx, deadline, max_checks, window, self._pair_moves)

    def _pair_moves(self, cur: list[int], slack: list[float], nbrs: list[list[int]], eps: float) -> list[Move]:
        return pair_moves(self.times, self.costs, cur, slack, nbrs, eps)

    def _apply_moves(self, cur: list[int], cands: list[Move], limit: float, max_checks: int,
                     d: list[float], end: list[float]) -> tuple[list[int], int, int, bool]:
        """Try candidate moves ``(gain, w, new option of w, ((u, steps faster), ...))`` best first.

        ``d`` and ``end``: the durations and simulated ends of ``cur`` (updated
        here as moves are taken). A move is checked by re-timing only the units
        whose end it changes (:meth:`.Retimer.retime`): the same answer as simulating
        the whole iteration.
        """
        cands.sort()
        cur = list(cur)
        times = self.times
        on_time = max(end) <= limit  # once so, it stays so: a move is taken only if every end is within limit
        touched: set[int] = set()
        checks = accepted = failures = 0
        for _gain, w, j, used in cands:
            if checks >= max_checks or failures >= MAX_FAILED_CHECKS:
                break
            if w in touched or any(u in touched for u, _ in used):
                continue
            moved = {w: j}
            for u, k in used:
                moved[u] = cur[u] - k
            checks += 1
            new_end = self.retimer.retime(d, end, {v: times[v][k] for v, k in moved.items()}, limit, on_time)
            if new_end is not None:
                on_time = True
                for v, k in moved.items():
                    cur[v] = k
                    d[v] = times[v][k]
                for v, e in new_end.items():
                    end[v] = e
                touched.update(moved)
                accepted += 1
                failures = 0
            else:
                failures += 1
        return cur, checks, accepted, accepted > 0

    def exchange_search(self, idx: list[int], deadline: float, max_checks: int, window: int = 3
                        ) -> tuple[list[int], int, int]:
        """Exchange time between neighbours: slow one unit down, speed up to three neighbours.

        For a unit ``w`` and each slower option, the time it lacks beyond its own
        slack is bought from its neighbours (same stage within ``window``
        places, and its cross-stage producers and consumers), cheapest energy
        per second first. Costs are separable, so every candidate's gain is
        known up front; candidates are checked best first by simulating the
        iteration, several per round (those touching a unit already moved wait
        for the next round), then the plan is settled again.
        """
        return self._search(idx, deadline, max_checks, window, self._exchange_moves)

    def _exchange_moves(self, cur: list[int], slack: list[float], nbrs: list[list[int]], eps: float) -> list[Move]:
        return exchange_moves(self.times, self.costs, cur, slack, nbrs, eps)

    # -- repair ------------------------------------------------------------------------
    def repair(self, idx: list[int], deadline: float) -> tuple[list[int], int]:
        """Raise clocks on the simulated critical path until the deadline holds."""
        steps = 0
        limit = deadline * (1 + FEASIBILITY_RTOL)
        while True:
            tl = self.graph.simulate(self.model.durations(idx))
            if tl.iteration_time_s <= limit:
                return idx, steps
            cands = [v for v in tl.critical_path() if idx[v] > 0]
            if not cands:
                raise InfeasibleDeadline(
                    f"no plan meets an iteration time of {deadline:.6g} s: the critical path already runs "
                    f"at the fastest clocks ({tl.iteration_time_s:.6g} s)"
                )
            v = min(cands, key=lambda u: (self.marginal(u, idx[u]), u))
            idx = list(idx)
            idx[v] -= 1
            steps += 1


class _PassChain:
    """The settle passes of one plan ``idx`` (forward first), each built when first asked for: the
    reference the local search's trials are re-timed against. ``prev`` (another plan's chain) lets a
    pass be re-timed from that chain's instead of computed whole."""

    def __init__(self, retimer: Retimer, idx: list[int], deadline: float, prev: "_PassChain | None" = None) -> None:
        self.retimer, self.idx, self.deadline = retimer, idx, deadline
        self.passes: list[SlackPass] = []
        self.out_costs: dict[int, float] = {}  # pass -> the cost of its plan, once asked for
        self.prev = prev
        if prev is not None:
            prev.prev = None  # only prev's passes are read from here on: no chain of chains kept alive

    def get(self, i: int) -> SlackPass:
        while len(self.passes) <= i:
            j = len(self.passes)
            inp = self.idx if j == 0 else self.passes[-1].out
            old = self.prev.passes[j] if self.prev is not None and j < len(self.prev.passes) else None
            if old is None:
                self.passes.append(self.retimer.full_pass(j % 2 == 0, inp, self.deadline))
            else:
                ref_inp = old.inp
                diff = list(compress(count(), map(ne, inp, ref_inp)))
                self.passes.append(self.retimer.next_slack_pass(old, inp, diff)[0])
        return self.passes[i]

    def out_cost(self, i: int, cost: Callable[[Sequence[int]], float]) -> float:
        """``cost`` of pass ``i``'s plan (the same list, so the same sum), computed once."""
        c = self.out_costs.get(i)
        if c is None:
            c = self.out_costs[i] = cost(self.get(i).out)
        return c

