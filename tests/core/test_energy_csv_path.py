"""--envpipe-energy-csv and --losses-out checked at start-up (core/energy_csv.check_energy_csv, core/atomic.check_output,
config/launch_checks.check_output_files): never one of the run's inputs or the other output, writable now, appended
only to an energy CSV; nothing written on refusal (issue 39, classes 3 and 4)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from megatron_envpipe.config import EnvPipeConfig
from megatron_envpipe.config.launch_checks import check_output_files
from megatron_envpipe.core import atomic
from megatron_envpipe.core.energy_csv import CSV_COLUMNS
from megatron_envpipe.core.resources import configs_dir, shipped_profile
from megatron_envpipe.flag_types import EnvPipeConfigError

SIM = "simulated:a40/gpt3-175b"


@pytest.fixture
def files(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    Path("p.csv").write_text(shipped_profile("a40/gpt3-175b").read_text())
    Path("dyn.toml").write_text((configs_dir() / "realistic-gpu.toml").read_text())
    return tmp_path


def _refused(config: EnvPipeConfig, *words: str, losses_out: str | None = None) -> str:
    before = {p: p.read_bytes() for p in Path(".").iterdir() if p.is_file()}
    with pytest.raises(EnvPipeConfigError) as info:
        config.validate()
        check_output_files(config, losses_out)
    message = str(info.value)
    assert "\n" not in message, message
    for word in words:
        assert word in message, message
    assert {p: p.read_bytes() for p in Path(".").iterdir() if p.is_file()} == before  # nothing written
    return message


@pytest.mark.parametrize("config, what", [
    (EnvPipeConfig(gpu=SIM, profile="p.csv", energy_csv="p.csv"), "--envpipe-profile"),
    (EnvPipeConfig(gpu="simulated:p.csv", energy_csv="p.csv"), "--envpipe-gpu"),
    (EnvPipeConfig(gpu=SIM, energy_csv=str(shipped_profile("a40/gpt3-175b"))), "--envpipe-gpu"),
    (EnvPipeConfig(gpu=SIM, sim_dynamics="dyn.toml", energy_csv="dyn.toml"), "--envpipe-sim-dynamics"),
])
def test_the_energy_csv_is_never_an_input(files, config, what):
    _refused(config, "--envpipe-energy-csv", what, "destroy")


def test_the_energy_csv_through_a_link_to_an_input_is_refused(files):
    os.symlink("p.csv", "link.csv")
    _refused(EnvPipeConfig(gpu="simulated:p.csv", energy_csv="link.csv"), "--envpipe-gpu")


def test_the_energy_csv_and_losses_out_are_different_files(files):
    _refused(EnvPipeConfig(energy_csv="out.json"), "--losses-out", losses_out="out.json")


def test_losses_out_is_never_an_input(files):
    _refused(EnvPipeConfig(gpu=SIM, sim_dynamics="dyn.toml"), "--losses-out", "--envpipe-sim-dynamics",
             losses_out="dyn.toml")


def test_rows_are_appended_only_to_an_energy_csv(files):
    Path("notes.txt").write_text("my notes\n")
    _refused(EnvPipeConfig(energy_csv="notes.txt"), "not an energy CSV")
    Path("old.csv").write_text(",".join(CSV_COLUMNS) + "\n1,1,0,0,1,1,1,1,1,,,1\n")
    EnvPipeConfig(energy_csv="old.csv").validate()  # an earlier run's: appended to
    Path("empty.csv").write_text("")
    EnvPipeConfig(energy_csv="empty.csv").validate()


def test_a_dangling_link_is_refused_at_start_up(files):
    os.symlink("missing/dir/e.csv", "dangling.csv")
    _refused(EnvPipeConfig(energy_csv="dangling.csv"), "link to nothing")


def test_a_read_only_file_is_refused_at_start_up(files, monkeypatch):
    Path("ro.csv").write_text("")
    os.chmod("ro.csv", 0o444)
    real = os.access
    # root may write any file (os.access says so): ask as an ordinary user would be answered
    monkeypatch.setattr(atomic.os, "access", lambda p, mode: False if str(p).endswith("ro.csv") else real(p, mode))
    _refused(EnvPipeConfig(energy_csv="ro.csv"), "read-only")


def test_a_fresh_path_is_accepted(files):
    EnvPipeConfig(gpu=SIM, energy_csv="new/energy.csv").validate()
    assert not Path("new").exists()  # checked, not created
