"""The ``envpipe`` flag types (ranges from core.flag_ranges, shared with training's flags), and the type of
``envpipe menu --schedules``: what parser.py, twins.py and the command modules share."""

from __future__ import annotations

import argparse
from collections.abc import Callable

from megatron_envpipe.config import fraction as parse_fraction
from megatron_envpipe.config import int_list, max_inflight_arg
from megatron_envpipe.core.flag_ranges import RANGES, FlagRange
from megatron_envpipe.core.memory import AUTO, Budget
from megatron_envpipe.planning.menu import MENU_SCHEDULES


# -- flag types -----------------------------------------------------------------------
# Every range comes from core.flag_ranges, the table the --envpipe-* training flags read too.
def ranged(key: str | FlagRange) -> Callable[[str], int | float]:
    """argparse type: a number of the kind and range of ``RANGES[key]`` (or of the range itself: a twin's
    is its training flag's, apps/cli/twins.py); nan and inf never pass."""
    limits: FlagRange = RANGES[key] if isinstance(key, str) else key

    def parse(text: str) -> int | float:
        try:
            value = int(text) if limits.kind == "int" else float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"expected a {'whole number' if limits.kind == 'int' else 'number'}, got {text!r}") from None
        if not limits.holds(value):
            if limits.kind == "int":
                raise argparse.ArgumentTypeError(f"must be between {limits.low:g} and {limits.high:g}, got {text}")
            raise argparse.ArgumentTypeError(f"must be a finite number {limits.describe()}, got {text}")
        return value

    return parse


def fraction(text: str) -> float:
    """``0.05`` or ``5%`` -> 0.05, at most 1 (100 %): the parser of --envpipe-max-slowdown, and its range."""
    value = parse_fraction(text)
    most = RANGES["max_slowdown"].high
    if value > most:
        raise argparse.ArgumentTypeError(
            f"must be a fraction between 0 and {most:g} ({100 * most:g} %): 0.05 or 5% is 5 % slower, got {text}")
    return value


def warmup_list(text: str) -> list[int]:
    """``4,3,1,0`` -> ``[4, 3, 1, 0]``: whole numbers >= 0 (their count is checked against the stages later)."""
    values = int_list(text)
    if not values:
        raise argparse.ArgumentTypeError(f"expected whole numbers, one per stage, e.g. 4,3,1,0, got {text!r}")
    if any(v < 0 for v in values):
        raise argparse.ArgumentTypeError(f"extra warm-up values must be >= 0, got {text}")
    return values


def budget_arg(text: str) -> Budget:
    """``--max-inflight``: ``N`` for every stage, ``4,3,2,2`` one per stage, or ``none``; each 1..10^9.

    ``auto`` needs memory measured in a training run (``--envpipe-max-inflight auto``), so it is refused
    here; the count of a per-stage list is checked against the stages by the planner.
    """
    value = max_inflight_arg(text)
    if value == AUTO:
        raise argparse.ArgumentTypeError(
            "auto derives the budget from memory measured while training (--envpipe-max-inflight auto); "
            "here give N for every stage, one per stage (e.g. 8,7,6,5,4,3,2,1), or none")
    limits = RANGES["max_inflight"]
    for b in value if isinstance(value, tuple) else (value,):
        if b is not None and not limits.holds(b):
            raise argparse.ArgumentTypeError(f"each budget must be between {limits.low:g} and {limits.high:g} "
                                             f"micro-batch activations, got {text}")
    return value


def menu_schedules(text: str) -> tuple[str, ...]:
    """``--schedules 1f1b,ours``: a subset of 1f1b, ours, interleaved (argparse type)."""
    given = [n.strip() for n in text.split(",")]
    names = tuple(dict.fromkeys(given))
    bad = [n for n in names if n not in MENU_SCHEDULES]
    if bad or not names:
        raise argparse.ArgumentTypeError(f"expected some of {','.join(MENU_SCHEDULES)}, comma-separated, got {text!r}")
    if len(names) < len(given):  # a repeated name would plan nothing more: say so rather than drop it
        twice = sorted({n for n in given if given.count(n) > 1})
        raise argparse.ArgumentTypeError(f"{', '.join(twice)} given twice in {text!r}: name each schedule once")
    return names
