"""Per-stage instruction programs, and a static deadlock check under NCCL semantics.

A stage's program is the exact list the executor runs: clock changes, the
start and finish of every receive and send, forwards, backwards and frees.
Pure Python, no torch.

Communication design. Every neighbouring pair of stages gets **one channel
per direction** (activations s -> s+1, gradients s+1 -> s), i.e. a separate
communicator each, so an activation never queues behind a gradient on a
shared per-pair stream. Messages on a channel are in micro-batch order on both
sides. Receives are posted ahead (``prefetch`` per channel) and waited just
before the unit that consumes them; an activation send is waited for only
right before the backward of the same micro-batch (which already depends on
the receiver having consumed it), gradient sends at the end of the iteration.
So the programs add **no dependency** beyond the iteration DAG that the
timeline models: plans are scored on exactly what runs. (EnvPipe's own KISTI
order, or the §8.5 pairing, hold activations until gradients arrive; see
:func:`paired_hold_dependencies` to score that variant.)

:func:`check_deadlock` runs every program against a rendezvous model: a send
completes only once the peer has posted the matching receive; ops on one
stream complete in FIFO order; nothing is buffered. It reports the stuck
stages, instructions and peers if the programs can block forever. With
``lazy_communicators`` it also models NCCL's lazy communicator creation (the
first operation on a channel, on either stage, is a blocking rendezvous of
its two stages); :mod:`~megatron_envpipe.core.communicators` gives the warm-up
order that makes those first uses a chain instead of a cycle.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import ClassVar

from megatron_envpipe.core.plan import FrequencyPlan
from megatron_envpipe.core.schedule import B, F, Schedule, ScheduleError, Unit
from megatron_envpipe.core.timeline import Dependency
from megatron_envpipe.errors import EnvPipeError

ACT = "act"
GRAD = "grad"


class DeadlockError(EnvPipeError, RuntimeError):
    """The programs can block forever; the message names stage, instruction and peer."""


@dataclass(frozen=True)
class Instruction:
    """Base class: every instruction prints as ``Name(arg)``."""

    def __str__(self) -> str:
        args = ",".join(str(v) for v in self.__dict__.values())
        return f"{type(self).__name__}({args})"


@dataclass(frozen=True)
class SetFrequency(Instruction):
    freq_mhz: int


@dataclass(frozen=True)
class Forward(Instruction):
    microbatch: int


@dataclass(frozen=True)
class Backward(Instruction):
    microbatch: int


@dataclass(frozen=True)
class Free(Instruction):
    """Drop the stage's input/output tensors of a micro-batch after its backward."""

    microbatch: int


@dataclass(frozen=True)
class CommInstruction(Instruction):
    """Start or finish of one P2P message of one micro-batch."""

    microbatch: int

    kind: ClassVar[str]  # ACT or GRAD
    is_send: ClassVar[bool]
    is_start: ClassVar[bool]

    def peer(self, stage: int) -> int:
        """The other stage of this message."""
        if self.kind == ACT:
            return stage + 1 if self.is_send else stage - 1
        return stage - 1 if self.is_send else stage + 1

    def channel(self, stage: int) -> tuple[int, int, str]:
        """(sender, receiver, kind): one communicator per direction and pair."""
        peer = self.peer(stage)
        return (stage, peer, self.kind) if self.is_send else (peer, stage, self.kind)


@dataclass(frozen=True)
class RecvActivationStart(CommInstruction):
    kind, is_send, is_start = ACT, False, True


@dataclass(frozen=True)
class RecvActivationFinish(CommInstruction):
    kind, is_send, is_start = ACT, False, False


@dataclass(frozen=True)
class SendActivationStart(CommInstruction):
    kind, is_send, is_start = ACT, True, True


@dataclass(frozen=True)
class SendActivationFinish(CommInstruction):
    kind, is_send, is_start = ACT, True, False


@dataclass(frozen=True)
class RecvGradStart(CommInstruction):
    kind, is_send, is_start = GRAD, False, True


@dataclass(frozen=True)
class RecvGradFinish(CommInstruction):
    kind, is_send, is_start = GRAD, False, False


@dataclass(frozen=True)
class SendGradStart(CommInstruction):
    kind, is_send, is_start = GRAD, True, True


@dataclass(frozen=True)
class SendGradFinish(CommInstruction):
    kind, is_send, is_start = GRAD, True, False


_BY_NAME = {
    cls.__name__: cls
    for cls in (
        SetFrequency,
        Forward,
        Backward,
        Free,
        RecvActivationStart,
        RecvActivationFinish,
        SendActivationStart,
        SendActivationFinish,
        RecvGradStart,
        RecvGradFinish,
        SendGradStart,
        SendGradFinish,
    )
}


def parse_instruction(text: str) -> Instruction:
    name, _, rest = text.strip().partition("(")
    cls = _BY_NAME.get(name)
    if cls is None or not rest.endswith(")"):
        raise ScheduleError(f"cannot parse instruction {text!r}")
    return cls(int(rest[:-1]))


@dataclass(frozen=True)
class StageProgram:
    stage: int
    instructions: tuple[Instruction, ...]

    def __str__(self) -> str:
        return f"S{self.stage}: " + " ".join(str(i) for i in self.instructions)

    def units(self) -> list[Unit]:
        """The compute units in program order (must equal the schedule's order)."""
        out = []
        for ins in self.instructions:
            if isinstance(ins, Forward):
                out.append(F(ins.microbatch))
            elif isinstance(ins, Backward):
                out.append(B(ins.microbatch))
        return out


def build_programs(
    schedule: Schedule,
    plan: FrequencyPlan | None = None,
    prefetch: int = 2,
) -> list[StageProgram]:
    """The instruction list of every stage for one iteration of ``schedule``.

    ``plan`` adds a ``SetFrequency`` wherever a unit's clock differs from the
    previous unit's (and once at the start). ``prefetch`` is how many receives
    per channel are posted ahead of use (receive buffers held per channel).
    """
    if prefetch < 1:
        raise ScheduleError(f"prefetch must be >= 1, got {prefetch}")
    if plan is not None and plan.schedule.orders != schedule.orders:
        raise ScheduleError("the frequency plan belongs to a different schedule")
    p, m = schedule.num_stages, schedule.num_microbatches
    programs = []
    for s, order in enumerate(schedule.orders):
        out: list[Instruction] = []
        first, last = s == 0, s == p - 1
        next_act = next_grad = 0  # next receive to post, per channel

        # Bound per stage (defaults): the closure never outlives this iteration.
        def post(kind: str, upto: int, out: list[Instruction] = out, first: bool = first, last: bool = last) -> None:
            nonlocal next_act, next_grad
            if kind == ACT and not first:
                while next_act < min(m, upto):
                    out.append(RecvActivationStart(next_act))
                    next_act += 1
            if kind == GRAD and not last:
                while next_grad < min(m, upto):
                    out.append(RecvGradStart(next_grad))
                    next_grad += 1

        post(ACT, prefetch)
        post(GRAD, prefetch)
        current = None
        for i, unit in enumerate(order):
            if plan is not None:
                f = plan.freqs_mhz[s][i]
                if f != current:
                    out.append(SetFrequency(f))
                    current = f
            mb = unit.microbatch
            if unit.is_forward:
                if not first:
                    out.append(RecvActivationFinish(mb))
                    post(ACT, mb + 1 + prefetch)
                out.append(Forward(mb))
                if not last:
                    out.append(SendActivationStart(mb))
            else:
                if not last:
                    out.append(RecvGradFinish(mb))
                    post(GRAD, mb + 1 + prefetch)
                    # Its receiver consumed this activation before producing the
                    # gradient just received, so this wait never blocks.
                    out.append(SendActivationFinish(mb))
                out.append(Backward(mb))
                if not first:
                    out.append(SendGradStart(mb))
                out.append(Free(mb))
        if not first:
            out.extend(SendGradFinish(mb) for mb in range(m))
        programs.append(StageProgram(s, tuple(out)))
    for prog, order in zip(programs, schedule.orders):
        assert tuple(prog.units()) == order
    return programs


def check_deadlock(
    programs: Sequence[StageProgram],
    shared_pair_stream: bool = False,
    *,
    lazy_communicators: bool = False,
    warmup: Sequence[Sequence[tuple[int, int, str]]] | None = None,
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

    Also checks that every message is sent and received exactly once and in
    the same order on both sides. Raises :class:`DeadlockError`.
    """

    def comm(snd: int, rcv: int, kind: str) -> tuple:
        return (min(snd, rcv), max(snd, rcv)) if shared_pair_stream else (snd, rcv, kind)

    def stream(stage: int, ins: CommInstruction):
        return comm(*ins.channel(stage))

    num = len(programs)
    warm = [list(w) for w in warmup] if warmup is not None else [[] for _ in range(num)]
    if len(warm) != num:
        raise DeadlockError(f"warm-up for {len(warm)} stages, programs for {num}")
    for s, channels in enumerate(warm):
        for snd, rcv, _ in channels:
            if s not in (snd, rcv) or abs(snd - rcv) != 1 or not (0 <= snd < num and 0 <= rcv < num):
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
        while True:
            ends = [q for q in qs.values() if q]
            if len(ends) < 2:
                return
            (sa, ia, a), (sb, ib, b) = (qs[s][0] for s in sorted(qs) if qs[s])
            if not (a.is_send != b.is_send and a.kind == b.kind and a.microbatch == b.microbatch):
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
                    peer = ins.peer(s)
                    if not 0 <= peer < num:
                        raise DeadlockError(f"stage {s}: {ins} has no peer stage {peer}")
                    if ins.is_start and lazy_communicators and not create(s, stream(s, ins), peer):
                        break  # blocked creating the communicator
                    if ins.is_start:
                        key = stream(s, ins)
                        qs = queues.setdefault(key, {})
                        qs.setdefault(s, deque()).append((s, pcs[s], ins))
                        qs.setdefault(peer, deque())
                        op_index[(s, ins.kind, ins.is_send, ins.microbatch)] = (s, pcs[s])
                        (sent if ins.is_send else received).setdefault(ins.channel(s), []).append(ins.microbatch)
                        settle(key)
                    else:
                        start = op_index.get((s, ins.kind, ins.is_send, ins.microbatch))
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
            peer = ins.peer(s) if isinstance(ins, CommInstruction) else None
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


def paired_hold_dependencies(schedule: Schedule) -> list[Dependency]:
    """Dependencies the §8.5 / KISTI pairing would add (for comparison only).

    There, stage s sends activation i > w_{s+1} only together with its receive
    of gradient j = i - w_{s+1} - 1, i.e. once it reaches ``B(s, j)``: so
    ``F(s+1, i)`` waits for the unit before ``B(s, j)`` on stage s.
    """
    deps = []
    m = schedule.num_microbatches
    for s in range(schedule.num_stages - 1):
        w_next = schedule.forwards_before_first_backward(s + 1) - 1  # Megatron-style warm-up count
        order = schedule.orders[s]
        for i in range(w_next + 1, m):
            j = i - w_next - 1
            pos = order.index(B(j))
            if pos == 0:
                continue
            deps.append(Dependency(s, order[pos - 1], s + 1, F(i)))
    return deps


def format_programs(programs: Iterable[StageProgram]) -> str:
    return "\n".join(str(p) for p in programs)
