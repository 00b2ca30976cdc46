"""One exception root: every error of the CLI path is an EnvPipeError, reported as one line.

``main`` catches exactly ``EnvPipeError``: a ``UsageError`` (input the user can
fix) exits 2, any other EnvPipeError 1; ``reset-clocks`` keeps its own 3/2.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from megatron_envpipe import EnvPipeError, UsageError
from megatron_envpipe.apps.cli import EXIT_FAILURE, EXIT_USAGE, CliError, gpu_cmds, main, planning_cmds
from megatron_envpipe.apps.demo_errors import DemoError
from megatron_envpipe.apps.plot import PlotUnavailableError
from megatron_envpipe.config import EnvPipeConfigError
from megatron_envpipe.core.gpu_specs import GpuSpecError
from megatron_envpipe.core.instructions import DeadlockError
from megatron_envpipe.core.profile import ProfileError
from megatron_envpipe.core.schedule import ScheduleError
from megatron_envpipe.gpu.devices.base import GpuError, GpuPermissionError
from megatron_envpipe.planning.basis import PlannerError
from megatron_envpipe.planning.optimal import InfeasibleDeadline

PLAN = ["plan", "--profile", "a40/gpt3-175b", "-m", "12"]


@pytest.mark.parametrize(
    "cls", [CliError, ProfileError, ScheduleError, PlannerError, InfeasibleDeadline, GpuSpecError,
            EnvPipeConfigError, PlotUnavailableError],
)
def test_user_input_errors_are_usage_errors(cls):
    assert issubclass(cls, UsageError) and issubclass(cls, EnvPipeError)


@pytest.mark.parametrize("cls", [DeadlockError, GpuError, GpuPermissionError, DemoError])
def test_other_cli_path_errors_derive_from_the_root(cls):
    assert issubclass(cls, EnvPipeError)


def test_exit_statuses():
    assert (EXIT_USAGE, EXIT_FAILURE) == (2, 1)


@pytest.mark.parametrize(
    "argv,needle",
    [
        (["plan", "--profile", "missing.csv", "-m", "4"], "envpipe plan: error: no profile 'missing.csv'"),
        (PLAN + ["--stages", "4"], "envpipe plan: error: --stages 4 does not match the profile's 8 stages"),
        (["simulate", "--profile", "a40/gpt3-175b"], "envpipe simulate: error: simulate needs --plan"),
    ],
)
def test_bad_input_exits_2_with_one_line_and_no_traceback(argv, needle):
    """Through the real interpreter entry (``python -m megatron_envpipe.apps.cli``)."""
    proc = subprocess.run([sys.executable, "-m", "megatron_envpipe.apps.cli", *argv], capture_output=True, text=True)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.startswith(needle) and proc.stderr.count("\n") == 1, proc.stderr
    assert "Traceback" not in proc.stderr and proc.stdout == ""


def test_demo_error_is_reported_as_bad_input(capsys, tmp_path):
    assert main(["demo", "--out", str(tmp_path), "--config", str(tmp_path / "none.toml")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("envpipe demo: error: ") and "cannot read demo config" in err and err.count("\n") == 1


def test_other_envpipe_errors_exit_1(capsys, monkeypatch):
    def fail(*args, **kwargs):
        raise DeadlockError("stage 1 waits on stage 0")

    monkeypatch.setattr(planning_cmds, "plan_envpipe", fail)
    assert main(PLAN) == 1
    assert capsys.readouterr().err == "envpipe plan: error: stage 1 waits on stage 0\n"


def test_only_envpipe_errors_are_caught(monkeypatch):
    def bug(*args, **kwargs):
        raise KeyError("a bug, not bad input")

    monkeypatch.setattr(planning_cmds, "plan_envpipe", bug)
    with pytest.raises(KeyError):
        main(PLAN)


@pytest.mark.parametrize("exc,code", [(GpuPermissionError("no permission"), 3), (GpuError("NVML gone"), 2)])
def test_reset_clocks_keeps_its_exit_statuses(capsys, monkeypatch, exc, code):
    def fail(*args, **kwargs):
        raise exc

    monkeypatch.setattr(gpu_cmds, "reset_clocks_from_state", fail)
    assert main(["reset-clocks"]) == code
    assert capsys.readouterr().err == f"envpipe reset-clocks: error: {exc}\n"


@pytest.mark.parametrize(
    "flag,names",
    [("--scheduling", "'1f1b', 'ours', 'interleaved'"), ("--type", "'baseline', 'uniform', 'envelope', 'optimal'"),
     ("--reconfig", "'default', 'greedy', 'balanced'"), ("--comm", "'per-direction', 'paired'")],
)
def test_invalid_choices_list_plain_names(capsys, flag, names):
    with pytest.raises(SystemExit) as info:
        main(PLAN + [flag, "x"])
    assert info.value.code == 2
    assert f"invalid choice: 'x' (choose from {names})" in capsys.readouterr().err
