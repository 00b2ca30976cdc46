"""EnvPipe with tensor and data parallelism (CPU, gloo, 4 spawned ranks each).

TP = 2 x PP = 2 and DP = 2 x PP = 2: EnvPipe profiles the simulated A40
(start-up sweep), plans ``envelope``/``ours``/``balanced`` with extended
warm-ups and runs it; the last iteration's losses and every gradient equal
stock Megatron's (run by its own rank processes, where EnvPipe was never
installed) bit for bit, and every rank of the layout, tensor-parallel peers
and data-parallel replicas alike, planned from the same profile (the same
measured floats) and chose the same clock for every unit. Replicas measure
their own wall times, so without the agreement over the data-parallel group
their profiles, and so their plans, would differ. And when only replica 0's
node has the profile cached, every rank plans from it (without agreeing on it,
replica 1 would profile while replica 0 plans, and their collectives hang).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

torch = pytest.importorskip("torch", reason="needs torch and megatron-core: pip install -e '.[megatron]' (install.sh does)")
pytest.importorskip("megatron.core", reason="needs torch and megatron-core: pip install -e '.[megatron]' (install.sh does)")

from megatron_envpipe.config import EnvPipeConfig
from megatron_envpipe.testing import MEGATRON_1F1B, PipelineRun, StageResult, compare_results, run_pipeline
from megatron_envpipe.testing.envpipe_runs import planned_schedule

EXECUTOR = "megatron_envpipe.megatron.executor.envpipe_forward_backward"
P, M = 2, 4
EXTRA_WARMUP = (2, 0)  # stage 0 runs all 4 forwards first: not Megatron's 1F1B order
ITERATIONS = 8  # 1 warm-up + 4 swept clocks (300 MHz apart), then 3 planned (reconfiguring)
LAYOUTS = {"TP2xPP2": (2, 1), "DP2xPP2": (1, 2)}  # name -> (TP, DP)

# Every test runs spawned ranks (test tiers: docs/testing.md).
pytestmark = [pytest.mark.filterwarnings("ignore:(Transformer Engine and )?Apex (is|are) not installed"),
              pytest.mark.dist]


def envpipe_config(profiles: Path) -> EnvPipeConfig:
    return EnvPipeConfig(
        plan_type="envelope", scheduling="ours", reconfig="balanced", extra_warmup=EXTRA_WARMUP,
        gpu="simulated:a40/gpt3-175b", sim_time_scale=0.02, profile_step_mhz=300, profile_iterations=1,
        profile_cache=str(profiles),
    )


@pytest.fixture(scope="module", params=list(LAYOUTS), ids=list(LAYOUTS))
def layout_runs(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    tp, dp = LAYOUTS[request.param]
    tmp = tmp_path_factory.mktemp(request.param)
    (stock,) = run_pipeline(P, [PipelineRun(M)], tensor_parallel_size=tp, data_parallel_size=dp, timeout_s=240)
    record = tmp / "record"
    record.mkdir()
    run = PipelineRun(M, planned_schedule(envpipe_config(tmp / "profiles"), str(record), ITERATIONS))
    (ours,) = run_pipeline(P, [run], tensor_parallel_size=tp, data_parallel_size=dp, timeout_s=240)
    records = [json.loads((record / f"rank{r.rank}.json").read_text()) for r in ours]
    return request.param, stock, ours, records


def test_layout_is_what_was_asked_for(layout_runs) -> None:
    name, stock, ours, _ = layout_runs
    tp, dp = LAYOUTS[name]
    for result in (stock, ours):
        assert len(result) == 4
        assert sorted((r.stage, r.tp_rank, r.dp_rank) for r in result) == sorted(
            (s, t, d) for s in range(P) for t in range(tp) for d in range(dp))


def test_last_iteration_runs_the_plan_with_extended_warmup(layout_runs) -> None:
    _, _, _, records = layout_runs
    for rec in records:
        phases = rec["phases"]
        assert phases[0] == "start-up" and phases[1].startswith("profile"), phases
        assert phases[-1] in ("reconfigure", "steady"), phases
        assert rec["plan"]["extra_warmup"] == list(EXTRA_WARMUP)
        stage0 = [unit for unit, _ in rec["plan"]["stages"][0]]
        assert stage0 == [f"F{i}" for i in range(M)] + [f"B{i}" for i in range(M)]  # not 1F1B


def test_bit_for_bit_with_stock_megatron(layout_runs) -> None:
    name, stock, ours, _ = layout_runs
    _assert_ran(stock, lambda i: i.name == MEGATRON_1F1B and i.is_stock_megatron, "stock Megatron")
    _assert_ran(ours, lambda i: i.name == EXECUTOR and i.envpipe_installed, "EnvPipe's executor")
    assert len(ours[-1].losses) == M and all(g is not None for r in ours for g in r.grads.values())
    problems = compare_results(stock, ours)
    assert not problems, f"{name}: EnvPipe differs from stock Megatron ({len(problems)} tensors): {problems[:5]}"


def test_every_rank_plans_the_same_clocks_from_the_same_profile(layout_runs) -> None:
    """TP peers of a stage and DP replicas: one profile, one plan (clocks of every unit)."""
    name, _, ours, records = layout_runs
    first = records[0]
    assert first["profile"] and first["profile_p2p_power_w"] is not None
    clocks = {f for stage in first["plan"]["stages"] for _, f in stage}
    assert clocks and all(855 <= f <= 1740 for f in clocks)
    for result, rec in zip(ours, records, strict=True):
        where = f"{name} rank {result.rank} (stage {result.stage}, TP {result.tp_rank}, DP {result.dp_rank})"
        assert rec["profile"] == first["profile"], f"{where} profiled other numbers than rank 0"
        assert rec["profile_p2p_power_w"] == first["profile_p2p_power_w"], where
        assert rec["plan"] == first["plan"], f"{where} chose other clocks than rank 0"
        assert rec["phases"] == first["phases"] and rec["planned_at"] == first["planned_at"], where


@pytest.mark.parametrize("layout_runs", ["DP2xPP2"], indirect=True)
def test_data_parallel_replicas_end_with_the_same_grads(layout_runs) -> None:
    _, _, ours, _ = layout_runs
    by_position = {}
    for r in ours:
        by_position.setdefault((r.stage, r.tp_rank), []).append(r)
    for replicas in by_position.values():
        a, b = replicas
        assert not compare_results([StageResult(0, [], a.grads)], [StageResult(0, [], b.grads)])
        if a.losses:  # each replica trained on its own micro-batches
            assert not torch.equal(a.losses[0]["lm loss"], b.losses[0]["lm loss"])


def _assert_ran(result: list[StageResult], check, what: str) -> None:
    for r in result:
        (identity,) = r.schedules
        assert check(identity), f"rank {r.rank} ran {identity}, not {what}"


@pytest.mark.parametrize("layout_runs", ["DP2xPP2"], indirect=True)
def test_replicas_agree_when_only_one_finds_a_cached_profile(layout_runs, tmp_path) -> None:
    """Replica 0's node has the profile cached (the run above stored it), replica 1's has none:
    every rank uses the cached one, instead of replica 1 profiling while replica 0 plans."""
    _, _, first, first_records = layout_runs
    cached = Path(first_records[0]["profile_cache"])
    assert any(cached.rglob("*.csv"))
    record = tmp_path / "record"
    record.mkdir()
    schedule = planned_schedule(envpipe_config(cached), str(record), 3,
                                replica_caches=(str(cached), str(tmp_path / "empty")))
    (ours,) = run_pipeline(P, [PipelineRun(M, schedule)], data_parallel_size=2, timeout_s=120)
    records = [json.loads((record / f"rank{r.rank}.json").read_text()) for r in ours]
    for rec in records:
        # No profiling anywhere: the measured energy baseline (1F1B at f_max), then the plan.
        after = [ph for ph in rec["phases"][1:] if not ph.startswith("baseline ")]
        assert not any(ph.startswith("profile") for ph in rec["phases"]), rec["phases"]
        assert after and after[0] in ("reconfigure", "steady"), rec["phases"]
        assert rec["profile"] == first_records[0]["profile"] and rec["plan"] == records[0]["plan"]
    assert not compare_results(first, ours)  # and the same math
