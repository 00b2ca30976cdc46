#!/usr/bin/env python3
"""World-wide collectives spent creating EnvPipe's P2P channel groups, counted with a fake dist.

Every rank of a fake world runs the real group-creation code of
``megatron_envpipe.megatron.channels`` (one thread per rank) against a
stand-in for ``torch.distributed`` that follows torch 2.13's rules, and counts
what each rank calls. Nothing is sent and no GPU is needed.

* ``new_group`` without ``use_local_synchronization``: every rank of the world
  must call it, in the same order (the fake checks that all ranks made the same
  sequence of such calls). With an eagerly initialised NCCL world (``device_id``
  bound) it is also an ``ncclCommSplit`` of the whole world, i.e. a world-wide
  synchronisation; with gloo it connects its members; with lazy NCCL it
  synchronises nothing.
* ``split_group``: a collective over its parent group (needs an eager world).
  Its group name hashes the ranks with the calling rank's count of registered
  groups, as torch 2.13 does; the fake checks both ends of every pair got the
  same name.
* ``all_gather_object``: a collective over its group.

    python bench/comm_groups.py [--stages 8] [--pipelines 128]
"""

from __future__ import annotations

import argparse
import hashlib
import threading
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

from megatron_envpipe.core.communicators import creation_order, warmup_order
from megatron_envpipe.megatron import channels

NON_GROUP_MEMBER = object()  # what torch's new_group returns to a non-member


class FakeGroup:
    """A process group as one rank sees it: its name, ranks and description."""

    def __init__(self, name: str, ranks: list[int], desc: str | None = None) -> None:
        self.group_name = name
        self.ranks = list(ranks)
        self.desc = desc
        self.bound_device_id: Any = None

    def size(self) -> int:
        return len(self.ranks)

    def __repr__(self) -> str:
        return f"FakeGroup({self.group_name!r}, {self.ranks})"


@dataclass
class RankState:
    pg_names: dict[Any, str] = field(default_factory=dict)  # torch's _world.pg_names of this rank
    group_count: int = 0  # torch's _world.group_count: names of world-wide new_group calls
    world_calls: Any = field(default_factory=hashlib.sha1)  # digest of the world-wide call sequence
    counts: Counter = field(default_factory=Counter)  # (what, world call?, ranks it waits for) -> calls
    seq: Counter = field(default_factory=Counter)  # collectives per member tuple


class FakeWorld:
    """``world_size`` ranks in pipelines ``pipelines`` (lists of global ranks, by stage).

    ``eager``: the default group is bound to a device (``init_process_group(device_id=...)``).
    ``extra_groups(rank)``: groups the rank registered before (Megatron's embedding groups
    make these differ between first, middle and last stages).
    """

    def __init__(self, pipelines: list[list[int]], *, backend: str = "nccl", eager: bool = False,
                 extra_groups: Callable[[int], int] = lambda rank: 0, timeout_s: float = 300.0) -> None:
        self.pipelines = pipelines
        self.size = sum(len(p) for p in pipelines)
        self.backend, self.eager, self.timeout_s = backend, eager, timeout_s
        self.default = FakeGroup("0", list(range(self.size)), "default_pg")
        self.default.bound_device_id = "cuda:0" if eager else None
        self.states = [RankState() for _ in range(self.size)]
        for rank, state in enumerate(self.states):
            state.pg_names[self.default] = "0"
            for i in range(extra_groups(rank)):
                state.pg_names[object()] = f"earlier-{i}"
        self.pp = {}  # rank -> its pipeline group, as that rank sees it
        for i, ranks in enumerate(pipelines):
            for r in ranks:
                self.pp[r] = FakeGroup(f"pp{i}", ranks, "PIPELINE_MODEL_PARALLEL_GROUP")
        self._lock = threading.Lock()
        self._slots: dict[tuple, dict] = {}

    def rendezvous(self, rank: int, members: tuple[int, ...], signature: Any, payload: Any) -> list[Any]:
        """A collective of ``members``: every member's payload, in member order.

        Raises if the members called different collectives (a real run would hang or corrupt).
        """
        state = self.states[rank]
        seq = state.seq[members]
        state.seq[members] += 1
        with self._lock:
            slot = self._slots.setdefault((members, seq), {"cv": threading.Condition(self._lock), "got": {}})
            slot["got"][rank] = (signature, payload)
            slot["cv"].notify_all()
            if not slot["cv"].wait_for(lambda: len(slot["got"]) == len(members), timeout=self.timeout_s):
                raise RuntimeError(f"fake collective of {len(members)} ranks: only {sorted(slot['got'])} came "
                                   "(a real run would hang)")
            got = slot["got"]
            if len({repr(sig) for sig, _ in got.values()}) > 1:
                raise RuntimeError(f"ranks {members} called different collectives: "
                                   f"{sorted({repr(sig) for sig, _ in got.values()})}")
            slot["read"] = slot.get("read", 0) + 1
            if slot["read"] == len(members):
                del self._slots[(members, seq)]
            return [got[m][1] for m in members]

    def run(self, fn: Callable[[FakeDist], Any]) -> list[Any]:
        """``fn(api)`` on every rank at once (one thread each); the results by rank."""
        results: list[Any] = [None] * self.size
        errors: list[BaseException] = []

        def body(rank: int) -> None:
            try:
                results[rank] = fn(FakeDist(self, rank))
            except BaseException as exc:  # noqa: BLE001 - re-raised in the caller
                errors.append(exc)

        old = threading.stack_size(256 * 1024)
        try:
            threads = [threading.Thread(target=body, args=(r,)) for r in range(self.size)]
        finally:
            threading.stack_size(old)
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]
        digests = {s.world_calls.hexdigest() for s in self.states}
        if len(digests) != 1:
            raise RuntimeError("ranks made different sequences of world-wide calls (a real run would hang)")
        return results


class FakeDist:
    """The part of ``torch.distributed`` that channel creation uses, for one rank of a FakeWorld."""

    def __init__(self, world: FakeWorld, rank: int) -> None:
        self.world, self.rank = world, rank
        self.state = world.states[rank]
        self.group = SimpleNamespace(WORLD=world.default)
        self.distributed_c10d = SimpleNamespace(_world=SimpleNamespace(pg_names=self.state.pg_names))

    # -- what channel creation calls ----------------------------------------------------
    def get_rank(self) -> int:
        return self.rank

    def get_world_size(self, group: Any = None) -> int:
        return (group or self.world.default).size()

    def get_process_group_ranks(self, group: Any) -> list[int]:
        return list(group.ranks)

    def get_backend(self, group: Any = None) -> str:
        return self.world.backend

    def all_gather_object(self, object_list: list[Any], obj: Any, group: Any = None) -> None:
        members = tuple((group or self.world.default).ranks)
        self._count("all_gather_object", len(members) == self.world.size, len(members))
        object_list[:] = self.world.rendezvous(self.rank, members, "all_gather_object", obj)

    def new_group(self, ranks: list[int] | None = None, timeout: Any = None, backend: Any = None,
                  pg_options: Any = None, use_local_synchronization: bool = False, group_desc: str | None = None,
                  device_id: Any = None) -> Any:
        members = sorted(ranks) if ranks is not None else list(range(self.world.size))
        if use_local_synchronization:
            if self.world.eager:
                raise RuntimeError("new_group(use_local_synchronization=True) with a bound device splits the "
                                   "world's communicator with only the members calling: a real run hangs")
            if self.rank not in members:
                return None
            self._count("new_group(local)", False, 0)
            return self._register(self._hashed_name(members), members, group_desc)
        # Every rank calls it, in the same order; the name is the world-wide counter.
        self.state.world_calls.update(repr(("new_group", members)).encode())
        name = str(self.state.group_count)
        self.state.group_count += 1
        # Eager NCCL: an ncclCommSplit of the world. Gloo: its members connect. Lazy NCCL: nothing.
        waits = self.world.size if self.world.eager else len(members) if self.world.backend == "gloo" else 0
        self._count("new_group", True, waits)
        if self.rank not in members:
            return NON_GROUP_MEMBER
        return self._register(name, members, group_desc)

    def split_group(self, parent_pg: Any = None, split_ranks: list[list[int]] | None = None, timeout: Any = None,
                    pg_options: Any = None, group_desc: str | None = None, backend: Any = None) -> Any:
        if not self.world.eager:
            raise RuntimeError("No device associated with the default pg, not safe to split any process groups")
        parent = parent_pg or self.world.default
        members = tuple(parent.ranks)
        me = members.index(self.rank)
        self._count("split_group", len(members) == self.world.size, len(members))
        self.world.rendezvous(self.rank, members, ("split_group", [list(g) for g in split_ranks]), None)
        mine = next((sorted(g) for g in split_ranks if me in g), None)
        if mine is None:
            return None
        name = self._hashed_name(mine)  # computed from the parent's group ranks, like torch
        return self._register(name, [members[i] for i in mine], group_desc)

    # -- bookkeeping --------------------------------------------------------------------
    def _hashed_name(self, ranks: list[int]) -> str:
        # torch 2.13's _hash_ranks_to_str: the ranks, salted with this rank's number of groups.
        text = "_".join(map(str, ranks)) + "_" + str(len(self.state.pg_names))
        return hashlib.sha1(text.encode()).hexdigest()

    def _register(self, name: str, ranks: list[int], desc: str | None) -> FakeGroup:
        group = FakeGroup(name, ranks, desc)
        self.state.pg_names[group] = name
        return group

    def _count(self, what: str, world_call: bool, waits_for: int) -> None:
        self.state.counts[(what, world_call, waits_for)] += 1


def megatron_layout(stages: int, pipelines: int) -> list[list[int]]:
    """Megatron's pipelines for TP = 1: global rank = dp + stage x DP."""
    return [[d + s * pipelines for s in range(stages)] for d in range(pipelines)]


def megatron_extra_groups(stages: int, pipelines: int) -> Callable[[int], int]:
    """First stages hold an embedding and a position-embedding group, last stages an embedding group."""
    def extra(rank: int) -> int:
        stage = rank // pipelines
        return (2 if stage == 0 else 0) + (1 if stage == stages - 1 else 0)
    return extra


@dataclass
class Tally:
    strategy: str
    world_calls: int  # calls every rank of the world must make
    world_syncs: int  # of those, the ones that synchronise the whole world
    smaller_collectives: int  # collectives over fewer ranks than the world (most on one rank)
    warmup_pairs: int  # pairwise rendezvous of the warm-up (most on one rank)
    groups: int  # process groups a rank registers (most on one rank)
    name_mismatches: int  # channel groups whose name differs on its two ranks


def tally(world: FakeWorld, create: Callable[[Any, Any], Any]) -> Tally:
    """Run ``create(pp_group, api)`` on every rank of ``world`` and count what it called."""
    before = [len(s.pg_names) for s in world.states]
    made = world.run(lambda api: create(world.pp[api.rank], api))
    n = world.size
    world_calls = {sum(k for (_, every, _), k in s.counts.items() if every) for s in world.states}
    world_syncs = {sum(k for (_, _, waits), k in s.counts.items() if waits == n) for s in world.states}
    if len(world_calls) != 1 or len(world_syncs) != 1:
        raise RuntimeError("world-wide counts differ between ranks")
    smaller = max(sum(k for (_, _, waits), k in s.counts.items() if 1 < waits < n) for s in world.states)
    mismatches = 0
    p = len(world.pipelines[0])
    for ranks in world.pipelines:
        for channel in creation_order(p):
            ends = [made[ranks[s]].act if channel[2] == "act" else made[ranks[s]].grad for s in channel[:2]]
            names = {str(getattr(e[min(channel[:2])], "group_name", "")) for e in ends}
            mismatches += len(names) > 1
    return Tally(
        strategy=made[0].strategy,
        world_calls=world_calls.pop(),
        world_syncs=world_syncs.pop(),
        smaller_collectives=smaller,
        warmup_pairs=max(len(warmup_order(s, p)) for s in range(p)),
        groups=max(len(s.pg_names) - b for s, b in zip(world.states, before)),
        name_mismatches=mismatches,
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--stages", type=int, default=8)
    ap.add_argument("--pipelines", type=int, default=128, help="data-parallel size (TP = 1)")
    args = ap.parse_args()
    p, dp = args.stages, args.pipelines
    layout = megatron_layout(p, dp)
    extra = megatron_extra_groups(p, dp)
    rows = [  # (when, label, backend, device_id bound, creation)
        ("before", "NCCL, no device_id", "nccl", False, channels._per_pair_groups),
        ("before", "NCCL, device_id", "nccl", True, channels._per_pair_groups),
        ("after", "gloo (CPU tests)", "gloo", False, channels._create_channel_groups),
        ("after", "NCCL, no device_id", "nccl", False, channels._create_channel_groups),
        ("after", "NCCL, device_id", "nccl", True, channels._create_channel_groups),
    ]
    print(f"{p * dp} ranks = {dp} pipelines x {p} stages (TP = 1); fake torch.distributed, nothing runs\n")
    head = ("", "world", "strategy", "world-wide", "of which", "smaller", "warm-up", "groups", "name")
    sub = ("", "", "", "calls", "sync", "collectives", "pairs", "per rank", "mismatches")
    fmt = "{:<7}{:<21}{:<29}{:>10}{:>9}{:>12}{:>8}{:>9}{:>11}"
    print(fmt.format(*head))
    print(fmt.format(*sub))
    for when, label, backend, eager, create in rows:
        world = FakeWorld(layout, backend=backend, eager=eager, extra_groups=extra)
        t = tally(world, create)
        warm = t.warmup_pairs if when == "after" else 0
        print(fmt.format(when, label, t.strategy, t.world_calls, t.world_syncs, t.smaller_collectives, warm,
                         t.groups, t.name_mismatches))
    print("""
world-wide calls: calls every rank must make, in the same order. 'sync': of those, the ones that wait for
the whole world (the gather of every pipeline's ranks; under device_id each new_group is an ncclCommSplit
of the world; gloo connects a world-sized group's members). Smaller collectives: over the pipeline (the
gather of group counts and the split_group calls). Warm-up pairs: one-number messages per rank before the
first iteration, each a rendezvous of two ranks, in the chain order. Name mismatches: pair groups whose
name differs on its two ranks (the split strategy pads to avoid them).""")


if __name__ == "__main__":
    main()
