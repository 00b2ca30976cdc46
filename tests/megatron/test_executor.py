"""EnvPipe's executor inside real Megatron-core training (CPU, gloo, spawned ranks).

Same math, tested so that EnvPipe cannot be compared with itself: the
reference is stock Megatron-core run by its own set of rank processes, where
``install()`` is never called, and every result names the schedule function
that ran on each rank (``StageResult.schedules``): the reference must be
Megatron's own ``forward_backward_pipelining_without_interleaving`` with
EnvPipe not installed, the other side EnvPipe's executor running its program.
For P in {2, 4}, M in {P, 2P, 4P}, EnvPipe in 1F1B order and in its own order
with extended warm-ups (from M = 2P on, a different order than 1F1B), losses
and every parameter gradient equal stock Megatron's bit for bit. Also: each
stage ran exactly its planned instruction program; held activations are
freed (live tensors stay bounded); a stuck transfer fails with a clear error.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pytest

torch = pytest.importorskip("torch", reason="needs torch and megatron-core: pip install -e '.[megatron]' (install.sh does)")
pytest.importorskip("megatron.core", reason="needs torch and megatron-core: pip install -e '.[megatron]' (install.sh does)")

from megatron_envpipe.config import EnvPipeConfig
from megatron_envpipe.testing import MEGATRON_1F1B, PipelineRun, StageResult, compare_results, run_pipeline
from megatron_envpipe.testing.envpipe_runs import envpipe_schedule

EXECUTOR = "megatron_envpipe.megatron.executor.envpipe_forward_backward"
FACTORS = (1, 2, 4)  # M = factor x P
SCHEDULINGS = ("1f1b", "ours")
FORWARD_ONLY_M = 4  # the evaluation step, at P = 2

# Expected on a CPU-only machine: Megatron falls back to plain torch modules.
pytestmark = pytest.mark.filterwarnings("ignore:(Transformer Engine and )?Apex (is|are) not installed")


def write_profile(path: Path, stages: int) -> str:
    """A synthetic 3-clock profile whose slack makes EnvPipe extend warm-ups."""
    rows = ["stage,instruction,frequency,time,energy"]
    for s in range(stages):
        for f, slow, power in ((1500, 1.0, 300.0), (1200, 1.15, 200.0), (900, 1.45, 150.0)):
            rows.append(f"{s},forward,{f},{0.010 * slow},{0.010 * slow * power}")
            rows.append(f"{s},backward,{f},{0.020 * slow},{0.020 * slow * power}")
    path.write_text("\n".join(rows) + "\n")
    return str(path)


def records(record_dir: Path, rank: int) -> dict:
    """What ``rank`` recorded in its one EnvPipe call into ``record_dir``."""
    (path,) = record_dir.glob(f"rank{rank}-*.json")
    return json.loads(path.read_text())


def extra_warmup(p: int, m: int) -> tuple[int, ...]:
    """EnvPipe's r_s per stage, chosen so that clamp_extra_warmup keeps them as given.

    M = P leaves no room (r = 0: the 1F1B order); M = 2P: every stage but the
    last runs all its forwards first (P = 4, M = 8: [4, 4, 4, 0]); M = 4P:
    graded (P = 4, M = 16: [12, 8, 4, 0]).
    """
    if m == 2 * p:
        return (m - p,) * (p - 1) + (0,)
    return tuple((m - p) * (p - 1 - s) // (p - 1) for s in range(p))


def one_f_one_b_order(p: int, m: int, stage: int) -> list[str]:
    """Megatron's 1F1B unit order for ``stage``, written out independently of the package."""
    warmup = min(p - stage - 1, m)
    order = [f"F{i}" for i in range(warmup)]
    for i in range(m - warmup):
        order += [f"F{warmup + i}", f"B{i}"]
    return order + [f"B{i}" for i in range(m - warmup, m)]


def compute_order(executed: list[str]) -> list[str]:
    """F/B units, in order, of an executed instruction list (``Forward(3)`` -> ``F3``)."""
    units = []
    for instr in executed:
        for kind in ("Forward", "Backward"):
            if instr.startswith(f"{kind}("):
                units.append(f"{kind[0]}{instr[len(kind) + 1:-1]}")
    return units


@dataclass(frozen=True)
class SameMathRuns:
    p: int
    stock: dict[int, list[StageResult]]  # M -> stock Megatron, in ranks where EnvPipe was never installed
    envpipe: dict[tuple[str, int], list[StageResult]]  # (scheduling, M) -> EnvPipe's executor
    record_dirs: dict[tuple[str, int], Path]
    stock_forward_only: list[StageResult] | None = None  # P = 2 only
    envpipe_forward_only: list[StageResult] | None = None
    forward_only_dir: Path | None = None


def _same_math_runs(p: int, tmp: Path) -> SameMathRuns:
    ms = [factor * p for factor in FACTORS]
    # The reference first, in its own run_pipeline call: its ranks are fresh processes
    # (forked from a forkserver that only imported torch and megatron) and never install EnvPipe.
    stock_runs = [PipelineRun(m) for m in ms]
    if p == 2:
        stock_runs.append(PipelineRun(FORWARD_ONLY_M, forward_only=True))
    stock = run_pipeline(p, stock_runs, timeout_s=240)

    profile = write_profile(tmp / "profile.csv", p)
    runs, keys = [], []
    for scheduling in SCHEDULINGS:
        for m in ms:
            if scheduling == "1f1b":
                cfg = EnvPipeConfig()  # baseline / 1f1b / default
            else:
                cfg = EnvPipeConfig(plan_type="envelope", scheduling="ours", reconfig="balanced", profile=profile,
                                    extra_warmup=extra_warmup(p, m))
            rec = tmp / f"{scheduling}-{m}"
            rec.mkdir()
            runs.append(PipelineRun(m, envpipe_schedule(cfg, str(rec))))
            keys.append((scheduling, m))
    forward_only_dir = None
    if p == 2:
        forward_only_dir = tmp / "forward-only"
        forward_only_dir.mkdir()
        cfg = EnvPipeConfig(plan_type="envelope", scheduling="ours", profile=profile)
        runs.append(PipelineRun(FORWARD_ONLY_M, envpipe_schedule(cfg, str(forward_only_dir)), forward_only=True))
    results = run_pipeline(p, runs, timeout_s=240)
    return SameMathRuns(
        p=p,
        stock=dict(zip(ms, stock, strict=False)),
        envpipe=dict(zip(keys, results, strict=False)),
        record_dirs={key: tmp / f"{key[0]}-{key[1]}" for key in keys},
        stock_forward_only=stock[-1] if p == 2 else None,
        envpipe_forward_only=results[-1] if p == 2 else None,
        forward_only_dir=forward_only_dir,
    )


@pytest.fixture(scope="module")
def same_math_p2(tmp_path_factory: pytest.TempPathFactory) -> SameMathRuns:
    return _same_math_runs(2, tmp_path_factory.mktemp("same-math-p2"))


@pytest.fixture(scope="module")
def same_math_p4(tmp_path_factory: pytest.TempPathFactory) -> SameMathRuns:
    return _same_math_runs(4, tmp_path_factory.mktemp("same-math-p4"))


@pytest.fixture(params=[2, 4], ids=lambda p: f"P{p}")
def same_math(request: pytest.FixtureRequest) -> SameMathRuns:
    return request.getfixturevalue(f"same_math_p{request.param}")


def _assert_stock(result: list[StageResult], what: str) -> None:
    for stage in result:
        (identity,) = stage.schedules
        assert identity.name == MEGATRON_1F1B and identity.is_stock_megatron, \
            f"{what}: rank {stage.rank} ran {identity}, not stock Megatron"


def _assert_envpipe(result: list[StageResult], what: str) -> None:
    for stage in result:
        (identity,) = stage.schedules
        assert identity.name == EXECUTOR and identity.envpipe_installed, \
            f"{what}: rank {stage.rank} ran {identity}, not EnvPipe's executor"


def test_reference_is_stock_megatron_where_envpipe_was_never_installed(same_math: SameMathRuns) -> None:
    p = same_math.p
    for m, result in same_math.stock.items():
        _assert_stock(result, f"stock P={p} M={m}")
        # Not vacuous: M loss reports and a gradient for every parameter of every stage.
        assert len(result[-1].losses) == m
        for stage in result:
            assert stage.grads and all(g is not None for g in stage.grads.values()), f"rank {stage.rank}"


@pytest.mark.parametrize("factor", FACTORS, ids=lambda f: f"M={f}P")
@pytest.mark.parametrize("scheduling", SCHEDULINGS)
def test_envpipe_runs_its_executor_and_its_programs(same_math: SameMathRuns, scheduling: str, factor: int) -> None:
    p, m = same_math.p, factor * same_math.p
    _assert_envpipe(same_math.envpipe[scheduling, m], f"{scheduling} P={p} M={m}")
    rec = same_math.record_dirs[scheduling, m]
    orders = []
    for rank in range(p):
        r = records(rec, rank)
        assert r["executed"] == r["planned"], f"{scheduling} M={m} rank {rank} did not follow its program"
        orders.append(compute_order(r["executed"]))
        assert sorted(orders[-1]) == sorted([f"F{i}" for i in range(m)] + [f"B{i}" for i in range(m)])
    if scheduling == "1f1b":
        assert orders == [one_f_one_b_order(p, m, s) for s in range(p)]
        return
    r = extra_warmup(p, m)
    assert records(rec, 0)["extra_warmup"] == list(r)  # the plan kept the requested warm-ups
    for s in range(p):  # stage s runs its 1F1B warm-up, r_s more forwards, then 1F1B
        assert orders[s].index("B0") == min(m, p - s + r[s]), f"stage {s}: {orders[s]}"
    if m > p:  # really another order than Megatron's
        assert orders[0] == [f"F{i}" for i in range(m)] + [f"B{i}" for i in range(m)]
        assert orders != [one_f_one_b_order(p, m, s) for s in range(p)]


@pytest.mark.parametrize("factor", FACTORS, ids=lambda f: f"M={f}P")
@pytest.mark.parametrize("scheduling", SCHEDULINGS)
def test_bit_for_bit_with_stock_megatron(same_math: SameMathRuns, scheduling: str, factor: int) -> None:
    p, m = same_math.p, factor * same_math.p
    stock, ours = same_math.stock[m], same_math.envpipe[scheduling, m]
    _assert_stock(stock, f"stock P={p} M={m}")
    _assert_envpipe(ours, f"{scheduling} P={p} M={m}")
    problems = compare_results(stock, ours)
    assert not problems, (f"EnvPipe {scheduling} P={p} M={m} differs from stock Megatron "
                          f"({len(problems)} tensors): {problems[:5]}")


def test_held_activations_are_freed_over_6_iterations(tmp_path):
    p, m = 4, 8
    profile = write_profile(tmp_path / "profile.csv", p)
    cfg = EnvPipeConfig(plan_type="envelope", scheduling="ours", reconfig="balanced", profile=profile,
                        extra_warmup=(8, 8, 8, 0))
    rec = tmp_path / "rec"
    rec.mkdir()
    run_pipeline(p, [PipelineRun(m, envpipe_schedule(cfg, str(rec), repeat=6))], timeout_s=240)
    for rank in range(p):
        r = records(rec, rank)
        assert r["extra_warmup"] == [4, 4, 4, 0]  # stage 0 holds all 8 activations
        live = r["live_tensors"]
        assert len(live) == 6
        # Same model, 6 iterations: the count of live tensors stays bounded. Leaking the held
        # activations would add >= M=8 tensors per iteration (>= 40 by the end, where 20 iterations
        # gave >= 150: either is far past the tolerance); a few transient ones (a collective's
        # buffers in flight) are tolerated.
        assert max(live[1:]) - live[1] <= 6, f"rank {rank} leaks tensors: {live}"


def test_stuck_transfer_raises_naming_stage_instruction_and_peer():
    cfg = EnvPipeConfig(comm_timeout_s=2.0)
    # One healthy iteration, then stage 1 hangs: stage 0 must fail with a clear error, not hang.
    runs = [PipelineRun(2, envpipe_schedule(cfg)), PipelineRun(2, envpipe_schedule(cfg, stall_rank=1))]
    with pytest.raises(Exception) as info:
        run_pipeline(2, runs, timeout_s=120)
    text = str(info.value)
    assert "CommTimeoutError" in text and "EnvPipe stage 0" in text
    assert "RecvGradFinish(0) with peer rank 1 did not complete within 2 s" in text
    assert "--envpipe-comm-timeout" in text


def test_forward_only_falls_back_to_megatron_and_matches(same_math_p2: SameMathRuns) -> None:
    stock, ours = same_math_p2.stock_forward_only, same_math_p2.envpipe_forward_only
    assert stock is not None and ours is not None and same_math_p2.forward_only_dir is not None
    _assert_stock(stock, "stock forward-only")
    _assert_envpipe(ours, "EnvPipe forward-only")
    assert not compare_results(stock, ours)
    assert len(ours[1].losses) == FORWARD_ONLY_M and all(g is None for g in ours[0].grads.values())  # no backward
    assert records(same_math_p2.forward_only_dir, 0)["executed"] == []  # Megatron's schedule ran, not the program


def test_grad_sync_calls_as_megatrons_1f1b(tmp_path):
    """no_sync and grad_sync_func around the units: the same calls at the same points as stock 1F1B."""
    p, m = 4, 8
    stock = run_pipeline(p, [PipelineRun(m, record_sync=True)], timeout_s=240)[0]
    ours = run_pipeline(p, [PipelineRun(m, envpipe_schedule(EnvPipeConfig(), str(tmp_path)), record_sync=True)],
                        timeout_s=240)[0]
    for want, got in zip(stock, ours, strict=True):
        assert want.schedules[0].name == MEGATRON_1F1B and got.schedules[0].name == EXECUTOR
        # Not vacuous: stage 0 syncs inside its last backward, the others launch grad_sync_func after it.
        expected = {"forward", "no_sync", "sync"} | ({"grad_sync"} if want.rank else set())
        assert {e[0] for e in want.events} == expected, want.events
        assert got.events == want.events, f"rank {want.rank}: {got.events} != {want.events}"
