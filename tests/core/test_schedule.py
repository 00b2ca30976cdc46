"""Schedules: hand-worked orders, an independent step-formula oracle, print/parse, validation."""

from __future__ import annotations

import itertools
import random

import pytest

from megatron_envpipe.core.kinds import build_schedule
from megatron_envpipe.core.schedule import (
    B,
    F,
    Schedule,
    ScheduleError,
    check_extra_warmup,
    clamp_extra_warmup,
    envpipe_schedule,
    one_f_one_b,
    raw_extra_warmup,
)

# envpipe.md §2.5, P=4, M=8 — transcribed from the notes, not generated.
HAND_1F1B = """
S0: F0 F1 F2 F3 B0 F4 B1 F5 B2 F6 B3 F7 B4 B5 B6 B7
S1: F0 F1 F2 B0 F3 B1 F4 B2 F5 B3 F6 B4 F7 B5 B6 B7
S2: F0 F1 B0 F2 B1 F3 B2 F4 B3 F5 B4 F6 B5 F7 B6 B7
S3: F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 F5 B5 F6 B6 F7 B7
"""
HAND_OURS_4310 = """
S0: F0 F1 F2 F3 F4 F5 F6 F7 B0 B1 B2 B3 B4 B5 B6 B7
S1: F0 F1 F2 F3 F4 F5 B0 F6 B1 F7 B2 B3 B4 B5 B6 B7
S2: F0 F1 F2 B0 F3 B1 F4 B2 F5 B3 F6 B4 F7 B5 B6 B7
S3: F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 F5 B5 F6 B6 F7 B7
"""
HAND_OURS_S1_R2 = "F0 F1 F2 F3 F4 B0 F5 B1 F6 B2 F7 B3 B4 B5 B6 B7"


def test_hand_worked_1f1b_p4_m8():
    assert one_f_one_b(4, 8).orders == Schedule.parse(HAND_1F1B).orders


def test_hand_worked_ours_p4_m8():
    assert envpipe_schedule(4, 8, [4, 3, 1, 0]).orders == Schedule.parse(HAND_OURS_4310).orders
    assert envpipe_schedule(4, 8, [4, 3, 1, 0]).peak_inflight() == (8, 6, 3, 1)
    s1 = envpipe_schedule(4, 8, [4, 2, 1, 0]).orders[1]
    assert " ".join(map(str, s1)) == HAND_OURS_S1_R2


def deepspeed_step_order(p: int, m: int, r: list[int]) -> list[list[str]]:
    """EnvPipe/DeepSpeed's step encoding (envpipe.md §2.1), an independent oracle.

    F(s, mb) runs at step 2mb+s and B(s, mb) at 2mb+2P-1-s+2r_s; a stage's order
    is its units sorted by step.
    """
    orders = []
    for s in range(p):
        units = [(2 * mb + s, f"F{mb}") for mb in range(m)]
        units += [(2 * mb + 2 * p - 1 - s + 2 * r[s], f"B{mb}") for mb in range(m)]
        orders.append([u for _, u in sorted(units)])
    return orders


@pytest.mark.parametrize("p,m", [(p, m) for p in (1, 2, 3, 4, 5, 8) for m in (1, 2, 3, p, p + 1, 2 * p, 4 * p)])
def test_1f1b_matches_step_formula_and_megatron_warmup(p, m):
    sched = one_f_one_b(p, m).validate()
    assert [[str(u) for u in o] for o in sched.orders] == deepspeed_step_order(p, m, [0] * p)
    for s in range(p):
        assert sched.forwards_before_first_backward(s) == min(p - s, m)
    assert sched.peak_inflight() == tuple(min(p - s, m) for s in range(p))


def test_ours_matches_step_formula_on_random_clamped_warmups():
    rng = random.Random(7)
    for _ in range(400):
        p = rng.randint(2, 9)
        m = rng.randint(p, 5 * p)
        raw = [rng.randint(0, m) for _ in range(p)]
        r = clamp_extra_warmup(p, m, raw)
        sched = envpipe_schedule(p, m, r).validate()
        assert [[str(u) for u in o] for o in sched.orders] == deepspeed_step_order(p, m, list(r)), (p, m, r)
        assert sched.peak_inflight() == tuple(min(m, p - s + r[s]) for s in range(p))


def test_print_parse_roundtrip():
    for sched in (one_f_one_b(5, 7), envpipe_schedule(4, 9, [3, 2, 1, 0])):
        assert Schedule.parse(str(sched)).orders == sched.orders


@pytest.mark.parametrize(
    "text,needle",
    [
        ("S0: F0 B0 F0 B1 F1", "more than once"),
        ("S0: B0 F0", "runs before F0"),
        ("S0: F0 F1 B0", "missing B1"),
        ("S0: F0 B0\nS2: F0 B0", "numbered 0..1"),
        ("S0: F0 X0", "cannot parse unit"),
        ("garbage", "expected 'S<stage>"),
        # Stage 0 waits for B0 from stage 1, which waits for F1 from stage 0: a cycle.
        ("S0: F0 B0 F1 B1\nS1: F0 F1 B0 B1", "deadlock"),
    ],
)
def test_invalid_schedules_are_rejected(text, needle):
    with pytest.raises(ScheduleError, match=needle):
        Schedule.parse(text)


def test_extra_warmup_formula_and_clamps():
    # T_B(f_max)/T_F(f_opt) = 1.5 -> r = floor(1.5*(P-s-1)) = [4, 3, 1, 0] before clamps (§2.5).
    raw = raw_extra_warmup(4, [1.5] * 4, [1.0] * 4)
    assert raw == [4, 3, 1, 0]
    assert clamp_extra_warmup(4, 8, raw) == (4, 3, 1, 0)
    # M-(P-s) caps: M=6 -> stage 0 at most 2, stage 1 at most 3 -> non-increasing -> [2,2,1,0].
    assert clamp_extra_warmup(4, 6, raw) == (2, 2, 1, 0)
    # The saturated-stage exception ([2,3,1,0] in EnvPipe) is not allowed: r is non-increasing.
    assert clamp_extra_warmup(4, 6, [2, 3, 1, 0]) == (2, 2, 1, 0)
    # Memory budget in activations: stage s already holds P-s under 1F1B.
    assert clamp_extra_warmup(4, 8, raw, max_inflight=6) == (2, 2, 1, 0)
    with pytest.raises(ScheduleError, match="below the 4 in-flight"):
        clamp_extra_warmup(4, 8, raw, max_inflight=3)


@pytest.mark.parametrize(
    "raw,needle",
    [
        ([3, 2, 1], r"extra warm-up has 3 value\(s\) \[3, 2, 1\] for 4 stages: give 4 whole numbers"),
        ([1, 1, 1, 0, 0], "has 5 value"),
        ([2, -1, 0, 0], r"stage 1 is negative \(-1\)"),
        ([1.5, 0, 0, 0], "stage 0 is 1.5, not a whole number"),
        ([float("nan"), 0, 0, 0], "stage 0 is nan"),
        ([True, 0, 0, 0], "stage 0 is True"),
        (7, "must be a list"),
    ],
)
def test_extra_warmup_input_mistakes_raise_instead_of_being_clamped(raw, needle):
    """A wrong count or a negative value is an input mistake (it used to be an IndexError or clamped away)."""
    with pytest.raises(ScheduleError, match=needle):
        clamp_extra_warmup(4, 8, raw)
    with pytest.raises(ScheduleError, match=needle):
        build_schedule("ours", 4, 8, raw)


def test_extra_warmup_checks_keep_good_input():
    assert check_extra_warmup(4, [4.0, 3, 1, 0]) == (4, 3, 1, 0)
    assert build_schedule("1f1b", 4, 8, [0, 0, 0, 0]) == one_f_one_b(4, 8)
    with pytest.raises(ScheduleError, match="scheduling '1f1b' has no extra warm-up"):
        build_schedule("1f1b", 4, 8, [1, 0, 0, 0])


def test_envpipe_schedule_rejects_unclamped_warmup():
    with pytest.raises(ScheduleError, match="non-increasing"):
        envpipe_schedule(4, 8, [1, 2, 0, 0])
    with pytest.raises(ScheduleError, match="last stage"):
        envpipe_schedule(2, 8, [1, 1])
    with pytest.raises(ScheduleError, match="above M-\\(P-s\\)"):
        envpipe_schedule(4, 6, [3, 0, 0, 0])


def test_every_clamped_schedule_is_valid_and_acyclic():
    for p, m in itertools.product(range(1, 7), range(1, 13)):
        raw = [m] * p
        r = clamp_extra_warmup(p, m, raw)
        sched = envpipe_schedule(p, m, r).validate()
        assert all(sched.orders[s].count(F(0)) == 1 and B(m - 1) in sched.orders[s] for s in range(p))
