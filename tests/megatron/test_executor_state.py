"""The executor's process-wide state changes only through its methods (megatron/state.py): the ones that
replaced the assignments other modules made (tests/test_run_state_ownership.py lists its owner)."""

from __future__ import annotations

import pytest

pytest.importorskip("torch", reason="the executor state imports the channels (torch)")

from megatron_envpipe.core import instructions as ins  # noqa: E402
from megatron_envpipe.megatron.state import ExecutorState  # noqa: E402


def test_show_program_says_when_verbose_prints_a_program_again():
    state = ExecutorState()
    one = (ins.Forward(0), ins.Backward(0))
    other = (ins.Forward(1),)
    assert state.show_program(one) and not state.show_program(one)  # printed once while it does not change
    assert state.show_program(other) and state.show_program(one)  # and again each time it changes
    assert state.shown_program == one


def test_device_set_up_marks_the_device_ready_until_the_next_install():
    state = ExecutorState()
    link = object()
    state.device_set_up(link)  # type: ignore[arg-type]
    assert state.device_ready and state.device_time is link
    state.configure(None, original=lambda **_: [])  # type: ignore[arg-type]
    assert not state.device_ready and state.device_time is None
