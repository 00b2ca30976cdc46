"""The deadlock check against its plain form (the specification of the tuned one).

``spec_check_deadlock`` below is core/deadlock.py's ``check_deadlock`` as it was before its hot loop was tuned
(per-instruction method calls, a general settle loop). The tuned one must return the same steps and raise the
same errors, word for word, on valid programs and on broken ones.
"""

from __future__ import annotations

import random
from collections import deque
from collections.abc import Sequence

import pytest
from test_instructions import random_schedule

from megatron_envpipe.core.communicators import warmup_programs
from megatron_envpipe.core.deadlock import check_deadlock
from megatron_envpipe.core.instructions import (
    ACT,
    ACT_SHAPE,
    DOWNSTREAM,
    GRAD,
    GRAD_SHAPE,
    SHAPE_KIND,
    CommInstruction,
    DeadlockError,
    StageProgram,
    build_programs,
)
from megatron_envpipe.core.interleaved import interleaved_schedule


def outcome(check, programs, **options) -> tuple[str, object]:
    try:
        return "steps", check(programs, **options)
    except DeadlockError as exc:
        return "error", str(exc)


def mutated(programs: list[StageProgram], rng: random.Random) -> list[StageProgram]:
    """One stage's program with an instruction swapped, dropped, doubled or moved (most deadlock or mismatch)."""
    out = list(programs)
    s = rng.randrange(len(out))
    ins = list(out[s].instructions)
    if len(ins) < 2:
        return out
    i, j = rng.randrange(len(ins)), rng.randrange(len(ins))
    how = rng.choice(["swap", "drop", "double", "move"])
    if how == "swap":
        ins[i], ins[j] = ins[j], ins[i]
    elif how == "drop":
        del ins[i]
    elif how == "double":
        ins.insert(j, ins[i])
    else:
        ins.insert(j, ins.pop(i))
    out[s] = StageProgram(s, tuple(ins))
    return out


OPTIONS = [{}, {"shared_pair_stream": True}, {"lazy_communicators": True}, {"shapes_on_data_channels": True}]


@pytest.mark.parametrize("seed", range(4))
def test_the_tuned_check_equals_its_specification(seed):
    rng = random.Random(seed)
    kinds = {"steps": 0, "error": 0}
    for _ in range(50):
        if rng.random() < 0.25:
            p, v = rng.randint(2, 4), rng.randint(2, 3)
            sched, wrap = interleaved_schedule(p, p * rng.randint(1, 2), v), True
        else:
            sched, wrap = random_schedule(rng, max_stages=6, max_microbatches=12), False
        shapes = rng.random() < 0.3
        programs = build_programs(sched, prefetch=rng.choice([1, 2, 3]), shapes=shapes)
        cases = [programs] + [mutated(programs, rng) for _ in range(3)]
        for progs in cases:
            options = dict(rng.choice(OPTIONS))
            if options.get("lazy_communicators") and rng.random() < 0.5:
                options["warmup"] = warmup_programs(sched.num_stages, wrap=wrap, shapes=shapes)
            expected = outcome(spec_check_deadlock, progs, **options)
            assert outcome(check_deadlock, progs, **options) == expected
            kinds[expected[0]] += 1
    assert kinds["steps"] and kinds["error"], kinds  # both outcomes were compared


# ---- the specification: check_deadlock before tuning, unchanged but for its name ----


def spec_check_deadlock(
    programs: Sequence[StageProgram],
    shared_pair_stream: bool = False,
    *,
    lazy_communicators: bool = False,
    warmup: Sequence[Sequence[tuple[int, int, str]]] | None = None,
    shapes_on_data_channels: bool = False,
) -> int:
    """Prove the programs complete under strict rendezvous; return the steps taken.

    Model: a ``*Start`` posts an op on its stream and never blocks; a
    ``*Finish`` blocks until its op completed; an op completes when it and its
    peer op are both at the head of their ranks' queues on the same stream
    (FIFO, no buffering: a send needs the posted receive). Streams are one per
    channel (sender, receiver, kind), or with ``shared_pair_stream`` one per
    pair of stages for both directions (PyTorch's default per-pair NCCL
    communicator), which is where naive orders deadlock. A stream is one
    communicator.

    ``lazy_communicators``: a communicator does not exist until the first op
    on it, and creating it blocks the stage until the other stage also
    creates it (NCCL's lazy init: both ranks must join). ``warmup`` (per
    stage, channels ``(sender, receiver, kind)``) are creations each stage
    performs in that order before its program, each a rendezvous of the two
    stages (and the one-element message the executor sends on it, which pairs
    the same two stages at the same point).

    With shape messages, a data receive must be posted after its shape's wait
    (its size is unknown before). ``shapes_on_data_channels`` models shapes
    sharing the data's communicator (the design the shape channels avoid).

    Also checks that every message is sent and received exactly once and in
    the same order on both sides. Raises :class:`DeadlockError`.
    """

    merged_kinds = {ACT_SHAPE: ACT, GRAD_SHAPE: GRAD}

    def comm(snd: int, rcv: int, kind: str) -> tuple:
        if shapes_on_data_channels:
            kind = merged_kinds.get(kind, kind)
        return (min(snd, rcv), max(snd, rcv)) if shared_pair_stream else (snd, rcv, kind)

    num = len(programs)
    spec_check_shapes_known(programs)

    warm = [list(w) for w in warmup] if warmup is not None else [[] for _ in range(num)]
    if len(warm) != num:
        raise DeadlockError(f"warm-up for {len(warm)} stages, programs for {num}")
    for s, channels in enumerate(warm):
        for snd, rcv, _ in channels:
            neighbours = abs(snd - rcv) == 1 or {snd, rcv} == {0, num - 1}  # the wrap-around pair too
            if s not in (snd, rcv) or snd == rcv or not neighbours or not (0 <= snd < num and 0 <= rcv < num):
                raise DeadlockError(f"stage {s}: warm-up channel {(snd, rcv)} is not one of its channels")
    ready: list[set[tuple]] = [set() for _ in range(num)]  # communicators each stage has created
    joining: dict[int, tuple] = {}  # stage -> communicator it is blocked creating
    wpcs = [0] * num
    pcs = [0] * num
    queues: dict[tuple, dict[int, deque]] = {}
    completed: set[tuple[int, int]] = set()  # (stage, instruction index)
    op_index: dict[tuple[int, int], tuple] = {}
    sent: dict[tuple, list[int]] = {}
    received: dict[tuple, list[int]] = {}
    steps = 0

    def settle(key: tuple) -> None:
        qs = queues[key]
        if len(qs) == 2:  # always: a stream joins one stage and its peer (the loop below is the general form)
            (sa, qa), (sb, qb) = sorted(qs.items())
            while qa and qb:
                ia, a = qa[0][1:]
                ib, b = qb[0][1:]
                if a.is_send == b.is_send or a.message(sa, num) != b.message(sb, num):
                    return  # heads do not match: this stream is stuck for now
                qa.popleft()
                qb.popleft()
                completed.add((sa, ia))
                completed.add((sb, ib))
            return
        while True:
            ends = [q for q in qs.values() if q]
            if len(ends) < 2:
                return
            (sa, ia, a), (sb, ib, b) = (qs[s][0] for s in sorted(qs) if qs[s])
            if not (a.is_send != b.is_send and a.message(sa, num) == b.message(sb, num)):
                return  # heads do not match: this stream is stuck for now
            qs[sa].popleft()
            qs[sb].popleft()
            completed.add((sa, ia))
            completed.add((sb, ib))

    def create(s: int, key: tuple, peer: int) -> bool:
        """Stage ``s`` needs communicator ``key`` (shared with ``peer``): True once it exists."""
        if key in ready[s]:
            return True
        if joining.get(peer) == key:  # the peer is already waiting in the same creation
            ready[s].add(key)
            ready[peer].add(key)
            del joining[peer]
            joining.pop(s, None)
            return True
        joining[s] = key
        return False

    progress = True
    while progress:
        progress = False
        for s, prog in enumerate(programs):
            while wpcs[s] < len(warm[s]):
                snd, rcv, kind = warm[s][wpcs[s]]
                if not create(s, comm(snd, rcv, kind), rcv if snd == s else snd):
                    break
                wpcs[s] += 1
                steps += 1
                progress = True
            if wpcs[s] < len(warm[s]):
                continue  # blocked in its warm-up
            while pcs[s] < len(prog.instructions):
                ins = prog.instructions[pcs[s]]
                if isinstance(ins, CommInstruction):
                    # Virtual stage 0 has no previous one: nothing to receive activations from or send grads to.
                    if num < 2 or (ins.chunk == 0 and s == 0 and (ins.kind in DOWNSTREAM) != ins.is_send):
                        raise DeadlockError(f"stage {s}: {ins} has no peer stage {ins.peer(s)}")
                    if ins.is_start:
                        peer = ins.peer(s, num)
                        channel = ins.channel(s, num)
                        key = comm(*channel)  # the stream (communicator) of this op
                        if lazy_communicators and not create(s, key, peer):
                            break  # blocked creating the communicator
                        qs = queues.setdefault(key, {})
                        qs.setdefault(s, deque()).append((s, pcs[s], ins))
                        qs.setdefault(peer, deque())
                        op_index[(s, ins.kind, ins.is_send, ins.microbatch, ins.chunk)] = (s, pcs[s])
                        (sent if ins.is_send else received).setdefault(channel, []).append(
                            ins.message(s, num)[1:])
                        settle(key)
                    else:
                        start = op_index.get((s, ins.kind, ins.is_send, ins.microbatch, ins.chunk))
                        if start is None:
                            raise DeadlockError(f"stage {s}: {ins} finishes an op that was never started")
                        if start not in completed:
                            break  # blocked
                pcs[s] += 1
                steps += 1
                progress = True
    stuck = [s for s, prog in enumerate(programs) if wpcs[s] < len(warm[s]) or pcs[s] < len(prog.instructions)]
    if stuck:
        parts = []
        for s in stuck:
            if wpcs[s] < len(warm[s]):
                snd, rcv, kind = warm[s][wpcs[s]]
                parts.append(f"stage {s} blocked at warm-up creating communicator {comm(snd, rcv, kind)} "
                             f"waiting on stage {rcv if snd == s else snd}")
                continue
            ins = programs[s].instructions[pcs[s]]
            peer = ins.peer(s, num) if isinstance(ins, CommInstruction) else None
            what = f" creating communicator {joining[s]}" if s in joining else ""
            parts.append(f"stage {s} blocked at {ins}{what}"
                         + (f" waiting on stage {peer}" if peer is not None else ""))
        raise DeadlockError("deadlock: " + "; ".join(parts))
    for key, qs in queues.items():
        left = [str(op[2]) for q in qs.values() for op in q]
        if left:
            raise DeadlockError(f"stream {key}: unmatched ops left at the end: {' '.join(left[:6])}")
    for channel in set(sent) | set(received):
        if sent.get(channel) != received.get(channel):
            raise DeadlockError(
                f"channel {channel}: sends {sent.get(channel)} and receives {received.get(channel)} differ"
            )
    return steps


def spec_check_shapes_known(programs: Sequence[StageProgram]) -> None:
    """With shape messages anywhere: every data receive is posted after its shape's wait."""
    shape_kinds = set(SHAPE_KIND.values())
    if not any(isinstance(i, CommInstruction) and i.kind in shape_kinds for p in programs for i in p.instructions):
        return
    for prog in programs:
        known = set()
        for i in prog.instructions:
            if not isinstance(i, CommInstruction) or i.is_send:
                continue
            if i.kind in shape_kinds and not i.is_start:
                known.add((i.kind, i.microbatch, i.chunk))
            elif i.kind in SHAPE_KIND and i.is_start and (SHAPE_KIND[i.kind], i.microbatch, i.chunk) not in known:
                raise DeadlockError(f"stage {prog.stage}: {i} is posted before its shape is known (its shape "
                                    f"receive must finish first: with variable lengths the size comes from it)")
