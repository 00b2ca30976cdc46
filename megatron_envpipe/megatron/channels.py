"""Point-to-point channels between pipeline stages, and one iteration's async transfers.

:class:`PipelineChannels` creates one process group per direction and
neighbouring pair (once per pipeline, cached by the executor state).
:class:`P2PTransfers` is a stage's bookkeeping of the ``isend``/``irecv`` its
instruction program starts and finishes: which peer and group each message
uses, the in-flight work, time-limited waits that name the stuck transfer, and
activation sends found complete early (so their outputs can be freed).
"""

from __future__ import annotations

import datetime
import time
from typing import Any

import torch
import torch.distributed as dist

from megatron_envpipe.core import instructions as ins
from megatron_envpipe.errors import EnvPipeError

__all__ = ["CommError", "CommTimeoutError", "P2PTransfers", "PipelineChannels", "TransferKey"]


class CommError(EnvPipeError, RuntimeError):
    """A P2P transfer failed: the peer died, or it did not complete in time."""


class CommTimeoutError(CommError):
    """A P2P transfer did not complete within ``--envpipe-comm-timeout``."""


class PipelineChannels:
    """One process group per direction and neighbouring pair of this pipeline.

    Separate communicators keep activations and gradients on separate NCCL
    streams, so neither can queue behind the other (the deadlock of a shared
    per-pair stream, envpipe.md §8.3). Every rank must create every group in
    the same order, so the pipelines' rank lists are gathered first.
    """

    def __init__(self, pp_group: Any) -> None:
        mine = dist.get_process_group_ranks(pp_group)
        everyone: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mine)
        self.act: dict[int, Any] = {}  # stage -> group for activations stage -> stage+1
        self.grad: dict[int, Any] = {}  # stage -> group for gradients stage+1 -> stage
        for ranks in sorted({tuple(r) for r in everyone}):
            for s in range(len(ranks) - 1):
                pair = [ranks[s], ranks[s + 1]]
                g_act = dist.new_group(pair)
                g_grad = dist.new_group(pair)
                if tuple(ranks) == tuple(mine):
                    self.act[s], self.grad[s] = g_act, g_grad
        self.ranks = tuple(mine)


# (kind, is_send, micro-batch): one message of one iteration.
TransferKey = tuple[str, bool, int]


class P2PTransfers:
    """A stage's in-flight sends and receives of one iteration.

    ``start_*`` posts the transfer and returns at once; :meth:`finish` waits for
    it (at most ``timeout_s``) and returns its tensor. Received tensors are
    allocated here with the P2P shapes; an activation receive requires grad so
    the stage's backward produces the input gradient.
    """

    def __init__(self, channels: PipelineChannels, stage: int, num_stages: int, *, timeout_s: float,
                 recv_shape: tuple[int, ...], send_shape: tuple[int, ...], dtype: torch.dtype,
                 device: torch.device) -> None:
        self.channels = channels
        self.stage = stage
        first, last = stage == 0, stage == num_stages - 1
        self.prev_rank = channels.ranks[stage - 1] if not first else None
        self.next_rank = channels.ranks[stage + 1] if not last else None
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self.recv_shape, self.send_shape = recv_shape, send_shape
        self.dtype, self.device = dtype, device
        self.pending: dict[TransferKey, tuple[Any, torch.Tensor]] = {}
        self.reaped: set[TransferKey] = set()  # activation sends found complete (and freed) early

    def _route(self, instr: ins.CommInstruction) -> tuple[int | None, Any]:
        """(peer rank, process group) of a message."""
        if instr.kind == ins.ACT:
            peer = self.next_rank if instr.is_send else self.prev_rank
            group = self.channels.act[self.stage if instr.is_send else self.stage - 1]
        else:
            peer = self.prev_rank if instr.is_send else self.next_rank
            group = self.channels.grad[self.stage - 1 if instr.is_send else self.stage]
        return peer, group

    def start_send(self, instr: ins.CommInstruction, tensor: torch.Tensor) -> None:
        peer, group = self._route(instr)
        work = dist.isend(tensor, dst=peer, group=group)
        self.pending[(instr.kind, True, instr.microbatch)] = (work, tensor)

    def start_recv(self, instr: ins.CommInstruction) -> None:
        peer, group = self._route(instr)
        is_act = instr.kind == ins.ACT
        shape = self.recv_shape if is_act else self.send_shape
        tensor = torch.empty(shape, dtype=self.dtype, device=self.device, requires_grad=is_act)
        work = dist.irecv(tensor, src=peer, group=group)
        self.pending[(instr.kind, False, instr.microbatch)] = (work, tensor)

    def finish(self, instr: ins.CommInstruction) -> torch.Tensor | None:
        """Wait for the transfer ``instr`` finishes; its tensor, or None for an activation
        send already found complete by :meth:`reap_activation_sends`."""
        key = (instr.kind, instr.is_send, instr.microbatch)
        entry = self.pending.pop(key, None)
        if entry is None:
            if instr.is_send and instr.kind == ins.ACT and key in self.reaped:
                self.reaped.discard(key)
                return None
            raise RuntimeError(f"EnvPipe stage {self.stage}: {instr} has no matching start")
        work, tensor = entry
        self._wait(work, instr, self._route(instr)[0])
        return tensor

    def reap_activation_sends(self) -> list[int]:
        """Micro-batches whose activation send already completed (never blocks).

        Megatron frees an output right after its blocking send; with async sends
        the executor frees it as soon as the send is seen done, at the latest
        before the micro-batch's backward (SendActivationFinish).
        """
        done = [k for k, (w, _) in self.pending.items() if k[0] == ins.ACT and k[1] and w.is_completed()]
        if not done:
            return done  # the common case: nothing allocated
        for key in done:
            work, _ = self.pending.pop(key)
            work.wait()  # completed: returns at once, and surfaces a transport error
            self.reaped.add(key)
        return [key[2] for key in done]

    def clear(self) -> None:
        """Drop every in-flight transfer (after an error, so a retry does not leak)."""
        self.pending.clear()

    def _wait(self, work: Any, instr: ins.Instruction, peer: int | None) -> None:
        t0 = time.monotonic()
        limit = self.timeout.total_seconds()
        where = f"EnvPipe stage {self.stage} (rank {dist.get_rank()}): {instr} with peer rank {peer}"
        try:
            ok = work.wait(self.timeout)
        except RuntimeError as exc:
            waited = time.monotonic() - t0
            if waited >= 0.9 * limit or "timed out" in str(exc).lower() or "timeout" in str(exc).lower():
                raise CommTimeoutError(
                    f"{where} did not complete within {limit:g} s: that stage is stuck or has died "
                    f"(raise --envpipe-comm-timeout if it is legitimately slow). Transport said: {exc}"
                ) from exc
            raise CommError(f"{where} failed after {waited:.1f} s: {exc}") from exc
        if ok is False:
            raise CommTimeoutError(f"{where} did not complete within {limit:g} s")
