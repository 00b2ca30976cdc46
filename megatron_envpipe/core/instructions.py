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

Model chunks (Megatron's interleaved pipeline, ``Schedule.num_chunks`` = V > 1):
compute and message instructions carry the local ``chunk`` (printed only when
non-zero: ``Forward(3,1)``); rank s chunk v is virtual stage v*P+s. Activations
of the last rank's chunk v go to rank 0's chunk v+1 and gradients back (the
wrap-around): two more channels, ``(P-1, 0, act)`` and ``(0, P-1, grad)``,
distinct from the neighbour channels even at P = 2. A message is named by its
kind, micro-batch and sending virtual stage, so the check matches both ends
across the wrap.

Variable sequence lengths (``build_programs(..., shapes=True)``): every data
message is preceded by a shape message on a channel of its own per direction
and pair (kinds ``act_shape``, ``grad_shape``); shape receives are posted
ahead where data receives were, a data receive once its shape is known. Why
shapes cannot share the data's communicator, and why this adds no dependency:
docs/executor.md, "Variable sequence lengths".
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from megatron_envpipe.core.plan import FrequencyPlan
from megatron_envpipe.core.schedule import B, F, Schedule, ScheduleError, Unit
from megatron_envpipe.core.timeline import Dependency
from megatron_envpipe.errors import EnvPipeError

ACT = "act"
GRAD = "grad"
ACT_SHAPE = "act_shape"  # the shape of an activation, ahead of it, on a channel of its own
GRAD_SHAPE = "grad_shape"
DOWNSTREAM = frozenset({ACT, ACT_SHAPE})  # kinds sent from stage s to s+1 (virtual stage v to v+1)


class DeadlockError(EnvPipeError, RuntimeError):
    """The programs can block forever; the message names stage, instruction and peer."""


@dataclass(frozen=True)
class Instruction:
    """Base class: every instruction prints as ``Name(arg)``; a chunk 0 is left out."""

    def __str__(self) -> str:
        values = list(self.__dict__.values())
        if getattr(self, "chunk", None) == 0:
            values = values[:-1]  # chunk is the last field; one-chunk programs print as before
        return f"{type(self).__name__}({','.join(str(v) for v in values)})"


@dataclass(frozen=True)
class SetFrequency(Instruction):
    freq_mhz: int


@dataclass(frozen=True)
class Forward(Instruction):
    microbatch: int
    chunk: int = 0


@dataclass(frozen=True)
class Backward(Instruction):
    microbatch: int
    chunk: int = 0


@dataclass(frozen=True)
class Free(Instruction):
    """Drop the stage's input/output tensors of a micro-batch (of a chunk) after its backward."""

    microbatch: int
    chunk: int = 0


@dataclass(frozen=True)
class CommInstruction(Instruction):
    """Start or finish of one P2P message of one micro-batch, sent or received by local ``chunk``."""

    microbatch: int
    chunk: int = 0

    kind: ClassVar[str]  # ACT or GRAD
    is_send: ClassVar[bool]
    is_start: ClassVar[bool]

    def peer(self, stage: int, num_stages: int | None = None) -> int:
        """The other stage of this message; with ``num_stages``, across the wrap-around too."""
        step = 1 if (self.kind in DOWNSTREAM) == self.is_send else -1
        return (stage + step) % num_stages if num_stages else stage + step

    def channel(self, stage: int, num_stages: int | None = None) -> tuple[int, int, str]:
        """(sender, receiver, kind): one communicator per direction and pair."""
        peer = self.peer(stage, num_stages)
        return (stage, peer, self.kind) if self.is_send else (peer, stage, self.kind)

    def message(self, stage: int, num_stages: int) -> tuple[str, int, int]:
        """(kind, micro-batch, sending virtual stage): equal on the two ends of one message."""
        virtual = self.chunk * num_stages + stage
        if not self.is_send:
            virtual += -1 if self.kind in DOWNSTREAM else 1
        return self.kind, self.microbatch, virtual


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


@dataclass(frozen=True)
class RecvActivationShapeStart(CommInstruction):
    kind, is_send, is_start = ACT_SHAPE, False, True


@dataclass(frozen=True)
class RecvActivationShapeFinish(CommInstruction):
    kind, is_send, is_start = ACT_SHAPE, False, False


@dataclass(frozen=True)
class SendActivationShapeStart(CommInstruction):
    kind, is_send, is_start = ACT_SHAPE, True, True


@dataclass(frozen=True)
class SendActivationShapeFinish(CommInstruction):
    kind, is_send, is_start = ACT_SHAPE, True, False


@dataclass(frozen=True)
class RecvGradShapeStart(CommInstruction):
    kind, is_send, is_start = GRAD_SHAPE, False, True


@dataclass(frozen=True)
class RecvGradShapeFinish(CommInstruction):
    kind, is_send, is_start = GRAD_SHAPE, False, False


@dataclass(frozen=True)
class SendGradShapeStart(CommInstruction):
    kind, is_send, is_start = GRAD_SHAPE, True, True


@dataclass(frozen=True)
class SendGradShapeFinish(CommInstruction):
    kind, is_send, is_start = GRAD_SHAPE, True, False


# Data instruction -> the shape instructions it becomes with shapes (see with_shape_messages).
_WITH_SHAPES: dict[type, tuple[type, ...]] = {
    RecvActivationStart: (RecvActivationShapeStart,),
    RecvActivationFinish: (RecvActivationShapeFinish, RecvActivationStart, RecvActivationFinish),
    SendActivationStart: (SendActivationShapeStart, SendActivationStart),
    SendActivationFinish: (SendActivationShapeFinish, SendActivationFinish),
    RecvGradStart: (RecvGradShapeStart,),
    RecvGradFinish: (RecvGradShapeFinish, RecvGradStart, RecvGradFinish),
    SendGradStart: (SendGradShapeStart, SendGradStart),
    SendGradFinish: (SendGradShapeFinish, SendGradFinish),
}
SHAPE_KIND = {ACT: ACT_SHAPE, GRAD: GRAD_SHAPE}  # data kind -> the kind of its shape messages

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
        *{cls for classes in _WITH_SHAPES.values() for cls in classes},
    )
}


def _parse_instruction(text: str) -> Instruction:
    """``Name(arg)`` or, for a unit or message of chunk c > 0, ``Name(microbatch,c)``."""
    name, _, rest = text.strip().partition("(")
    cls = _BY_NAME.get(name)
    args = rest[:-1].split(",") if rest.endswith(")") else []
    if cls is None or not 1 <= len(args) <= (1 if cls is SetFrequency else 2):
        raise ScheduleError(f"cannot parse instruction {text!r}")
    try:
        return cls(*(int(a) for a in args))
    except ValueError:
        raise ScheduleError(f"cannot parse instruction {text!r}") from None


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
                out.append(F(ins.microbatch, ins.chunk))
            elif isinstance(ins, Backward):
                out.append(B(ins.microbatch, ins.chunk))
        return out


def with_shape_messages(program: StageProgram) -> StageProgram:
    """``program`` with a shape message ahead of every data message (variable sequence lengths).

    Posted-ahead data receives become shape receives at the same positions; a
    data receive is posted just before it is waited for, after its shape's wait;
    sends start and wait for the shape right before the data.
    """
    out: list[Instruction] = []
    for instr in program.instructions:
        classes = _WITH_SHAPES.get(type(instr))
        if classes is None or not isinstance(instr, CommInstruction):
            out.append(instr)
        else:
            out.extend(cls(instr.microbatch, instr.chunk) for cls in classes)
    return StageProgram(program.stage, tuple(out))


def _message_sequences(schedule: Schedule) -> list[dict[str, list[tuple[int, int]]]]:
    """Per stage and kind, the (micro-batch, receiving chunk) it receives, in its sender's send order.

    A channel is FIFO, so the receiver posts its receives in the order the
    sender sends: the sender's forward (activation) or backward (gradient)
    order. Rank 0 receives activations from rank P-1 (chunk v -> v+1), rank
    P-1 gradients from rank 0 (chunk v+1 -> v).
    """
    p, v_max = schedule.num_stages, schedule.num_chunks - 1
    out: list[dict[str, list[tuple[int, int]]]] = [{ACT: [], GRAD: []} for _ in range(p)]
    for s, order in enumerate(schedule.orders):
        for unit in order:
            v = unit.chunk
            if unit.is_forward and not (s == p - 1 and v == v_max):
                out[(s + 1) % p][ACT].append((unit.microbatch, v + 1 if s == p - 1 else v))
            elif not unit.is_forward and not (s == 0 and v == 0):
                out[(s - 1) % p][GRAD].append((unit.microbatch, v - 1 if s == 0 else v))
    return out


def build_programs(
    schedule: Schedule,
    plan: FrequencyPlan | None = None,
    prefetch: int = 2,
    shapes: bool = False,
) -> list[StageProgram]:
    """The instruction list of every stage for one iteration of ``schedule``.

    ``plan`` adds a ``SetFrequency`` wherever a unit's clock differs from the
    previous unit's (and once at the start). ``prefetch`` is how many receives
    per channel are posted ahead of use (receive buffers held per channel).
    With model chunks, a unit's input comes from the previous virtual stage
    (rank 0's chunk v > 0: from rank P-1's chunk v-1) and its gradient from the
    next one; only virtual stage 0 has no input and the last no output gradient.
    ``shapes``: variable sequence lengths, a shape message ahead of every data
    message (:func:`with_shape_messages`).
    """
    if prefetch < 1:
        raise ScheduleError(f"prefetch must be >= 1, got {prefetch}")
    if plan is not None and plan.schedule.orders != schedule.orders:
        raise ScheduleError("the frequency plan belongs to a different schedule")
    p, v_max = schedule.num_stages, schedule.num_chunks - 1
    incoming = _message_sequences(schedule)
    programs = []
    for s, order in enumerate(schedule.orders):
        out: list[Instruction] = []
        seqs = incoming[s]
        position = {kind: {msg: i for i, msg in enumerate(seq)} for kind, seq in seqs.items()}
        posted = {ACT: 0, GRAD: 0}  # receives posted so far, per channel
        starts = {ACT: RecvActivationStart, GRAD: RecvGradStart}

        # Bound per stage (defaults): the closure never outlives this iteration.
        def post(kind: str, upto: int, out: list[Instruction] = out, seqs: dict = seqs, posted: dict = posted,
                 starts: dict = starts) -> None:
            seq = seqs[kind]
            stop = min(len(seq), upto)
            while posted[kind] < stop:
                out.append(starts[kind](*seq[posted[kind]]))
                posted[kind] += 1

        def consume(kind: str, msg: tuple[int, int], finish: type, out: list[Instruction] = out,
                    position: dict = position, posted: dict = posted) -> None:
            i = position[kind][msg]
            if posted[kind] <= i:  # otherwise consumed in channel order: already prefetched
                post(kind, i + 1)
            out.append(finish(*msg))
            post(kind, i + 1 + prefetch)

        post(ACT, prefetch)
        post(GRAD, prefetch)
        grad_sends: list[tuple[int, int]] = []
        current = None
        for i, unit in enumerate(order):
            if plan is not None:
                f = plan.freqs_mhz[s][i]
                if f != current:
                    out.append(SetFrequency(f))
                    current = f
            msg = (unit.microbatch, unit.chunk)
            has_input = not (s == 0 and msg[1] == 0)
            has_output = not (s == p - 1 and msg[1] == v_max)
            if unit.is_forward:
                if has_input:
                    consume(ACT, msg, RecvActivationFinish)
                out.append(Forward(*msg))
                if has_output:
                    out.append(SendActivationStart(*msg))
            else:
                if has_output:
                    consume(GRAD, msg, RecvGradFinish)
                    # Its receiver consumed this activation before producing the
                    # gradient just received, so this wait never blocks.
                    out.append(SendActivationFinish(*msg))
                out.append(Backward(*msg))
                if has_input:
                    out.append(SendGradStart(*msg))
                    grad_sends.append(msg)
                out.append(Free(*msg))
        out.extend(SendGradFinish(*msg) for msg in sorted(grad_sends))
        programs.append(StageProgram(s, tuple(out)))
    for prog, order in zip(programs, schedule.orders):
        assert tuple(prog.units()) == order
    return [with_shape_messages(prog) for prog in programs] if shapes else programs


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
