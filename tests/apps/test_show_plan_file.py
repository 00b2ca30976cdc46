"""'envpipe show' (apps/cli/planning_cmds.cmd_show, common.plan_from_file): every number of the plan file bounded
while parsing, every check made before the first line is printed, the file's strings printed on one line each
(issue 39, classes 1 and 7)."""

from __future__ import annotations

import json

import pytest

from megatron_envpipe.apps.cli import main

PLAN = ["plan", "--profile", "a40/gpt3-175b", "--microbatches", "8", "--type", "envelope",
        "--scheduling", "1f1b", "--gpu", "a40"]
BIG = "1" + "0" * 400


@pytest.fixture(scope="module")
def plan_text(tmp_path_factory):
    path = tmp_path_factory.mktemp("plan") / "plan.json"
    assert main(PLAN + ["--out", str(path)]) == 0
    return path.read_text()


def _show(capsys, tmp_path, text: str) -> tuple[int, str, str]:
    path = tmp_path / "p.json"
    path.write_text(text)
    code = main(["show", str(path)])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def _set(path: tuple, value: object):
    """An edit of the plan file: ``value`` at ``path`` (keys and indices); "BIG" becomes a 400-digit integer."""

    def edit(text: str) -> str:
        data = json.loads(text)
        where = data
        for key in path[:-1]:
            where = where[key]
        where[path[-1]] = value
        return json.dumps(data).replace('"BIG"', BIG).replace('"NAN"', "NaN")

    return edit


@pytest.mark.parametrize("edit", [
    _set(("energy_saving",), "BIG"),
    _set(("baseline", "energy_j"), -(10**30)),
    _set(("energy_saving",), "NAN"),
    _set(("plan", "recv_wait_ms", 0, 0), "BIG"),
    _set(("plan", "recv_wait_ms", 0, 0), "x"),
    _set(("plan", "critical_path", 0), "S0\nERROR: forged"),
])
def test_a_bad_plan_file_prints_nothing_but_one_error_line(capsys, tmp_path, plan_text, edit):
    text = edit(plan_text)
    code, out, err = _show(capsys, tmp_path, text)
    assert code == 2 and out == "" and err.count("\n") == 1 and "p.json" in err, (out, err)
    assert "Traceback" not in err and len(err) < 600


def test_a_newline_in_a_plan_files_string_is_printed_escaped(capsys, tmp_path, plan_text):
    data = json.loads(plan_text)
    data["warnings"] = ["first\nERROR: forged line"]
    code, out, _ = _show(capsys, tmp_path, json.dumps(data))
    assert code == 0 and "WARNING: first\\nERROR: forged line" in out
    assert not any(line.startswith("ERROR") for line in out.splitlines())
