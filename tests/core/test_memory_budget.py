"""The activation budget's arithmetic (core.memory) and how the schedule and planner apply it."""

from __future__ import annotations

import itertools

import pytest

from megatron_envpipe.core.memory import (
    _GIB,
    AUTO,
    MIB,
    MemoryModel,
    StageMemory,
    _one_f_one_b_need,
    budget_line,
    budget_problem,
    derive_budget,
    parse_max_inflight,
    show_budget,
    within_budget,
)
from megatron_envpipe.core.schedule import ScheduleError, clamp_extra_warmup, envpipe_schedule, one_f_one_b
from megatron_envpipe.planning.basis import PlannerConfig, PlannerError


@pytest.mark.parametrize("text,value", [
    ("auto", AUTO), (" AUTO ", AUTO), ("none", None), ("unlimited", None), ("8", 8), ("0", 0),
    ("4,3,2,2", (4, 3, 2, 2)), ("4, 3,2 ,2", (4, 3, 2, 2)), ("5,", None),
])
def test_parse_max_inflight_forms(text, value):
    if text == "5,":
        with pytest.raises(ValueError, match="expected auto, none, a whole number"):
            parse_max_inflight(text)
        return
    assert parse_max_inflight(text) == value


@pytest.mark.parametrize("text", ["nan", "8.5", "four", "", "4;3", "auto,3"])
def test_parse_max_inflight_rejects_other_text(text):
    with pytest.raises(ValueError, match=repr(text).replace("(", r"\(")):
        parse_max_inflight(text)


def test_show_budget_spells_the_flag():
    assert [show_budget(b) for b in (AUTO, None, 8, (4, 3, None))] == ["auto", "none", "8", "4,3,none"]


def test_one_f_one_b_need_is_the_1f1b_peak():
    for p, m in itertools.product(range(1, 9), range(1, 20)):
        assert _one_f_one_b_need(p, m) == one_f_one_b(p, m).peak_inflight()
    assert _one_f_one_b_need(4, None) == (4, 3, 2, 1)


def test_budget_problem_names_the_stage_and_the_fix():
    assert budget_problem(4, 8, None) is None and budget_problem(4, 8, 4) is None
    assert budget_problem(4, 8, (4, 3, 2, 1)) is None and budget_problem(4, 8, (4, None, 2, 1)) is None
    assert budget_problem(4, 2, (2, 2, 2, 1)) is None  # M = 2: 1F1B holds at most 2
    assert "below the 4" in budget_problem(4, 8, 3) and "stage 0" in budget_problem(4, 8, 3)
    msg = budget_problem(4, 8, (4, 3, 1, 1))
    assert "stage 2's budget 1 is below the 2" in msg and "at least 4,3,2,1" in msg
    msg = budget_problem(4, 8, (4, 3))
    assert "4,3 has 2 entries but the pipeline has 4 stages" in msg and "one per stage" in msg


def test_within_budget():
    assert within_budget([8, 6, 3, 1], None) and within_budget([8, 6, 3, 1], 8)
    assert within_budget([8, 6, 3, 1], (8, 6, None, 1)) and not within_budget([8, 6, 3, 1], (8, 5, 3, 1))
    assert not within_budget([8, 6, 3, 1], 7)


def test_memory_model_parses_and_checks():
    model = MemoryModel.parse("0.75, 256")
    assert model == MemoryModel(0.75, 256.0)
    assert model.stage_memory() == StageMemory(256 * MIB, int(0.75 * _GIB))
    for bad, needle in (("2", "GIB_FREE,MIB_PER_MICROBATCH"), ("2,x", "GIB_FREE"), ("1,2,3", "GIB_FREE"),
                        ("-1,256", "free memory"), ("nan,256", "free memory"), ("2,0", "activation memory"),
                        ("2,inf", "activation memory")):
        with pytest.raises(ValueError, match=needle):
            MemoryModel.parse(bad)


def test_derive_budget_fits_the_free_memory_above_1f1b():
    # 4 GiB free at 1F1B's peak, 256 MiB per micro-batch: margin max(512 MiB, 410 MiB) = 512 MiB,
    # (4096 - 512) / 256 = 14 more activations on every stage, capped at M.
    mem = [StageMemory(256 * MIB, 4 * _GIB)] * 4
    assert derive_budget(8, mem) == (8, 8, 8, 8)
    assert derive_budget(32, mem) == (18, 17, 16, 15)
    # 20 GiB free: a 10 % margin (2 GiB) -> 18 GiB / 1 GiB = 18 more.
    assert derive_budget(64, [StageMemory(_GIB, 20 * _GIB)] * 2) == (20, 19)
    # Too little free memory: never below 1F1B's own need.
    assert derive_budget(8, [StageMemory(256 * MIB, 0)] * 4) == (4, 3, 2, 1)
    assert derive_budget(8, [StageMemory(256 * MIB, 600 * MIB)] * 4) == (4, 3, 2, 1)
    # Per stage: later stages have more room (and here also smaller activations).
    mem = [StageMemory(512 * MIB, _GIB), StageMemory(256 * MIB, _GIB), StageMemory(256 * MIB, 2 * _GIB)]
    assert derive_budget(24, mem) == (4, 4, 7)
    # Nothing measured on a stage: no limit there.
    assert derive_budget(8, [StageMemory(0, _GIB), StageMemory(256 * MIB, _GIB)]) == (None, 3)


def test_stage_memory_merges_pessimistically():
    a, b = StageMemory(100, 5000), StageMemory(120, 4000)
    assert a.merge(b) == b.merge(a) == StageMemory(120, 4000)


def test_budget_line_format():
    mem = [StageMemory(256 * MIB, int(0.75 * _GIB))] * 4
    line = budget_line((5, 4, 3, 2), mem, "memory model")
    assert line.startswith("activation budget per stage [5, 4, 3, 2] (256 MiB per micro-batch, 0.75 GiB free")
    mem = [StageMemory(300 * MIB, 20 * _GIB), StageMemory(250 * MIB, 30 * _GIB)]
    assert "([300, 250] MiB per micro-batch, [20, 30] GiB free" in budget_line((9, None), mem, "x")
    assert "[9, none]" in budget_line((9, None), mem, "x")


@pytest.mark.parametrize("p,m", [(4, 8), (4, 16), (8, 12), (8, 24), (8, 96), (3, 3)])
def test_clamped_schedule_never_exceeds_a_per_stage_budget(p, m):
    """Every per-stage budget >= 1F1B's need, any raw r: the schedule's peak per stage fits."""
    need = _one_f_one_b_need(p, m)
    raw = [m] * (p - 1) + [0]
    for extra in itertools.product(range(3), repeat=p):
        budget = tuple(n + e for n, e in zip(need, extra, strict=True))
        r = clamp_extra_warmup(p, m, raw, budget)
        peaks = envpipe_schedule(p, m, r).peak_inflight()
        assert within_budget(peaks, budget), (budget, r, peaks)
        if p > 4:
            break  # 3^8 budgets is too many: the first is enough there


def test_clamp_errors_name_the_stage():
    with pytest.raises(ScheduleError, match=r"stage 2: activation budget \(max-inflight\) 1 is below the 2 .*"
                                            r"give at least 2 for stage 2"):
        clamp_extra_warmup(4, 8, [3, 2, 1, 0], (4, 3, 1, 1))
    with pytest.raises(ScheduleError, match="4,none has 2 entries but the pipeline has 4 stages"):
        clamp_extra_warmup(4, 8, [3, 2, 1, 0], (4, None))


def test_planner_config_takes_auto_as_no_limit_and_checks_entries():
    assert PlannerConfig(max_inflight=AUTO).max_inflight is None
    assert PlannerConfig(max_inflight=[4, 3]).max_inflight == (4, 3)
    for bad in (0, (4, 0), (4, True), 2.5):
        with pytest.raises(PlannerError, match="whole numbers >= 1"):
            PlannerConfig(max_inflight=bad).validate()
