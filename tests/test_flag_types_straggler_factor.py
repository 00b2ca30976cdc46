"""--envpipe-sim-straggler R:1 slows nothing (flag_types.py, issue 39): a flag that cannot act is refused,
naming what would make it act; factors above 1 are accepted as before."""

from __future__ import annotations

import argparse

import pytest

from megatron_envpipe.flag_types import SimStraggler, sim_straggler_arg


@pytest.mark.parametrize("text", ["1:1", "1:1.0", "0:1.0@5", "2:1e0"])
def test_a_factor_of_one_is_refused(text):
    with pytest.raises(argparse.ArgumentTypeError) as info:
        sim_straggler_arg(text)
    assert "slows nothing" in str(info.value) and "\n" not in str(info.value)


def test_a_factor_of_one_in_code_is_a_problem_too():
    assert "slows nothing" in (SimStraggler(1, 1.0).problem() or "")


@pytest.mark.parametrize("text, factor", [("1:1.01", 1.01), ("1:1.15@10", 1.15), ("0:4", 4.0)])
def test_factors_above_one_are_accepted(text, factor):
    assert sim_straggler_arg(text).factor == factor
