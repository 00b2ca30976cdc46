"""The executor's phase logic (measure -> plan -> reconfigure -> steady), pure Python."""

from __future__ import annotations

import pytest

from megatron_envpipe.config import EnvPipeConfig
from megatron_envpipe.core.deadlock import check_deadlock
from megatron_envpipe.core.measurement import IterationMeasurement
from megatron_envpipe.core.timeline import PipelineGraph
from megatron_envpipe.megatron.runtime import EnvPipeRuntime


def measured(schedule, durations):
    """Per-stage measurements of a simulated iteration (what each stage's executor reports)."""
    graph = PipelineGraph(schedule)
    whole = graph.simulate([durations(s, u) for s, u in graph.nodes]).measurement()
    return [IterationMeasurement((stage,)) for stage in whole.stages]


def test_without_profile_measures_1f1b_then_plans_ours_from_measured_times():
    rt = EnvPipeRuntime(EnvPipeConfig(plan_type="envelope", scheduling="ours", reconfig="balanced"))
    first = rt.prepare(4, 8)
    assert first.phase.startswith("measure") and first.measure and first.schedule.name == "1f1b"
    rt.finish(4, 8, measured(first.schedule, lambda s, u: 1.0 if u.is_forward else 2.0))
    nxt = rt.prepare(4, 8)
    # T_B/T_F = 2 -> r_s = floor(2 (P-s-1)) = [6, 4, 2, 0], clamped by M-(P-s) = [4, 5, 6, 7].
    assert nxt.schedule.extra_warmup == (4, 4, 2, 0)
    assert nxt.phase == "steady" and not nxt.measure  # one clock: nothing to reconfigure
    check_deadlock(nxt.programs)


def test_stock_config_runs_1f1b_without_measuring():
    rt = EnvPipeRuntime(EnvPipeConfig())
    it = rt.prepare(4, 8)
    assert it.schedule.name == "1f1b" and not it.measure


def test_with_profile_reconfigures_online_until_finished(tmp_path):
    path = tmp_path / "p.csv"
    rows = ["stage,instruction,frequency,time,energy"]
    for s in range(3):
        for f, slow in ((1500, 1.0), (1200, 1.2), (900, 1.5)):
            rows += [f"{s},forward,{f},{slow},{100 * slow}", f"{s},backward,{f},{2 * slow},{200 * slow}"]
    path.write_text("\n".join(rows) + "\n")
    rt = EnvPipeRuntime(EnvPipeConfig(plan_type="envelope", scheduling="1f1b", reconfig="balanced",
                                      profile=str(path), finish_limit=2))
    it = rt.prepare(3, 6)
    assert it.phase == "reconfigure" and it.measure
    assert set(it.plan.flat()) <= {1500, 1200, 900}
    # Feed measurements where every unit runs at max speed: the path is the envelope, no more
    # progress, so after finish_limit+1 iterations the runtime settles.
    for _ in range(3):
        rt.finish(3, 6, measured(it.schedule, lambda s, u: 1.0 if u.is_forward else 2.0))
        it = rt.prepare(3, 6)
    assert it.phase == "steady" and not it.measure


def test_profile_with_wrong_stage_count_is_a_clear_error():
    rt = EnvPipeRuntime(EnvPipeConfig(plan_type="envelope", profile="a40/gpt3-175b"))
    with pytest.raises(ValueError, match="has 8 stages but the pipeline has 4"):
        rt.prepare(4, 8)
