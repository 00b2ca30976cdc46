"""The executor's handler table: one handler per instruction class, checked at construction."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch", reason="needs torch and megatron-core: pip install -e '.[megatron]' (install.sh does)")
pytest.importorskip("megatron.core", reason="needs torch and megatron-core: pip install -e '.[megatron]' (install.sh does)")

from megatron_envpipe.core import instructions as ins
from megatron_envpipe.errors import EnvPipeError
from megatron_envpipe.megatron.dispatch import HandlerTableError, _instruction_classes, checked_handler_table
from megatron_envpipe.megatron.executor import StageIteration


def _noop(instr: ins.Instruction) -> None:
    pass


def test_instruction_classes_are_the_concrete_ones():
    names = {cls.__name__ for cls in _instruction_classes()}
    assert names == {
        "SetFrequency", "Forward", "Backward", "Free",
        "RecvActivationStart", "RecvActivationFinish", "SendActivationStart", "SendActivationFinish",
        "RecvGradStart", "RecvGradFinish", "SendGradStart", "SendGradFinish",
        # Shape messages (variable sequence lengths).
        "RecvActivationShapeStart", "RecvActivationShapeFinish", "SendActivationShapeStart",
        "SendActivationShapeFinish", "RecvGradShapeStart", "RecvGradShapeFinish", "SendGradShapeStart",
        "SendGradShapeFinish",
    }


def test_a_table_missing_a_type_fails_naming_it():
    table = {cls: _noop for cls in _instruction_classes() if cls not in (ins.Free, ins.SendGradFinish)}
    with pytest.raises(HandlerTableError, match="no handler for Free, SendGradFinish") as info:
        checked_handler_table(table)
    assert isinstance(info.value, EnvPipeError)


def test_a_handler_for_a_base_class_is_refused():
    table = {cls: _noop for cls in _instruction_classes()}
    table[ins.CommInstruction] = _noop  # dispatch is by exact type: this would never run
    with pytest.raises(HandlerTableError, match="non-instructions CommInstruction"):
        checked_handler_table(table)


def test_executor_handles_every_instruction():
    # Bound methods need no iteration state, so an unconstructed executor builds the table.
    table = StageIteration.__new__(StageIteration).handler_table()
    assert set(table) == _instruction_classes()
    assert all(handler.__self__ is not None for handler in table.values())


def test_executor_missing_a_handler_fails_at_construction():
    class Incomplete(StageIteration):
        def handler_table(self):
            table = super().handler_table()
            del table[ins.SetFrequency]
            return checked_handler_table(table)

    with pytest.raises(HandlerTableError, match="no handler for SetFrequency"):
        Incomplete(*[None] * 14)
