"""The longest-path kernel of core/graph.py (issue 38): the relaxations every walk calls.

``ready_s``/``due_s`` (any edge list), their flat-step pair forms and :class:`Overlay` (the
incremental walks' view of moved times) are held to the recurrence written out edge by edge,
bit for bit, on ties, zeros and the absent-edge slot, where an operation order or a sign would show.
"""

from __future__ import annotations

import copy
import pickle
import random

from megatron_envpipe.core.graph import Overlay, due_pair_s, due_s, ready_pair_s, ready_s


def reference_ready(edges, end):
    return max([0.0, *(end[u] + lat for u, lat in edges)])


def reference_due(edges, latest_start, deadline):
    return min([deadline, *(latest_start[w] - lat for w, lat in edges)])


def cases(seed: int, n: int = 40):
    rng = random.Random(seed)
    pick = [0.0, 0.25, 0.5, 1.0, 1e-7]
    times = [rng.choice([*pick, rng.random(), rng.random() * 1e-3]) for _ in range(n)]
    for _ in range(200):
        k = rng.choice([0, 1, 2, 3])
        yield times, [(rng.randrange(n), rng.choice([0.0, 1e-4, rng.random()])) for _ in range(k)]


def test_ready_and_due_follow_the_recurrence_bit_for_bit():
    for seed in range(5):
        for times, edges in cases(seed):
            assert ready_s(edges, times).hex() == reference_ready(edges, times).hex()
            assert due_s(edges, times, 2.0).hex() == reference_due(edges, times, 2.0).hex()


def test_a_pair_is_the_general_form_of_its_two_edges_and_the_absent_slot_never_wins():
    for seed in range(5):
        for times, edges in cases(seed):
            if len(edges) > 2:
                continue
            n = len(times)
            padded = (*edges, (n, 0.0), (n, 0.0))[:2]
            flat = [x for pair in padded for x in pair]
            assert ready_pair_s([*times, 0.0], *flat).hex() == ready_s(edges, times).hex()
            assert due_pair_s([*times, 3.0], 3.0, *flat).hex() == due_s(edges, times, 3.0).hex()


def test_starts_stay_at_or_after_zero_and_finishes_at_or_before_the_deadline():
    assert ready_s([(0, 0.0), (1, 0.0)], [-5.0, -1.0]) == 0.0
    assert due_s([(0, 0.0)], [9.0], 4.0) == 4.0
    assert ready_s([], []) == 0.0 and due_s([], [], 7.5) == 7.5


def test_an_overlay_reads_changes_over_its_base_and_holds_only_them():
    base = [1.0, 2.0, 3.0]
    o = Overlay(base)
    o[1] = 5.0
    assert [o[v] for v in range(3)] == [1.0, 5.0, 3.0]
    assert dict(o) == {1: 5.0} and 0 not in o and o.get(0) is None
    assert ready_s([(0, 0.5), (1, 0.5)], o) == 5.5
    for clone in (copy.copy(o), pickle.loads(pickle.dumps(o))):
        assert clone.base == base and dict(clone) == {1: 5.0} and clone[2] == 3.0
