"""EnvPipe's executor with Megatron's ``variable_seq_lengths`` (micro-batches of different lengths), against stock.

The tiny GPT draws each micro-batch's length from [4, 16] (``TinyGPTSpec.min_seq_length``),
so one iteration's messages differ in size and a receiver learns each size from a shape
message. The reference is stock Megatron-core (its own shape handshake), run by rank
processes of its own where ``install()`` is never called; every result names the
schedule function that ran on each rank. For 1F1B, EnvPipe's order (extended warm-ups)
and the interleaved order (V = 2), P = 4, M = 8: losses and every gradient equal stock
bit for bit, and each rank ran exactly its program with shape messages. What still goes
to Megatron's schedule (``mtp_standalone``) says so. The early posting of data receives
(as soon as a shape is in: NCCL reports completions, gloo does not before ``wait``) is
checked on EnvPipe's own bookkeeping with the transport replaced.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch", reason="needs torch and megatron-core: pip install -e '.[megatron]' (install.sh does)")
pytest.importorskip("megatron.core", reason="needs torch and megatron-core: pip install -e '.[megatron]' (install.sh does)")

from megatron_envpipe.config import EnvPipeConfig, TransportSettings
from megatron_envpipe.testing.envpipe_runs import envpipe_schedule
from megatron_envpipe.testing.harness import (
    MEGATRON_1F1B,
    MEGATRON_INTERLEAVED,
    PipelineRun,
    StageResult,
    compare_results,
    megatron_1f1b,
    megatron_interleaved,
    run_pipeline,
)
from megatron_envpipe.testing.tiny_gpt import TinyGPTSpec, synthetic_batches

P, M, V = 4, 8, 2
SPEC = TinyGPTSpec(min_seq_length=4)  # lengths 4..16 tokens per micro-batch
EXTRA_WARMUP = (4, 4, 4, 0)  # EnvPipe's order: stages 0-2 run all their forwards first (not 1F1B)
EXECUTORS = {"1f1b": "megatron_envpipe.megatron.executor.envpipe_forward_backward",
             "ours": "megatron_envpipe.megatron.executor.envpipe_forward_backward",
             "interleaved": "megatron_envpipe.megatron.executor.envpipe_interleaved_forward_backward"}
STOCK = {"1f1b": MEGATRON_1F1B, "ours": MEGATRON_1F1B, "interleaved": MEGATRON_INTERLEAVED}

pytestmark = pytest.mark.filterwarnings("ignore:(Transformer Engine and )?Apex (is|are) not installed")


def write_profile(path: Path) -> str:
    """A 3-clock profile with slack, so that EnvPipe keeps the requested warm-ups."""
    rows = ["stage,instruction,frequency,time,energy"]
    for s in range(P):
        for f, slow, power in ((1500, 1.0, 300.0), (1200, 1.15, 200.0), (900, 1.45, 150.0)):
            rows.append(f"{s},forward,{f},{0.010 * slow},{0.010 * slow * power}")
            rows.append(f"{s},backward,{f},{0.020 * slow},{0.020 * slow * power}")
    path.write_text("\n".join(rows) + "\n")
    return str(path)


@dataclass(frozen=True)
class Runs:
    stock: dict[str, list[StageResult]]
    envpipe: dict[str, list[StageResult]]
    record_dirs: dict[str, Path]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Runs:
    tmp = tmp_path_factory.mktemp("variable-lengths")
    # References first, in ranks of their own that never install EnvPipe.
    stock_1f1b = run_pipeline(P, [PipelineRun(M, megatron_1f1b)], spec=SPEC, timeout_s=240)[0]
    stock_interleaved = run_pipeline(P, [PipelineRun(M, megatron_interleaved)], spec=SPEC, virtual_pipeline_size=V,
                                     timeout_s=240)[0]
    dirs = {name: tmp / name for name in EXECUTORS}
    for d in dirs.values():
        d.mkdir()
    ours_cfg = EnvPipeConfig(plan_type="envelope", scheduling="ours", reconfig="balanced",
                             profile=write_profile(tmp / "profile.csv"), extra_warmup=EXTRA_WARMUP)
    one, ours = run_pipeline(P, [PipelineRun(M, envpipe_schedule(EnvPipeConfig(), str(dirs["1f1b"]))),
                                 PipelineRun(M, envpipe_schedule(ours_cfg, str(dirs["ours"])))],
                             spec=SPEC, timeout_s=240)
    (interleaved,) = run_pipeline(P, [PipelineRun(M, envpipe_schedule(EnvPipeConfig(scheduling="interleaved"),
                                                                      str(dirs["interleaved"])))],
                                  spec=SPEC, virtual_pipeline_size=V, timeout_s=240)
    return Runs({"1f1b": stock_1f1b, "ours": stock_1f1b, "interleaved": stock_interleaved},
                {"1f1b": one, "ours": ours, "interleaved": interleaved}, dirs)


def records(record_dir: Path, rank: int) -> dict:
    (path,) = record_dir.glob(f"rank{rank}-*.json")
    return json.loads(path.read_text())


def test_the_micro_batches_differ_in_length() -> None:
    lengths = [batch["tokens"].shape[1] for batch in synthetic_batches(SPEC, M)]
    assert len(set(lengths)) >= 4 and max(lengths) <= SPEC.seq_length, lengths
    # Every stage reads the same lengths: attention masks and positions are built per micro-batch.
    again = [(b["attention_mask"].shape[-1], b["position_ids"].shape[1]) for b in synthetic_batches(SPEC, M)]
    assert again == [(n, n) for n in lengths]


@pytest.mark.parametrize("scheduling", list(EXECUTORS))
def test_bit_for_bit_with_stock_megatron_variable_lengths(runs: Runs, scheduling: str) -> None:
    stock, ours = runs.stock[scheduling], runs.envpipe[scheduling]
    for stage in stock:
        (identity,) = stage.schedules
        assert identity.name == STOCK[scheduling] and identity.is_stock_megatron, f"rank {stage.rank}: {identity}"
        assert stage.grads and all(g is not None for g in stage.grads.values()), f"rank {stage.rank}"
    assert len(stock[-1].losses) == M
    for stage in ours:
        (identity,) = stage.schedules
        assert identity.name == EXECUTORS[scheduling] and identity.envpipe_installed, f"rank {stage.rank}: {identity}"
    problems = compare_results(stock, ours)
    assert not problems, f"EnvPipe {scheduling} with variable lengths differs from stock ({len(problems)}): {problems[:5]}"


@pytest.mark.parametrize("scheduling", list(EXECUTORS))
def test_each_rank_ran_its_program_with_shape_messages(runs: Runs, scheduling: str) -> None:
    for rank in range(P):
        r = records(runs.record_dirs[scheduling], rank)
        assert r["executed"] == r["planned"], f"{scheduling} rank {rank} did not follow its program"
        executed = r["executed"]
        # Not vacuous: the executor ran, with a shape receive and wait before each data receive.
        data_recvs = sum(i.startswith(("RecvActivationFinish(", "RecvGradFinish(")) for i in executed)
        shape_waits = sum(i.startswith(("RecvActivationShapeFinish(", "RecvGradShapeFinish(")) for i in executed)
        assert data_recvs == shape_waits > 0, (scheduling, rank)
        sends = sum(i.startswith(("SendActivationStart(", "SendGradStart(")) for i in executed)
        assert sends == sum(i.startswith(("SendActivationShapeStart(", "SendGradShapeStart(")) for i in executed)
    if scheduling == "ours":
        assert records(runs.record_dirs["ours"], 0)["extra_warmup"] == list(EXTRA_WARMUP)


def _config(**fields: object) -> SimpleNamespace:
    base = dict(overlap_p2p_comm=False, variable_seq_lengths=False, mtp_standalone=False,
                num_microbatches_with_partial_activation_checkpoints=None)
    return SimpleNamespace(**{**base, **fields})


def test_variable_lengths_run_and_mtp_standalone_still_falls_back() -> None:
    from megatron.core.enums import ModelType

    from megatron_envpipe.megatron.support import unsupported_reason

    model = SimpleNamespace(model_type=ModelType.encoder_or_decoder)
    assert unsupported_reason(model, _config(variable_seq_lengths=True), {}) is None
    reason = unsupported_reason(model, _config(variable_seq_lengths=True, mtp_standalone=True), {})
    assert reason is not None and "mtp_standalone" in reason
    reason = unsupported_reason(model, _config(variable_seq_lengths=True), {"adjust_tensor_shapes_fn": print})
    assert reason is not None and "adjust_tensor_shapes_fn" in reason


class _Work:
    """A transfer whose completion the test decides (gloo reports none before wait(); NCCL does)."""

    def __init__(self, tensor: torch.Tensor, log: list) -> None:
        self.tensor, self.done = tensor, False
        self.log = log

    def is_completed(self) -> bool:
        return self.done

    def wait(self, timeout: object = None) -> bool:
        self.log.append(("wait", tuple(self.tensor.shape)))
        return True


class _Dist:
    """The calls P2PTransfers makes on torch.distributed, recorded; shape receives filled by the test."""

    def __init__(self) -> None:
        self.log: list = []
        self.works: list[_Work] = []

    def irecv(self, tensor: torch.Tensor, src: int, group: object) -> _Work:
        self.log.append(("irecv", group, tuple(tensor.shape)))
        self.works.append(_Work(tensor, self.log))
        return self.works[-1]

    def isend(self, tensor: torch.Tensor, dst: int, group: object) -> _Work:
        self.log.append(("isend", group, tensor.tolist() if group in ("act_shape", "grad_shape") else tuple(tensor.shape)))
        return _Work(tensor, self.log)

    def get_rank(self) -> int:
        return 1


class _Channels:
    ranks = (0, 1)

    def warm_up(self, device: object, timeout: object) -> None:
        pass

    def group(self, channel: tuple) -> str:
        return channel[2]


def test_data_receives_are_posted_once_their_shape_is_in_in_channel_order(monkeypatch: pytest.MonkeyPatch) -> None:
    """Our bookkeeping, with the transport replaced: a data receive is allocated with the size its shape
    brought, posted as soon as that shape is in (post_known_receives) but never ahead of an earlier
    message of its channel, and the program's own Recv*Start / shape wait then find it done."""
    from megatron_envpipe.core import instructions as ins
    from megatron_envpipe.megatron import channels

    fake = _Dist()
    monkeypatch.setattr(channels, "dist", fake)
    stage1 = channels.P2PTransfers(_Channels(), 1, 2, transport=TransportSettings(prefetch=2, comm_timeout_s=5.0),
                                   recv_shape=(16, 2, 32), send_shape=(16, 2, 32),
                                   dtype=torch.float32, device=torch.device("cpu"), shapes=True)
    with pytest.raises(RuntimeError, match=r"RecvActivationStart\(0\) is posted before its shape arrived"):
        stage1.start_recv(ins.RecvActivationStart(0))
    stage1.start_recv(ins.RecvActivationShapeStart(0))
    stage1.start_recv(ins.RecvActivationShapeStart(1))
    assert fake.log == [("irecv", "act_shape", (3,)), ("irecv", "act_shape", (3,))]
    first, second = fake.works
    first.tensor.copy_(torch.tensor([7, 2, 32]))
    second.tensor.copy_(torch.tensor([12, 2, 32]))
    second.done = True
    stage1.post_known_receives()  # micro-batch 1's shape is in, 0's is not: its data must wait (FIFO)
    assert [e for e in fake.log if e[0] == "irecv" and e[1] == "act"] == []
    first.done = True
    stage1.post_known_receives()
    assert [e for e in fake.log if e[0] == "irecv" and e[1] == "act"] == [("irecv", "act", (7, 2, 32)),
                                                                           ("irecv", "act", (12, 2, 32))]
    posted = len(fake.log)
    assert stage1.finish(ins.RecvActivationShapeFinish(0)) is None  # already read
    stage1.start_recv(ins.RecvActivationStart(0))  # already posted: nothing new
    assert len(fake.log) == posted
    data = stage1.finish(ins.RecvActivationFinish(0))
    assert data.shape == (7, 2, 32) and data.requires_grad
    # The shape message a sender posts carries its data's size, right before the data.
    stage1.start_send(ins.SendGradShapeStart(0), torch.zeros(9, 2, 32))
    assert fake.log[-1] == ("isend", "grad_shape", [9, 2, 32])
