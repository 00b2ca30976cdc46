"""--p2p-transport host: torch.distributed transfers staged through host memory (megatron/host_p2p.py).

Two real gloo ranks exercise every staged call on CPU tensors (the same code path a
CUDA run takes: host buffer, gloo, copy into the caller's tensor on completion).
The end-to-end check (4 ranks, EnvPipe vs stock Megatron, losses bit for bit) is
step 7's test, tests/apps/test_gpu_check_executor.py.
"""

from __future__ import annotations

import argparse
import datetime
from pathlib import Path

import pytest

torch = pytest.importorskip("torch", reason="needs torch: pip install -e '.[megatron]'")
import torch.distributed as dist  # noqa: E402

from megatron_envpipe.megatron import host_p2p  # noqa: E402
from megatron_envpipe.testing.harness import join_ranks, start_ranks  # noqa: E402

WORLD = 2
TIMEOUT = datetime.timedelta(seconds=60)


def _staged_calls(rank: int) -> None:
    """Every patched call once (asserts inside: a failure surfaces as the rank's exception)."""
    peer = 1 - rank
    real_isend = dist.isend
    with host_p2p.host_p2p() as counts:
        assert counts is host_p2p.current_counts() and counts is not None
        assert dist.isend is not real_isend

        # isend/irecv: the receive lands in the caller's tensor on completion, not before.
        if rank == 0:
            data = torch.arange(6, dtype=torch.float32).reshape(2, 3)
            work = dist.isend(data, dst=1, tag=7)
            data.fill_(-5.0)  # the host copy was taken when the send was posted
            assert work.wait(TIMEOUT) is not False
        else:
            buf = torch.full((2, 3), -1.0, requires_grad=True)  # a leaf that requires grad, as Megatron's
            work = dist.irecv(buf, src=0, tag=7)
            work._inner.wait(TIMEOUT)  # the gloo transfer into the host buffer is done ...
            assert torch.equal(buf.detach(), torch.full((2, 3), -1.0))  # ... yet nothing landed before completion
            assert work.is_completed()  # is_completed() reporting done lands the data
            assert torch.equal(buf.detach(), torch.arange(6, dtype=torch.float32).reshape(2, 3))
            work.wait()  # idempotent

        # P2POp + batch_isend_irecv with the staged functions, both directions at once.
        mine = torch.full((4,), float(rank + 1), dtype=torch.float64)
        theirs = torch.zeros(4, dtype=torch.float64)
        ops = [dist.P2POp(dist.isend, mine, peer), dist.P2POp(dist.irecv, theirs, peer)]
        assert isinstance(ops[0], dist.distributed_c10d.P2POp)
        for work in dist.batch_isend_irecv(ops):
            work.wait()
        assert torch.equal(theirs, torch.full((4,), float(peer + 1), dtype=torch.float64))

        # Blocking send/recv.
        if rank == 0:
            dist.send(torch.tensor([3, 1, 4], dtype=torch.int64), dst=1)
        else:
            got = torch.zeros(3, dtype=torch.int64)
            assert dist.recv(got, src=0) == 0
            assert got.tolist() == [3, 1, 4]

        # The collectives gloo has no CUDA path for, sync and async.
        parts = [torch.zeros(2) for _ in range(WORLD)]
        dist.all_gather(parts, torch.full((2,), float(rank)))
        assert [p.tolist() for p in parts] == [[0.0, 0.0], [1.0, 1.0]]
        out = torch.zeros(2 * WORLD)
        dist.all_gather_into_tensor(out, torch.full((2,), float(rank + 10)))
        assert out.tolist() == [10.0, 10.0, 11.0, 11.0]
        total = torch.tensor([float(rank + 1)])
        dist.all_reduce(total, op=dist.ReduceOp.SUM)
        assert total.item() == 3.0
        total = torch.tensor([float(rank + 1)])
        dist.all_reduce(total, op=dist.ReduceOp.MAX, async_op=True).wait()
        assert total.item() == 2.0
        value = torch.tensor([float(rank * 7)])
        dist.broadcast(value, src=1)
        assert value.item() == 7.0

        assert (counts.sends, counts.recvs, counts.collectives) == ((3, 1, 5) if rank == 0 else (1, 3, 5))
        assert counts.p2p_messages > 0 and counts.bytes_staged > 0
    assert dist.isend is real_isend and dist.P2POp is dist.distributed_c10d.P2POp  # restored
    assert host_p2p.current_counts() is None
    with host_p2p.host_p2p(enabled=False) as nothing:  # --p2p-transport direct
        assert nothing is None and dist.isend is real_isend


def _worker(rank: int, init_file: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    try:
        _staged_calls(rank)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def test_every_staged_call_moves_the_data_and_lands_it_on_completion(tmp_path: Path) -> None:
    join_ranks(start_ranks(_worker, (str(tmp_path / "init"),), WORLD), timeout_s=120)


def test_transport_is_restored_after_an_error() -> None:
    real = {name: getattr(dist, name) for name in ("isend", "irecv", "P2POp", "all_gather")}
    with pytest.raises(ValueError), host_p2p.host_p2p():
        raise ValueError("boom")
    assert {name: getattr(dist, name) for name in real} == real
    assert host_p2p.current_counts() is None


# --------------------------------------------------------------------------- train_tiny_gpt's flags


def _args(*argv: str) -> argparse.Namespace:
    pytest.importorskip("megatron.core", reason="needs megatron-core")
    from megatron_envpipe.apps.train_tiny_gpt import parse_args

    return parse_args(list(argv))


def test_p2p_transport_flag_defaults_to_direct() -> None:
    assert _args().p2p_transport == "direct"
    assert _args("--p2p-transport", "host").p2p_transport == "host"
    with pytest.raises(SystemExit):
        _args("--p2p-transport", "carrier-pigeon")


def test_ranks_sharing_a_gpu_need_host_transport_and_a_simulated_gpu() -> None:
    from megatron_envpipe.apps.tiny_parallel import _shared_gpu_problem

    cuda = ("--device", "cuda")
    # One GPU per rank, or CPU: nothing to say.
    assert _shared_gpu_problem(_args(*cuda), 4, 4) is None
    assert _shared_gpu_problem(_args("--device", "cpu", "--p2p-transport", "host"), 4, 0) is None
    # NCCL cannot put two ranks on one GPU.
    problem = _shared_gpu_problem(_args(*cuda), 4, 1)
    assert problem is not None and "--p2p-transport host" in problem
    # Shared GPU: EnvPipe must drive the simulated GPU; stock Megatron may run.
    problem = _shared_gpu_problem(_args(*cuda, "--p2p-transport", "host", "--envpipe-type", "envelope"), 4, 1)
    assert problem is not None and "simulated:" in problem and "4 local ranks on 1 GPU" in problem
    assert _shared_gpu_problem(_args(*cuda, "--p2p-transport", "host", "--no-envpipe"), 4, 1) is None
    assert _shared_gpu_problem(_args(*cuda, "--p2p-transport", "host", "--envpipe-gpu", "simulated:a40/gpt3-175b"),
                              4, 1) is None
