"""The ``envpipe`` command's twins of the training flags (``--type`` of ``--envpipe-type``), generated from
the one field table (config/flag_table.py): the meaning (help, with the training flags it cites renamed
to this surface's), the choices and the range are the table's; this module adds only what the command
does differently: its argparse type where it parses earlier or stricter (``--max-inflight`` has no
``auto``: nothing is measured here), a metavar, and per command the default and a note.

The command's own flags (``--profile``, ``--gpu`` as a GPU-table entry, ``--microbatches``, ...) have no
training twin and stay hand-written in parser.py. tests/apps/test_cli_twins.py keeps the two in step."""

from __future__ import annotations

import argparse
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from megatron_envpipe.apps.cli.arg_types import budget_arg, fraction, ranged, warmup_list
from megatron_envpipe.config.flag_table import BY_NAME, FIELDS
from megatron_envpipe.planning.switching import DEFAULT_SWITCH_LATENCY_S


@dataclass(frozen=True)
class _Twin:
    """What the command's flag adds to its table entry."""

    parse: Callable[[str], Any] | None = None  # None: the field's range through ranged(), else no type
    metavar: str | None = None
    help: str | None = None  # only where the command's value means something else than training's


# field -> its twin; every field with a cli_flag has one (the test checks).
_TWINS: dict[str, _Twin] = {
    "plan_type": _Twin(),
    "scheduling": _Twin(),
    "reconfig": _Twin(),
    "max_inflight": _Twin(budget_arg, "N|b0,b1,...|none",
                          help="activation budget of ours, in micro-batch activations: N for every stage or one per "
                               "stage, e.g. 8,7,6,5,4,3,2,1, or none (no limit)"),
    "extra_warmup": _Twin(warmup_list),
    "p2p_power_w": _Twin(),
    "reconfig_step_mhz": _Twin(),
    "prefetch": _Twin(),
    "timing_margin": _Twin(metavar="FRACTION"),
    "max_slowdown": _Twin(fraction),  # 0.05 or 5%, at most the table's range
    "target_time_s": _Twin(metavar="S"),
    "switch_cost_j": _Twin(metavar="J"),
    "max_clock_changes": _Twin(metavar="N"),
    "deadline_from": _Twin(),
}

# The training flag -> its twin, for the help texts that cite other flags.
_RENAMED = {f.flag: f.cli_flag for f in FIELDS if f.cli_flag}


def _twin_help(name: str) -> str:
    """The twin's help without its default: the table's, citing this command's flags (``--type optimal``)."""
    text = _TWINS[name].help or BY_NAME[name].help
    return re.sub(r"--envpipe-[a-z-]+", lambda m: _RENAMED.get(m.group(0), m.group(0)), text)


def add_twin(p: argparse.ArgumentParser, name: str, note: str = "", **more: Any) -> argparse.Action:
    """Add the twin of field ``name`` to ``p``; ``note`` follows the help (this command's default, how it
    combines), ``more`` are this command's add_argument keywords (default, action, help of another use)."""
    field, twin = BY_NAME[name], _TWINS[name]
    parse = twin.parse or (ranged(field.range) if field.range is not None else None)
    choices = field.choices() if callable(field.choices) else field.choices
    spec = {"type": parse, "choices": choices, "metavar": twin.metavar or field.metavar,
            "help": _twin_help(name) + note}
    spec = {key: value for key, value in spec.items() if value is not None}
    return p.add_argument(field.cli_flag, **{**spec, **more})


def add_switching_args(p: argparse.ArgumentParser, which: str) -> None:
    """--switch-cost-j and --max-clock-changes of 'plan', 'frontier' and 'menu': what a clock change costs the plan."""
    add_twin(p, "switch_cost_j", f" (0: off; default {which}the GPU's clock latency model, settle time "
             f"({DEFAULT_SWITCH_LATENCY_S * 1000:g} ms unless configs/gpus.toml says otherwise) x the P2P power"
             + (", off for the other types)" if which else ")"))
    add_twin(p, "max_clock_changes")
