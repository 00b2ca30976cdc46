"""The LP at scale (issue 24, part 5): the short pipeline that starts the long LP is itself started from
one about half as long, and the answer stays the exact LP optimum. Counts and results, never seconds."""

from __future__ import annotations

import pytest

import megatron_envpipe.planning.optimal.model as model_module
from megatron_envpipe.core.gpu_specs import get_gpu_spec
from megatron_envpipe.core.kinds import build_schedule
from megatron_envpipe.planning.optimal.model import TimeEnergyModel

A40 = get_gpu_spec("a40")


def _model(schedule, prof):
    return TimeEnergyModel(schedule, prof, prof.common_frequencies(), A40.p2p_power_w)


# (scheduling, M, the start chain): 1F1B at P = 8: 3 warm-ups = 24, then 12 (= W + P / 2; not 6: fewer
# than the warm-up and half a pipeline is no steady state); interleaved V = 2: 3 x 11 warm-up
# micro-batches -> 40 (a multiple of P), then 20 -> 24.
@pytest.mark.parametrize("scheduling,m,chain", [("1f1b", 96, (24, 12)), ("interleaved", 64, (40, 24))])
def test_the_short_lp_starts_from_a_shorter_one_and_the_answer_stays_exact(
        gpt3_profile, monkeypatch, scheduling, m, chain):
    pytest.importorskip("highspy")
    # The real threshold keeps P = 8 LPs cold (they solve in hundredths of a second); lowered here so that a
    # small case walks the same code as P = 32, M = 256 (256 <- 96 <- 48).
    monkeypatch.setattr(model_module, "_MIN_UNITS_FOR_START", 0)
    monkeypatch.setattr(model_module, "_MIN_UNITS_FOR_NESTED_START", 0)
    chunks = 2 if scheduling == "interleaved" else 1
    prof = gpt3_profile.for_chunks(chunks)
    sched = build_schedule(scheduling, 8, m, num_chunks=chunks)
    started, cold = _model(sched, prof), _model(sched, prof)
    cold.shorter_pipeline_start = lambda *a: None
    deadline = cold.fastest_time_s()
    weight = A40.p2p_power_w * 8
    d_s, t_s, obj_s = started.solve_lp(deadline, weight)
    d_c, t_c, obj_c = cold.solve_lp(deadline, weight)
    assert started.start_chain == chain and cold.start_chain == ()
    assert obj_s == pytest.approx(obj_c, rel=1e-9) and t_s <= deadline * (1 + 1e-9)
    assert started.graph.simulate(d_s).iteration_time_s <= deadline * (1 + 1e-9)



def test_large_cold_lps_skip_presolve_small_ones_keep_it(gpt3_profile):
    # HiGHS's presolve removes little from these chains and costs a quarter of a large cold solve; the small
    # LPs (P = 8: every reference plan) keep HiGHS's default, so their plans stay as they were.
    pytest.importorskip("highspy")
    small = _model(build_schedule("1f1b", 8, 64), gpt3_profile).prepare_lp()
    large = _model(build_schedule("1f1b", 8, 256), gpt3_profile).prepare_lp()
    assert small.n < model_module._MIN_UNITS_WITHOUT_PRESOLVE <= large.n
    assert small._lp.h.getOptionValue("presolve")[-1] != "off"
    assert large._lp.h.getOptionValue("presolve")[-1] == "off"
