"""Incremental re-timing for the clock search: redo only the units a change reaches.

The local search tries a small change (one unit a clock step faster, a unit
slowed and a neighbour sped up) and asks what a simulation, or a slack pass,
would make of the whole plan. At scale a change moves a handful of units'
times, yet a full pass visits all of them: here the units are re-timed in
(reverse) topological order starting from the changed ones, and only while a
time actually moves. Every unit that is visited is computed by the relaxations
of :mod:`megatron_envpipe.core.graph` (``ready_s``/``due_s``, reading the times
moved so far through an ``Overlay`` of the reference pass), and every unit that
is not keeps its old value, so the answers are bit-identical to full passes;
plans do not change, only the work. A change that reaches too far for the heap
still starts at a few units: its pass is walked whole from where the walks first
meet a change (:meth:`Retimer.resumed_pass`), and a feasibility check's
simulation from the first changed unit. On zero-latency graphs (the planners'
default) the walks run over core.graph's pairs (:mod:`.pair_walks`).

Pure Python, like :mod:`megatron_envpipe.core.graph`.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Sequence
from dataclasses import dataclass
from heapq import heapify, heappop, heappush
from itertools import compress, count
from operator import getitem, ne
from typing import Any

from megatron_envpipe.core.graph import (
    EdgeLists,
    Edges,
    Overlay,
    Pair,
    Step,
    due_pair_s,
    due_s,
    earliest_pairs_from,
    earliest_times,
    flat_steps,
    latest_pairs_from,
    latest_times,
    ready_pair_s,
    ready_s,
)
from megatron_envpipe.errors import EnvPipeError
from megatron_envpipe.planning.optimal.pair_walks import backward_pairs, forward_pairs


@dataclass(frozen=True)
class SlackPass:
    """One full slack pass, kept as the reference its incremental variants start from.

    Forward (``forward``): ``bound`` = each unit's latest finish, ``bound_at`` =
    its latest start (both for the input's durations ``d``), ``at`` = its end
    in the pass. Backward: ``bound`` = earliest start, ``bound_at`` = earliest
    end, ``at`` = latest start in the pass. ``out``: the option chosen per unit.
    """

    forward: bool
    deadline: float
    inp: list[int]
    d: list[float]
    bound: list[float]
    bound_at: list[float]
    at: list[float]
    out: list[int]


class Retimer:
    """Slack passes and feasibility checks over one DAG, full or incremental (see the module docstring)."""

    wide_part = 16  # an incremental pass gives up past 1/wide_part of the units (retime: 2/wide_part)

    def __init__(self, order: Sequence[int], preds: Edges, succs: Edges, times: Sequence[Sequence[float]],
                 eps_rtol: float) -> None:
        self.order, self.preds, self.succs, self.times = order, preds, succs, times  # order: the graph's own (core.graph walks it flat)
        self.eps_rtol = eps_rtol
        self.n = len(preds)
        self.pos = [0] * self.n  # each unit's place in ``order``: the visiting order
        for i, v in enumerate(self.order):
            self.pos[v] = i
        self.visits = 0  # units re-timed incrementally so far (a count the caller may budget)
        self._cap = 0  # ... and where the current incremental pass gives up for a full one
        self._retimes_near = self._retimes_wide = 0  # checks the heap answered / gave up on
        # The full passes walk core.graph's flat steps (a missing edge points at slot n) while every
        # unit has at most two edges (any schedule without extra dependencies), else the general loop.
        self._flat: dict[bool, Sequence[Step]] = {}
        self._wide: dict[bool, list[int]] = {}
        for backward, edges in ((False, preds), (True, succs)):
            steps = flat_steps(edges, self.order, backward)
            self._flat[backward] = steps or ()
            self._wide[backward] = [] if steps is not None else list(reversed(self.order) if backward else self.order)
        # With every latency +0.0 (the planners' default), the same walks over core.graph's zero-latency pairs.
        self._back_order = tuple(reversed(self.order))
        self._pairs: dict[bool, Sequence[Pair] | None] = {
            backward: edges.pairs() if isinstance(edges, EdgeLists) and edges.walks(self.order, backward) else None
            for backward, edges in ((False, preds), (True, succs))
        }

    # -- full passes ---------------------------------------------------------------------
    def full_pass(self, forward: bool, inp: list[int], deadline: float) -> SlackPass:
        """The slack pass of ``ClockSearch.forward_pass`` / ``backward_pass`` (every option), kept whole."""
        d = list(map(getitem, self.times, inp))
        if forward:
            ls, lf = latest_times(self.order, self.succs, d, deadline)
            out, end = self.choose_forward(lf, deadline, self.times)
            return SlackPass(True, deadline, list(inp), d, lf, ls, end, out)
        es, ee = earliest_times(self.order, self.preds, d)
        out, latest_start = self.choose_backward(es, deadline, self.times)
        return SlackPass(False, deadline, list(inp), d, es, ee, latest_start, out)

    def choose_forward(self, lf: Sequence[float], deadline: float, option_times: Sequence[Sequence[float]],
                       hull: Sequence[Sequence[int]] | None = None) -> tuple[list[int], list[float]]:
        """Topological order: each unit's slowest option (of ``option_times[v]``, mapped through
        ``hull[v]`` when given) that finishes by ``lf[v]``; (the choices, each unit's end)."""
        n, eps = self.n, self.eps_rtol * deadline
        out = [0] * n
        end = [0.0] * (n + 1)  # slot n: the absent edge of the flat steps (0 s: never wins)
        pairs = self._pairs[False]
        if pairs is not None:
            forward_pairs(pairs, lf, eps, option_times, out, end)
            if hull is not None:  # the hull's options mapped after the walk
                out = list(map(getitem, hull, out))
        for v, a, lat_a, b, lat_b in self._flat[False] if pairs is None else ():
            t = ready_pair_s(end, a, lat_a, b, lat_b)
            ts = option_times[v]
            k = bisect_right(ts, lf[v] - t + eps) - 1
            if k < 0:
                k = 0
            out[v] = hull[v][k] if hull is not None else k
            end[v] = t + ts[k]
        if self._wide[False]:
            preds = self.preds
            for v in self._wide[False]:  # some unit has more than two edges: every unit, in order
                t = ready_s(preds[v], end)
                ts = option_times[v]
                k = bisect_right(ts, lf[v] - t + eps) - 1
                if k < 0:
                    k = 0
                out[v] = hull[v][k] if hull is not None else k
                end[v] = t + ts[k]
        end.pop()
        return out, end

    def choose_backward(self, es: Sequence[float], deadline: float, option_times: Sequence[Sequence[float]],
                        hull: Sequence[Sequence[int]] | None = None) -> tuple[list[int], list[float]]:
        """Reverse topological order: each unit's slowest option that starts after ``es[v]``;
        (the choices, each unit's latest start)."""
        n, eps = self.n, self.eps_rtol * deadline
        out = [0] * n
        latest_start = [deadline] * (n + 1)  # slot n: the absent edge (the deadline: never wins)
        pairs = self._pairs[True]
        if pairs is not None:
            backward_pairs(pairs, es, deadline, eps, option_times, out, latest_start)
            if hull is not None:
                out = list(map(getitem, hull, out))
        for v, a, lat_a, b, lat_b in self._flat[True] if pairs is None else ():
            t = due_pair_s(latest_start, deadline, a, lat_a, b, lat_b)
            ts = option_times[v]
            k = bisect_right(ts, t - es[v] + eps) - 1
            if k < 0:
                k = 0
            out[v] = hull[v][k] if hull is not None else k
            latest_start[v] = t - ts[k]
        if self._wide[True]:
            succs = self.succs
            for v in self._wide[True]:
                t = due_s(succs[v], latest_start, deadline)
                ts = option_times[v]
                k = bisect_right(ts, t - es[v] + eps) - 1
                if k < 0:
                    k = 0
                out[v] = hull[v][k] if hull is not None else k
                latest_start[v] = t - ts[k]
        latest_start.pop()
        return out, latest_start

    def resumed_pass(self, ref: SlackPass, inp: list[int], diff: Sequence[int]) -> SlackPass | None:
        """``full_pass(ref.forward, inp, ref.deadline)`` where ``inp`` differs from ``ref.inp`` only at ``diff``: the
        walks resumed where they first meet a change (the units before it keep ``ref``'s times and choices), the
        same floats; None where the graph has no zero-latency pairs (the caller runs the full pass).

        Changes that reach far still start at a few units, so this is the wide change's answer: a forward pass
        walks its latest times back from the last changed unit and chooses from the first unit whose latest
        finish moved; a backward pass the mirror image.
        """
        fwd, bwd = self._pairs[False], self._pairs[True]
        if fwd is None or bwd is None or not diff:
            return None
        n, pos, order, deadline = self.n, self.pos, self.order, ref.deadline
        eps = self.eps_rtol * deadline
        d = list(map(getitem, self.times, inp))
        out = list(ref.out)
        if ref.forward:
            ls = list(ref.bound_at)
            ls.append(deadline)  # the absent edge's slot
            lf = list(ref.bound)
            latest_pairs_from(bwd, n - 1 - max(pos[v] for v in diff), d, deadline, ls, lf)
            ls.pop()
            # the first unit (in order) whose latest finish moved: the choices before it are ref's
            first = next(compress(count(), map(ne, map(lf.__getitem__, order), map(ref.bound.__getitem__, order))), n)
            end = list(ref.at)
            end.append(0.0)
            forward_pairs(fwd, lf, eps, self.times, out, end, first)
            end.pop()
            return SlackPass(True, deadline, list(inp), d, lf, ls, end, out)
        es = list(ref.bound)
        ee = list(ref.bound_at)
        ee.append(0.0)
        earliest_pairs_from(fwd, min(pos[v] for v in diff), es, ee, d)
        ee.pop()
        # the backward walk's first unit whose earliest start moved: the choices before it are ref's
        back = self._back_order
        first = next(compress(count(), map(ne, map(es.__getitem__, back), map(ref.bound.__getitem__, back))), n)
        latest_start = list(ref.at)
        latest_start.append(deadline)
        backward_pairs(bwd, es, deadline, eps, self.times, out, latest_start, first)
        latest_start.pop()
        return SlackPass(False, deadline, list(inp), d, es, ee, latest_start, out)

    # -- incremental passes -------------------------------------------------------------
    def next_pass(self, ref: SlackPass, inp: list[int], diff: Sequence[int]) -> tuple[list[int], list[int]]:
        """``ref``'s pass on ``inp``, which differs from ``ref.inp`` only at the units ``diff``:
        (its output, the units where that output differs from ``ref.out``)."""
        sp, moved = self.next_slack_pass(ref, inp, diff, keep=False)
        return sp.out, moved

    def next_slack_pass(self, ref: SlackPass, inp: list[int], diff: Sequence[int], keep: bool = True
                        ) -> tuple[SlackPass, list[int]]:
        """:meth:`next_pass` kept whole (``keep``; else only ``out`` is filled in): the next reference."""
        deadline = ref.deadline
        times = self.times
        d_new = {v: times[v][inp[v]] for v in diff}
        # A wide change: the heap costs a few times a full pass's visit, so past a sixteenth of
        # the units re-timed, the full pass is the cheaper way to the same answer.
        self._cap = self.visits + self.n // self.wide_part
        try:
            if len(diff) * 2 * self.wide_part > self.n:
                raise _TooWide
            if ref.forward:
                bound, bound_at = self._latest(ref, d_new, deadline)
                changed, at = self._choose_forward(ref, bound, deadline)
            else:
                bound, bound_at = self._earliest(ref, d_new)
                changed, at = self._choose_backward(ref, bound, deadline)
        except _TooWide:
            sp = self.resumed_pass(ref, inp, diff) or self.full_pass(ref.forward, inp, deadline)
            return sp, list(compress(range(self.n), map(ne, sp.out, ref.out)))
        out = list(ref.out)
        moved = []
        for v, k in changed.items():
            if k != ref.out[v]:
                out[v] = k
                moved.append(v)
        if not keep:
            return SlackPass(ref.forward, deadline, inp, [], [], [], [], out), moved
        return SlackPass(ref.forward, deadline, list(inp), _patched(ref.d, d_new), _patched(ref.bound, bound),
                         _patched(ref.bound_at, bound_at), _patched(ref.at, at), out), moved

    def _latest(self, ref: SlackPass, d_new: dict[int, float], deadline: float
                ) -> tuple[dict[int, float], dict[int, float]]:
        """Latest finish and latest start that move when the units of ``d_new`` take those durations."""
        pos, preds, succs = self.pos, self.preds, self.succs
        lf_ref, ls_ref, d_ref = ref.bound, ref.bound_at, ref.d
        heap = [(-pos[v], v) for v in d_new]
        heapify(heap)
        queued = set(d_new)
        lf: dict[int, float] = {}
        ls = Overlay(ls_ref)  # the latest starts that moved, read through to the reference's
        while heap:
            v = heappop(heap)[1]
            self.visits += 1
            if self.visits > self._cap:
                raise _TooWide
            t = due_s(succs[v], ls, deadline)
            if t != lf_ref[v]:
                lf[v] = t
            s = t - (d_new[v] if v in d_new else d_ref[v])
            if s != ls_ref[v]:
                ls[v] = s
                for u, _ in preds[v]:
                    if u not in queued:
                        queued.add(u)
                        heappush(heap, (-pos[u], u))
        return lf, ls

    def _earliest(self, ref: SlackPass, d_new: dict[int, float]) -> tuple[dict[int, float], dict[int, float]]:
        """Earliest start and end that move when the units of ``d_new`` take those durations."""
        pos, preds, succs = self.pos, self.preds, self.succs
        es_ref, ee_ref, d_ref = ref.bound, ref.bound_at, ref.d
        heap = [(pos[v], v) for v in d_new]
        heapify(heap)
        queued = set(d_new)
        es: dict[int, float] = {}
        ee = Overlay(ee_ref)
        while heap:
            v = heappop(heap)[1]
            self.visits += 1
            if self.visits > self._cap:
                raise _TooWide
            t = ready_s(preds[v], ee)
            if t != es_ref[v]:
                es[v] = t
            e = t + (d_new[v] if v in d_new else d_ref[v])
            if e != ee_ref[v]:
                ee[v] = e
                for w, _ in succs[v]:
                    if w not in queued:
                        queued.add(w)
                        heappush(heap, (pos[w], w))
        return es, ee

    def _choose_forward(self, ref: SlackPass, lf: dict[int, float], deadline: float
                        ) -> tuple[dict[int, int], dict[int, float]]:
        """The forward pass's choices for the units whose latest finish or start moves."""
        pos, preds, succs, times = self.pos, self.preds, self.succs, self.times
        lf_ref, end_ref = ref.bound, ref.at
        eps = self.eps_rtol * deadline
        heap = [(pos[v], v) for v in lf]
        heapify(heap)
        queued = set(lf)
        end = Overlay(end_ref)
        out: dict[int, int] = {}
        while heap:
            v = heappop(heap)[1]
            self.visits += 1
            if self.visits > self._cap:
                raise _TooWide
            t = ready_s(preds[v], end)
            ts = times[v]
            k = bisect_right(ts, (lf[v] if v in lf else lf_ref[v]) - t + eps) - 1
            if k < 0:
                k = 0
            out[v] = k
            e = t + ts[k]
            if e != end_ref[v]:
                end[v] = e
                for w, _ in succs[v]:
                    if w not in queued:
                        queued.add(w)
                        heappush(heap, (pos[w], w))
        return out, end

    def _choose_backward(self, ref: SlackPass, es: dict[int, float], deadline: float
                         ) -> tuple[dict[int, int], dict[int, float]]:
        """The backward pass's choices for the units whose earliest start or latest start moves."""
        pos, preds, succs, times = self.pos, self.preds, self.succs, self.times
        es_ref, ls_ref = ref.bound, ref.at
        eps = self.eps_rtol * deadline
        heap = [(-pos[v], v) for v in es]
        heapify(heap)
        queued = set(es)
        ls = Overlay(ls_ref)
        out: dict[int, int] = {}
        while heap:
            v = heappop(heap)[1]
            self.visits += 1
            if self.visits > self._cap:
                raise _TooWide
            t = due_s(succs[v], ls, deadline)
            ts = times[v]
            k = bisect_right(ts, t - (es[v] if v in es else es_ref[v]) + eps) - 1
            if k < 0:
                k = 0
            out[v] = k
            s = t - ts[k]
            if s != ls_ref[v]:
                ls[v] = s
                for u, _ in preds[v]:
                    if u not in queued:
                        queued.add(u)
                        heappush(heap, (-pos[u], u))
        return out, ls

    # -- feasibility ----------------------------------------------------------------------
    def retime(self, d: Sequence[float], end: Sequence[float], changed: dict[int, float], limit: float,
               on_time: bool | None = None) -> dict[int, float] | None:
        """New ends of the units whose end moves when the units in ``changed`` take those durations
        (``d``, ``end``: the durations and their simulated ends, exactly), or None if one would end after ``limit``.
        ``on_time``: whether every old end is within ``limit``, when the caller knows (None: looked up here,
        a pass over every unit).

        With every old end within ``limit`` this is the verdict of simulating the whole iteration.
        """
        if on_time is None:
            on_time = max(end) <= limit
        # The heap only while it answers at least a third of the checks (on a graph where changes
        # travel far, e.g. interleaved, every attempt would be wasted work before the whole simulation).
        if on_time and self._retimes_wide <= 2 * self._retimes_near + 2:
            new_end = self._retime_near(d, end, changed, limit)
            if new_end is not _WIDE:
                self._retimes_near += 1
                return new_end
            self._retimes_wide += 1
        # The old plan is late somewhere (only the whole simulation can tell), or the change
        # reaches too many units for the heap to pay: simulate the whole iteration.
        trial = list(d)
        for v, t in changed.items():
            trial[v] = t
        pairs = self._pairs[False]
        if pairs is not None:
            # The zero-latency walk resumed at the first changed unit (in order): the units before it keep their
            # ends (``end``: the simulation's), so the same floats as the whole simulation (planning/resimulation.py).
            new = list(end)
            new.append(0.0)  # the absent edge's slot
            pos = self.pos
            earliest_pairs_from(pairs, min((pos[v] for v in changed), default=self.n), [0.0] * self.n, new, trial)
            new.pop()
        else:
            new = earliest_times(self.order, self.preds, trial)[1]
        if max(new) > limit:
            return None
        return {v: new[v] for v in compress(range(self.n), map(ne, new, end))}

    def _retime_near(self, d: Sequence[float], end: Sequence[float], changed: dict[int, float], limit: float
                     ) -> Any:
        """:meth:`retime` by the heap, or ``_WIDE`` past an eighth of the units."""
        pos, preds, succs = self.pos, self.preds, self.succs
        heap = [(pos[v], v) for v in changed]
        heapify(heap)
        queued = set(changed)
        new_end = Overlay(end)
        budget = 2 * self.n // self.wide_part
        while heap:
            v = heappop(heap)[1]
            self.visits += 1
            budget -= 1
            if budget < 0:
                return _WIDE
            e = ready_s(preds[v], new_end) + (changed[v] if v in changed else d[v])
            if e == end[v]:
                continue
            if e > limit:
                return None
            new_end[v] = e
            for w, _ in succs[v]:
                if w not in queued:
                    queued.add(w)
                    heappush(heap, (pos[w], w))
        return new_end


_WIDE = object()  # _retime_near's answer when the change reaches too many units


class _TooWide(EnvPipeError):  # noqa: N818 - control flow inside next_slack_pass, never escapes it
    """An incremental pass reached too many units: the caller runs the full pass."""


def _patched(values: list[float], changes: dict[int, float]) -> list[float]:
    out = list(values)
    for v, x in changes.items():
        out[v] = x
    return out
