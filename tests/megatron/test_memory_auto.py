"""``--envpipe-max-inflight auto`` (the default) and per-stage budgets: flags, run-time, CLI, and a
torchrun run of the tiny GPT on the simulated GPU with the memory model standing in for CUDA."""

from __future__ import annotations

import argparse
import json
import logging
import re
from pathlib import Path

import pytest
from launching import torchrun

from megatron_envpipe.apps.cli import main
from megatron_envpipe.config import EnvPipeConfig, EnvPipeConfigError, add_envpipe_args
from megatron_envpipe.core.measurement import IterationMeasurement
from megatron_envpipe.core.memory import _GIB, AUTO, MIB, MemoryModel, StageMemory, within_budget
from megatron_envpipe.core.schedule import envpipe_schedule
from megatron_envpipe.core.timeline import PipelineGraph
from megatron_envpipe.megatron.runtime import EnvPipeRuntime
from megatron_envpipe.planning.basis import PlannerConfig
from megatron_envpipe.planning.planner import plan_envpipe

REPO = Path(__file__).resolve().parents[2]
OURS = ["--envpipe-type", "envelope", "--envpipe-scheduling", "ours"]


def parse(argv: list[str]) -> EnvPipeConfig:
    return EnvPipeConfig.from_args(add_envpipe_args(argparse.ArgumentParser(prog="train")).parse_args(argv))


def megatron(pp: int = 4, m: int | None = 8) -> argparse.Namespace:
    return argparse.Namespace(pipeline_model_parallel_size=pp, num_microbatches=m)


# -- flags ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("flag,value", [
    (None, AUTO), ("auto", AUTO), ("none", None), ("unlimited", None), ("6", 6), ("5,4,3,2", (5, 4, 3, 2)),
])
def test_max_inflight_flag_forms(flag, value):
    cfg = parse(OURS + (["--envpipe-max-inflight", flag] if flag else []))
    assert cfg.max_inflight == value
    cfg.validate_with_megatron_args(megatron())
    # The planner on its own has nothing to measure: auto plans without a limit, like none.
    assert cfg.planner_config().max_inflight == (None if value == AUTO else value)


def test_sim_memory_flag():
    assert parse([]).sim_memory is None
    assert parse(OURS + ["--envpipe-sim-memory", "0.75,256"]).sim_memory == MemoryModel(0.75, 256.0)
    # Where auto measures nothing, the model would be silently ignored: an error instead.
    for argv in (["--envpipe-type", "envelope"], OURS + ["--envpipe-max-inflight", "6"]):
        with pytest.raises(EnvPipeConfigError, match="--envpipe-sim-memory only applies to --envpipe-max-inflight auto"):
            parse(argv + ["--envpipe-sim-memory", "0.75,256"])


@pytest.mark.parametrize("argv,needles", [
    (["--envpipe-max-inflight", "5,4"], ["--envpipe-max-inflight 5,4 has 2 entries", "4 stages", "e.g. 4,3,2,1"]),
    (["--envpipe-max-inflight", "5,4,1,1"], ["--envpipe-max-inflight 5,4,1,1", "stage 2's budget 1 is below the 2",
                                             "at least 4,3,2,1"]),
    (["--envpipe-max-inflight", "5,0,2,1"], ["--envpipe-max-inflight 5,0,2,1", "stage 1's entry 0", ">= 1"]),
    (["--envpipe-max-inflight", "3"], ["--envpipe-max-inflight 3 is below the 4", "stage 0", "at least 4"]),
])
def test_explicit_budget_below_the_need_is_a_start_up_error(argv, needles):
    with pytest.raises(EnvPipeConfigError) as info:
        parse(OURS + argv).validate_with_megatron_args(megatron())
    for needle in needles:
        assert needle in str(info.value), str(info.value)


def test_per_stage_budget_follows_the_micro_batch_count():
    # M = 2: 1F1B holds min(2, P-s) = [2, 2, 2, 1].
    parse(OURS + ["--envpipe-max-inflight", "2,2,2,1"]).validate_with_megatron_args(megatron(4, 2))
    with pytest.raises(EnvPipeConfigError, match="stage 0's budget 2 is below the 4"):
        parse(OURS + ["--envpipe-max-inflight", "2,2,2,1"]).validate_with_megatron_args(megatron(4, 8))


@pytest.mark.parametrize("argv,needle", [
    (["--envpipe-max-inflight", "4,x"], "'4,x'"),
    (["--envpipe-sim-memory", "2"], "GIB_FREE,MIB_PER_MICROBATCH"),
    (["--envpipe-sim-memory", "2,-5"], "activation memory per micro-batch must be"),
])
def test_unparsable_budget_flags_are_argparse_errors(argv, needle, capsys):
    with pytest.raises(SystemExit):
        parse(argv)
    err = capsys.readouterr().err.splitlines()[-1]
    assert "argument --envpipe-" in err and needle in err, err


# -- the run-time's budget phase ---------------------------------------------------------------------


def timings(schedule, fwd: float = 1.0, bwd: float = 2.0):
    """What the executor hands over after a measured iteration (every stage's units, serially timed)."""
    graph = PipelineGraph(schedule)
    whole = graph.simulate([fwd if u.is_forward else bwd for _, u in graph.nodes]).measurement()
    return [IterationMeasurement((stage,)) for stage in whole.stages]


def model_memory(p: int, free_gib: float, mib: float) -> tuple[StageMemory, ...]:
    return (MemoryModel(free_gib, mib).stage_memory(),) * p


def test_auto_with_the_memory_model_measures_in_the_1f1b_iteration_then_plans_within(caplog):
    caplog.set_level(logging.INFO, logger="megatron_envpipe")
    cfg = EnvPipeConfig(plan_type="envelope", scheduling="ours", sim_memory=MemoryModel(0.75, 256))
    rt = EnvPipeRuntime(cfg)
    first = rt.prepare(4, 8)
    assert first.phase == "measure 1/1" and first.measure and first.measure_memory
    assert first.schedule.name == "1f1b"
    rt.finish(4, 8, timings(first.schedule), memory=model_memory(4, 0.75, 256))
    nxt = rt.prepare(4, 8)
    # (768 MiB - 512 MiB margin) / 256 MiB = 1 more activation than 1F1B's [4, 3, 2, 1].
    assert rt.budgets[(4, 8)] == (5, 4, 3, 2)
    assert within_budget(nxt.schedule.peak_inflight(), (5, 4, 3, 2)) and not nxt.measure_memory
    assert "EnvPipe activation budget per stage [5, 4, 3, 2] (256 MiB per micro-batch, 0.75 GiB free" in caplog.text
    # Unlimited, T_B/T_F = 2 gives r = [4, 4, 2, 0], peaks [8, 7, 4, 1]: the budget binds.
    assert "activation budget binds" in caplog.text and "points given up" in caplog.text
    assert nxt.schedule.extra_warmup == (1, 1, 1, 0)


def test_with_a_profile_auto_runs_its_own_1f1b_memory_iteration():
    cfg = EnvPipeConfig(plan_type="envelope", scheduling="ours", profile="a40/gpt3-175b",
                        sim_memory=MemoryModel(2, 512))
    rt = EnvPipeRuntime(cfg)
    it = rt.prepare(8, 24)
    assert it.phase == "measure activation memory 1/1" and it.measure_memory and not it.measure
    assert it.schedule.name == "1f1b"
    rt.finish(8, 24, None, memory=model_memory(8, 2, 512))
    planned = rt.prepare(8, 24)
    budget = rt.budgets[(8, 24)]
    assert budget == (11, 10, 9, 8, 7, 6, 5, 4)  # 3 more than 1F1B on every stage
    assert within_budget(planned.schedule.peak_inflight(), budget)
    # The same plan as the explicit per-stage budget gives.
    explicit = plan_envpipe(rt.profile, 24, PlannerConfig("envelope", "ours", "default", gpu=rt.gpu,
                                                          max_inflight=budget))
    assert planned.schedule == explicit.schedule


def test_on_cuda_two_1f1b_iterations_are_measured():
    """The first optimizer step allocates optimizer state after iteration 1: measure iteration 2 too."""
    rt = EnvPipeRuntime(EnvPipeConfig(plan_type="envelope", scheduling="ours"))
    rt.attach_memory("cuda")
    first = rt.prepare(4, 8)
    assert first.phase == "measure 1/1" and first.measure_memory
    rt.finish(4, 8, timings(first.schedule), memory=(StageMemory(256 * MIB, 4 * _GIB),) * 4)
    second = rt.prepare(4, 8)
    assert second.phase == "measure activation memory 2/2" and second.measure_memory and not second.measure
    # Iteration 2 sees less free memory (optimizer state): the smaller one counts.
    rt.finish(4, 8, None, memory=(StageMemory(256 * MIB, _GIB),) * 4)
    rt.prepare(4, 8)
    assert rt.budgets[(4, 8)] == (6, 5, 4, 3)


def test_without_a_way_to_measure_auto_keeps_no_limit_and_says_so_once(caplog):
    caplog.set_level(logging.INFO, logger="megatron_envpipe")
    rt = EnvPipeRuntime(EnvPipeConfig(plan_type="envelope", scheduling="ours"))
    first = rt.prepare(4, 8)
    assert not first.measure_memory
    rt.finish(4, 8, timings(first.schedule))
    planned = rt.prepare(4, 8)
    unlimited = EnvPipeRuntime(EnvPipeConfig(plan_type="envelope", scheduling="ours", max_inflight=None))
    unlimited.finish(4, 8, timings(unlimited.prepare(4, 8).schedule))
    assert planned.schedule == unlimited.prepare(4, 8).schedule
    assert planned.schedule.extra_warmup == (4, 4, 2, 0) and rt.budgets[(4, 8)] is None
    assert caplog.text.count("this device's memory cannot be measured") == 1
    assert "--envpipe-max-inflight none" in caplog.text


def test_a_budget_that_does_not_bind_leaves_the_plan_alone(caplog):
    caplog.set_level(logging.INFO, logger="megatron_envpipe")
    rt = EnvPipeRuntime(EnvPipeConfig(plan_type="envelope", scheduling="ours", sim_memory=MemoryModel(40, 256)))
    first = rt.prepare(4, 8)
    rt.finish(4, 8, timings(first.schedule), memory=model_memory(4, 40, 256))
    assert rt.prepare(4, 8).schedule.extra_warmup == (4, 4, 2, 0)
    assert rt.budgets[(4, 8)] == (8, 8, 8, 8) and "does not bind" in caplog.text


def test_explicit_and_small_cases_measure_nothing():
    """An explicit budget, 1F1B, or M <= P (no stage can run extra warm-up): no memory iteration."""
    for cfg, m in ((EnvPipeConfig(plan_type="envelope", scheduling="ours", max_inflight=(5, 4, 3, 2)), 8),
                   (EnvPipeConfig(plan_type="envelope", scheduling="1f1b"), 8),
                   (EnvPipeConfig(plan_type="envelope", scheduling="ours"), 4)):
        rt = EnvPipeRuntime(cfg)
        rt.attach_memory("cuda")  # memory could be measured
        first = rt.prepare(4, m)
        assert not first.measure_memory
        rt.finish(4, m, timings(first.schedule))
        planned = rt.prepare(4, m)
        assert not planned.measure_memory and planned.phase == "steady"
        if cfg.max_inflight == (5, 4, 3, 2):
            assert planned.schedule.peak_inflight() == (5, 4, 3, 1)


# -- envpipe plan --max-inflight --------------------------------------------------------------------

PLAN = ["plan", "--profile", "a40/gpt3-175b", "-m", "24"]


@pytest.mark.parametrize("plan_type", ["envelope", "optimal"])
def test_plan_takes_a_per_stage_budget_and_reports_peaks_next_to_the_saving(plan_type, capsys):
    budget = [12, 10, 9, 7, 6, 4, 3, 1]  # 1F1B + 50 %
    assert main(PLAN + ["--type", plan_type, "--max-inflight", ",".join(map(str, budget)), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["plan"]["max_inflight"] == budget
    assert within_budget(data["plan"]["peak_inflight_activations"], tuple(budget))
    assert main(PLAN + ["--type", plan_type, "--max-inflight", ",".join(map(str, budget))]) == 0
    out = capsys.readouterr().out
    line = next(line for line in out.splitlines() if line.startswith("energy saving"))
    peaks = data["plan"]["peak_inflight_activations"]
    assert (f"peak in-flight {peaks} (1F1B [8, 7, 6, 5, 4, 3, 2, 1]; budget 12,10,9,7,6,4,3,1)"
            in line), line


def test_plan_without_a_budget_is_unlimited_and_prints_its_peaks(capsys):
    assert main(PLAN + ["--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert "max_inflight" not in data["plan"] and data["plan"]["peak_inflight_activations"][0] > 8
    assert main(PLAN + ["--max-inflight", "none", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["plan"] == data["plan"]
    assert main(PLAN) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("energy saving"))
    assert re.search(r"peak in-flight \[\d+(, \d+){7}\] \(1F1B \[8, 7, 6, 5, 4, 3, 2, 1\]\)", line), line


@pytest.mark.parametrize("flag,needle", [
    ("12,10", "12,10 has 2 entries but the pipeline has 8 stages"),
    ("12,10,9,7,3,3,3,1", "stage 4: activation budget (max-inflight) 3 is below the 4"),
    ("auto", "auto derives the budget from memory measured while training"),
    ("8,0,6,5,4,3,2,1", "each budget must be between 1 and"),
])
def test_plan_budget_errors_are_one_line(flag, needle, capsys):
    try:
        code = main(PLAN + ["--max-inflight", flag])
    except SystemExit as exc:  # argparse's own errors
        code = exc.code
    assert code == 2
    err = capsys.readouterr().err
    assert needle in err and len(err.strip().splitlines()) == 1, err


def test_schedule_takes_a_per_stage_budget(capsys):
    assert main(["schedule", "--stages", "4", "-m", "8", "--scheduling", "ours", "--extra-warmup", "4,3,1,0",
                 "--max-inflight", "6,5,3,1"]) == 0
    assert "# peak in-flight activations per stage: [6, 5, 3, 1]" in capsys.readouterr().out
    assert envpipe_schedule(4, 8, (2, 2, 1, 0)).peak_inflight() == (6, 5, 3, 1)


# -- end to end: the tiny GPT on the simulated GPU, memory model for CUDA --------------------------


def test_tiny_gpt_auto_budget_on_the_simulated_gpu(tmp_path):
    pytest.importorskip("torch", reason="needs torch and megatron-core: pip install -e '.[megatron]'")
    pytest.importorskip("megatron.core", reason="needs torch and megatron-core: pip install -e '.[megatron]'")
    out = tmp_path / "run.json"
    log = torchrun(["--nproc-per-node", 4, REPO / "examples" / "train_tiny_gpt.py", "--pipeline-model-parallel-size", 4,
                    "--device", "cpu", "--train-iters", 6, "--cache-dir", tmp_path / "cache", "--losses-out", out,
                    *OURS, "--envpipe-gpu", "simulated:a40/gpt3-175b", "--envpipe-profile-step", 300,
                    "--envpipe-profile-iterations", 1, "--envpipe-profile-cache", tmp_path / "profiles",
                    "--envpipe-sim-memory", "0.75,256"],
                   cwd=REPO, log_dir=tmp_path / "ranks", timeout_s=300, forked=True).log
    # 4 stages x 8 micro-batches; (768 - 512) MiB / 256 MiB = 1 activation more than 1F1B's [4, 3, 2, 1].
    expected = "EnvPipe activation budget per stage [5, 4, 3, 2] (256 MiB per micro-batch, 0.75 GiB free at 1F1B's peak"
    assert expected in log, log[-6000:]
    assert "EnvPipe plan envelope/ours" in log and "activation budget binds" in log
    plan = json.loads(out.read_text())["envpipe_run"]["plan"]
    assert within_budget(plan["peak_inflight_activations"], (5, 4, 3, 2)), plan
