"""Point-to-point channels between pipeline stages, and one iteration's async transfers.

:class:`PipelineChannels` gives every neighbouring pair of stages one
communicator per direction (once per pipeline, cached by the executor state)
and, before the first iteration, uses each in the pipeline's one creation
order (:mod:`~megatron_envpipe.core.communicators`), so that NCCL's lazy
communicator creation cannot deadlock. :class:`P2PTransfers` is a stage's
bookkeeping of the ``isend``/``irecv`` its instruction program starts and
finishes: which peer and group each message uses, the in-flight work,
time-limited waits that name the stuck transfer, and activation sends found
complete early (so their outputs can be freed).

How the groups are made (:func:`_create_channel_groups`), by what torch 2.13
does (``torch/distributed/distributed_c10d.py``, ``ProcessGroupNCCL``):

* ``new_group`` without ``use_local_synchronization`` must be called by every
  rank of the world, in the same order (group names come from a world-wide
  counter); with an eagerly initialised NCCL world each call is also an
  ``ncclCommSplit`` of the whole world. ``new_subgroups_by_enumeration`` is
  just a loop over it. Creating one group per pair for every pipeline on every
  rank (:data:`_PER_PAIR`, the original way) costs ``2 (P-1) x pipelines`` such
  calls.
* Lazily initialised NCCL (no ``device_id``) and gloo (:data:`_WORLD_GROUPS`):
  two world-sized groups, one per direction, two world-wide calls in all. An
  unbatched ``isend``/``irecv`` on a lazy NCCL group creates its own 2-rank
  communicator per pair of ranks at its first use, so every pair and direction
  still gets a communicator (and stream) of its own.
* Eagerly initialised NCCL (``device_id`` bound, :data:`_SPLIT`): P2P ops on a
  group use its one communicator, so the pairs need groups of their own; one
  ``split_group`` of the pipeline group per class of disjoint pairs (four
  classes) makes them, collectives over the pipeline only, none over the world.
  ``new_group(use_local_synchronization=True)`` would avoid the world too, but
  with a bound device it splits the world's communicator with only the
  members calling, which hangs.

A ``split_group`` group's name hashes its ranks with the number of process
groups the calling rank has registered, a rank-local count (Megatron gives
first and last stages embedding groups the others lack). Names that differ on
the two ends of a pair make ``destroy_process_group`` shut groups down in
different orders on different ranks (pytorch#189073, #190396), so the split
strategy first pads every stage of the pipeline to the same count with
one-rank groups and completes each class with one-rank groups.
"""

from __future__ import annotations

import datetime
import hashlib
import logging
import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from megatron_envpipe.config.groups import TransportSettings
from megatron_envpipe.core import instructions as ins
from megatron_envpipe.core.communicators import Channel, creation_order, disjoint_classes, is_wrap, warmup_order
from megatron_envpipe.errors import EnvPipeError

__all__ = [
    "CommError",
    "CommTimeoutError",
    "P2PTransfers",
    "PipelineChannels",
    ]

log = logging.getLogger("megatron_envpipe")

_PER_PAIR = "per-pair new_group"
_WORLD_GROUPS = "two world groups"
_SPLIT = "split_group of the pipeline"


class CommError(EnvPipeError, RuntimeError):
    """A P2P transfer failed: the peer died, or it did not complete in time."""


class CommTimeoutError(CommError):
    """A P2P transfer did not complete within ``--envpipe-comm-timeout``."""


# -- group creation ---------------------------------------------------------------------
@dataclass
class _ChannelGroups:
    """The process groups of this rank's channels.

    ``act[s]`` carries activations from stage ``s`` to ``s + 1``, ``grad[s]``
    gradients from ``s + 1`` to ``s``; only the pairs this rank belongs to.
    ``wrap[kind]``: the wrap-around channels of a pipeline with model chunks.
    ``shape[(kind, s)]``: with variable sequence lengths, the shape channels of
    pair (s, s + 1) (kind ``act_shape`` or ``grad_shape``).
    """

    strategy: str
    ranks: tuple[int, ...]  # the pipeline's global ranks, by stage
    stage: int
    act: dict[int, Any] = field(default_factory=dict)
    grad: dict[int, Any] = field(default_factory=dict)
    wrap: dict[str, Any] = field(default_factory=dict)
    shape: dict[tuple[str, int], Any] = field(default_factory=dict)

    def store(self, channel: Channel, group: Any) -> None:
        snd, rcv, kind = channel
        if self.stage in (snd, rcv):
            if is_wrap(channel):
                self.wrap[kind] = group
            elif kind in (ins.ACT, ins.GRAD):
                (self.act if kind == ins.ACT else self.grad)[min(snd, rcv)] = group
            else:
                self.shape[(kind, min(snd, rcv))] = group


def _layout(api: Any, pp_group: Any, strategy: str) -> _ChannelGroups:
    ranks = tuple(api.get_process_group_ranks(pp_group))
    return _ChannelGroups(strategy, ranks, ranks.index(api.get_rank()))


_DESC = {ins.ACT: "ENVPIPE_ACTIVATIONS", ins.GRAD: "ENVPIPE_GRADIENTS", ins.ACT_SHAPE: "ENVPIPE_ACTIVATION_SHAPES",
         ins.GRAD_SHAPE: "ENVPIPE_GRADIENT_SHAPES"}


def _per_pair_groups(pp_group: Any, api: Any = dist, wrap: bool = False, shapes: bool = False) -> _ChannelGroups:
    """Two ``new_group`` per pair of every pipeline, on every rank (world-wide calls)."""
    out = _layout(api, pp_group, _PER_PAIR)
    everyone: list[Any] = [None] * api.get_world_size()
    api.all_gather_object(everyone, list(out.ranks))  # every rank must create every pipeline's groups
    for pipeline in sorted({tuple(r) for r in everyone}):
        for channel in creation_order(len(pipeline), wrap, shapes):
            snd, rcv, kind = channel
            group = api.new_group(sorted([pipeline[snd], pipeline[rcv]]), group_desc=_DESC[kind])
            if pipeline == out.ranks:
                out.store(channel, group)
    return out


def _world_direction_groups(pp_group: Any, api: Any = dist, wrap: bool = False, shapes: bool = False) -> _ChannelGroups:
    """One world-sized group per direction; lazy NCCL makes a communicator per pair inside each.

    The wrap-around channels get two more: at P = 2 the wrap pair is the
    neighbour pair, and one communicator for both directions of a kind would
    put the two ranks' first operations in a cycle. ``shapes``: one more per
    direction for the shape messages (two more with ``wrap``).
    """
    out = _layout(api, pp_group, _WORLD_GROUPS)
    kinds = (ins.ACT, ins.GRAD, ins.ACT_SHAPE, ins.GRAD_SHAPE) if shapes else (ins.ACT, ins.GRAD)
    groups = {kind: api.new_group(group_desc=_DESC[kind]) for kind in kinds}
    wrapped = {}
    if wrap:
        wrapped = {kind: api.new_group(group_desc=_DESC[kind].replace("ENVPIPE_", "ENVPIPE_WRAP_")) for kind in kinds}
    for channel in creation_order(len(out.ranks), wrap, shapes):
        out.store(channel, (wrapped if is_wrap(channel) else groups)[channel[2]])
    return out


def _registered_group_count(api: Any = dist) -> int | None:
    """How many process groups this rank has registered, or None if torch does not say.

    torch (2.13) salts the hashed name of a ``split_group`` group with this
    rank-local count; no public API reads it.
    """
    world = getattr(getattr(api, "distributed_c10d", None), "_world", None)
    names = getattr(world, "pg_names", None)
    return len(names) if names is not None else None


def _split_pipeline_groups(pp_group: Any, api: Any = dist, wrap: bool = False, shapes: bool = False) -> _ChannelGroups:
    """Pair groups split from the (eagerly initialised) pipeline group: collectives over the pipeline only."""
    out = _layout(api, pp_group, _SPLIT)
    p = len(out.ranks)
    counts: list[Any] = [None] * p
    api.all_gather_object(counts, _registered_group_count(api), group=pp_group)
    if None not in counts:
        # Pad with one-rank groups until every stage has registered as many groups as the
        # most: then both ends of every pair hash the same name below.
        top = max(counts)
        for j in range(1, top - min(counts) + 1):
            api.split_group(parent_pg=pp_group, split_ranks=[[g] for g in range(p) if top - counts[g] >= j],
                            group_desc="ENVPIPE_PAD")
    for members in disjoint_classes(p, wrap, shapes):
        pairs = [sorted(c[:2]) for c in members]
        covered = {g for pair in pairs for g in pair}
        # Uncovered stages get a one-rank group, so that every stage registers one group per call.
        split = pairs + [[g] for g in range(p) if g not in covered]
        kind = members[0][2]
        group = api.split_group(parent_pg=pp_group, split_ranks=split, group_desc=_DESC[kind])
        for channel in members:
            out.store(channel, group)
    return out


def _eager_world(api: Any) -> bool:
    """The default group is bound to a device: NCCL communicators are created eagerly."""
    world = getattr(getattr(api, "group", None), "WORLD", None)
    return getattr(world, "bound_device_id", None) is not None


def _create_channel_groups(pp_group: Any, api: Any = dist, wrap: bool = False, shapes: bool = False) -> _ChannelGroups:
    """This rank's channel groups, made with as few world-wide calls as torch allows.

    Every rank of the world calls it at the same point (the first iteration),
    for its own pipeline. ``api`` is ``torch.distributed`` or a stand-in.
    ``wrap``: model chunks, so the wrap-around channels too. ``shapes``:
    variable sequence lengths, so the shape channels too.
    """
    if api.get_world_size(pp_group) < 2:
        return _layout(api, pp_group, "none")
    if not _eager_world(api):
        return _world_direction_groups(pp_group, api, wrap, shapes)
    if hasattr(api, "split_group") and "nccl" in str(api.get_backend(pp_group)):
        return _split_pipeline_groups(pp_group, api, wrap, shapes)
    return _per_pair_groups(pp_group, api, wrap, shapes)


def _fingerprint(group: Any) -> int:
    """A number from the group's name, equal on both ends of a pair when their names agree."""
    digest = hashlib.sha1(str(getattr(group, "group_name", "")).encode()).digest()
    return int.from_bytes(digest[:7], "big")


def _wait_work(work: Any, timeout: datetime.timedelta, where: str) -> None:
    """Wait at most ``timeout`` for ``work``; CommTimeoutError / CommError say ``where``."""
    t0 = time.monotonic()
    limit = timeout.total_seconds()
    try:
        ok = work.wait(timeout)
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


class PipelineChannels:
    """One communicator per direction and neighbouring pair of this pipeline.

    Separate communicators keep activations and gradients on separate NCCL
    streams, so neither can queue behind the other (the deadlock of a shared
    per-pair stream, envpipe.md §8.3). Every rank of the world constructs its
    pipeline's channels at the same point (the groups' creation involves all
    of them, see :func:`_create_channel_groups`); :meth:`warm_up` then makes
    the first use of each channel, in the pipeline's one creation order.
    """

    def __init__(self, pp_group: Any, api: Any = dist, wrap: bool = False, shapes: bool = False) -> None:
        groups = _create_channel_groups(pp_group, api, wrap, shapes)
        self.strategy = groups.strategy
        self.wrap, self.shapes = wrap, shapes
        self.ranks, self.stage = groups.ranks, groups.stage
        self.act: dict[int, Any] = groups.act  # stage -> group for activations stage -> stage+1
        self.grad: dict[int, Any] = groups.grad  # stage -> group for gradients stage+1 -> stage
        self.wrapped: dict[str, Any] = groups.wrap  # kind -> group of the wrap-around channel
        self.shape: dict[tuple[str, int], Any] = groups.shape  # (shape kind, stage) -> group of a shape channel
        self.warmed = False
        log.debug("EnvPipe stage %d: P2P channel groups by %s", self.stage, self.strategy)

    def group(self, channel: Channel) -> Any:
        snd, rcv, kind = channel
        if is_wrap(channel):
            return self.wrapped[kind]
        if kind in (ins.ACT_SHAPE, ins.GRAD_SHAPE):
            return self.shape[(kind, min(snd, rcv))]
        return (self.act if kind == ins.ACT else self.grad)[min(snd, rcv)]

    def warm_up(self, device: torch.device, timeout: datetime.timedelta) -> None:
        """Send one number over each of this stage's channels, in the pipeline's creation order.

        A lazily created NCCL communicator comes into being at the first
        operation on it and blocks until both ranks join; the programs' own first
        operations touch a pair's two channels in opposite orders on its two
        stages (a cycle), this order is a chain (proof: ``check_deadlock`` with
        ``lazy_communicators``). Unbatched ``isend``/``irecv`` like the programs,
        so it creates exactly the communicators they use. The number is a
        fingerprint of the group's name; a mismatch is logged. Once per channels.
        """
        if self.warmed:
            return
        for channel in warmup_order(self.stage, len(self.ranks), self.wrap, self.shapes):
            snd, rcv, kind = channel
            group = self.group(channel)
            peer = self.ranks[rcv if snd == self.stage else snd]
            mine = torch.tensor([_fingerprint(group)], dtype=torch.int64, device=device)
            if snd == self.stage:
                work = dist.isend(mine, dst=peer, group=group)
                theirs = mine
            else:
                theirs = torch.empty_like(mine)
                work = dist.irecv(theirs, src=peer, group=group)
            where = (f"EnvPipe stage {self.stage} (rank {self.ranks[self.stage]}): warm-up of the {kind} "
                     f"channel {snd} -> {rcv} with peer rank {peer}")
            _wait_work(work, timeout, where)
            if int(theirs.item()) != int(mine.item()):
                log.warning("%s: the group's name differs on the two ranks; destroy_process_group may shut "
                            "groups down in different orders on them", where)
        self.warmed = True


# (kind, is_send, micro-batch, chunk): one message of one iteration.
_TransferKey = tuple[str, bool, int, int]

# Shape kind -> the data kind it announces, and the data receive posted once the shape is in.
_DATA_OF = {ins.ACT_SHAPE: ins.ACT, ins.GRAD_SHAPE: ins.GRAD}
_DATA_RECV = {ins.ACT_SHAPE: ins.RecvActivationStart, ins.GRAD_SHAPE: ins.RecvGradStart}


class P2PTransfers:
    """A stage's in-flight sends and receives of one iteration.

    ``start_*`` posts the transfer and returns at once; :meth:`finish` waits for
    it (at most the transport settings' ``comm_timeout_s``) and returns its tensor. Received tensors are
    allocated here with the P2P shapes; an activation receive requires grad so
    the stage's backward produces the input gradient.

    ``shapes`` (variable sequence lengths): a shape message (three int64, the
    tensor's size, as Megatron's ``_communicate_shapes``) precedes each data
    message on the channels' shape channels; the wait for a shape posts its data
    receive, with the size it brought (the program's ``Recv*Start`` that follows
    finds it posted). :meth:`post_known_receives` does so as soon as a shape is
    in, so data still arrives ahead of use.
    """

    def __init__(self, channels: PipelineChannels, stage: int, num_stages: int, *, transport: TransportSettings,
                 recv_shape: tuple[int, ...], send_shape: tuple[int, ...], dtype: torch.dtype,
                 device: torch.device, shapes: bool = False) -> None:
        self.channels = channels
        self.stage, self.num_stages = stage, num_stages
        self.timeout = datetime.timedelta(seconds=transport.comm_timeout_s)
        self.recv_shape, self.send_shape = recv_shape, send_shape
        self.dtype, self.device = dtype, device
        self.pending: dict[_TransferKey, tuple[Any, torch.Tensor]] = {}
        self.reaped: set[_TransferKey] = set()  # activation sends found complete (and freed) early
        self.shapes = shapes
        self.early: set[_TransferKey] = set()  # shape receives whose data receive was posted early
        channels.warm_up(device, self.timeout)  # first iteration only: before any program op

    def _route(self, instr: ins.CommInstruction) -> tuple[int, Any]:
        """(peer rank, process group) of a message (the wrap-around included)."""
        channel = instr.channel(self.stage, self.num_stages)
        return self.channels.ranks[instr.peer(self.stage, self.num_stages)], self.channels.group(channel)

    def start_send(self, instr: ins.CommInstruction, tensor: torch.Tensor) -> None:
        """Send ``tensor``, or for a shape message the size of the data ``tensor`` sent right after it."""
        if instr.kind in _DATA_OF:
            tensor = torch.tensor(tensor.size(), dtype=torch.int64, device=self.device)
        peer, group = self._route(instr)
        work = dist.isend(tensor, dst=peer, group=group)
        self.pending[(instr.kind, True, instr.microbatch, instr.chunk)] = (work, tensor)

    def start_recv(self, instr: ins.CommInstruction) -> None:
        key = (instr.kind, False, instr.microbatch, instr.chunk)
        is_act = instr.kind == ins.ACT
        if instr.kind in _DATA_OF:
            tensor = torch.empty((3,), dtype=torch.int64, device=self.device)
        elif self.shapes:
            if key not in self.pending:  # posted by the wait for its shape
                raise RuntimeError(f"EnvPipe stage {self.stage}: {instr} is posted before its shape arrived")
            return
        else:
            tensor = torch.empty(self.recv_shape if is_act else self.send_shape, dtype=self.dtype,
                                 device=self.device, requires_grad=is_act)
        self._post_recv(instr, tensor)

    def _post_recv(self, instr: ins.CommInstruction, tensor: torch.Tensor) -> None:
        peer, group = self._route(instr)
        work = dist.irecv(tensor, src=peer, group=group)
        self.pending[(instr.kind, False, instr.microbatch, instr.chunk)] = (work, tensor)

    def finish(self, instr: ins.CommInstruction) -> torch.Tensor | None:
        """Wait for the transfer ``instr`` finishes; its tensor, or None for an activation
        send already found complete by :meth:`reap_activation_sends`."""
        key = (instr.kind, instr.is_send, instr.microbatch, instr.chunk)
        entry = self.pending.pop(key, None)
        if entry is None:
            if instr.is_send and instr.kind == ins.ACT and key in self.reaped:
                self.reaped.discard(key)
                return None
            if key in self.early:  # a shape already read by post_known_receives
                self.early.discard(key)
                return None
            raise RuntimeError(f"EnvPipe stage {self.stage}: {instr} has no matching start")
        work, tensor = entry
        self._wait(work, instr, self._route(instr)[0])
        if instr.kind in _DATA_OF and not instr.is_send:  # the shape is in: post its data's receive
            data = _DATA_RECV[instr.kind](instr.microbatch, instr.chunk)
            self._post_recv(data, torch.empty(tensor.tolist(), dtype=self.dtype, device=self.device,
                                              requires_grad=data.kind == ins.ACT))
        return tensor

    def post_known_receives(self) -> None:
        """Post the data receive of every shape already received (never blocks).

        The program posts a data receive only right before its wait (its size
        comes with the shape); posting it as soon as the shape is in lets the
        data arrive while the stage computes, as a prefetched receive would.
        Receives are posted earlier, never in another order: per kind (a stage
        receives each kind on one channel) in posting order, up to the first
        shape still in flight. Posting a receive never blocks, so no wait changes.
        """
        in_flight: set[str] = set()
        for key, (work, _) in list(self.pending.items()):  # insertion order: posting order
            kind, is_send, mb, chunk = key
            if is_send or kind not in _DATA_OF or kind in in_flight:
                continue
            if not work.is_completed():
                in_flight.add(kind)
                continue
            self.finish(ins.RecvActivationShapeFinish(mb, chunk) if kind == ins.ACT_SHAPE
                        else ins.RecvGradShapeFinish(mb, chunk))  # completed: returns at once, posts the data's
            self.early.add(key)

    def reap_activation_sends(self) -> list[tuple[int, int]]:
        """(micro-batch, chunk) whose activation send already completed (never blocks).

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
        return [key[2:] for key in done]

    def clear(self) -> None:
        """Drop every in-flight transfer (after an error, so a retry does not leak)."""
        self.pending.clear()
        self.early.clear()

    def _wait(self, work: Any, instr: ins.Instruction, peer: int | None) -> None:
        where = f"EnvPipe stage {self.stage} (rank {dist.get_rank()}): {instr} with peer rank {peer}"
        _wait_work(work, self.timeout, where)
