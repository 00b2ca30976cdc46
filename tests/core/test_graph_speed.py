"""The fast paths of the graph core give exactly what the general code gives, and build once.

A built :class:`PipelineGraph` walks its frozen :class:`EdgeLists` as flat
steps and is shared per schedule; ``unit_dag`` finds senders by integer keys.
Each is checked here against the general rule (plain lists, ``message_source``)
bit for bit, and by counting what gets built. Nothing is timed.
"""

from __future__ import annotations

import copy
import math
import pickle
import random

import pytest

from megatron_envpipe.core.gpu_specs import get_gpu_spec
from megatron_envpipe.core.graph import EdgeLists, earliest_times, latest_times, successors
from megatron_envpipe.core.interleaved import interleaved_schedule
from megatron_envpipe.core.schedule import (
    B,
    F,
    Schedule,
    ScheduleError,
    clamp_extra_warmup,
    envpipe_schedule,
    one_f_one_b,
)
from megatron_envpipe.core.timeline import Dependency, PipelineGraph, PlanEvaluator
from megatron_envpipe.core.units import message_source, unit_dag, unit_index
from megatron_envpipe.planning.basis import PlannerConfig
from megatron_envpipe.planning.planner import plan_envpipe

SCHEDULES = {
    "1f1b": one_f_one_b(4, 9),
    "ours": envpipe_schedule(5, 12, clamp_extra_warmup(5, 12, [3, 2, 2, 1, 0])),
    "interleaved-2": interleaved_schedule(4, 8, 2),
    "interleaved-3": interleaved_schedule(3, 6, 3),
}


def bits(values: list[float]) -> list[str]:
    """Floats compared bit for bit (NaN equal to itself, -0.0 apart from 0.0)."""
    return [v.hex() for v in values]


def plain(edges: EdgeLists) -> list[list[tuple[int, float]]]:
    """The same edges as plain lists: the general loops, not the flat steps."""
    return [list(e) for e in edges]


def durations(n: int, seed: int) -> list[float]:
    rng = random.Random(seed)
    # Ties (equal ready times) and zeros are where an edge order or a sign could show.
    return [rng.choice([0.0, 0.5, 1.0, rng.random(), rng.random() * 1e-3]) for _ in range(n)]


@pytest.mark.parametrize("name", sorted(SCHEDULES))
@pytest.mark.parametrize("latency", [0.0, 0.25, 1e-7])
def test_flat_walks_equal_the_general_loops_bit_for_bit(name, latency):
    graph = PipelineGraph(SCHEDULES[name], latency)
    n = len(graph.nodes)
    order = list(graph.order)  # a caller's copy, as the planners keep it
    assert graph.preds.walks(order, backward=False) and graph.succs.walks(order, backward=True)
    for seed in range(5):
        d = durations(n, seed)
        fast = earliest_times(order, graph.preds, d)
        slow = earliest_times(order, plain(graph.preds), d)
        assert [bits(x) for x in fast] == [bits(x) for x in slow]
        deadline = max(fast[1]) * (1.0 + 0.1 * seed)
        fast_l = latest_times(order, graph.succs, d, deadline)
        slow_l = latest_times(order, successors(plain(graph.preds)), d, deadline)
        assert [bits(x) for x in fast_l] == [bits(x) for x in slow_l]
        assert bits(graph.simulate(d).end_s) == bits(slow[1])


def test_flat_walks_keep_nan_and_signed_zeros_like_the_loops():
    graph = PipelineGraph(SCHEDULES["1f1b"], 0.0)
    n = len(graph.nodes)
    d = durations(n, 7)
    d[3], d[5], d[11] = math.nan, -0.0, math.inf
    for deadline in (10.0, -0.0, math.nan):
        got = latest_times(graph.order, graph.succs, d, deadline)
        want = latest_times(graph.order, successors(plain(graph.preds)), d, deadline)
        assert [bits(x) for x in got] == [bits(x) for x in want]
    got = earliest_times(graph.order, graph.preds, d)
    assert [bits(x) for x in got] == [bits(x) for x in earliest_times(graph.order, plain(graph.preds), d)]


@pytest.mark.parametrize("latency", [0.0, -0.0, 0.25, 5e-324])
def test_zero_latency_pairs_are_taken_only_when_every_latency_is_plus_zero(latency):
    """The walks skip the latency additions only where they change no float: every latency +0.0 (``x - (-0.0)``
    turns a -0.0 into +0.0, and any other latency moves the times)."""
    graph = PipelineGraph(SCHEDULES["interleaved-2"], latency)
    zero = latency == 0.0 and math.copysign(1.0, latency) > 0
    assert (graph.preds.pairs() is not None) is zero and (graph.succs.pairs() is not None) is zero
    if zero:
        assert graph.preds.pairs() == tuple((v, a, b) for v, a, _, b, _ in graph.preds.steps())
    d = durations(len(graph.nodes), 11)
    d[4], d[9] = -0.0, math.nan  # where skipping ``+ 0.0`` could show
    fast = earliest_times(graph.order, graph.preds, d)
    assert [bits(x) for x in fast] == [bits(x) for x in earliest_times(graph.order, plain(graph.preds), d)]
    for deadline in (40.0, -0.0):
        got = latest_times(graph.order, graph.succs, d, deadline)
        want = latest_times(graph.order, successors(plain(graph.preds)), d, deadline)
        assert [bits(x) for x in got] == [bits(x) for x in want]


def test_other_orders_and_wider_nodes_take_the_general_loop():
    schedule = SCHEDULES["1f1b"]
    graph = PipelineGraph(schedule)
    other = list(reversed(graph.order))
    assert not graph.preds.walks(other, backward=False)
    assert not graph.preds.walks(graph.order, backward=True)  # predecessors are not walked backwards
    # Two extra dependencies into one unit: three edges, no flat steps, same answers.
    deps = [Dependency(0, F(1), 2, F(0)), Dependency(1, F(2), 2, F(0), 0.5)]
    wide = PipelineGraph(schedule, 0.1, deps)
    assert wide.preds.steps() is None and not wide.preds.walks(wide.order, backward=False)
    d = durations(len(wide.nodes), 3)
    assert earliest_times(wide.order, wide.preds, d) == earliest_times(wide.order, plain(wide.preds), d)
    t = max(earliest_times(wide.order, wide.preds, d)[1])
    assert latest_times(wide.order, wide.succs, d, t) == latest_times(
        wide.order, successors(plain(wide.preds)), d, t
    )


def test_edge_lists_are_frozen_shared_and_survive_copies():
    graph = PipelineGraph(SCHEDULES["interleaved-2"], 0.5)
    assert successors(graph.preds) is graph.succs  # built once per graph
    assert [list(s) for s in graph.succs] == successors(plain(graph.preds))
    for clone in (copy.deepcopy(graph.preds), pickle.loads(pickle.dumps(graph.preds))):
        assert clone == graph.preds and clone.order == graph.preds.order
        assert clone.walks(graph.order, backward=False) and clone.steps() == graph.preds.steps()
    with pytest.raises(TypeError):
        graph.preds[0] = ()  # type: ignore[index]


@pytest.mark.parametrize("name", sorted(SCHEDULES))
def test_unit_dag_follows_message_source(name):
    schedule = SCHEDULES[name]
    dag = unit_dag(schedule)
    assert [dag.index[node] for node in dag.nodes] == list(range(len(dag.nodes)))
    for v, (s, unit) in enumerate(dag.nodes):
        pos = schedule.orders[s].index(unit)
        assert dag.stage_pred[v] == (dag.index[(s, schedule.orders[s][pos - 1])] if pos else -1)
        source = message_source(schedule.num_stages, schedule.num_chunks, s, unit)
        assert dag.message_pred[v] == (-1 if source is None else unit_index(dag.index, source, "source"))


def test_unit_dag_names_a_missing_sender_and_keeps_repeated_units_last():
    orders = one_f_one_b(2, 2).orders
    with pytest.raises(ScheduleError, match=r"dependency source S1 B1 is not in the schedule"):
        unit_dag(Schedule(2, (orders[0], (F(0), F(1), B(0)))))  # stage 0's B1 waits for it
    repeated = Schedule(2, ((F(0), F(1), F(0), B(0), B(1)), orders[1]))
    dag = unit_dag(repeated)  # validate() rejects it; the DAG keeps the general rule (last one wins)
    assert dag.index[(0, F(0))] == 2 and dag.stage_pred[dag.index[(0, F(0))]] == 1
    assert dag.stage_pred[0] == -1 and dag.stage_pred[3] == 2
    assert dag.stage_pred[1] == 2  # F1 follows "F0", whose node is the last F0's (a cycle: validate()'s to report)
    assert dag.message_pred[dag.index[(1, F(0))]] == 2


def test_evaluators_of_one_schedule_share_one_graph(gpt3_profile):
    schedule = one_f_one_b(gpt3_profile.num_stages, 12)
    first = PlanEvaluator(schedule, gpt3_profile, 100.0)
    assert PlanEvaluator(schedule, gpt3_profile, 50.0).graph is first.graph
    assert PlanEvaluator(schedule, gpt3_profile, 100.0, p2p_latency_s=1e-4).graph is not first.graph
    twin = one_f_one_b(gpt3_profile.num_stages, 12)  # equal, not the same object: its own graph
    assert PlanEvaluator(twin, gpt3_profile, 100.0).graph is not first.graph
    assert PipelineGraph.shared(schedule) is first.graph


def test_optimal_planning_builds_each_schedule_graph_once(gpt3_profile, monkeypatch):
    built: list[int] = []
    build = PipelineGraph.__init__

    def counting(self, schedule, *args, **kwargs):
        built.append(id(schedule))
        build(self, schedule, *args, **kwargs)

    monkeypatch.setattr(PipelineGraph, "__init__", counting)
    PipelineGraph._shared.clear()
    config = PlannerConfig("optimal", "1f1b", "default", gpu=get_gpu_spec("a40"), switch_cost_j=None)
    result = plan_envpipe(gpt3_profile, 16, config)
    assert built and len(built) == len(set(built))  # the basis, the model and the switching pass share one
    assert result.timeline.graph.schedule is result.schedule
