"""EnvPipe's executor on Megatron's interleaved pipeline (model chunks), against stock Megatron.

Same math as tests/megatron/test_executor.py, for virtual pipelines: the
reference is stock Megatron-core's ``forward_backward_pipelining_with_interleaving``,
run by its own rank processes where ``install()`` is never called; every
result names the schedule function that ran on each rank. For P in {2, 4},
V = 2, M in {P, 2P, 4P}, EnvPipe's executor (``--envpipe-scheduling
interleaved``) gives the same losses and every gradient of every chunk bit for
bit, each rank ran exactly its planned instruction program, and its units ran
in Megatron's interleaved order (written out here independently of the package).
``install()`` routes ``get_forward_backward_func()`` to the executor for
virtual pipelines only with that scheduling; with another one Megatron's
interleaved schedule runs, logged once.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pytest

torch = pytest.importorskip("torch", reason="needs torch and megatron-core: pip install -e '.[megatron]' (install.sh does)")
pytest.importorskip("megatron.core", reason="needs torch and megatron-core: pip install -e '.[megatron]' (install.sh does)")

from megatron_envpipe.config import EnvPipeConfig
from megatron_envpipe.testing.envpipe_runs import envpipe_schedule
from megatron_envpipe.testing.harness import (
    MEGATRON_INTERLEAVED,
    PipelineRun,
    StageResult,
    compare_results,
    megatron_interleaved,
    run_pipeline,
)
from megatron_envpipe.testing.tiny_gpt import TinyGPTSpec

EXECUTOR = "megatron_envpipe.megatron.executor.envpipe_interleaved_forward_backward"
V = 2
FACTORS = (1, 2, 4)  # M = factor x P

pytestmark = pytest.mark.filterwarnings("ignore:(Transformer Engine and )?Apex (is|are) not installed")


def megatron_interleaved_order(p: int, m: int, v: int, stage: int) -> list[str]:
    """Megatron-core's interleaved unit order on ``stage`` (group size N = P), written out here.

    Forward k runs (micro-batch, chunk) ``table[k]``; backward k the same micro-batch on chunk
    ``v - 1 - table[k].chunk``; ``2 (P - s - 1) + (V - 1) N`` warm-up forwards, then pairs.
    """
    n = p
    table = []
    for low in range(0, m, n):
        high = m if low + n >= m else low + n
        table += [(mb, c) for c in range(v) for mb in range(low, high)]

    def name(kind: str, mb: int, chunk: int) -> str:
        return f"{kind}{mb}" + (f"v{chunk}" if chunk else "")

    total = m * v
    warmup = min(total, 2 * (p - stage - 1) + (v - 1) * n)
    order = [name("F", *table[k]) for k in range(warmup)]
    for k in range(total - warmup):
        order.append(name("F", *table[k + warmup]))
        order.append(name("B", table[k][0], v - 1 - table[k][1]))
    order += [name("B", table[k][0], v - 1 - table[k][1]) for k in range(total - warmup, total)]
    return order


def compute_order(executed: list[str]) -> list[str]:
    """F/B units of an executed instruction list: ``Forward(3)`` -> ``F3``, ``Backward(2,1)`` -> ``B2v1``."""
    units = []
    for instr in executed:
        for kind in ("Forward", "Backward"):
            if instr.startswith(f"{kind}("):
                mb, _, chunk = instr[len(kind) + 1:-1].partition(",")
                units.append(f"{kind[0]}{mb}" + (f"v{chunk}" if chunk and chunk != "0" else ""))
    return units


def records(record_dir: Path, rank: int) -> dict:
    (path,) = record_dir.glob(f"rank{rank}-*.json")
    return json.loads(path.read_text())


@dataclass(frozen=True)
class Runs:
    p: int
    stock: dict[int, list[StageResult]]
    envpipe: dict[int, list[StageResult]]
    record_dirs: dict[int, Path]


def spec_for(p: int) -> TinyGPTSpec:
    """P = 2 as Megatron-LM allows it: with overlap_p2p_comm (its batched exchanges would pair an
    activation and a gradient between the same two ranks and swap them), and without pseudo-freeing
    outputs (0.16's overlapped sends read them after they were freed)."""
    if p == 2:
        return TinyGPTSpec(overlap_p2p_comm=True, deallocate_pipeline_outputs=False)
    return TinyGPTSpec()


def _runs(p: int, tmp: Path) -> Runs:
    ms = [f * p for f in FACTORS]
    # The reference first, in ranks of its own that never install EnvPipe.
    stock = run_pipeline(p, [PipelineRun(m, megatron_interleaved) for m in ms], virtual_pipeline_size=V,
                         spec=spec_for(p), timeout_s=300)
    cfg = EnvPipeConfig(scheduling="interleaved")
    runs, dirs = [], {}
    for m in ms:
        dirs[m] = tmp / f"interleaved-{m}"
        dirs[m].mkdir()
        runs.append(PipelineRun(m, envpipe_schedule(cfg, str(dirs[m]))))
    ours = run_pipeline(p, runs, virtual_pipeline_size=V, spec=spec_for(p), timeout_s=300)
    return Runs(p, dict(zip(ms, stock, strict=True)), dict(zip(ms, ours, strict=True)), dirs)


@pytest.fixture(scope="module")
def runs_p2(tmp_path_factory: pytest.TempPathFactory) -> Runs:
    return _runs(2, tmp_path_factory.mktemp("interleaved-p2"))


@pytest.fixture(scope="module")
def runs_p4(tmp_path_factory: pytest.TempPathFactory) -> Runs:
    return _runs(4, tmp_path_factory.mktemp("interleaved-p4"))


@pytest.fixture(params=[2, 4], ids=lambda p: f"P{p}")
def runs(request: pytest.FixtureRequest) -> Runs:
    return request.getfixturevalue(f"runs_p{request.param}")


def test_reference_order_matches_megatrons_own_table() -> None:
    """The independent order above agrees with Megatron's own table and warm-up counts."""
    from megatron.core.pipeline_parallel.schedules import get_schedule_table

    for p, m in ((2, 4), (4, 8), (4, 12)):
        table = get_schedule_table(m, V, p)
        order = megatron_interleaved_order(p, m, V, 0)
        forwards = [u for u in order if u.startswith("F")]
        assert forwards == [f"F{mb}" + (f"v{c}" if c else "") for mb, c in table]


@pytest.mark.parametrize("factor", FACTORS, ids=lambda f: f"M={f}P")
def test_bit_for_bit_with_stock_interleaved_megatron(runs: Runs, factor: int) -> None:
    p, m = runs.p, factor * runs.p
    stock, ours = runs.stock[m], runs.envpipe[m]
    for stage in stock:
        (identity,) = stage.schedules
        assert identity.name == MEGATRON_INTERLEAVED and identity.is_stock_megatron, f"rank {stage.rank}: {identity}"
        # Not vacuous: a gradient for every parameter of every chunk.
        assert {name.split(".", 1)[0] for name in stage.grads} == {f"chunk{v}" for v in range(V)}
        assert all(g is not None for g in stage.grads.values()), f"rank {stage.rank}"
    assert len(stock[-1].losses) == m
    for stage in ours:
        (identity,) = stage.schedules
        assert identity.name == EXECUTOR and identity.envpipe_installed, f"rank {stage.rank}: {identity}"
    problems = compare_results(stock, ours)
    assert not problems, f"EnvPipe interleaved P={p} M={m} differs from stock ({len(problems)}): {problems[:5]}"


@pytest.mark.parametrize("factor", FACTORS, ids=lambda f: f"M={f}P")
def test_executor_runs_its_program_in_megatrons_interleaved_order(runs: Runs, factor: int) -> None:
    p, m = runs.p, factor * runs.p
    for rank in range(p):
        r = records(runs.record_dirs[m], rank)
        assert r["executed"] == r["planned"], f"M={m} rank {rank} did not follow its program"
        assert compute_order(r["executed"]) == megatron_interleaved_order(p, m, V, rank)
        if rank == 0:  # rank 0 receives chunk 1's input from rank P-1 (the wrap-around)
            assert "RecvActivationFinish(0,1)" in r["executed"]
            assert "SendGradStart(0,1)" in r["executed"]


def test_what_it_does_not_run_falls_back_to_stock_interleaved(tmp_path: Path) -> None:
    """Another scheduling than interleaved, or a forward-only (evaluation) call: Megatron's own schedule runs."""
    other, evaluation = tmp_path / "other", tmp_path / "forward-only"
    other.mkdir()
    evaluation.mkdir()
    stock = run_pipeline(2, [PipelineRun(4, megatron_interleaved), PipelineRun(4, megatron_interleaved,
                                                                                forward_only=True)],
                         virtual_pipeline_size=V, spec=spec_for(2), timeout_s=240)
    ours = run_pipeline(2, [PipelineRun(4, envpipe_schedule(EnvPipeConfig(), str(other))),
                            PipelineRun(4, envpipe_schedule(EnvPipeConfig(scheduling="interleaved"), str(evaluation)),
                                        forward_only=True)],
                        virtual_pipeline_size=V, spec=spec_for(2), timeout_s=240)
    for want, got, rec in zip(stock, ours, (other, evaluation), strict=True):
        assert not compare_results(want, got)
        assert records(rec, 0)["executed"] == []  # Megatron's schedule ran, not a program
    assert len(ours[1][-1].losses) == 4 and all(g is None for g in ours[1][0].grads.values())  # no backward


def test_install_routes_interleaved_only_with_interleaved_scheduling() -> None:
    from megatron.core.pipeline_parallel import get_forward_backward_func, schedules

    from megatron_envpipe.megatron.executor import envpipe_interleaved_forward_backward
    from megatron_envpipe.megatron.patch import install, uninstall

    stock = schedules.forward_backward_pipelining_with_interleaving
    try:
        install(EnvPipeConfig(scheduling="interleaved"))
        assert get_forward_backward_func(pp_size=2, vp_size=2) is envpipe_interleaved_forward_backward
        install(EnvPipeConfig())  # re-configured: another scheduling
        routed = get_forward_backward_func(pp_size=2, vp_size=2)
        assert routed is not envpipe_interleaved_forward_backward and routed.__wrapped__ is stock
    finally:
        uninstall()
    assert schedules.forward_backward_pipelining_with_interleaving is stock


@pytest.mark.parametrize("chunks", [2, 3], ids=lambda v: f"V{v}")
def test_grad_and_param_sync_per_chunk_as_megatron_calls_them(tmp_path: Path, chunks: int) -> None:
    """no_sync, grad_sync_func and param_sync_func per chunk: the same calls at the same points as stock.

    Recorded in each rank with the forwards around them (testing/sync_events.py): the stock
    schedule's sequence, with grad/param sync hooks set, must be EnvPipe's too. V = 3 also
    launches a parameter sync in the middle of the iteration (chunks 0 and 1 sync up front).
    """
    p, m = 4, 8
    spec = TinyGPTSpec(layers_per_stage=chunks)
    stock = run_pipeline(p, [PipelineRun(m, megatron_interleaved, record_sync=True)], virtual_pipeline_size=chunks,
                         spec=spec, timeout_s=240)[0]
    rec = tmp_path / "rec"
    rec.mkdir()
    ours = run_pipeline(p, [PipelineRun(m, envpipe_schedule(EnvPipeConfig(scheduling="interleaved"), str(rec)),
                                        record_sync=True)], virtual_pipeline_size=chunks, spec=spec,
                        timeout_s=240)[0]
    assert records(rec, 0)["executed"], "EnvPipe's executor did not run"
    for want, got in zip(stock, ours, strict=True):
        kinds = {e[0] for e in want.events}
        # Not vacuous: every hook fired, for both chunks.
        assert kinds == {"forward", "no_sync", "sync", "grad_sync", "param_sync"}, (want.rank, kinds)
        assert {e[1] for e in want.events if e[0] == "grad_sync"} == set(range(chunks))
        assert {e[1] for e in want.events if e[0] == "param_sync"} == set(range(chunks))
        assert got.events == want.events, f"rank {want.rank}: {got.events} != {want.events}"
    assert not compare_results(stock, ours)


@pytest.mark.parametrize("stages", [2, 3, 4])
@pytest.mark.parametrize("eager", [False, True], ids=["lazy", "split"])
def test_wrap_around_channels_get_groups_of_their_own(stages: int, eager: bool) -> None:
    """Rank P-1 -> rank 0 activations and the gradients back: a group shared by exactly those two ends,
    never the neighbour channel's (at P = 2 the same pair), with one group name on both ends."""
    import importlib.util
    import sys

    from megatron_envpipe.core.communicators import _wrap_channels
    from megatron_envpipe.megatron import channels

    bench = Path(__file__).resolve().parents[2] / "bench" / "comm_groups.py"
    spec = importlib.util.spec_from_file_location("envpipe_bench_comm_groups", bench)
    fake = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = fake
    spec.loader.exec_module(fake)
    world = fake.FakeWorld(fake.megatron_layout(stages, 2), extra_groups=fake.megatron_extra_groups(stages, 2),
                           eager=eager)
    made = world.run(lambda api: channels._create_channel_groups(api.world.pp[api.rank], api, wrap=True))
    for ranks in world.pipelines:
        for snd, rcv, kind in _wrap_channels(stages):
            ends = [made[ranks[x]].wrap[kind] for x in (snd, rcv)]
            assert ends[0].group_name == ends[1].group_name
            # Split: a group of the pair; lazy: a world-sized group of its own (two pipelines).
            assert sorted(ends[0].ranks) == sorted([ranks[snd], ranks[rcv]]) or (not eager
                                                                                and ends[0].size() == 2 * stages)
            neighbour = (made[ranks[0]].act if kind == "act" else made[ranks[0]].grad).get(0)
            assert neighbour is None or neighbour.group_name != ends[0].group_name
    assert fake.tally(world, lambda pp, api: channels._create_channel_groups(pp, api, wrap=True)).name_mismatches == 0
