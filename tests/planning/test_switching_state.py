"""The clock-switching pass's state (planning/switching_state.py): its tables, its incremental timeline and its
memory of refused merges are exact, bit for bit, against the evaluator and a full simulation."""

from __future__ import annotations

import pytest

pytest.importorskip("numpy")

import megatron_envpipe.planning.switching as switching  # noqa: E402
from megatron_envpipe.core.gpu_specs import get_gpu_spec  # noqa: E402
from megatron_envpipe.core.graph import latest_times, successors  # noqa: E402
from megatron_envpipe.core.timeline import PlanEvaluator  # noqa: E402
from megatron_envpipe.planning.basis import PlannerConfig  # noqa: E402
from megatron_envpipe.planning.planner import plan_envpipe  # noqa: E402
from megatron_envpipe.planning.switching import default_switch_cost_j, reduce_clock_changes  # noqa: E402
from megatron_envpipe.planning.switching_state import SwitchingState  # noqa: E402
from megatron_envpipe.testing.synthetic import repeated  # noqa: E402

A40 = get_gpu_spec("a40")


@pytest.fixture(scope="module")
def optimal_plans(bloom_profile):
    """Per scheduling, an optimal plan without the pass (Bloom repeated to 16 stages, 16 micro-batches)."""
    profile = repeated(bloom_profile, 2)
    plans = {}

    def get(scheduling):
        if scheduling not in plans:
            kw = {"virtual_stages": 2} if scheduling == "interleaved" else {}
            result = plan_envpipe(profile, 16, PlannerConfig("optimal", scheduling, "default", gpu=A40,
                                                             switch_cost_j=0.0, **kw))
            plans[scheduling] = result.plan, PlanEvaluator(result.schedule, profile,
                                                           A40.p2p_power_w, graph=result.timeline.graph)
        return plans[scheduling]
    return get


@pytest.mark.parametrize("scheduling", ["1f1b", "interleaved"])
def test_tables_are_the_evaluators(optimal_plans, scheduling):
    """Durations and effective-energy prefix sums per clock: the evaluator's numbers, summed unit by unit."""
    plan, evaluator = optimal_plans(scheduling)
    state = SwitchingState(plan, evaluator, evaluator.simulate(plan.flat()).iteration_time_s)
    assert state.durations and set(state.durations) == set(state.prefix)
    for f, table in state.durations.items():
        dur = evaluator.durations([f] * state.n)
        energy = evaluator.unit_energies([f] * state.n)
        acc, prefix = 0.0, [0.0]
        for d, e in zip(dur, energy):
            acc += e - evaluator.p2p_power_w * d
            prefix.append(acc)
        assert table == dur
        assert state.prefix[f] == prefix


@pytest.mark.parametrize("scheduling, two_edges", [("1f1b", True), ("1f1b", False), ("interleaved", True)])
def test_incremental_timeline_is_a_full_simulation(optimal_plans, scheduling, two_edges):
    """After the pass (and with the general loops instead of the two-edge ones), settling every marked change
    gives the full simulation's ends and latest finishes, bit for bit."""
    plan, evaluator = optimal_plans(scheduling)
    deadline = evaluator.simulate(plan.flat()).iteration_time_s * 1.01
    state = SwitchingState(plan, evaluator, deadline)
    if not two_edges:
        state._steps = None
    switching._by_switch_cost(state, 5.0)
    assert state.merges > 0
    state.settle(float("inf"), float("-inf"))
    timeline = evaluator.simulate(state.freqs)
    _, finish = latest_times(evaluator.graph.order, successors(evaluator.graph.preds), timeline.duration_s, deadline)
    assert state.end[:state.n] == timeline.end_s
    assert state.latest_finish == finish


@pytest.mark.parametrize("scheduling", ["1f1b", "interleaved"])
def test_remembered_refusals_are_what_a_check_says(optimal_plans, scheduling, monkeypatch):
    """Every merge the pass refuses from memory is refused again by a real deadline check at that moment,
    and the memory is used (the greedy rounds ask again for merges the deadline forbade)."""
    plan, evaluator = optimal_plans(scheduling)
    hits = []

    class Checked(SwitchingState):
        def still_refused(self, run, freq):
            remembered = super().still_refused(run, freq)
            if remembered:
                base = self.offset[run.stage]
                hits.append(self.fits(run, base + run.start, base + run.end, freq))
            return remembered

    expected = reduce_clock_changes(plan, evaluator, None, default_switch_cost_j(A40.p2p_power_w))
    monkeypatch.setattr(switching, "SwitchingState", Checked)
    checked = reduce_clock_changes(plan, evaluator, None, default_switch_cost_j(A40.p2p_power_w))
    assert hits and not any(hits)
    assert checked.plan.freqs_mhz == expected.plan.freqs_mhz


@pytest.mark.parametrize("scheduling", ["1f1b", "interleaved"])
def test_graph_parts_built_once_give_the_same_pass(optimal_plans, scheduling, monkeypatch):
    """A second pass on the same graph reuses its successors, positions and flat steps (switching_state's
    per-graph memo), and plans exactly what a pass that builds them afresh plans."""
    import megatron_envpipe.planning.switching_state as switching_state

    plan, evaluator = optimal_plans(scheduling)
    deadline = evaluator.simulate(plan.flat()).iteration_time_s * 1.01
    first = SwitchingState(plan, evaluator, deadline)
    second = SwitchingState(plan, evaluator, deadline)
    assert second._steps is first._steps and second.topo_pos is first.topo_pos and second.succs is first.succs
    remembered = reduce_clock_changes(plan, evaluator, deadline, 5.0)
    monkeypatch.setattr(switching_state, "_GRAPH_PARTS", {})
    fresh = reduce_clock_changes(plan, evaluator, deadline, 5.0)
    assert fresh.merges > 0
    assert remembered.plan.freqs_mhz == fresh.plan.freqs_mhz and remembered.score == fresh.score
    assert first.topo_pos == [evaluator.graph.order.index(v) for v in range(first.n)]
