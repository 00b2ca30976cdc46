"""The static deadlock prover of instruction programs: :func:`check_deadlock` runs every stage's program
against bounded channels and proves it finishes (or names the stuck instructions).

Split from core/instructions.py (the instruction set and the program builder) by job.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

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
)

__all__ = ["check_deadlock"]


def check_deadlock(
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
    _check_shapes_known(programs)

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
    # Per stream, its two stages in order with their queues: (sa, qa, sb, qb), sa < sb.
    pairs: dict[tuple, tuple[int, deque, int, deque]] = {}
    completed: set[tuple[int, int]] = set()  # (stage, instruction index)
    op_index: dict[tuple, tuple[int, int]] = {}
    sent: dict[tuple, list[tuple[int, int]]] = {}
    received: dict[tuple, list[tuple[int, int]]] = {}
    steps = 0

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

    # The hot loop reads each instruction's class once (_comm_info) and inlines CommInstruction's peer,
    # channel and message; queue entries carry (stage, index, instruction, is_send, message) so that
    # matching two heads compares precomputed messages. Same model and results as the plain form
    # (tests/core/test_program_specs.py runs both).
    known_info = _COMM_INFO.get
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
            instructions = prog.instructions
            size = len(instructions)
            pc = start_pc = pcs[s]
            while pc < size:
                ins = instructions[pc]
                info = known_info(type(ins), _UNSEEN)
                if info is _UNSEEN:
                    info = _comm_info(type(ins))
                if info is not None:
                    kind, is_send, is_start, downstream = info
                    chunk = ins.chunk
                    # Virtual stage 0 has no previous one: nothing to receive activations from or send grads to.
                    if num < 2 or (chunk == 0 and s == 0 and downstream != is_send):
                        pcs[s] = pc
                        steps += pc - start_pc
                        raise DeadlockError(f"stage {s}: {ins} has no peer stage {ins.peer(s)}")
                    microbatch = ins.microbatch
                    if is_start:
                        peer = (s + (1 if downstream == is_send else -1)) % num
                        channel = (s, peer, kind) if is_send else (peer, s, kind)
                        key = comm(*channel)  # the stream (communicator) of this op
                        if lazy_communicators and not create(s, key, peer):
                            break  # blocked creating the communicator
                        virtual = chunk * num + s
                        if not is_send:
                            virtual += -1 if downstream else 1
                        message = (kind, microbatch, virtual)
                        qs = queues.get(key)
                        if qs is None:
                            qs = queues[key] = {s: deque(), peer: deque()}
                            pairs[key] = (s, qs[s], peer, qs[peer]) if s < peer else (peer, qs[peer], s, qs[s])
                        qs[s].append((s, pc, ins, is_send, message))
                        op_index[(s, kind, is_send, microbatch, chunk)] = (s, pc)
                        (sent if is_send else received).setdefault(channel, []).append((microbatch, virtual))
                        # Settle the stream: complete matching heads (a send and its receive) in FIFO order.
                        sa, qa, sb, qb = pairs[key]
                        while qa and qb:
                            a = qa[0]
                            b = qb[0]
                            if a[3] == b[3] or a[4] != b[4]:
                                break  # heads do not match: this stream is stuck for now
                            qa.popleft()
                            qb.popleft()
                            completed.add((sa, a[1]))
                            completed.add((sb, b[1]))
                    else:
                        start = op_index.get((s, kind, is_send, microbatch, chunk))
                        if start is None:
                            pcs[s] = pc
                            steps += pc - start_pc
                            raise DeadlockError(f"stage {s}: {ins} finishes an op that was never started")
                        if start not in completed:
                            break  # blocked
                pc += 1
            if pc != start_pc:
                pcs[s] = pc
                steps += pc - start_pc
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


def _comm_info(cls: type) -> tuple[str, bool, bool, bool] | None:
    """(kind, is_send, is_start, downstream) of a communication instruction class; None for the others."""
    try:
        return _COMM_INFO[cls]
    except KeyError:
        info = (cls.kind, cls.is_send, cls.is_start, cls.kind in DOWNSTREAM) if issubclass(cls, CommInstruction) \
            else None
        _COMM_INFO[cls] = info
        return info


_COMM_INFO: dict[type, tuple[str, bool, bool, bool] | None] = {}
_UNSEEN = ("", False, False, False)  # a class _comm_info has not read yet


def _check_shapes_known(programs: Sequence[StageProgram]) -> None:
    """With shape messages anywhere: every data receive is posted after its shape's wait."""
    shape_kinds = set(SHAPE_KIND.values())
    classes = set().union(*(map(type, p.instructions) for p in programs))
    if not any(info is not None and info[0] in shape_kinds for info in map(_comm_info, classes)):
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
