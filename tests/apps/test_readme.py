"""Every `envpipe` command and Python block in README.md really runs."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from megatron_envpipe.apps.cli import main

README = Path(__file__).resolve().parents[2] / "README.md"


def blocks(lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", README.read_text(), flags=re.S)


def envpipe_lines() -> list[str]:
    lines = []
    for block in blocks("bash"):
        for line in block.splitlines():
            line = line.split("  #")[0].strip()
            # `envpipe demo` (two training runs, ~1-2 min) is CI's main job: .ci/run runs it.
            if line.startswith("envpipe ") and not line.startswith("envpipe demo"):
                lines.append(line)
    return lines


def test_readme_has_commands():
    assert len(envpipe_lines()) >= 8
    assert any("--compat perseus" in line for line in envpipe_lines())


def test_readme_envpipe_commands_run(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)  # out/plan.json etc. land here; order matters (plan before show)
    for line in envpipe_lines():
        code = main(shlex.split(line)[1:])
        err = capsys.readouterr().err
        assert code == 0, f"README command failed: {line}\n{err}"
    assert (tmp_path / "out" / "plan.json").is_file() and (tmp_path / "out" / "timeline.png").is_file()


@pytest.mark.parametrize("index", range(len(blocks("python"))))
def test_readme_python_blocks_run(index, capsys):
    if any(word in blocks("python")[index] for word in ("megatron.core", "import torch", ".install(")):
        pytest.importorskip("torch", reason="this README example trains with torch + megatron-core")
        pytest.importorskip("megatron.core", reason="this README example trains with torch + megatron-core")
    exec(compile(blocks("python")[index], f"README.md python block {index}", "exec"), {})
    assert capsys.readouterr().out


def test_readme_main_job_numbers_are_current(capsys):
    main(["plan", "--profile", "a40/gpt3-175b", "--microbatches", "12"])
    out = capsys.readouterr().out
    text = README.read_text()
    for line in out.splitlines():
        if line.startswith(("baseline ", "plan ")):
            assert line.strip() in text, f"README's sample output is stale: {line}"
    saving = re.search(r"energy saving ([\d.]+) %", out).group(1)
    assert f"energy saving {saving} %" in text


def test_readme_main_job_is_what_ci_runs():
    ci = (README.parent / ".ci" / "run").read_text()
    assert "envpipe demo" in README.read_text() and "envpipe demo" in ci
    # .ci/run calls exactly the test command the README documents
    command = re.search(r"^(python3 -m pytest .*?tests)\s", README.read_text(), re.M).group(1)
    assert "bash install.sh" in ci and command in ci, command
