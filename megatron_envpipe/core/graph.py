"""Longest paths over a DAG of node indices: the one implementation the simulator and the planners share.

A graph is its predecessor lists, ``preds[v] = ((u, latency_s), ...)``: ``v``
cannot start before ``u`` ends plus the latency. Every node starts at 0 at the
earliest and, given a deadline, must end by it at the latest.

The recurrences are written once, with a fixed summation order that the plans
depend on bit for bit: ``start_v = max(0, max_u (end_u + latency))``,
``end_v = start_v + duration_v``; ``finish_v = min(deadline, min_w (latest_start_w - latency))``,
``latest_start_v = finish_v - duration_v``.
The two relaxations are the kernel: :func:`ready_s` (when a node may start)
and :func:`due_s` (when it must finish), with :func:`ready_pair_s` /
:func:`due_pair_s` for a flat step's two edges. Every walk in the planners
(full, incremental, choosing a duration per node) calls them rather than
writing the loop again (tests/test_architecture_extension.py checks it); only
the simulator's fixed-duration flat walks here inline the pair form (a call
per node would cost them ~30 %; tests/core/test_graph_speed.py holds them to
the general loop bit for bit; testing.graph_choosing's walks, which pick each
duration from the time the node may start or must finish, call them too).
A built graph hands out
its edges as :class:`EdgeLists` (frozen, with their topological order); given
those, the two walks run over precomputed flat steps instead of nested tuples:
the same float operations in the same order, about twice as fast; with every latency +0.0 (the
planners' default) over pairs ``(v, a, b)`` that skip the additions (:meth:`EdgeLists.pairs`).

Pure Python, no imports from the package.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable, Sequence
from itertools import islice
from operator import itemgetter
from typing import Protocol

Edges = Sequence[Sequence[tuple[int, float]]]  # per node: (neighbour, latency_s)
Step = tuple[int, int, float, int, float]  # (v, a, latency_a, b, latency_b): one node of a flat walk (EdgeLists)
Pair = tuple[int, int, int]  # (v, a, b): a flat step whose two latencies are +0.0 (EdgeLists.pairs)


class _Times(Protocol):
    """What the kernel reads node times from: a list, or an overlay of changes over one (:class:`Overlay`)."""

    def __getitem__(self, node: int, /) -> float: ...


def ready_s(in_edges: Iterable[tuple[int, float]], end_s: _Times) -> float:
    """When a node may start: ``max(0, end_u + latency)`` over its ``(u, latency_s)`` edges, in list order.

    The forward relaxation, written once: strict ``>`` from 0.0, edge by edge, so every
    caller gets the same float for the same inputs (the plans depend on it bit for bit).
    """
    t = 0.0
    for u, lat in in_edges:
        ready = end_s[u] + lat
        if ready > t:
            t = ready
    return t


def ready_pair_s(end_s: _Times, a: int, lat_a: float, b: int, lat_b: float) -> float:
    """:func:`ready_s` over a flat step's two edges ``(a, lat_a), (b, lat_b)``, the same comparisons in the same
    order (an absent edge points at a slot holding 0 s, which never wins)."""
    t = 0.0
    ready = end_s[a] + lat_a
    if ready > t:
        t = ready
    ready = end_s[b] + lat_b
    if ready > t:
        t = ready
    return t


def due_s(out_edges: Iterable[tuple[int, float]], latest_start_s: _Times, deadline_s: float) -> float:
    """When a node must finish: ``min(deadline, latest_start_w - latency)`` over its ``(w, latency_s)`` edges,
    in list order (the backward relaxation, strict ``<`` from the deadline)."""
    t = deadline_s
    for w, lat in out_edges:
        by = latest_start_s[w] - lat
        if by < t:
            t = by
    return t


def due_pair_s(latest_start_s: _Times, deadline_s: float, a: int, lat_a: float, b: int, lat_b: float) -> float:
    """:func:`due_s` over a flat step's two edges (an absent edge points at a slot holding the deadline)."""
    t = deadline_s
    by = latest_start_s[a] - lat_a
    if by < t:
        t = by
    by = latest_start_s[b] - lat_b
    if by < t:
        t = by
    return t


class Overlay(dict):
    """Changed node times over a base list, for incremental walks: ``o[v]`` is the change when there is one,
    else ``base[v]``; the dict itself holds only the changes."""

    __slots__ = ("base",)

    def __init__(self, base: Sequence[float]) -> None:
        super().__init__()
        self.base = base

    def __missing__(self, node: int) -> float:
        return self.base[node]

    def __reduce__(self) -> tuple:  # pickling/copying: dict's default would drop the base
        return (_overlay, (self.base, dict(self)))


def _overlay(base: Sequence[float], changes: dict[int, float]) -> Overlay:
    o = Overlay(base)
    o.update(changes)
    return o

class EdgeLists(tuple):
    """Per-node edge lists ``((neighbour, latency_s), ...)`` of a built graph, frozen, with the order they are walked in.

    ``order`` is a topological order; predecessor lists are walked in it,
    successor lists (``backward=True``, made by :func:`successors`) in reverse.
    Being immutable, they can carry their walk precomputed as flat steps
    ``(v, a, latency_a, b, latency_b)``: a node's (at most two) edges in list
    order, a missing one pointing at the extra slot ``n``, whose time never
    wins a comparison (0 s for a start, the deadline for a finish). Nodes with
    more than two edges leave the walks on the general loop.
    """

    def __new__(cls, lists: Edges, order: Sequence[int], backward: bool = False) -> "EdgeLists":
        self = super().__new__(cls, [tuple(edges) for edges in lists])
        self.order = tuple(order)
        self.backward = backward
        self._flat: bool | None = None  # whether the walk fits the flat steps; None: not looked at yet
        self._steps: tuple[Step, ...] = ()
        self._pairs: tuple[Pair, ...] | None = None  # the zero-latency walk (pairs()), once _paired
        self._paired = False
        self._successors: EdgeLists | None = None
        return self

    def __reduce__(self) -> tuple:  # pickling/copying: tuple's default would drop the order
        return (EdgeLists, (tuple(self), self.order, self.backward))

    def walks(self, order: Sequence[int], backward: bool) -> bool:
        """Whether these are the lists a walk in ``order`` (forward: predecessors) can take precomputed."""
        if self.backward is not backward or self.steps() is None:
            return False
        return order is self.order or (order if isinstance(order, tuple) else tuple(order)) == self.order

    def steps(self) -> tuple[Step, ...] | None:
        """The flat walk (built on first use), or None when some node has more than two edges."""
        if self._flat is None:
            steps = _build_steps(self, self.order, self.backward)
            self._steps = steps or ()
            self._flat = steps is not None  # set last: a planner thread reading it alongside sees whole steps
        return self._steps if self._flat else None

    def pairs(self) -> tuple[Pair, ...] | None:
        """The flat steps without their latencies when every latency is +0.0 (the planners' default: no P2P
        latency, no extra dependencies), else None (built on first use). ``x + 0.0`` and ``x - 0.0`` give ``x``
        back but for ``-0.0 + 0.0``, so the zero-latency walks skip two additions per node and keep the same
        floats (bit for bit: tests/core/test_graph_speed.py)."""
        if not self._paired:
            steps = self.steps()
            if steps is not None:
                lats = array("d", map(itemgetter(2), steps))
                lats.extend(map(itemgetter(4), steps))
                if not lats.tobytes().strip(b"\0"):  # all bits 0: +0.0 (a -0.0 has its sign bit set)
                    self._pairs = tuple(zip(*(map(itemgetter(k), steps) for k in (0, 1, 3))))
            self._paired = True  # set last, like steps()
        return self._pairs

    def successors(self) -> "EdgeLists":
        """The successor lists of these predecessor lists, built once."""
        if self._successors is None:
            self._successors = EdgeLists(_successor_lists(self), self.order, backward=True)
        return self._successors


def flat_steps(edges: Edges, order: Sequence[int], backward: bool = False) -> tuple[Step, ...] | None:
    """The walk over ``edges`` in ``order`` (reversed when ``backward``) as :class:`EdgeLists`' flat steps, or
    None when some node has more than two edges; a built graph's lists hand out theirs, built once."""
    if isinstance(edges, EdgeLists) and edges.walks(order, backward):
        return edges.steps()
    return _build_steps(edges, order, backward)


def _build_steps(edges: Edges, order: Sequence[int], backward: bool) -> tuple[Step, ...] | None:
    absent = (len(edges), 0.0)
    steps = []
    for v in reversed(order) if backward else order:
        e = edges[v]
        if len(e) > 2:
            return None
        (a, lat_a), (b, lat_b) = (*e, absent, absent)[:2]
        steps.append((v, a, lat_a, b, lat_b))
    return tuple(steps)


def successors(preds: Edges) -> list[list[tuple[int, float]]] | EdgeLists:
    """Successor lists ``(w, latency_s)``, each in increasing ``w``, then in ``preds[w]`` order.

    A built graph's :class:`EdgeLists` give their (shared, frozen) successor :class:`EdgeLists`.
    """
    if isinstance(preds, EdgeLists) and not preds.backward:
        return preds.successors()
    return _successor_lists(preds)


def _successor_lists(preds: Edges) -> list[list[tuple[int, float]]]:
    succs: list[list[tuple[int, float]]] = [[] for _ in range(len(preds))]
    for v, ps in enumerate(preds):
        for u, lat in ps:
            succs[u].append((v, lat))
    return succs


def topological_order(preds: Edges) -> list[int]:
    """Kahn's order (ready nodes taken last in, first out). Shorter than ``len(preds)`` iff there is a cycle:
    the missing nodes are the ones on it or waiting for it."""
    n = len(preds)
    indegree = [len(p) for p in preds]
    succs: list[list[int]] = [[] for _ in range(n)]
    for v, ps in enumerate(preds):
        for u, _ in ps:
            succs[u].append(v)
    ready = [v for v in range(n) if indegree[v] == 0]
    order: list[int] = []
    while ready:
        v = ready.pop()
        order.append(v)
        for w in succs[v]:
            indegree[w] -= 1
            if indegree[w] == 0:
                ready.append(w)
    return order


def earliest_times(order: Sequence[int], preds: Edges, durations_s: Sequence[float]) -> tuple[list[float], list[float]]:
    """(start, end) of every node when each starts as soon as all its inputs are ready."""
    n = len(preds)
    if isinstance(preds, EdgeLists) and preds.walks(order, backward=False):
        pairs = preds.pairs()
        if pairs is not None:
            return _earliest_pairs(pairs, n, durations_s)
        return _earliest_steps(preds.steps() or (), n, durations_s)
    start = [0.0] * n
    end = [0.0] * n
    for v in order:
        start[v] = t = ready_s(preds[v], end)
        end[v] = t + durations_s[v]
    return start, end


def latest_times(
    order: Sequence[int], succs: Edges, durations_s: Sequence[float], deadline_s: float
) -> tuple[list[float], list[float]]:
    """(latest start, latest finish) of every node for all to end by ``deadline_s``.

    ``order`` is a topological order (walked backwards); ``succs`` as from :func:`successors`.
    """
    n = len(succs)
    if isinstance(succs, EdgeLists) and succs.walks(order, backward=True):
        pairs = succs.pairs()
        if pairs is not None:
            return _latest_pairs(pairs, n, durations_s, deadline_s)
        return _latest_steps(succs.steps() or (), n, durations_s, deadline_s)
    latest_start = [deadline_s] * n
    latest_finish = [deadline_s] * n
    for v in reversed(order):
        latest_finish[v] = t = due_s(succs[v], latest_start, deadline_s)
        latest_start[v] = t - durations_s[v]
    return latest_start, latest_finish


def _earliest_steps(
    steps: Sequence[Step], n: int, durations_s: Sequence[float]
) -> tuple[list[float], list[float]]:
    """:func:`earliest_times` over flat steps: the same comparisons and sums, edge by edge in list order.

    The absent edge reads ``end[n] + 0.0 = 0.0``, never above ``t`` (which starts at 0 and only grows).
    """
    start = [0.0] * n
    end = [0.0] * (n + 1)
    earliest_steps_from(steps, 0, start, end, durations_s)
    end.pop()
    return start, end


def earliest_steps_from(steps: Sequence[Step], first: int, start: list[float], end: list[float],
                        durations_s: Sequence[float]) -> None:
    """The flat walk of :func:`earliest_times` from ``steps[first]`` on, in place: ``start``/``end`` hold the times of
    the nodes walked before (``end`` with the absent edge's extra slot, 0 s, at its end), as a walk that resumes
    after a few durations changed needs (planning/resimulation.py): the same comparisons, the same floats."""
    for v, a, lat_a, b, lat_b in islice(steps, first, None):
        t = 0.0  # ready_pair_s, inlined: the simulator's inner loop (a call per node costs it ~30 %)
        ready = end[a] + lat_a
        if ready > t:
            t = ready
        ready = end[b] + lat_b
        if ready > t:
            t = ready
        start[v] = t
        end[v] = t + durations_s[v]


def _earliest_pairs(pairs: Sequence[Pair], n: int, durations_s: Sequence[float]) -> tuple[list[float], list[float]]:
    """:func:`_earliest_steps` over zero-latency pairs (:meth:`EdgeLists.pairs`)."""
    start = [0.0] * n
    end = [0.0] * (n + 1)
    earliest_pairs_from(pairs, 0, start, end, durations_s)
    end.pop()
    return start, end


def earliest_pairs_from(pairs: Sequence[Pair], first: int, start: list[float], end: list[float],
                        durations_s: Sequence[float]) -> None:
    """:func:`earliest_steps_from` over zero-latency pairs: the same floats. ``max(0, end_a + 0.0, end_b + 0.0)``
    with strict ``>`` is ``end_a`` when it is above 0 (else 0.0: this also drops a NaN or a -0.0, as the
    comparison from 0.0 does), then ``end_b`` where it is above that (``end_b + 0.0`` differs from ``end_b`` only
    at -0.0, which is above nothing the walk holds)."""
    for v, a, b in pairs if first == 0 else islice(pairs, first, None):
        t = end[a]  # ready_pair_s with zero latencies, inlined (see earliest_steps_from)
        if not t > 0.0:
            t = 0.0
        ready = end[b]
        if ready > t:
            t = ready
        start[v] = t
        end[v] = t + durations_s[v]


def _latest_pairs(
    pairs: Sequence[Pair], n: int, durations_s: Sequence[float], deadline_s: float
) -> tuple[list[float], list[float]]:
    """:func:`_latest_steps` over zero-latency pairs: ``x - 0.0`` is ``x`` for every float, so the same floats."""
    latest_start = [deadline_s] * (n + 1)
    latest_finish = [deadline_s] * n
    latest_pairs_from(pairs, 0, durations_s, deadline_s, latest_start, latest_finish)
    latest_start.pop()
    return latest_start, latest_finish


def latest_pairs_from(pairs: Sequence[Pair], first: int, durations_s: Sequence[float], deadline_s: float,
                      latest_start: list[float], latest_finish: list[float]) -> None:
    """The zero-latency walk of :func:`latest_times` from ``pairs[first]`` on (``pairs`` of the successor lists),
    in place: the lists hold the times of the nodes walked before (``latest_start`` with the absent edge's slot,
    the deadline, at its end), as a walk resumed after a few durations changed needs (planning/optimal/retiming.py).
    ``x - 0.0`` is ``x`` for every float, so the same floats as :func:`_latest_steps`."""
    for v, a, b in pairs if first == 0 else islice(pairs, first, None):
        t = deadline_s  # due_pair_s with zero latencies, inlined like _earliest_steps
        by = latest_start[a]
        if by < t:
            t = by
        by = latest_start[b]
        if by < t:
            t = by
        latest_finish[v] = t
        latest_start[v] = t - durations_s[v]


def _latest_steps(
    steps: Sequence[Step], n: int, durations_s: Sequence[float], deadline_s: float
) -> tuple[list[float], list[float]]:
    """:func:`latest_times` over flat steps; the absent edge reads ``deadline - 0.0``, never below ``t``."""
    latest_start = [deadline_s] * (n + 1)
    latest_finish = [deadline_s] * n
    for v, a, lat_a, b, lat_b in steps:
        t = deadline_s  # due_pair_s, inlined like _earliest_steps
        by = latest_start[a] - lat_a
        if by < t:
            t = by
        by = latest_start[b] - lat_b
        if by < t:
            t = by
        latest_finish[v] = t
        latest_start[v] = t - durations_s[v]
    latest_start.pop()
    return latest_start, latest_finish


def critical_path(
    sink: int,
    start_s: Sequence[float],
    end_s: Sequence[float],
    preds: Edges,
    tol_s: float,
    preferred: Sequence[int] | None = None,
) -> list[int]:
    """Nodes from ``sink`` back to one starting at 0, each step to the predecessor that made the node wait.

    A predecessor is tight when its end + latency is within ``tol_s`` of the
    node's start. ``preferred[v]`` (a zero-latency predecessor, or -1) wins
    when tight; otherwise the tight one ready last (the first of equals);
    failing both (float noise), the one ready last.
    """
    v = sink
    path = [v]
    while True:
        start = start_s[v]
        if start <= tol_s:
            break
        nxt = -1
        first = preferred[v] if preferred is not None else -1
        if first >= 0 and abs(end_s[first] - start) <= tol_s:
            nxt = first
        else:
            best = -1.0
            for u, lat in preds[v]:
                ready = end_s[u] + lat
                if abs(ready - start) <= tol_s and ready > best:
                    best, nxt = ready, u
        if nxt < 0:
            nxt = max(preds[v], key=lambda ul: end_s[ul[0]] + ul[1])[0]
        path.append(nxt)
        v = nxt
    return path
