"""Per-iteration clock plans from micro-batch sizes (issue 25, part 3, planning side). Simulated time only."""

from __future__ import annotations

import random

import pytest

from megatron_envpipe.core.gpu_specs import get_gpu_spec
from megatron_envpipe.core.length_costs import LengthCostError, MicrobatchSize, _default_length_model
from megatron_envpipe.core.plan import FrequencyPlan
from megatron_envpipe.core.timeline import PlanEvaluator
from megatron_envpipe.planning.basis import PlannerConfig, PlannerError
from megatron_envpipe.planning.optimal.entry import plan_optimal
from megatron_envpipe.planning.optimal.model import TimeEnergyModel
from megatron_envpipe.planning.per_iteration import IterationPlanner
from megatron_envpipe.testing.microbatch_sizes import average_size

P, M = 4, 8


def config(scheduling="ours", **kw):
    if scheduling == "interleaved":
        kw.setdefault("virtual_stages", 2)
    return PlannerConfig("optimal", scheduling, "default", gpu=get_gpu_spec("a40"), switch_cost_j=None, **kw)


def random_sizes(seed, m=M):
    rng = random.Random(seed)
    return [MicrobatchSize.from_lengths([rng.randint(100, 1500) for _ in range(rng.randint(1, 2))]) for _ in range(m)]


@pytest.fixture(scope="module")
def prof(gpt3_profile):
    return gpt3_profile.for_pipeline(P)


@pytest.fixture(scope="module")
def model():
    return _default_length_model("gpt3-175b")


@pytest.mark.parametrize("scheduling", ["ours", "1f1b", "interleaved"])
def test_reference_sizes_plan_what_the_optimal_planner_plans(prof, model, scheduling):
    """At the profile's own size every micro-batch costs its row: the plan is --type optimal's, clock for clock."""
    planner = IterationPlanner(prof, model, M, config(scheduling))
    got = planner.plan([model.reference] * M)
    want = plan_optimal(prof, M, config(scheduling))
    assert got.plan == want.plan
    assert got.baseline_time_s == want.baseline.iteration_time_s
    assert got.iteration_time_s == want.score.iteration_time_s
    assert got.energy_j == pytest.approx(want.energy_j, rel=1e-12)
    assert not got.fallback


@pytest.mark.parametrize("scheduling", ["ours", "1f1b", "interleaved"])
def test_each_iteration_meets_the_stock_run_for_its_own_sizes(prof, model, scheduling):
    planner = IterationPlanner(prof, model, M, config(scheduling))
    for seed in range(3):
        sizes = random_sizes(seed)
        it = planner.plan(sizes)
        # The deadline is the stock order at f_max on these sizes, scored independently here.
        stock_sched = planner.baseline_schedule
        assert stock_sched.num_chunks == (2 if scheduling == "interleaved" else 1)
        stock = PlanEvaluator(stock_sched, prof, planner.p2p_power_w, microbatch_sizes=sizes, length_model=model)
        stock_score = stock.score(FrequencyPlan.constant(stock_sched, [1740] * P).flat())
        assert it.baseline_time_s == stock_score.iteration_time_s
        assert it.deadline_s == it.baseline_time_s
        assert it.iteration_time_s <= it.deadline_s * (1 + 1e-9)
        assert it.energy_saving > 0.05
        assert it.sizes == tuple(sizes)
        # Its prediction is the plan scored on these sizes (clock changes charged).
        assert it.energy_j == pytest.approx(planner.energy_j(it.plan, planner.score(it.plan, sizes)), rel=1e-12)


def test_uneven_sizes_get_their_own_plan_and_beat_one_plan_for_the_average(prof, model):
    """1F1B has no slack at zero slowdown: one plan made for the average micro-batch is late on uneven
    sizes, the per-iteration plan is on time and (here) cheaper."""
    planner = IterationPlanner(prof, model, M, config("1f1b"))
    sizes = random_sizes(7)
    single = planner.plan([average_size(sizes)] * M).plan
    on_actual = planner.score(single, sizes)
    it = planner.plan(sizes)
    assert it.plan != single
    assert on_actual.iteration_time_s > it.baseline_time_s * 1.001  # late
    assert it.iteration_time_s <= it.baseline_time_s * (1 + 1e-9)
    assert it.energy_j < planner.energy_j(single, on_actual)


def test_pruned_clocks_give_the_same_plan_as_every_clock(prof, model):
    """The planner scales only the clocks worth choosing at the reference size (the default model scales all
    clocks alike): the same plan as the time-energy model over every profiled clock."""
    planner = IterationPlanner(prof, model, M, config("ours"))
    sizes = random_sizes(3)
    full = TimeEnergyModel(planner.schedule, prof, planner.candidates_mhz, planner.p2p_power_w,
                           microbatch_sizes=sizes, length_model=model)
    it = planner.plan(sizes)
    assert full.solve(it.deadline_s).freqs_mhz == it.plan.flat()
    assert len(planner._planning_profile.points(0, "forward")) < len(prof.points(0, "forward"))


def test_bad_input_is_refused_at_the_edge(prof, model):
    with pytest.raises(PlannerError, match="per-iteration plans use --type optimal"):
        IterationPlanner(prof, model, M, PlannerConfig("envelope", "ours", gpu=get_gpu_spec("a40")))
    with pytest.raises(PlannerError, match="do not support a target iteration time"):
        IterationPlanner(prof, model, M, config(target_time_s=5.0))
    with pytest.raises(LengthCostError, match="need a LengthCostModel"):
        IterationPlanner(prof, None, M, config())
    planner = IterationPlanner(prof, model, M, config("1f1b"))
    with pytest.raises(LengthCostError, match="3 micro-batch sizes for an iteration of 8 micro-batches"):
        planner.plan(random_sizes(0)[:3])


def test_average_size_caps_attention_at_one_sequence():
    a, b = MicrobatchSize(100, 10_000), MicrobatchSize(1, 1)
    assert average_size([a, b]) == MicrobatchSize(50, 2_500)
    assert average_size([a, a]) == a
    with pytest.raises(LengthCostError, match="no micro-batch sizes"):
        average_size([])


def test_an_order_that_cannot_keep_up_runs_at_f_max_in_the_same_order(prof, model, monkeypatch):
    # Never another order (the stock one): the executor's programs are proved for the fixed order only.
    from megatron_envpipe.planning.optimal.deadline import InfeasibleDeadline

    planner = IterationPlanner(prof, model, M, config("ours"))
    assert planner.schedule is not planner.baseline_schedule

    def infeasible(self, deadline_s, padded=False, search_work=0):
        raise InfeasibleDeadline(f"no plan meets {deadline_s:.6g} s")

    monkeypatch.setattr(TimeEnergyModel, "solve", infeasible)
    sizes = random_sizes(7)
    got = planner.plan(sizes)
    assert got.fallback.startswith("the fixed order at f_max: no plan meets")
    assert got.plan.schedule is planner.schedule
    assert set(got.plan.flat()) == {planner.f_max_mhz}
    assert got.iteration_time_s == planner.score(got.plan, sizes).iteration_time_s
