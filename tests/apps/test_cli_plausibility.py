"""A profile measured above the named GPU's highest clock, or a --freq above it, is refused by every command
that pairs a profile with a GPU (apps/cli/plausibility.py, issue 39: `envpipe simulate --profile p.csv
--gpu a40 --freq 5000` with 5000 MHz rows was accepted, though an A40 tops out at 1740 MHz). In-process."""

from __future__ import annotations

from pathlib import Path

import pytest

from megatron_envpipe.apps.cli import main
from megatron_envpipe.core.gpu_specs import get_gpu_spec
from megatron_envpipe.core.resources import shipped_profile

A40_MAX = get_gpu_spec("a40").max_clock_mhz


def _with_rows_at(tmp_path: Path, mhz: int) -> str:
    """The shipped A40 profile plus a copy of its f_max rows at ``mhz``."""
    lines = Path(shipped_profile("a40/gpt3-175b")).read_text().splitlines()
    extra = [line.replace(f",{A40_MAX},", f",{mhz},", 1) for line in lines[1:] if f",{A40_MAX}," in line]
    path = tmp_path / f"rows-at-{mhz}.csv"
    path.write_text("\n".join(lines + extra) + "\n")
    return str(path)


COMMANDS = {
    "plan": ["plan", "-m", "8"],
    "plan optimal": ["plan", "-m", "8", "--type", "optimal"],
    "frontier": ["frontier", "-m", "8", "--points", "3"],
    "menu": ["menu", "-m", "8"],
    "simulate": ["simulate", "-m", "8", "--rows", "summary"],
}


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize("mhz", [A40_MAX + 1, 5000])
def test_rows_above_the_gpus_highest_clock_are_refused(tmp_path, capsys, command, mhz):
    out = tmp_path / "out.json"
    argv = [*COMMANDS[command], "--profile", _with_rows_at(tmp_path, mhz), "--gpu", "a40"]
    if command in ("plan", "menu"):
        argv += ["--out", str(out)]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and f"{mhz} MHz" in err and f"{A40_MAX} MHz" in err, err
    assert not out.exists()  # refused before anything is written


def test_freq_above_the_gpus_highest_clock_is_refused(tmp_path, capsys):
    profile = _with_rows_at(tmp_path, 5000)
    assert main(["simulate", "--profile", "a40/gpt3-175b", "--freq", "5000", "-m", "8"]) == 2
    assert "--freq 5000 MHz is above a40's highest clock" in capsys.readouterr().err
    assert main(["simulate", "--profile", profile, "--gpu", "a40", "--freq", "5000", "-m", "8"]) == 2
    assert "--freq 5000" in capsys.readouterr().err


def test_rows_within_range_or_without_a_gpu_are_accepted(tmp_path, capsys):
    assert main(["simulate", "--profile", "a40/gpt3-175b", "--freq", str(A40_MAX), "-m", "8", "--rows", "summary"]) == 0
    # No --gpu on a custom CSV: no clock range to hold it to (as before).
    assert main(["simulate", "--profile", _with_rows_at(tmp_path, 5000), "--freq", "5000", "-m", "8",
                 "--rows", "summary"]) == 0
