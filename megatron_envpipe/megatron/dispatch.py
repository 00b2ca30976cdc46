"""The executor's handler table: one handler per instruction class, checked up front.

The executor dispatches every instruction of a stage's program through a dict
``type -> handler`` (as DynaPipe's executor does). :func:`checked_handler_table`
builds it and refuses a table that misses a concrete instruction class of
:mod:`megatron_envpipe.core.instructions`, so a new instruction without a
handler fails when the executor is constructed, not halfway through an
iteration. Pure Python: no torch.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Mapping

from megatron_envpipe.core import instructions
from megatron_envpipe.core.instructions import Instruction
from megatron_envpipe.errors import EnvPipeError

__all__ = ["Handler", "HandlerTableError", "checked_handler_table"]

Handler = Callable[[Instruction], None]


class HandlerTableError(EnvPipeError, TypeError):
    """The executor's handler table misses an instruction class (or names a non-instruction)."""


@functools.cache
def _instruction_classes() -> frozenset[type[Instruction]]:
    """Every concrete instruction class :mod:`~megatron_envpipe.core.instructions` defines.

    Concrete means no class of that module derives from it: ``Instruction`` and
    ``CommInstruction`` are bases, never instructions of a program.
    """
    defined = [
        cls for _, cls in inspect.getmembers(instructions, inspect.isclass)
        if issubclass(cls, Instruction) and cls.__module__ == instructions.__name__
    ]
    return frozenset(cls for cls in defined if not any(o is not cls and issubclass(o, cls) for o in defined))


def checked_handler_table(handlers: Mapping[type[Instruction], Handler]) -> dict[type[Instruction], Handler]:
    """``handlers`` as a dict, if it has exactly one handler per concrete instruction class.

    Raises :class:`HandlerTableError` naming the classes without a handler, and
    any key that is not a concrete instruction class (dispatch is by exact
    type, so a handler for a base class would never run).
    """
    expected = _instruction_classes()
    missing = sorted(cls.__name__ for cls in expected - handlers.keys())
    unknown = sorted(getattr(k, "__name__", repr(k)) for k in handlers.keys() - expected)
    if missing or unknown:
        parts = []
        if missing:
            parts.append(f"no handler for {', '.join(missing)}")
        if unknown:
            parts.append(f"handlers for non-instructions {', '.join(unknown)}")
        raise HandlerTableError(f"EnvPipe executor: {'; '.join(parts)} (every instruction class of "
                                f"megatron_envpipe.core.instructions needs exactly one handler)")
    return dict(handlers)
