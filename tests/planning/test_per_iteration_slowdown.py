"""Per-iteration plans with a slowdown allowed (--envpipe-max-slowdown > 0): the deadline stretches with it."""

from __future__ import annotations

import pytest

from megatron_envpipe.core.gpu_specs import get_gpu_spec
from megatron_envpipe.core.length_costs import MicrobatchSize, _default_length_model
from megatron_envpipe.planning.basis import PlannerConfig
from megatron_envpipe.planning.optimal.entry import plan_optimal
from megatron_envpipe.planning.per_iteration import IterationPlanner

P, M = 4, 8
SLOWDOWN = 0.10


def config(max_slowdown: float) -> PlannerConfig:
    return PlannerConfig("optimal", "ours", "default", gpu=get_gpu_spec("a40"), switch_cost_j=None,
                         max_slowdown=max_slowdown)


@pytest.fixture(scope="module")
def prof(gpt3_profile):
    return gpt3_profile.for_pipeline(P)


@pytest.fixture(scope="module")
def model():
    return _default_length_model("gpt3-175b")


def test_reference_sizes_plan_what_the_optimal_planner_plans_with_the_slowdown(prof, model):
    got = IterationPlanner(prof, model, M, config(SLOWDOWN)).plan([model.reference] * M)
    want = plan_optimal(prof, M, config(SLOWDOWN))
    assert got.deadline_s == pytest.approx(got.baseline_time_s * (1 + SLOWDOWN), rel=1e-12)
    assert got.plan == want.plan
    assert got.iteration_time_s == want.score.iteration_time_s


SIZE_SETS = [
    [MicrobatchSize.from_lengths([2048])] * 7 + [MicrobatchSize.from_lengths([1800])],
    [MicrobatchSize.from_lengths([1024])] * M,
    [MicrobatchSize.from_lengths([1024, 1024])] * M,
]


@pytest.mark.parametrize("index", range(len(SIZE_SETS)))
def test_the_slowdown_is_used_and_buys_energy_on_each_iterations_sizes(prof, model, index):
    """Sizes whose plan is held by the deadline at zero slowdown: with 10 % it takes the extra time
    (never more) and saves more for it."""
    sizes = SIZE_SETS[index]
    a = IterationPlanner(prof, model, M, config(0.0)).plan(sizes)
    b = IterationPlanner(prof, model, M, config(SLOWDOWN)).plan(sizes)
    assert b.baseline_time_s == a.baseline_time_s  # the stock run does not depend on the slowdown
    assert a.deadline_s == a.baseline_time_s
    assert b.deadline_s == pytest.approx(a.baseline_time_s * (1 + SLOWDOWN), rel=1e-12)
    assert a.iteration_time_s <= a.deadline_s * (1 + 1e-9)
    assert a.baseline_time_s * (1 + 0.5 * SLOWDOWN) < b.iteration_time_s <= b.deadline_s * (1 + 1e-9)
    assert 0.5 * SLOWDOWN < b.slowdown <= SLOWDOWN + 1e-9
    assert b.energy_saving > a.energy_saving + 0.02
    assert not a.fallback and not b.fallback
