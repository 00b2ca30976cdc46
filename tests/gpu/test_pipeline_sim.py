"""The latency-aware prediction (core/clock_transitions.py) against real simulated GPUs with clock latency
(testing/pipeline_sim.py), and bench/clock_latency.py --quick. All in simulated time: no host timing."""

import importlib.util
import random
import sys
from pathlib import Path

import pytest

from megatron_envpipe.core.clock_lead import ClockLead
from megatron_envpipe.core.clock_transitions import predict_with_latency
from megatron_envpipe.core.device_dynamics import EXACT, DeviceDynamics
from megatron_envpipe.core.gpu_specs import get_gpu_spec
from megatron_envpipe.core.kinds import build_schedule
from megatron_envpipe.core.profile import Profile, ProfilePoint
from megatron_envpipe.core.resources import shipped_profile
from megatron_envpipe.core.timeline import PlanEvaluator
from megatron_envpipe.planning.basis import PlannerConfig
from megatron_envpipe.planning.planner import plan_envpipe
from megatron_envpipe.testing.pipeline_sim import run_pipeline_sim

REPO = Path(__file__).resolve().parents[2]
CLOCKS = (900, 1200, 1500, 1800)
P2P_W = 40.0


def profile(num_stages):
    """Units of 20-90 ms (some shorter than the 30 ms latency below), energy rising with the clock."""
    rows = {}
    for s in range(num_stages):
        for ins, base in (("forward", 0.030), ("backward", 0.060)):
            t = base * (1 + 0.1 * s)
            rows[(s, ins)] = [ProfilePoint(f, t * 1800 / f, t * 1800 / f * (60 + 0.1 * f)) for f in CLOCKS]
    return Profile(rows, source="synthetic four-clock")


def dynamics(latency_s, call_s):
    return DeviceDynamics(clock_latency_s=latency_s, nvml_call_s=call_s, source="test")


CASES = [("1f1b", 2, 3, 1), ("ours", 3, 5, 1), ("interleaved", 2, 4, 2)]


@pytest.mark.parametrize("scheduling, stages, microbatches, chunks", CASES)
@pytest.mark.parametrize("latency_s, call_s", [(0.015, 0.010), (0.030, 0.030)])
@pytest.mark.parametrize("enabled", [True, False])
def test_prediction_is_what_the_simulated_gpus_measure(scheduling, stages, microbatches, chunks, latency_s, call_s,
                                                        enabled):
    warmup = (1,) * (stages - 1) + (0,) if scheduling == "ours" else None
    schedule = build_schedule(scheduling, stages, microbatches, warmup, num_chunks=chunks)
    evaluator = PlanEvaluator(schedule, profile(stages), P2P_W)
    rng = random.Random(f"{scheduling}{latency_s}{enabled}")
    freqs = [rng.choice(CLOCKS) for _ in evaluator.graph.nodes]
    lead = ClockLead(latency_s, enabled)
    want = predict_with_latency(evaluator, freqs, lead, nvml_call_s=call_s)
    got = run_pipeline_sim(evaluator, freqs, dynamics(latency_s, call_s), lead)
    assert got.iteration_time_s == pytest.approx(want.score.iteration_time_s, rel=1e-9, abs=1e-12)
    assert got.energy_j == pytest.approx(want.score.energy_j, rel=1e-9)
    for s, energy in enumerate(want.score.stage_energy_j):
        assert got.stage_energy_j[s] == pytest.approx(energy, rel=1e-9)
    assert got.start_s == pytest.approx(want.timeline.start_s, abs=1e-9)
    assert got.end_s == pytest.approx(want.timeline.end_s, abs=1e-9)
    assert (got.requests, got.led) == (want.requests, want.led)
    # The latency did something: the run is not the zero-latency one.
    assert got.energy_j != pytest.approx(evaluator.score(freqs).energy_j, rel=1e-9)


def test_exact_devices_measure_the_plan_evaluator():
    schedule = build_schedule("ours", 3, 5, (1, 1, 0))
    evaluator = PlanEvaluator(schedule, profile(3), P2P_W)
    freqs = [random.Random(1).choice(CLOCKS) for _ in evaluator.graph.nodes]
    got = run_pipeline_sim(evaluator, freqs, EXACT, None)
    exact = evaluator.score(freqs)
    assert got.iteration_time_s == pytest.approx(exact.iteration_time_s, rel=1e-12)
    assert got.energy_j == pytest.approx(exact.energy_j, rel=1e-12)


def test_the_rule_keeps_the_measured_time_of_a_shipped_plan():
    # GPT-3 175B, P = 4, optimal zero-slowdown plan: 15 ms without the rule costs time, with it none.
    prof = Profile.from_csv(shipped_profile("a40/gpt3-175b")).for_pipeline(4)
    cfg = PlannerConfig("optimal", "ours", "default", gpu=get_gpu_spec("a40"), switch_cost_j=0.0)
    result = plan_envpipe(prof, 8, cfg)
    evaluator = PlanEvaluator(result.schedule, prof, cfg.effective_p2p_power_w, graph=result.timeline.graph)
    freqs = result.plan.flat()
    deadline = result.baseline.iteration_time_s
    off = run_pipeline_sim(evaluator, freqs, dynamics(0.015, 0.010), ClockLead(0.015, enabled=False))
    on = run_pipeline_sim(evaluator, freqs, dynamics(0.015, 0.010), ClockLead(0.015))
    assert off.iteration_time_s > deadline * 1.001
    assert on.iteration_time_s <= deadline * (1 + 1e-9)
    # The planner reports the same when told the latency.
    told = plan_envpipe(prof, 8, PlannerConfig("optimal", "ours", "default", gpu=get_gpu_spec("a40"),
                                               switch_cost_j=0.0, clock_latency_s=0.015, clock_call_s=0.010))
    assert told.score.iteration_time_s == pytest.approx(on.iteration_time_s, rel=1e-9)
    assert told.score.energy_j == pytest.approx(on.energy_j, rel=1e-9)
    assert told.details["clock_latency"]["without_latency"]["energy_j"] == pytest.approx(result.energy_j)


def test_bench_quick_prints_a_table_whose_cells_hold(capsys):
    spec = importlib.util.spec_from_file_location("envpipe_bench_clock_latency", REPO / "bench" / "clock_latency.py")
    bench = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = bench  # its dataclass looks its module up there
    spec.loader.exec_module(bench)
    assert bench.main(["--quick"]) == 0
    out = capsys.readouterr().out
    # 15 ms: with the rule the measured iteration keeps the deadline; without it, it is late.
    assert "| gpt3-175b | 4 | optimal | ours | 15 ms | on | +0.000 % |" in out
    assert "| gpt3-175b | 4 | optimal | ours | 15 ms | off | +0.000 % |" not in out
    assert "rule on: 1/1 cells hold" in out
