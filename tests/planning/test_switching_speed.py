"""The clock-change pass at scale (planning/switching.py): same plans as before, far fewer units walked.

The pass keeps the timeline exact incrementally; since issue 24 it propagates a merge that slows nothing
lazily and stops a deadline check as soon as the answer is certain. Neither may change a plan: the digests
below are those of the eager pass (every merge propagated to the iteration's end), recorded before the
change. The work is counted in units recomputed (``SwitchingResult.units_walked``), not timed.
"""

from __future__ import annotations

import hashlib

import pytest

pytest.importorskip("numpy")

from megatron_envpipe.core.gpu_specs import get_gpu_spec  # noqa: E402
from megatron_envpipe.core.timeline import PlanEvaluator  # noqa: E402
from megatron_envpipe.planning.basis import PlannerConfig  # noqa: E402
from megatron_envpipe.planning.planner import plan_envpipe  # noqa: E402
from megatron_envpipe.planning.switching import default_switch_cost_j, reduce_clock_changes  # noqa: E402
from megatron_envpipe.testing.synthetic import repeated  # noqa: E402

A40 = get_gpu_spec("a40")
MICRO_BATCHES = 32


@pytest.fixture(scope="module")
def optimal_p16(bloom_profile):
    """Per scheduling, an optimal plan (no switching pass) of Bloom repeated to 16 stages: tight everywhere,
    as at scale."""
    profile = repeated(bloom_profile, 2)
    plans = {}

    def get(scheduling="1f1b"):
        if scheduling not in plans:
            result = plan_envpipe(profile, MICRO_BATCHES, PlannerConfig("optimal", scheduling, "default", gpu=A40,
                                                                        switch_cost_j=0.0))
            plans[scheduling] = result, PlanEvaluator(result.schedule, profile, A40.p2p_power_w)
        return plans[scheduling]
    return get


def digest(plan):
    return hashlib.sha256(repr(plan.freqs_mhz).encode()).hexdigest()[:16]


# (scheduling, deadline x own iteration time or None, switch cost (None: the default), budget) -> the eager
# pass's plan and clock changes. "ours" 5.0/20 has merges that make some units faster and others slower.
CASES = [
    ("1f1b", None, None, None, "c73b397737c5eb86", 726),
    ("1f1b", None, 0.0, 12, "b573c8b0d28cbf20", 187),
    ("1f1b", 1.02, 5.0, 20, "c2279625b7954ac8", 155),
    ("ours", 1.02, 5.0, 20, "75377aa7b87eee12", 140),
]


@pytest.mark.parametrize("scheduling, stretch, cost, budget, expected, changes", CASES)
def test_same_plan_as_the_eager_pass(optimal_p16, scheduling, stretch, cost, budget, expected, changes):
    result, evaluator = optimal_p16(scheduling)
    deadline = None if stretch is None else result.timeline.iteration_time_s * stretch
    cost = default_switch_cost_j(A40.p2p_power_w) if cost is None else cost
    sw = reduce_clock_changes(result.plan, evaluator, deadline, cost, budget)
    assert sum(sw.changes_after) == changes
    assert digest(sw.plan) == expected
    assert sw.timeline.iteration_time_s <= sw.deadline_s * (1 + 1e-9)


def test_default_pass_walks_a_fraction_of_the_eager_work(optimal_p16):
    """The eager pass recomputed 30,200 units here (a slowing merge walked on to the iteration's end, each
    check again); the lazy pass with early answers walks 9,637. The bound leaves room, not 30,200."""
    result, evaluator = optimal_p16()
    sw = reduce_clock_changes(result.plan, evaluator, None, default_switch_cost_j(A40.p2p_power_w))
    assert sw.merges == 92
    assert 0 < sw.units_walked < 12_000
