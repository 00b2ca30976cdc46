"""Lazy communicator creation: the deadlock of the programs' own first uses, and the warm-up chain.

Model (``check_deadlock(..., lazy_communicators=True)``): a channel's
communicator is created by the first operation on it, on either of its two
stages, and creating it blocks until the other stage creates it too (NCCL's
lazy init). Pure Python, no torch.
"""

from __future__ import annotations

import random

import pytest

from megatron_envpipe.core.communicators import creation_order, disjoint_classes, warmup_order, warmup_programs
from megatron_envpipe.core.deadlock import check_deadlock
from megatron_envpipe.core.instructions import ACT, GRAD, CommInstruction, DeadlockError, build_programs
from megatron_envpipe.core.schedule import Schedule, envpipe_schedule, one_f_one_b

SCHEDULES = [one_f_one_b(2, 2), one_f_one_b(2, 8), one_f_one_b(4, 8), one_f_one_b(8, 16),
             envpipe_schedule(4, 8, [4, 3, 1, 0]), envpipe_schedule(8, 16, [6, 5, 4, 3, 2, 2, 1, 0])]


def random_schedule(rng: random.Random) -> Schedule:
    """1F1B, or EnvPipe with any non-increasing extra warm-up (saturated stages included)."""
    p, m = rng.randint(2, 12), rng.randint(1, 40)
    if rng.random() < 0.2:
        return one_f_one_b(p, m)
    r, prev = [], m
    for s in range(p - 1):
        cap = min(prev, max(0, m - (p - s)))
        value = rng.choice([cap, rng.randint(0, cap)]) if cap > 0 else 0
        r.append(value)
        prev = value
    return envpipe_schedule(p, m, r + [0])


@pytest.mark.parametrize("sched", SCHEDULES, ids=lambda s: f"{s.name}-P{s.num_stages}-M{s.num_microbatches}")
def test_the_programs_own_first_uses_deadlock_when_communicators_are_lazy(sched):
    programs = build_programs(sched)
    check_deadlock(programs)  # the FIFO rendezvous model alone finds nothing
    # Stage 0 first posts a gradient receive from stage 1, stage 1 an activation receive from stage 0.
    with pytest.raises(DeadlockError, match=r"stage 0 blocked at RecvGradStart\(0\) creating communicator "
                                            r"\(1, 0, 'grad'\) waiting on stage 1; stage 1 blocked at "
                                            r"RecvActivationStart\(0\) creating communicator \(0, 1, 'act'\)"):
        check_deadlock(programs, lazy_communicators=True)


@pytest.mark.parametrize("sched", SCHEDULES, ids=lambda s: f"{s.name}-P{s.num_stages}-M{s.num_microbatches}")
def test_the_warmup_chain_makes_warmup_and_programs_deadlock_free(sched):
    programs = build_programs(sched)
    steps = check_deadlock(programs, lazy_communicators=True, warmup=warmup_programs(sched.num_stages))
    warm = sum(len(w) for w in warmup_programs(sched.num_stages))
    assert steps == check_deadlock(programs) + warm  # warm-up, then exactly the programs' steps


def test_property_random_plans_are_deadlock_free_after_the_warmup():
    rng = random.Random(12)
    for _ in range(400):
        sched = random_schedule(rng)
        programs = build_programs(sched, prefetch=rng.choice([1, 2, 3]))
        with pytest.raises(DeadlockError, match="creating communicator"):
            check_deadlock(programs, lazy_communicators=True)
        check_deadlock(programs, lazy_communicators=True, warmup=warmup_programs(sched.num_stages))


def test_a_warmup_in_opposite_orders_on_neighbours_is_caught():
    # Even stages activations first, odd stages gradients first: a cycle on every pair.
    p = 4
    warm = [sorted(warmup_order(s, p), key=lambda c: (c[2] == (ACT if s % 2 else GRAD), c)) for s in range(p)]
    with pytest.raises(DeadlockError, match=r"stage 0 blocked at warm-up creating communicator \(0, 1, 'act'\) "
                                            r"waiting on stage 1; stage 1 blocked at warm-up creating "
                                            r"communicator \(1, 0, 'grad'\)"):
        check_deadlock(build_programs(one_f_one_b(p, 8)), lazy_communicators=True, warmup=warm)


def test_warmup_order_is_the_global_order_restricted_to_the_stage_and_covers_its_program():
    for sched in SCHEDULES:
        p = sched.num_stages
        order = creation_order(p)
        for prog in build_programs(sched):
            mine = warmup_order(prog.stage, p)
            assert mine == [c for c in order if c in mine]  # a subsequence of the one global order
            used = {i.channel(prog.stage) for i in prog.instructions if isinstance(i, CommInstruction)}
            assert set(mine) == used
    assert creation_order(3) == [(0, 1, ACT), (1, 0, GRAD), (1, 2, ACT), (2, 1, GRAD)]
    assert warmup_programs(1) == [[]]


def test_disjoint_classes_cover_every_channel_once_without_a_stage_twice():
    for p in range(1, 10):
        classes = disjoint_classes(p)
        assert len(classes) == (0 if p == 1 else 2 if p == 2 else 4)
        assert sorted(c for cls in classes for c in cls) == sorted(creation_order(p))
        for cls in classes:
            stages = [s for c in cls for s in c[:2]]
            assert len(stages) == len(set(stages))
            assert len({c[2] for c in cls}) == 1


def test_warmup_entries_are_validated():
    programs = build_programs(one_f_one_b(3, 3))
    with pytest.raises(DeadlockError, match="not one of its channels"):
        check_deadlock(programs, warmup=[[(1, 2, ACT)], [], []])
    with pytest.raises(DeadlockError, match="warm-up for 2 stages"):
        check_deadlock(programs, warmup=[[], []])


def test_lazy_model_with_one_communicator_per_pair():
    # PyTorch's default: one communicator per pair, shared by both directions. The warm-up
    # still orders creation, but the programs then deadlock for the FIFO reason (envpipe.md §8.3).
    programs = build_programs(one_f_one_b(4, 8))
    with pytest.raises(DeadlockError, match=r"stage \d blocked at"):
        check_deadlock(programs, shared_pair_stream=True, lazy_communicators=True, warmup=warmup_programs(4))
