"""Simulated GPUs in virtual time across training processes (Lamport timestamps).

With ``--envpipe-sim-time virtual`` (the default for simulated GPUs) each rank's
:class:`~megatron_envpipe.gpu.devices.simulated.SimulatedGpu` runs on its own
:class:`~megatron_envpipe.core.virtual_clock.VirtualClock`: a unit takes exactly its
modelled time, and nothing the host does (gloo messages, Python, thread switches, a
busy CPU) takes device time. The ranks' clocks are kept consistent the way Lamport's
clocks are: when a unit ends, its stage sends the device time its output is ready to
the rank whose unit consumes it; before a unit begins, the consumer advances its
clock to ``max(now, stamp)``, idling (at P2P power) meanwhile, as a GPU whose input
is late would. Stamps travel over a gloo group of their own, one small float64 tensor
per message, tagged by the consuming unit so matching needs no ordering assumption;
the activations and gradients, and so the math, are untouched.

Producers, for stage ``s`` of ``P`` with ``V`` model chunks: F(m, c) waits for
F(m, c) on ``s-1`` (on stage 0, for chunk ``c > 0``: F(m, c-1) on ``P-1``); B(m, c)
for B(m, c) on ``s+1`` (on ``P-1``, for ``c < V-1``: B(m, c+1) on stage 0); the last
virtual stage's B needs only its own F, which ran on the same device before it.

At the iteration's end every stage idles until the pipeline's last unit finished
(the max device time, one all-reduce), so every energy window ends at one point, as
a wall-clock run's do. With data parallelism the pipelines then idle until the slowest
one finished (a second all-reduce, over every rank): the wait at the gradient sync, where
a straggler makes the others block. :attr:`DeviceTimeLink.own_time_s` is the pipeline's
own iteration time, without that wait.
"""

from __future__ import annotations

import datetime
from typing import Any

import torch
import torch.distributed as dist

from megatron_envpipe.config.groups import TransportSettings
from megatron_envpipe.core.schedule import Unit
from megatron_envpipe.core.virtual_clock import VirtualClock
from megatron_envpipe.errors import EnvPipeError

__all__ = ["DeviceTimeError", "DeviceTimeLink"]

_Peer = tuple[int, int, int, int]  # (stage, kind 0=F 1=B, micro-batch, chunk)


class DeviceTimeError(EnvPipeError, RuntimeError):
    """A device-time stamp did not arrive in time (a peer died or the programs disagree)."""


def _producer_of(unit: Unit, stage: int, num_stages: int, num_chunks: int) -> _Peer | None:
    """The (stage, kind, micro-batch, chunk) whose end ``unit`` on ``stage`` waits for; None: none
    on another rank (the pipeline's first forward, or the last virtual stage's backward)."""
    m, c, last = unit.microbatch, unit.chunk, num_stages - 1
    if unit.is_forward:
        if stage > 0:
            return stage - 1, 0, m, c
        return (last, 0, m, c - 1) if c > 0 else None
    if stage < last:
        return stage + 1, 1, m, c
    return (0, 1, m, c + 1) if c < num_chunks - 1 else None


def _consumer_of(unit: Unit, stage: int, num_stages: int, num_chunks: int) -> _Peer | None:
    """The unit on another rank that waits for ``unit`` on ``stage`` (the inverse of :func:`_producer_of`)."""
    m, c, last = unit.microbatch, unit.chunk, num_stages - 1
    if unit.is_forward:
        if stage < last:
            return stage + 1, 0, m, c
        return (0, 0, m, c + 1) if c < num_chunks - 1 else None
    if stage > 0:
        return stage - 1, 1, m, c
    return (last, 1, m, c - 1) if c > 0 else None


def _stamp_tag(kind: int, microbatch: int, chunk: int, num_chunks: int) -> int:
    """The gloo tag of the stamp that unit (kind, micro-batch, chunk) waits for: one per consuming unit."""
    return 1 + 2 * (microbatch * num_chunks + chunk) + kind


class DeviceTimeLink:
    """One rank's end of the stamps: :meth:`before_unit`, :meth:`after_unit`, :meth:`iteration_end`.

    ``ranks``: the pipeline's global ranks by stage; ``group``: a gloo group holding them
    (created by :meth:`create`).
    """

    def __init__(self, clock: VirtualClock, group: Any, ranks: tuple[int, ...], stage: int, num_chunks: int,
                 timeout_s: float = 300.0, replicas: Any = None) -> None:
        self.clock = clock
        self.replicas = replicas  # a gloo group of every rank (data parallelism), or None
        self.group = group
        self.ranks = ranks
        self.stage = stage
        self.num_stages = len(ranks)
        self.num_chunks = num_chunks
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self._sends: list[Any] = []  # isend handles (with their buffers) not yet known complete
        self.idle_s = 0.0  # device time spent waiting for stamps, for tests and reports
        self._begin_s = clock.now()  # the device time the current iteration began
        self.own_time_s: float | None = None  # the last iteration's, without the data-parallel wait
        self.dp_wait_s = 0.0  # the last iteration's wait for slower pipelines at the gradient sync

    @classmethod
    def create(cls, clock: VirtualClock, pp_group: Any, num_chunks: int,
               transport: TransportSettings) -> "DeviceTimeLink":
        """Make the stamps' gloo group of every pipeline: a collective over the world (every rank calls
        it once, at set-up, like Megatron's own group creation); a stamp waits at most the transport's
        ``--envpipe-comm-timeout``."""
        ranks = tuple(dist.get_process_group_ranks(pp_group))
        everyone: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, list(ranks))
        mine = None
        for pipeline in sorted({tuple(r) for r in everyone}):  # same order on every rank
            group = dist.new_group(list(pipeline), backend="gloo", group_desc="ENVPIPE_DEVICE_TIME")
            if pipeline == ranks:
                mine = group
        # More pipelines than this one (data parallelism): they meet at the gradient sync. Every rank's
        # maximum is the slowest pipeline's end: data-parallel groups join every pipeline.
        replicas = (dist.new_group(backend="gloo", group_desc="ENVPIPE_DEVICE_TIME_DP")
                    if dist.get_world_size() > len(ranks) else None)
        return cls(clock, mine, ranks, ranks.index(dist.get_rank()), num_chunks, transport.comm_timeout_s, replicas)

    def before_unit(self, unit: Unit) -> None:
        """Wait for the producer's stamp and advance this device's clock to it (idle meanwhile)."""
        peer = _producer_of(unit, self.stage, self.num_stages, self.num_chunks)
        if peer is None:
            return
        stamp = torch.zeros(1, dtype=torch.float64)
        tag = _stamp_tag(0 if unit.is_forward else 1, unit.microbatch, unit.chunk, self.num_chunks)
        work = dist.irecv(stamp, src=self.ranks[peer[0]], group=self.group, tag=tag)
        try:
            work.wait(self.timeout)
        except RuntimeError as exc:
            raise DeviceTimeError(f"EnvPipe stage {self.stage}: the device time of {unit} from stage {peer[0]} "
                                  f"did not arrive within {self.timeout.total_seconds():g} s ({exc})") from None
        wait_s = float(stamp.item()) - self.clock.now()
        if wait_s > 0:
            self.idle_s += wait_s
            self.clock.sleep(wait_s)

    def after_unit(self, unit: Unit) -> None:
        """Send the time this unit's output is ready to the rank whose unit consumes it."""
        peer = _consumer_of(unit, self.stage, self.num_stages, self.num_chunks)
        if peer is None:
            return
        stamp = torch.tensor([self.clock.now()], dtype=torch.float64)
        tag = _stamp_tag(peer[1], peer[2], peer[3], self.num_chunks)
        self._sends.append((dist.isend(stamp, dst=self.ranks[peer[0]], group=self.group, tag=tag), stamp))
        self._sends = [s for s in self._sends if not s[0].is_completed()]

    def iteration_end(self) -> float:
        """Idle until the pipeline's last unit finished; returns that device time."""
        end = torch.tensor([self.clock.now()], dtype=torch.float64)
        dist.all_reduce(end, op=dist.ReduceOp.MAX, group=self.group)
        # Every consumer reached the all-reduce, so every stamp sent was received.
        for work, _ in self._sends:
            work.wait(self.timeout)
        self._sends = []
        end_s = float(end.item())
        self.own_time_s = end_s - self._begin_s
        if self.replicas is not None:  # the gradient sync: wait for the slowest pipeline
            dist.all_reduce(end, op=dist.ReduceOp.MAX, group=self.replicas)
            end_s = float(end.item())
        self.dp_wait_s = end_s - self._begin_s - self.own_time_s
        self.clock.sleep(end_s - self.clock.now())
        self._begin_s = end_s
        return end_s

    def abandon(self) -> None:
        """After a failed iteration: forget the sends (their peers may never receive them)."""
        self._sends = []
