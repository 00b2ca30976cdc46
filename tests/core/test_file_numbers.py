"""The bounded number reader (core/file_numbers.py) and the files that read through it: every bad number is one
line naming the file and key, never an OverflowError or ValueError traceback (issue 39, class 1)."""

from __future__ import annotations

import pytest

from megatron_envpipe.core.file_numbers import _MAX_FILE_INT, cell_number, file_number, loads_json, loads_toml, short
from megatron_envpipe.core.flag_ranges import FlagRange
from megatron_envpipe.errors import UsageError

BIG = "1" + "0" * 400        # fits no float: float(), x 1e-3 and math.isfinite() overflow
HUGE = "1" + "0" * 5000      # more digits than Python parses (4300)
RANGE = FlagRange("float", 0.0, 1000.0, "ms")


class Bad(UsageError):
    pass


def _one_line(info: pytest.ExceptionInfo, *words: str) -> str:
    message = str(info.value)
    assert "\n" not in message and len(message) < 400, message
    for word in words:
        assert word in message, message
    return message


@pytest.mark.parametrize("value", [10**400, -(10**400), float("nan"), float("inf"), -float("inf"), 1000.5, -1, True,
                                   "5", None])
def test_file_number_refuses_out_of_range_before_converting(value):
    with pytest.raises(Bad) as info:
        file_number(value, RANGE, "f.toml: [dynamics] clock_latency_ms", Bad)
    _one_line(info, "f.toml: [dynamics] clock_latency_ms")


def test_file_number_converts_in_range_values():
    assert file_number(15, RANGE, "x", Bad) == 15.0 and isinstance(file_number(15, RANGE, "x", Bad), float)
    assert file_number(7, FlagRange("int", 0, 10), "x", Bad) == 7


def test_flag_range_compares_huge_integers_exactly():
    # math.isfinite(10**400) raises OverflowError: the range check must not call it on ints
    assert "at most 1000" in RANGE.problem(10**400)
    assert ">= 0" in RANGE.problem(-(10**400))


@pytest.mark.parametrize("text, words", [
    (f"[t]\nx = {BIG}\n", ["[t] x", "digits", "out of range"]),
    (f"[t]\nx = -{BIG}\n", ["[t] x", "digits"]),
    (f"[t]\nx = {HUGE}\n", ["4300 digits"]),
    ("[t]\nx = nan\n", ["[t] x", "finite"]),
    ("[t]\nx = -inf\n", ["[t] x", "finite"]),
    (f"[t]\nx = [1, {BIG}]\n", ["[t] x[1]"]),
    ("[t\n", ["not valid TOML"]),
])
def test_loads_toml_refuses_numbers_no_file_holds(text, words):
    with pytest.raises(Bad) as info:
        loads_toml(text, "f.toml", Bad)
    _one_line(info, "f.toml", *words)


def test_loads_toml_uses_a_keys_own_range():
    with pytest.raises(Bad) as info:
        loads_toml(f"[dynamics]\nclock_latency_ms = {BIG}\n", "f.toml", Bad, {"dynamics.clock_latency_ms": RANGE})
    _one_line(info, "f.toml: [dynamics] clock_latency_ms", "must be at most 1000 ms")
    assert loads_toml(f"[t]\nx = {_MAX_FILE_INT}\n", "f.toml", Bad) == {"t": {"x": _MAX_FILE_INT}}


@pytest.mark.parametrize("text, words", [
    (f'{{"energy_saving": {BIG}}}', ["more than 40 characters"]),
    (f'{{"energy_saving": {HUGE}}}', ["more than 40 characters"]),
    ('{"a": NaN}', ["NaN", "finite"]),
    ('{"a": -Infinity}', ["Infinity"]),
    ('{"a": 1e400}', ["a", "finite"]),
    ('{"a": [[' + str(_MAX_FILE_INT) + "]]}", []),  # the largest a file may hold
])
def test_loads_json_bounds_numbers(text, words):
    if not words:
        assert loads_json(text, "p.json", Bad) == {"a": [[_MAX_FILE_INT]]}
        return
    with pytest.raises(Bad) as info:
        loads_json(text, "p.json", Bad)
    _one_line(info, "p.json", *words)


@pytest.mark.parametrize("cell", ["abc", "nan", "-inf", "inf", "1_000", "0x10", BIG, " ", "1e400"])
def test_cell_number_refuses_what_no_measurement_writes(cell):
    with pytest.raises(Bad) as info:
        cell_number(cell, RANGE, "p.csv:3: time_rel_unc", Bad)
    _one_line(info, "p.csv:3: time_rel_unc")


def test_cell_number_reads_decimals_in_range():
    assert cell_number(" 12.5 ", RANGE, "x", Bad) == 12.5
    assert cell_number("1e2", FlagRange("int", 0, 1000), "x", Bad) == 100


def test_short_escapes_and_cuts():
    assert short("a\nERROR: forged") == "'a\\nERROR: forged'"
    assert "digits" in short(10**5000)  # str() of it would raise ValueError
    assert len(short("x" * 1000)) < 80
