"""The short pipeline's LP start with slack in the deadline (issue 24): bloom-like profiles, whose
1F1B-at-f_max baseline is slower than every unit at its fastest clock, start too, and stay exact."""

from __future__ import annotations

import pytest

from megatron_envpipe.core.gpu_specs import get_gpu_spec
from megatron_envpipe.core.kinds import build_schedule
from megatron_envpipe.planning.basis import PlannerConfig
from megatron_envpipe.planning.optimal.entry import optimal_setup
from megatron_envpipe.planning.optimal.model import TimeEnergyModel
from megatron_envpipe.testing.synthetic import repeated

A40 = get_gpu_spec("a40")


def _started_and_cold(schedule, prof):
    """(started, cold: no start, starts: what started's own short-pipeline start returned, per call)."""
    kw = (prof.common_frequencies(), A40.p2p_power_w)
    started, cold = TimeEnergyModel(schedule, prof, *kw), TimeEnergyModel(schedule, prof, *kw)
    cold.shorter_pipeline_start = lambda *a: None
    starts, own = [], started.shorter_pipeline_start

    def recorded(*args):
        starts.append(own(*args))
        return starts[-1]

    started.shorter_pipeline_start = recorded
    return started, cold, starts


def test_bloom_baseline_deadline_has_slack(bloom_profile):
    # Why the start must handle slack: the default deadline of bloom-like profiles is not the fastest time.
    prof = repeated(bloom_profile, 2)
    cfg = PlannerConfig("optimal", "1f1b", "default", gpu=A40, switch_cost_j=None)
    setup = optimal_setup(prof, 96, cfg)
    model = setup.model(setup.schedules[0][1], prof, cfg)
    assert setup.baseline.iteration_time_s > model.fastest_time_s() * 1.001


# slack None: the planner's own deadline (bloom: about 0.7 % over the fastest time)
@pytest.mark.parametrize("scheduling,slack", [("1f1b", None), ("1f1b", 1.03), ("interleaved", None)])
def test_slack_deadline_starts_from_the_short_pipeline_and_stays_exact(bloom_profile, scheduling, slack):
    pytest.importorskip("highspy")
    p, m = 16, 128 if scheduling == "interleaved" else 96
    chunks = 2 if scheduling == "interleaved" else 1
    prof = repeated(bloom_profile, 2).for_chunks(chunks)
    cfg = PlannerConfig("optimal", scheduling, "default", gpu=A40, switch_cost_j=None,
                        **({"virtual_stages": 2} if chunks > 1 else {}))
    sched = build_schedule(scheduling, p, m, num_chunks=chunks) if chunks > 1 else build_schedule(scheduling, p, m)
    started, cold, starts = _started_and_cold(sched, prof)
    fastest = cold.fastest_time_s()
    if slack is None:
        deadline = optimal_setup(repeated(bloom_profile, 2), m, cfg).baseline.iteration_time_s
    else:
        deadline = fastest * slack
    assert deadline > fastest * 1.001
    weight = A40.p2p_power_w * p
    d_s, t_s, obj_s = started.solve_lp(deadline, weight)
    # The solve asked for the short pipeline's start once (the start itself solved once, not again by hand).
    assert len(starts) == 1 and starts[0] is not None and started._start_basis is not None
    obj_c = cold.solve_lp(deadline, weight)[2]
    assert obj_s == pytest.approx(obj_c, rel=1e-9) and t_s <= deadline * (1 + 1e-9)
    assert started.graph.simulate(d_s).iteration_time_s <= deadline * (1 + 1e-9)
    # counts, not seconds: the mapped basis leaves the dual simplex less to do than a cold start
    assert started._lp.h.getInfo().simplex_iteration_count < 0.7 * cold._lp.h.getInfo().simplex_iteration_count
