"""Megatron's interleaved order (model chunks): hand-worked tables and orders, sizes, print/parse, validation.

The comparison with Megatron-core's own functions (0.16 and 0.19, table helpers
and a real gloo run) is tests/megatron/test_interleaved_order.py.
"""

from __future__ import annotations

import pytest

from megatron_envpipe.core.interleaved import (
    _interleaved_order,
    _interleaved_schedule_table,
    _interleaved_warmup_counts,
    check_interleaved_sizes,
    interleaved_schedule,
)
from megatron_envpipe.core.kinds import build_schedule, scheduling_names
from megatron_envpipe.core.schedule import (
    B,
    F,
    Schedule,
    ScheduleError,
    Unit,
    message_source,
    unit_dag,
)
from megatron_envpipe.core.vocabulary import Scheduling


def valid_sizes(max_p: int = 5):
    for p in range(2, max_p + 1):
        for v in (1, 2, 3, 4):
            for m in range(p, 4 * p + 2):
                for n in range(p, m + 1):
                    if not 0 < m % n < p:
                        yield p, v, m, n


def test_units_print_and_parse_with_chunks():
    assert str(F(3)) == "F3" and str(F(3, 0)) == "F3" and str(B(3, 1)) == "B3v1"
    assert Unit.parse("F3") == F(3) == Unit.parse("F3v0")
    assert Unit.parse(" B12v3 ") == B(12, 3)
    for bad in ("F3v", "Fv1", "F3v-1", "F3 v1", "X3v1"):
        with pytest.raises(ScheduleError, match="cannot parse unit"):
            Unit.parse(bad)
    with pytest.raises(ScheduleError, match="model chunk id must be >= 0"):
        F(0, -1)


def test_scheduling_vocabulary_has_interleaved():
    assert Scheduling.INTERLEAVED == "interleaved" and "interleaved" in scheduling_names()


def test_schedule_table_matches_megatrons_documented_example():
    # schedules.py, forward_backward_pipelining_with_interleaving, "PP2 N3M5 with VP2" (transcribed):
    # virtual_microbatch_id | 0 1 2 3 4 5 6 7 8 9
    # microbatch_id         | 0 1 2 0 1 2 3 4 3 4
    # model_chunk_id        | 0 0 0 1 1 1 0 0 1 1
    table = _interleaved_schedule_table(5, 2, 3)
    assert [mb for mb, _ in table] == [0, 1, 2, 0, 1, 2, 3, 4, 3, 4]
    assert [c for _, c in table] == [0, 0, 0, 1, 1, 1, 0, 0, 1, 1]


def test_hand_worked_order_p2_v2_m4():
    # N = P = 2: table (0,0) (1,0) (0,1) (1,1) (2,0) (3,0) (2,1) (3,1); W_0 = 2*1 + 1*2 = 4, W_1 = 2.
    # Backward k runs table[k]'s micro-batch on chunk 1 - table[k].chunk.
    hand = """
    S0: F0 F1 F0v1 F1v1 F2 B0v1 F3 B1v1 F2v1 B0 F3v1 B1 B2v1 B3v1 B2 B3
    S1: F0 F1 F0v1 B0v1 F1v1 B1v1 F2 B0 F3 B1 F2v1 B2v1 F3v1 B3v1 B2 B3
    """
    sched = interleaved_schedule(2, 4, 2)
    assert sched.orders == Schedule.parse(hand).orders
    assert (sched.name, sched.num_chunks, sched.num_microbatches) == ("interleaved", 2, 4)
    assert _interleaved_warmup_counts(2, 4, 2) == (4, 2)


def test_hand_worked_order_with_a_group_size_above_p():
    # P = 2, V = 2, N = 3, M = 5: the table above; W_0 = 2 + 3 = 5, W_1 = 3.
    sched = interleaved_schedule(2, 5, 2, microbatch_group_size=3)
    assert " ".join(map(str, sched.orders[1])) == (
        "F0 F1 F2 F0v1 B0v1 F1v1 B1v1 F2v1 B2v1 F3 B0 F4 B1 F3v1 B2 F4v1 B3v1 B4v1 B3 B4"
    )


def test_every_valid_size_validates_and_has_megatrons_warmup():
    checked = 0
    for p, v, m, n in valid_sizes():
        case = (p, v, m, n)
        # Validated by the parse below: the parsed schedule has the same orders and sizes (both checked).
        sched = interleaved_schedule(p, m, v, n)
        assert sched.num_microbatches == m and sched.num_chunks == v, case
        total = m * v
        warmup_counts = _interleaved_warmup_counts(p, m, v, n)
        for s in range(p):
            w = min(total, 2 * (p - s - 1) + (v - 1) * n)
            # W warm-up forwards, then the first steady pair's forward (unless all forwards come first).
            assert sched.forwards_before_first_backward(s) == (w + 1 if w < total else total), case
            assert warmup_counts[s] == w, case
            assert sched.orders[s] == _interleaved_order(s, p, m, v, n), case
            # Forwards of each chunk run in micro-batch order, backwards too (Megatron's FIFO per chunk).
            seen = {(c, forward): [] for c in range(v) for forward in (True, False)}
            for u in sched.orders[s]:
                seen[(u.chunk, u.is_forward)].append(u.microbatch)
            assert all(mbs == list(range(m)) for mbs in seen.values()), case
        parsed = Schedule.parse(str(sched), name="interleaved")  # validates; (the name is only a label)
        assert parsed.orders == sched.orders, case
        assert parsed.num_chunks == v, case
        checked += 1
    assert checked > 500


def test_printed_form_names_the_chunks():
    text = str(interleaved_schedule(2, 2, 2))
    assert text.splitlines()[0].startswith("# schedule interleaved: 2 stages x 2 micro-batches x 2 model chunks")
    assert text.splitlines()[1] == "S0: F0 F1 F0v1 F1v1 B0v1 B1v1 B0 B1"


@pytest.mark.parametrize(
    "p,m,v,n,needle",
    [
        (1, 4, 2, None, "pipeline stages .* must be at least 2"),
        (4, 3, 2, None, "M=3 < P=4"),
        (4, 8, 0, None, "virtual stages V.* must be at least 1"),
        (4, 8, 2, 3, r"group size N=3 .* must lie in \[P=4, M=8\]"),
        (4, 8, 2, 9, r"group size N=9 .* must lie in \[P=4, M=8\]"),
        (4, 10, 2, None, "last group of 2 < P=4.*use M a multiple of 4$"),
        (3, 11, 2, 5, "last group of 1 < P=3.*a multiple of 5 or with M mod 5 >= 3"),
        (4, 8.5, 2, None, "micro-batches .* whole number"),
        (True, 8, 2, None, "whole number"),
        (4, 8, 2.0, 4, None),  # an integral float is fine
    ],
)
def test_sizes_megatron_refuses_are_refused(p, m, v, n, needle):
    if needle is None:
        assert check_interleaved_sizes(p, m, v, n) == 4
        return
    with pytest.raises(ScheduleError, match=needle):
        interleaved_schedule(p, m, v, n)


def test_group_size_defaults_to_p_and_remainders_of_at_least_p_are_fine():
    assert check_interleaved_sizes(4, 8, 2) == 4
    assert interleaved_schedule(4, 8, 2).orders == interleaved_schedule(4, 8, 2, 4).orders
    assert interleaved_schedule(4, 8, 2).orders != interleaved_schedule(4, 8, 2, 8).orders
    interleaved_schedule(3, 7, 2, 4).validate()  # 7 = 4 + 3: last group of 3 >= P


def test_dag_has_the_wrap_around_messages():
    p, v, m = 3, 3, 3
    sched = interleaved_schedule(p, m, v)
    dag = unit_dag(sched)
    sender = {dag.nodes[i]: (dag.nodes[j] if j >= 0 else None) for i, j in enumerate(dag.message_pred)}
    for mb in range(m):
        for c in range(v):
            for s in range(p):
                g = c * p + s  # virtual stage
                want_f = None if g == 0 else ((g - 1) % p, F(mb, (g - 1) // p))
                want_b = None if g == p * v - 1 else ((g + 1) % p, B(mb, (g + 1) // p))
                assert sender[(s, F(mb, c))] == want_f
                assert sender[(s, B(mb, c))] == want_b
                assert message_source(p, v, s, F(mb, c)) == want_f


def test_validate_checks_every_chunk():
    good = interleaved_schedule(2, 2, 2)
    missing = Schedule(2, (good.orders[0][:-1], good.orders[1]), num_chunks=2)
    with pytest.raises(ScheduleError, match="stage 0: missing B1"):
        missing.validate()
    early = "S0: F0 F1 F0v1 B0v1 F1v1 B1v1 B0 B1\nS1: F0 F1 B0v1 F0v1 F1v1 B1v1 B0 B1"
    with pytest.raises(ScheduleError, match="stage 1: B0v1 runs before F0v1"):
        Schedule.parse(early)
    beyond = Schedule(2, good.orders, num_chunks=1)
    with pytest.raises(ScheduleError, match=r"F0v1 is outside micro-batches 0..1 and chunks 0..0"):
        beyond.validate()
    with pytest.raises(ScheduleError, match="at least one model chunk"):
        Schedule(2, good.orders, num_chunks=0).validate()


def test_build_schedule_by_name():
    assert build_schedule("interleaved", 4, 8, num_chunks=2).orders == interleaved_schedule(4, 8, 2).orders
    assert build_schedule(Scheduling.INTERLEAVED, 4, 10, num_chunks=2, microbatch_group_size=5).orders == (
        interleaved_schedule(4, 10, 2, 5).orders
    )
    assert build_schedule("interleaved", 4, 8, extra_warmup=[0, 0, 0, 0], num_chunks=2).num_chunks == 2
    with pytest.raises(ScheduleError, match="'interleaved' has no extra warm-up"):
        build_schedule("interleaved", 4, 8, extra_warmup=[1, 0, 0, 0], num_chunks=2)
    for name, extra in (("1f1b", None), ("ours", [0, 0, 0, 0])):
        with pytest.raises(ScheduleError, match=f"'{name}' runs one model chunk per stage"):
            build_schedule(name, 4, 8, extra, num_chunks=2)
        with pytest.raises(ScheduleError, match="group size applies to scheduling 'interleaved' only"):
            build_schedule(name, 4, 8, extra, microbatch_group_size=4)
    # One-chunk schedules are what they were.
    assert build_schedule("1f1b", 4, 8).num_chunks == 1
    assert all(u.chunk == 0 for o in build_schedule("ours", 4, 8, [1, 1, 0, 0]).orders for u in o)
