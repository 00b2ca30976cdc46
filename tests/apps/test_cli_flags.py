"""``envpipe`` flags (issue 20): none silently ignored, no empty list entries, one range table with the training flags.

Each bad case runs through ``main(argv)`` in a fresh folder and must exit 2 with one
line ``envpipe <cmd>: error: ...`` naming the flag, no traceback, nothing on stdout,
nothing written. The training twins of these flags are in
tests/megatron/test_training_flags.py.
"""

from __future__ import annotations

import argparse
import shlex
from pathlib import Path

import pytest

from megatron_envpipe.apps.cli import build_parser, main
from megatron_envpipe.core.flag_ranges import RANGES
from megatron_envpipe.core.gpu_specs import MAX_P2P_POWER_W
from megatron_envpipe.flag_types import _check_no_empty_entry, int_list, max_inflight_arg, memory_model_arg
from megatron_envpipe.planning.basis import _MAX_TIMING_MARGIN, _MAX_VIRTUAL_STAGES, PlannerConfig, PlannerError
from megatron_envpipe.planning.switching import _MAX_SWITCH_COST_J

PLAN = "plan --profile a40/gpt3-175b -m 12"
FRONTIER = "frontier --profile a40/gpt3-175b -m 12 --points 3"
SIMULATE = "simulate --profile a40/gpt3-175b -m 12"
SCHEDULE = "schedule --stages 4 -m 8"
PROGRAMS = "programs --stages 4 -m 8"

# class 1: a flag that would do nothing is refused (argv, what the one line must say)
IGNORED = [
    (f"{PLAN} --scheduling 1f1b --max-inflight 4", "--max-inflight 4 budgets the extra warm-up of --scheduling ours"),
    (f"{FRONTIER} --scheduling 1f1b --max-inflight 8", "--scheduling 1f1b has none, so it would be ignored"),
    (f"{SCHEDULE} --max-inflight 4,3,2,1", "--max-inflight 4,3,2,1 budgets the extra warm-up"),
    (f"{SCHEDULE} --scheduling interleaved --virtual-stages 2 --max-inflight 4",
     "--scheduling interleaved has none, so it would be ignored"),
    (f"{PLAN} --scheduling interleaved --virtual-stages 2 --max-inflight 12", "--max-inflight 12 budgets"),
    (f"{PLAN} --compat perseus --scheduling 1f1b --virtual-stages 2", "--compat perseus has no --virtual-stages"),
    (f"{PLAN} --compat perseus --scheduling 1f1b --virtual-stages 1", "--compat perseus has no --virtual-stages"),
    (f"{PLAN} --type baseline --switch-cost-j 0.5", "--switch-cost-j 0.5 does nothing with --type baseline"),
    (f"{PLAN} --type baseline --max-clock-changes 5", "--max-clock-changes 5 does nothing with --type baseline"),
    (f"{PLAN} --type baseline --timing-margin 0.01", "--timing-margin 0.01 does nothing with --type baseline"),
    (f"{PLAN} --type baseline --timing-margin 0", "--timing-margin 0 does nothing with --type baseline"),
    (f"{PLAN} --type optimal --reconfig-step 60", "--reconfig-step 60 sets the step of offline reconfiguration, "
                                                  "and --type optimal plans without reconfiguration"),
    (f"{PLAN} --reconfig default --reconfig-step 60", "--reconfig default turns reconfiguration off"),
]

# class 2: an empty list entry is refused naming the flag and the entry
EMPTY_ENTRIES = [
    (f"{PLAN} --extra-warmup 4,4,,4,0,0,0,0", "argument --extra-warmup: entry 3 of '4,4,,4,0,0,0,0' is empty"),
    (f"{PLAN} --scheduling ours --max-inflight 8,,8", "argument --max-inflight: entry 2 of '8,,8' is empty"),
    (f"{FRONTIER} --max-inflight ,8", "argument --max-inflight: entry 1 of ',8' is empty"),
    (f"{SIMULATE} --scheduling ours --extra-warmup 1,0,", "argument --extra-warmup: entry 3 of '1,0,' is empty"),
    (f"{SCHEDULE} --scheduling ours --extra-warmup 3,2,1,,0", "argument --extra-warmup: entry 4"),
    (f"{SCHEDULE} --scheduling ours --max-inflight '4, ,4,4'", "argument --max-inflight: entry 2"),
    (f"{PROGRAMS} --scheduling ours --extra-warmup ,3,2,1,0", "argument --extra-warmup: entry 1"),
]

# class 3: the ranges of core.flag_ranges (the training twins read the same entries)
RANGE_CASES = [
    (f"{PLAN} --type optimal --max-slowdown 2", "argument --max-slowdown: must be a fraction between 0 and 1"),
    (f"{PLAN} --type optimal --max-slowdown 150%", "argument --max-slowdown: must be a fraction between 0 and 1"),
    (f"{PLAN} --type optimal --target-time 2e6", "argument --target-time: must be a finite number > 0 and <= 1e+06 s"),
    (f"{PLAN} --scheduling ours --max-inflight 2000000", "each budget must be between 1 and 1e+06"),
    (f"{SCHEDULE} --scheduling ours --max-inflight 8,8,8,2000000", "each budget must be between 1 and 1e+06"),
    (f"{PROGRAMS} --prefetch 20000", "argument --prefetch: must be between 1 and 10000"),
    (f"{PLAN} --switch-cost-j 2e6", "argument --switch-cost-j: must be a finite number >= 0 and <= 1e+06 J"),
    (f"{PLAN} --max-clock-changes 2000000", "argument --max-clock-changes: must be between 1 and 1e+06"),
    (f"{PLAN} --timing-margin 0.6", "argument --timing-margin: must be a finite number >= 0 and <= 0.5"),
    (f"{PLAN} --timing-margin inf", "argument --timing-margin: must be a finite number"),
    (f"{PLAN} --scheduling interleaved --virtual-stages 65", "argument --virtual-stages: must be between 1 and 64"),
    (f"{PLAN} --reconfig-step 200000", "argument --reconfig-step: must be between 1 and 100000"),
    (f"{PLAN} --p2p-power 20000", "argument --p2p-power: must be a finite number >= 0 and <= 10000 W"),
]

CASES = [pytest.param(argv, needle, id=f"ignored: {argv}") for argv, needle in IGNORED] + \
        [pytest.param(argv, needle, id=f"empty entry: {argv}") for argv, needle in EMPTY_ENTRIES] + \
        [pytest.param(argv, needle, id=f"range: {argv}") for argv, needle in RANGE_CASES]


def _tree(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*")}


def run(argv: list[str], capsys) -> tuple[int, str, str]:
    try:
        code = main(argv)
    except SystemExit as exc:  # argparse's errors
        code = exc.code
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.mark.parametrize("argv,needle", CASES)
def test_bad_flag_exits_2_with_one_line_and_writes_nothing(argv, needle, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    words = shlex.split(argv) + (["--json"] if argv.startswith(("plan", "frontier")) else [])
    if words[0] == "plan":
        words += ["--out", str(tmp_path / "plan.json")]  # a fix that came too late would write it
    code, out, err = run(words, capsys)
    assert code == 2, err
    assert err.startswith(f"envpipe {words[0]}: error: ") and err.count("\n") == 1, err
    assert needle in err and "Traceback" not in err and out == "", err
    assert _tree(tmp_path) == set()


@pytest.mark.parametrize("argv", [
    f"{PLAN} --scheduling ours --max-inflight 8",  # where the budget applies
    f"{PLAN} --type baseline",  # no default of the baseline-only refusals triggers
    f"{PLAN} --type envelope --switch-cost-j 0.5 --max-clock-changes 5 --timing-margin 0.01 --reconfig-step 60",
    f"{PLAN} --type optimal --max-slowdown 100%",  # the top of the range
    f"{PLAN} --compat perseus --scheduling 1f1b",
    f"{FRONTIER} --scheduling ours --max-inflight 8",
    f"{SCHEDULE} --scheduling ours --max-inflight 4,3,2,2",
    f"{SCHEDULE} --scheduling ours --extra-warmup '3, 2, 1, 0'",
    f"{PROGRAMS} --prefetch 10000",
])
def test_flags_that_apply_still_pass(argv, capsys):
    code, out, err = run(shlex.split(argv), capsys)
    assert code == 0 and err == "", err


# -- the one table ------------------------------------------------------------------------
def test_the_planners_own_limits_are_the_tables():
    """The planner's constants sit in a later layer than core.flag_ranges: they must agree with it."""
    assert RANGES["timing_margin"].high == _MAX_TIMING_MARGIN
    assert RANGES["virtual_stages"].high == _MAX_VIRTUAL_STAGES
    assert RANGES["switch_cost_j"].high == _MAX_SWITCH_COST_J
    assert RANGES["p2p_power_w"].high == MAX_P2P_POWER_W


# (range key, the CLI flag and the words it needs; value placeholder {v})
CLI_TWINS = [
    ("p2p_power_w", f"{PLAN} --p2p-power {{v}}"),
    ("clock_mhz", f"{PLAN} --reconfig-step {{v}}"),
    ("max_slowdown", f"{PLAN} --type optimal --max-slowdown {{v}}"),
    ("target_time_s", f"{PLAN} --type optimal --target-time {{v}}"),
    ("switch_cost_j", f"{PLAN} --switch-cost-j {{v}}"),
    ("max_clock_changes", f"{PLAN} --max-clock-changes {{v}}"),
    ("timing_margin", f"{PLAN} --timing-margin {{v}}"),
    ("max_inflight", f"{PLAN} --max-inflight {{v}}"),
    ("prefetch", f"{PROGRAMS} --prefetch {{v}}"),
    ("virtual_stages", f"{PLAN} --scheduling interleaved --virtual-stages {{v}}"),
]


def _above(key: str) -> str:
    limits = RANGES[key]
    return str(int(limits.high) + 1) if limits.kind == "int" else repr(limits.high * 1.5)


@pytest.mark.parametrize("key,argv", CLI_TWINS, ids=[k for k, _ in CLI_TWINS])
def test_cli_flag_takes_its_range_from_the_table(key, argv, capsys):
    """The top of the table's range parses, anything above is refused (the training twin: the other test file)."""
    parser = build_parser()
    top = RANGES[key].high
    shown = str(int(top)) if RANGES[key].kind == "int" else repr(top)
    parser.parse_args(shlex.split(argv.format(v=shown)))
    with pytest.raises(SystemExit):
        parser.parse_args(shlex.split(argv.format(v=_above(key))))
    assert capsys.readouterr().err.count("\n") == 1


# -- the list parsers on their own (Python API) -------------------------------------------
@pytest.mark.parametrize("parse", [int_list, max_inflight_arg, memory_model_arg, _check_no_empty_entry])
@pytest.mark.parametrize("text,entry", [("4,,4", 2), (",4", 1), ("4,", 2), ("4, ,4", 2), ("1,2,3,,", 4)])
def test_list_parsers_name_the_empty_entry(parse, text, entry):
    with pytest.raises(argparse.ArgumentTypeError, match=f"entry {entry} of .* is empty"):
        parse(text)


def test_blank_lists_are_left_for_the_caller_to_call_empty():
    assert int_list(",") == [] and int_list("") == []


def test_planner_config_refuses_an_activation_budget_with_1f1b():
    """Python API twin of `--max-inflight` with `--scheduling 1f1b`: refused, not silently dropped."""
    with pytest.raises(PlannerError, match=r"--max-inflight .* applies to --scheduling ours.*drop --max-inflight"):
        PlannerConfig("envelope", "1f1b", max_inflight=4).validate()
    with pytest.raises(PlannerError, match="applies to --scheduling ours"):
        PlannerConfig("optimal", "1f1b", max_inflight=(4, 3)).validate()
    assert PlannerConfig("envelope", "ours", max_inflight=4).validate().max_inflight == 4
    assert PlannerConfig("envelope", "1f1b").validate().max_inflight is None
