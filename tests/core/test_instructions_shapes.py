"""Shape messages for variable sequence lengths: programs, channels and the static deadlock check (pure Python).

With Megatron's ``variable_seq_lengths`` every data message is preceded by a
shape message on a channel of its own; a data receive is posted only once its
shape is known. The check proves 1F1B, EnvPipe's order and the interleaved
order with shapes (lazy communicators and the warm-up included), and fails on
programs that post shapes and data out of order, or put shapes on the data's
communicator (where a prefetched shape receive pairs with the wrong message).
"""

from __future__ import annotations

import random

import pytest

from megatron_envpipe.core.communicators import creation_order, disjoint_classes, warmup_order, warmup_programs
from megatron_envpipe.core.deadlock import check_deadlock
from megatron_envpipe.core.instructions import (
    ACT,
    ACT_SHAPE,
    GRAD,
    GRAD_SHAPE,
    CommInstruction,
    DeadlockError,
    RecvActivationShapeStart,
    RecvActivationStart,
    RecvGradShapeStart,
    SendActivationShapeStart,
    SendGradShapeFinish,
    StageProgram,
    _parse_instruction,
    build_programs,
    with_shape_messages,
)
from megatron_envpipe.core.interleaved import interleaved_schedule
from megatron_envpipe.core.schedule import Schedule, envpipe_schedule, one_f_one_b

SHAPE_KINDS = {ACT_SHAPE, GRAD_SHAPE}
SHAPE = {ACT: ACT_SHAPE, GRAD: GRAD_SHAPE}


def cases() -> list[tuple[str, Schedule]]:
    """1F1B, EnvPipe's extended warm-ups (graded and saturated) and Megatron's interleaved order."""
    out: list[tuple[str, Schedule]] = []
    for p in (2, 3, 4):
        for m in (p, 2 * p, 4 * p):
            out.append(("1f1b", one_f_one_b(p, m)))
            out.append(("ours", envpipe_schedule(p, m, [(m - p) * (p - 1 - s) // (p - 1) for s in range(p)])))
            out.append(("interleaved", interleaved_schedule(p, m, 2)))
    return out


def _comm(program: StageProgram) -> list[CommInstruction]:
    return [i for i in program.instructions if isinstance(i, CommInstruction)]


@pytest.mark.parametrize("prefetch", [1, 2, 3])
def test_programs_with_shapes_are_deadlock_free_with_lazy_communicators(prefetch: int) -> None:
    for name, sched in cases():
        wrap = sched.num_chunks > 1
        programs = build_programs(sched, prefetch=prefetch, shapes=True)
        assert [tuple(p.units()) for p in programs] == list(sched.orders), name
        check_deadlock(programs)
        check_deadlock(programs, lazy_communicators=True,
                       warmup=warmup_programs(sched.num_stages, wrap=wrap, shapes=True))


def test_every_data_message_has_one_shape_message_and_waits_for_it() -> None:
    checked = 0
    for name, sched in cases():
        for before, after in zip(build_programs(sched), build_programs(sched, shapes=True), strict=True):
            data = _comm(before)
            shapes = [i for i in _comm(after) if i.kind in SHAPE_KINDS]
            assert len(shapes) == len(data), name  # one shape start or finish per data start or finish
            # Leaving the shape messages out: the same data ops, in the same order, with receives posted later.
            assert sorted(map(str, (i for i in _comm(after) if i.kind not in SHAPE_KINDS))) == sorted(map(str, data))
            # A data receive is posted right after its shape's wait and right before its own wait.
            body = after.instructions
            for k, instr in enumerate(body):
                if isinstance(instr, CommInstruction) and instr.kind in (ACT, GRAD) and not instr.is_send \
                        and instr.is_start:
                    assert body[k - 1].kind == SHAPE[instr.kind] and not body[k - 1].is_start, (name, body[k - 1])
                    assert (body[k - 1].microbatch, body[k - 1].chunk) == (instr.microbatch, instr.chunk)
                    assert type(body[k + 1]).__name__ == type(instr).__name__.replace("Start", "Finish")
                    checked += 1
    assert checked > 100


def test_fixed_length_programs_have_no_shape_messages() -> None:
    for _, sched in cases():
        plain = build_programs(sched)
        for program in plain:
            assert not any(i.kind in SHAPE_KINDS for i in _comm(program))
        assert build_programs(sched, shapes=True) == [with_shape_messages(p) for p in plain]
    assert creation_order(3) == [(0, 1, ACT), (1, 0, GRAD), (1, 2, ACT), (2, 1, GRAD)]
    assert warmup_order(1, 3) == [(0, 1, ACT), (1, 0, GRAD), (1, 2, ACT), (2, 1, GRAD)]


def test_shape_instructions_print_and_parse() -> None:
    for instr in (RecvActivationShapeStart(3), RecvGradShapeStart(2, 1), SendActivationShapeStart(0, 1),
                  SendGradShapeFinish(5)):
        assert _parse_instruction(str(instr)) == instr
    assert str(RecvActivationShapeStart(3)) == "RecvActivationShapeStart(3)"
    assert str(SendGradShapeFinish(2, 1)) == "SendGradShapeFinish(2,1)"
    # Shape and data of one message: same peer and direction, channels of their own.
    assert SendActivationShapeStart(2).channel(1, 4) == (1, 2, ACT_SHAPE)
    assert RecvGradShapeStart(2).channel(1, 4) == (2, 1, GRAD_SHAPE)
    assert RecvActivationShapeStart(0, 1).channel(0, 4) == (3, 0, ACT_SHAPE)  # the wrap-around


def test_shape_channels_get_created_in_one_chain_and_split_classes() -> None:
    for p in (2, 3, 4, 5):
        for wrap in (False, True):
            order = creation_order(p, wrap, shapes=True)
            assert len(order) == len(set(order)) == 2 * len(creation_order(p, wrap))
            assert [c for c in order if c[2] in (ACT, GRAD)] == creation_order(p, wrap)
            classes = disjoint_classes(p, wrap, shapes=True)
            assert sorted(c for cls in classes for c in cls) == sorted(order)
            for cls in classes:
                stages = [s for c in cls for s in c[:2]]
                assert len(stages) == len(set(stages))


def test_shapes_on_the_data_channels_deadlock() -> None:
    """Why shapes have channels of their own: on the data's communicator, a shape receive posted ahead
    is matched (NCCL: posting order per communicator) against the previous data message."""
    failures = 0
    for _, sched in cases():
        if sched.num_microbatches < 2:
            continue
        programs = build_programs(sched, prefetch=2, shapes=True)
        check_deadlock(programs)  # on channels of their own: fine
        with pytest.raises(DeadlockError):
            check_deadlock(programs, shapes_on_data_channels=True)
        failures += 1
    assert failures >= 20


def _swap(program: StageProgram, a: int, b: int) -> StageProgram:
    body = list(program.instructions)
    body[a], body[b] = body[b], body[a]
    return StageProgram(program.stage, tuple(body))


def test_shape_receives_out_of_order_are_caught() -> None:
    programs = build_programs(one_f_one_b(4, 8), shapes=True)
    stage = programs[1]
    starts = [k for k, i in enumerate(stage.instructions) if isinstance(i, RecvActivationShapeStart)]
    bad = list(programs)
    bad[1] = _swap(stage, starts[0], starts[1])  # shape receives of micro-batches 0 and 1 swapped
    with pytest.raises(DeadlockError):
        check_deadlock(bad)


def test_data_receive_posted_before_its_shape_is_caught() -> None:
    programs = build_programs(one_f_one_b(4, 8), shapes=True)
    stage = programs[2]
    k = next(k for k, i in enumerate(stage.instructions) if isinstance(i, RecvActivationStart))
    bad = list(programs)
    bad[2] = _swap(stage, k - 1, k)  # RecvActivationStart before RecvActivationShapeFinish
    with pytest.raises(DeadlockError, match=r"stage 2: RecvActivationStart\(0\) is posted before its shape is known"):
        check_deadlock(bad)


def test_data_sent_without_its_shape_is_caught() -> None:
    programs = build_programs(one_f_one_b(3, 6), shapes=True)
    stage = programs[0]
    body = tuple(i for i in stage.instructions if not (isinstance(i, SendActivationShapeStart) and i.microbatch == 2))
    bad = [StageProgram(0, body), *programs[1:]]
    with pytest.raises(DeadlockError):
        check_deadlock(bad)


def test_shape_channels_need_their_warm_up() -> None:
    """With lazy communicators the shape channels' first uses also form a cycle unless warmed up in order."""
    failures = 0
    for _, sched in cases():
        wrap = sched.num_chunks > 1
        programs = build_programs(sched, shapes=True)
        try:
            check_deadlock(programs, lazy_communicators=True, warmup=warmup_programs(sched.num_stages, wrap=wrap))
        except DeadlockError:
            failures += 1
    assert failures


def test_random_envpipe_orders_with_shapes_are_deadlock_free() -> None:
    rng = random.Random(25)
    for _ in range(200):
        p, m = rng.randint(2, 8), rng.randint(1, 24)
        r, prev = [], m
        for s in range(p - 1):
            cap = min(prev, max(0, m - (p - s)))
            prev = rng.randint(0, cap) if cap > 0 else 0
            r.append(prev)
        sched = envpipe_schedule(p, m, r + [0])
        programs = build_programs(sched, prefetch=rng.choice([1, 2, 3]), shapes=True)
        check_deadlock(programs, lazy_communicators=True, warmup=warmup_programs(p, shapes=True))
