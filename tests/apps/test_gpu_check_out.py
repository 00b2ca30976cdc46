"""gpu-check's --out folder and its command line (apps/gpu_check/runner.py, cli.py, bench/gpu_check.sh): every
refusal one line, exit 2, before anything is removed; a re-run removes only the files of the steps it runs
(issue 39)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_envpipe.apps.gpu_check.cli import main

REPO = Path(__file__).resolve().parents[2]
FACTS = ["--device", "cpu", "--steps", "facts"]


def _run(capsys, argv: list[str]) -> tuple[int, str, str]:
    code = main(argv)
    out, err = capsys.readouterr()
    return code, out, err


def test_a_folder_named_summary_md_is_refused_before_anything_is_removed(tmp_path, capsys):
    out = tmp_path / "out"
    (out / "summary.md").mkdir(parents=True)
    (out / "check.log").write_text("old log\n")
    (out / "results.json").write_text("{}\n")
    code, stdout, err = _run(capsys, ["--out", str(out), *FACTS])
    assert code == 2 and "summary.md is not a regular file" in err and err.count("\n") == 1, err
    assert stdout == "" and (out / "check.log").read_text() == "old log\n" and (out / "results.json").exists()


def test_a_rerun_with_fewer_steps_keeps_the_files_it_does_not_rewrite(tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / "calibrated-gpu.toml").write_text("# an earlier check's preset\n")
    code, _, err = _run(capsys, ["--out", str(out), *FACTS])
    assert code == 0, err
    assert (out / "calibrated-gpu.toml").read_text() == "# an earlier check's preset\n"
    assert "kept from an earlier check" in (out / "summary.md").read_text()


def test_a_rerun_removes_the_stale_file_of_a_step_it_runs(tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / "calibrated-gpu.toml").write_text("stale\n")
    code, _, err = _run(capsys, ["--out", str(out), "--device", "cpu", "--steps", "preset"])
    assert code == 0, err  # the preset step is skipped (its inputs did not run): its stale file must not stay
    assert not (out / "calibrated-gpu.toml").exists() or (out / "calibrated-gpu.toml").read_text() != "stale\n"


@pytest.mark.parametrize("kind", ["fifo", "dangling"])
def test_out_that_is_no_folder_says_what_it_is(tmp_path, capsys, kind):
    path = tmp_path / kind
    if kind == "fifo":
        os.mkfifo(path)
        word = "FIFO"
    else:
        path.symlink_to(tmp_path / "nowhere" / "x")
        word = "link to nothing"
    code, _, err = _run(capsys, ["--out", str(path), *FACTS])
    assert code == 2 and word in err and "is a file" not in err and err.count("\n") == 1, err


def test_an_unknown_option_is_one_line(capsys):
    with pytest.raises(SystemExit) as info:
        main(["--bogus\nFORGED"])
    err = capsys.readouterr().err
    assert info.value.code == 2 and err.count("\n") == 1 and "usage" not in err and "--bogus\\nFORGED" in err, err


@pytest.mark.parametrize("env, args", [({"PYTHON": "/nonexistent"}, []), ({}, ["--bogus"])])
def test_the_shell_wrapper_errors_are_one_line_exit_2(env, args):
    run = subprocess.run(["bash", str(REPO / "bench" / "gpu_check.sh"), *args], capture_output=True, text=True,
                         env={**os.environ, "PYTHON": sys.executable, **env}, timeout=60)
    assert run.returncode == 2 and run.stderr.count("\n") == 1 and run.stdout == "", run.stderr
