"""The envpipe command's twins of the training flags read the one field table (config/flag_table.py):
each twin's help is the table's (citing the command's own flag names), its choices and its range are the
table's. A twin written by hand again, with its own words or bounds, fails here."""

from __future__ import annotations

import argparse
import re

import pytest

from megatron_envpipe.apps.cli.parser import build_parser
from megatron_envpipe.config.flag_table import FIELDS

TWINS = {f.cli_flag: f for f in FIELDS if f.cli_flag}
RENAMED = {f.flag: f.cli_flag for f in FIELDS if f.cli_flag}
# Where the command's value means something else than training's, so its words are its own:
# --max-inflight has no auto (nothing is measured offline); frontier --target-time picks a frontier point.
OWN_WORDS = {("*", "max_inflight"), ("frontier", "target_time_s")}


def _commands() -> dict[str, argparse.ArgumentParser]:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return dict(sub.choices)


def _twin_actions() -> list[tuple[str, argparse.Action]]:
    return [(command, action) for command, parser in _commands().items() for action in parser._actions
            if action.option_strings and action.option_strings[0] in TWINS]


TWIN_ACTIONS = _twin_actions()
IDS = [f"{command}{action.option_strings[0]}" for command, action in TWIN_ACTIONS]


def test_every_twin_in_the_table_is_a_flag_of_some_command():
    seen = {action.option_strings[0] for _, action in TWIN_ACTIONS}
    assert seen == set(TWINS), f"twins in the table no command has: {sorted(set(TWINS) - seen)}"
    assert len(TWIN_ACTIONS) >= 25  # plan, frontier, menu, simulate, schedule, programs share them


@pytest.mark.parametrize("command,action", TWIN_ACTIONS, ids=IDS)
def test_a_twin_says_what_the_table_says(command, action):
    field = TWINS[action.option_strings[0]]
    if ("*", field.name) in OWN_WORDS or (command, field.name) in OWN_WORDS:
        assert action.help and field.help not in action.help
        return
    words = re.sub(r"--envpipe-[a-z-]+", lambda m: RENAMED.get(m.group(0), m.group(0)), field.help)
    assert action.help.startswith(words), f"{command} {action.option_strings[0]}: {action.help!r} != {words!r}"
    assert "--envpipe-" not in words, "a twin cites a training flag the command does not have"


@pytest.mark.parametrize("command,action", TWIN_ACTIONS, ids=IDS)
def test_a_twin_takes_the_tables_choices_and_range(command, action):
    field = TWINS[action.option_strings[0]]
    if field.choices is not None:
        choices = field.choices() if callable(field.choices) else field.choices
        assert list(action.choices) == list(choices)
    limits = field.range
    if limits is None:
        return
    whole = limits.kind == "int"
    top = str(int(limits.high)) if whole else repr(limits.high)
    above = str(int(limits.high) + 1) if whole else repr(limits.high * 1.5 + 1)
    below = str(int(limits.low) - 1) if whole else repr(limits.low - 1.0)
    if not limits.high_open:
        assert action.type(top) == float(top)
    for bad in (above, below, "nan", "inf"):
        with pytest.raises(argparse.ArgumentTypeError):
            action.type(bad)
    if limits.low_open:
        with pytest.raises(argparse.ArgumentTypeError):
            action.type(repr(float(limits.low)))
