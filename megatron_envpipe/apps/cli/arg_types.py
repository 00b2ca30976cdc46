"""The ``envpipe`` flag types (ranges from core.flag_ranges, shared with training's flags), the switching
flags, and the flags of ``envpipe menu``: what parser.py and the command modules share."""

from __future__ import annotations

import argparse
from collections.abc import Callable

from megatron_envpipe.config import fraction as parse_fraction
from megatron_envpipe.config import int_list, max_inflight_arg
from megatron_envpipe.core.flag_ranges import RANGES, FlagRange
from megatron_envpipe.core.memory import AUTO, Budget
from megatron_envpipe.core.resources import shipped_profiles
from megatron_envpipe.core.vocabulary import CommModel, Scheduling
from megatron_envpipe.planning.menu import MENU_SCHEDULES
from megatron_envpipe.planning.switching import DEFAULT_SWITCH_LATENCY_S


# -- flag types -----------------------------------------------------------------------
# Every range comes from core.flag_ranges, the table the --envpipe-* training flags read too.
def ranged(key: str) -> Callable[[str], int | float]:
    """argparse type: a number of the kind and range of ``RANGES[key]`` (nan and inf never pass)."""
    limits: FlagRange = RANGES[key]

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


def add_switching_args(p: argparse.ArgumentParser, which: str) -> None:
    """--switch-cost-j and --max-clock-changes of 'plan' and 'frontier': what a clock change costs the plan."""
    p.add_argument("--switch-cost-j", type=ranged("switch_cost_j"), metavar="J",
                   help="joules a clock change costs: neighbouring units' clocks are merged while that gives up less "
                        "than J per change removed, and the plan's energy counts J per change it keeps (0: off; "
                        f"default {which}the GPU's clock latency model, settle time ({DEFAULT_SWITCH_LATENCY_S * 1000:g} "
                        "ms unless configs/gpus.toml says otherwise) x the P2P power"
                        + (", off for the other types)" if which else ")"))
    p.add_argument("--max-clock-changes", type=ranged("max_clock_changes"), metavar="N",
                   help="at most N clock changes per rank per iteration (the first lock counts), where the "
                        "deadline allows")



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


def add_menu_args(p: argparse.ArgumentParser) -> None:
    """The flags of 'menu': the profile and GPU flags of 'plan' (no --plot), M, the budget, the switching flags."""
    names = ", ".join(shipped_profiles())
    p.add_argument("--profile", required=True, help=f"Perseus-format CSV, or a shipped profile: {names}")
    p.add_argument("--gpu", help="GPU table entry (configs/gpus.toml; default for a shipped profile: its GPU)")
    p.add_argument("--p2p-power", type=ranged("p2p_power_w"), help="P2P blocking power in W (default: the GPU table's)")
    p.add_argument("--p2p-latency", type=ranged("p2p_latency_s"), default=0.0, help="latency of each P2P message in s")
    p.add_argument("--time-scale", type=ranged("profile_scale"), default=1.0, help="multiply profile times")
    p.add_argument("--energy-scale", type=ranged("profile_scale"), default=1.0, help="multiply profile energies")
    p.add_argument("--microbatches", "-m", type=ranged("microbatches"), required=True, help="micro-batches per iteration")
    p.add_argument("--stages", type=ranged("stages"), help="pipeline stages (checked against the profile)")
    p.add_argument("--max-inflight", type=budget_arg, metavar="N|b0,b1,...|none",
                   help="activation budget in micro-batch activations per stage: ours plans within it, interleaved "
                        "must fit it (an error if not); default none")
    p.add_argument("--schedules", type=menu_schedules, default=MENU_SCHEDULES, metavar="1f1b,ours,interleaved",
                   help="the schedules to plan (default all; interleaved only where Megatron allows M)")
    p.add_argument("--virtual-stages", type=ranged("virtual_stages"), default=2, metavar="V",
                   help="model chunks per rank of the interleaved rows (default 2)")
    add_switching_args(p, "")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    p.add_argument("--out", metavar="MENU.json", help="write the menu as JSON")
    # What planner_config reads from plan's flags: the budget reaches ours through scheduling "ours".
    p.set_defaults(scheduling=Scheduling.OURS.value, extra_warmup=None, comm=CommModel.PER_DIRECTION.value)
