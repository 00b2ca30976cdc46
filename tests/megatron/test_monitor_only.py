"""Without clock control EnvPipe keeps Megatron's order and memory, and says so once per rank.

A 4-rank CPU pipeline (gloo) of the tiny GPT with ``--envpipe-type envelope --envpipe-scheduling
ours --envpipe-on-no-permission monitor``, twice: on CPU ranks with no GPU at all, and on a
simulated GPU that refuses every clock lock (as a GPU does for a job without root). Each must
run Megatron's 1F1B order in every iteration (no measuring iteration, no extra warm-up), so
its peak in-flight activations are 1F1B's; print no clock plan (no ``EnvPipe plan`` table, no
predicted saving, no clock on CPU); say once on every rank what EnvPipe still does and what
to ask for; and train bit for bit like stock Megatron.
"""

from __future__ import annotations

import json

import pytest

pytest.importorskip("torch", reason="needs torch and megatron-core: pip install -e '.[megatron]' (install.sh does)")
pytest.importorskip("megatron.core", reason="needs torch and megatron-core: pip install -e '.[megatron]' (install.sh does)")

import logging

from megatron_envpipe.config import EnvPipeConfig
from megatron_envpipe.core.interleaved import interleaved_schedule
from megatron_envpipe.core.measurement import IterationMeasurement
from megatron_envpipe.core.schedule import one_f_one_b
from megatron_envpipe.core.timeline import PipelineGraph
from megatron_envpipe.gpu.startup import DeviceFacts
from megatron_envpipe.megatron.runtime import _MEGATRON_ORDER, EnvPipeRuntime
from megatron_envpipe.testing import PipelineRun, compare_results, run_pipeline
from megatron_envpipe.testing.monitor_runs import monitored_schedule

pytestmark = pytest.mark.filterwarnings("ignore:(Transformer Engine and )?Apex (is|are) not installed")

P, M, ITERATIONS = 4, 8, 3
FLAGS = dict(plan_type="envelope", scheduling="ours", reconfig="balanced", on_no_permission="monitor")
REFUSAL = "NVML_ERROR_NO_PERMISSION: not root"


def peak_inflight(order: list[str]) -> int:
    """The most forwards whose backward has not run yet (activations held), over an order."""
    held = peak = 0
    for unit in order:
        held += 1 if unit.startswith("F") else -1
        peak = max(peak, held)
    return peak


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict:
    tmp = tmp_path_factory.mktemp("monitor")
    # The reference in its own ranks, where EnvPipe is never installed.
    (stock,) = run_pipeline(P, [PipelineRun(M)], timeout_s=240)
    cpu, sim = tmp / "cpu", tmp / "sim"
    cpu.mkdir()
    sim.mkdir()
    configs = {"cpu": (EnvPipeConfig(**FLAGS), cpu, None),
               "sim": (EnvPipeConfig(**FLAGS, gpu="simulated:a40/gpt3-175b", log_interval=1), sim, REFUSAL)}
    results = {}
    for name, (cfg, where, refusal) in configs.items():
        (results[name],) = run_pipeline(P, [PipelineRun(M, monitored_schedule(cfg, str(where), ITERATIONS, refusal))],
                                        timeout_s=240)
    return {"stock": stock, "results": results, "dirs": {"cpu": cpu, "sim": sim}}


def rank_record(runs: dict, name: str, rank: int) -> tuple[dict, str]:
    where = runs["dirs"][name]
    return json.loads((where / f"rank{rank}.json").read_text()), (where / f"rank{rank}.log").read_text()


@pytest.mark.parametrize("name", ["cpu", "sim"])
def test_every_iteration_runs_1f1b_with_1f1b_peak_activations(runs, name):
    reference = one_f_one_b(P, M)
    for stage in range(P):
        record, _ = rank_record(runs, name, stage)
        assert not record["control"]
        assert len(record["orders"]) == ITERATIONS
        for i, order in enumerate(record["orders"]):
            assert order == [str(u) for u in reference.orders[stage]], f"stage {stage} iteration {i}: {order}"
            assert peak_inflight(order) == reference.peak_inflight()[stage]
        assert not record["planned"] and record["planned_at"] is None  # nothing was planned


@pytest.mark.parametrize("name", ["cpu", "sim"])
def test_same_math_as_stock_megatron(runs, name):
    assert compare_results(runs["stock"], runs["results"][name]) == []


def test_cpu_without_gpu_prints_no_clock_and_says_so_once_per_rank(runs):
    for stage in range(P):
        _, log = rank_record(runs, "cpu", stage)
        assert "EnvPipe plan" not in log and "saving" not in log and "MHz" not in log, log
        lines = [line for line in log.splitlines() if "no GPU clock control" in line]
        assert len(lines) == 1, log
        assert f"EnvPipe stage {stage}:" in lines[0] and "Megatron's own order and nothing else" in lines[0]


def test_refused_lock_measures_energy_in_megatrons_order_and_says_what_to_ask_for(runs):
    for stage in range(P):
        record, log = rank_record(runs, "sim", stage)
        assert "EnvPipe plan" not in log and "saving 0.00%" not in log, log
        lines = [line for line in log.splitlines() if "cannot lock clocks" in line]
        assert len(lines) == 1, log
        line = lines[0]
        assert f"EnvPipe stage {stage}:" in line and REFUSAL in line
        assert "measuring energy only" in line and "Megatron's own order" in line
        assert "root or with CAP_SYS_ADMIN" in line and "Not root?" in line
        # The only clock in the log is the one the trial lock asked for: no plan's, no invented one.
        assert all("MHz" not in other for other in log.splitlines() if other != line), log
        # Energy is still measured, every iteration.
        assert len(record["energy_j"]) == ITERATIONS and all(e > 0 for e in record["energy_j"])


# -- the run-time alone (no ranks) ---------------------------------------------------------------------------

def timed(schedule):
    """Every stage's unit timings of one iteration, as the executor hands them over (F 1 s, B 2 s)."""
    graph = PipelineGraph(schedule)
    whole = graph.simulate([1.0 if u.is_forward else 2.0 for _, u in graph.nodes]).measurement()
    return [IterationMeasurement((stage,)) for stage in whole.stages]


NO_CONTROL = DeviceFacts(backend="simulated", name="sim", driver_version="", clocks_mhz=(1740, 1500, 1200),
                         control=False, energy=True, modelled=True)


@pytest.mark.parametrize("chunks", [1, 2])
def test_without_control_every_iteration_is_megatrons_order_with_no_clock(chunks, caplog):
    caplog.set_level(logging.INFO, logger="megatron_envpipe")
    rt = EnvPipeRuntime(EnvPipeConfig(**{**FLAGS, "scheduling": "interleaved" if chunks > 1 else "ours"}))
    rt.attach_device(NO_CONTROL)
    group = 4 if chunks > 1 else None
    expected = one_f_one_b(P, M) if chunks == 1 else interleaved_schedule(P, M, chunks, group)
    for _ in range(3):
        it = rt.prepare(P, M, num_chunks=chunks, microbatch_group_size=group)
        assert it.schedule == expected and it.plan is None and it.phase == _MEGATRON_ORDER
        assert not it.measure and not it.measure_memory and not it.profiling
        assert "SetFrequency" not in str(it.programs[0])
        rt.finish(P, M, None)
    assert rt.last_result is None and "EnvPipe plan" not in caplog.text and "MHz" not in caplog.text


def test_baseline_without_control_plans_its_schedule_but_shows_no_clock(caplog):
    """``baseline`` needs no clock control: its schedule (here ``ours``) still runs, with no clock table."""
    caplog.set_level(logging.INFO, logger="megatron_envpipe")
    rt = EnvPipeRuntime(EnvPipeConfig(plan_type="baseline", scheduling="ours", extra_warmup=(1, 1, 1, 0)))
    rt.attach_device(NO_CONTROL)
    first = rt.prepare(P, M)  # timed at the one clock, for the schedule: 1F1B with no clock
    assert first.phase == "measure 1/1" and first.schedule == one_f_one_b(P, M) and first.plan is None
    rt.finish(P, M, timed(first.schedule))
    it = rt.prepare(P, M)
    assert it.phase == "steady" and it.schedule.extra_warmup == (1, 1, 1, 0) and it.plan is None
    assert "EnvPipe schedule baseline/ours" in caplog.text and "EnvPipe plan" not in caplog.text
    assert "MHz" not in caplog.text
