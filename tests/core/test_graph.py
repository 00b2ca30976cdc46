"""core.graph: the longest-path walks every planner and the simulator share."""

from __future__ import annotations

from megatron_envpipe.core.graph import (
    critical_path,
    earliest_times,
    latest_times,
    successors,
    topological_order,
)
from megatron_envpipe.testing.graph_choosing import earliest_times_choosing, latest_times_choosing

# 0 -> 1 -> 3, 0 -> 2 -> 3 (the 2 -> 3 edge with 0.5 s latency)
PREDS = [(), ((0, 0.0),), ((0, 0.0),), ((1, 0.0), (2, 0.5))]
DUR = [1.0, 2.0, 1.0, 1.0]


def test_order_successors_and_cycles():
    order = topological_order(PREDS)
    assert sorted(order) == [0, 1, 2, 3] and order[0] == 0 and order[-1] == 3
    assert successors(PREDS) == [[(1, 0.0), (2, 0.0)], [(3, 0.0)], [(3, 0.5)], []]
    assert len(topological_order([((1, 0.0),), ((0, 0.0),), ()])) == 1  # 0 <-> 1 never become ready


def test_earliest_latest_and_critical_path():
    order = topological_order(PREDS)
    start, end = earliest_times(order, PREDS, DUR)
    assert start == [0.0, 1.0, 1.0, 3.0] and end == [1.0, 3.0, 2.0, 4.0]
    ls, lf = latest_times(order, successors(PREDS), DUR, 4.0)
    assert lf == [1.0, 3.0, 2.5, 4.0] and ls == [0.0, 1.0, 1.5, 3.0]
    assert critical_path(3, start, end, PREDS, 1e-9) == [3, 1, 0]
    # The choosing walks with fixed durations are the plain walks.
    assert earliest_times_choosing(order, PREDS, lambda v, _t: DUR[v]) == (start, end)
    assert latest_times_choosing(order, successors(PREDS), 4.0, lambda v, _t: DUR[v]) == (ls, lf)


def test_critical_path_prefers_the_given_predecessor_on_ties():
    preds = [(), (), ((1, 0.0), (0, 0.0))]
    start, end = earliest_times([0, 1, 2], preds, [1.0, 1.0, 1.0])
    assert critical_path(2, start, end, preds, 1e-9) == [2, 1]  # ready last, first of equals
    assert critical_path(2, start, end, preds, 1e-9, preferred=[-1, -1, 0]) == [2, 0]
