"""A custom profile CSV on the simulated GPU names no GPU, so it would draw 0 W between units; with a stepped
energy counter the counter then stands still between units and every iteration reads "stalled" (unmeasured).
Refused at start-up unless a blocking power is given (config/launch_checks.py). In-process."""

from __future__ import annotations

from pathlib import Path

import pytest

from megatron_envpipe.apps.train_tiny_gpt import parse_args
from megatron_envpipe.config import EnvPipeConfig
from megatron_envpipe.core.resources import configs_dir, shipped_profile
from megatron_envpipe.flag_types import EnvPipeConfigError


def _validate(argv: list[str], monkeypatch) -> EnvPipeConfig:
    monkeypatch.setenv("WORLD_SIZE", "2")
    args = parse_args(["--pipeline-model-parallel-size", "2", *argv])
    return EnvPipeConfig.from_args(args).validate_with_megatron_args(args)


@pytest.fixture
def custom_csv(tmp_path: Path) -> Path:
    path = tmp_path / "my-gpu.csv"  # the shipped rows under a name that is no GPU of the table
    path.write_text(Path(shipped_profile("a40/gpt3-175b")).read_text())
    return path


@pytest.mark.parametrize("dynamics", ["realistic", "stepped"])
def test_a_custom_csv_with_a_stepped_counter_and_no_blocking_power_is_refused(monkeypatch, tmp_path, custom_csv,
                                                                              dynamics):
    if dynamics == "stepped":  # a dynamics file of the user's: any stepped counter, not only the preset
        dynamics = str(tmp_path / "d.toml")
        text = (Path(configs_dir()) / "realistic-gpu.toml").read_text().replace("counter_period_ms = 100", "counter_period_ms = 50")
        Path(dynamics).write_text(text)
    with pytest.raises(EnvPipeConfigError) as info:
        _validate(["--envpipe-gpu", f"simulated:{custom_csv}", "--envpipe-sim-dynamics", dynamics], monkeypatch)
    message = str(info.value)
    assert "\n" not in message and "0 W between units" in message and "--envpipe-p2p-power" in message, message


def test_a_blocking_power_or_a_table_gpu_or_an_exact_counter_is_accepted(monkeypatch, custom_csv):
    gpu = ["--envpipe-gpu", f"simulated:{custom_csv}"]
    _validate([*gpu, "--envpipe-sim-dynamics", "realistic", "--envpipe-p2p-power", "70"], monkeypatch)
    _validate([*gpu, "--envpipe-sim-dynamics", "exact"], monkeypatch)  # reads at 0 W are right there
    _validate(["--envpipe-gpu", "simulated:a40/gpt3-175b", "--envpipe-sim-dynamics", "realistic"], monkeypatch)


def test_sized_rows_that_fit_no_length_model_are_refused_at_start_up_even_without_variable_lengths(
        monkeypatch, tmp_path):
    """The simulated GPU fits its CSV's sized rows whenever it opens, inside every rank: a fit that fails there
    was a crash of every rank after start-up; now one line before any rank starts."""
    rows = Path(shipped_profile("a40/gpt3-175b")).read_text().splitlines()
    body = [rows[0] + ",tokens,attention_tokens2"]
    for row in rows[1:]:  # every row at 2048 tokens, plus one sample at 1024 tokens of the first unit only
        body.append(row + f",2048,{2048 ** 2}")
    body.append("0,forward,1740,0.05,17.0,1024,1048576")  # one token count: the fit needs >= 2 for every key
    bad = tmp_path / "one-size.csv"
    bad.write_text("\n".join(body) + "\n")
    with pytest.raises(EnvPipeConfigError) as info:
        _validate(["--envpipe-gpu", f"simulated:{bad}", "--envpipe-p2p-power", "70"], monkeypatch)
    assert "\n" not in str(info.value) and "simulated:" in str(info.value) and "tokens" in str(info.value)


def test_a_profile_measured_above_the_simulated_gpus_highest_clock_is_refused(monkeypatch, tmp_path):
    lines = Path(shipped_profile("a40/gpt3-175b")).read_text().splitlines()
    fast = tmp_path / "fast.csv"  # the A40 rows plus copies at 5000 MHz: an A40 tops out at 1740 MHz
    fast.write_text("\n".join(lines + [line.replace(",1740,", ",5000,", 1) for line in lines if ",1740," in line]) + "\n")
    monkeypatch.setenv("WORLD_SIZE", "8")
    eight = ["--pipeline-model-parallel-size", "8", "--num-layers", "8", "--envpipe-gpu", "simulated:a40/gpt3-175b"]
    with pytest.raises(EnvPipeConfigError) as info:
        args = parse_args([*eight, "--envpipe-profile", str(fast)])
        EnvPipeConfig.from_args(args).validate_with_megatron_args(args)
    assert "\n" not in str(info.value) and "5000 MHz" in str(info.value) and "1740 MHz" in str(info.value)
    args = parse_args([*eight, "--envpipe-profile", str(shipped_profile("a40/gpt3-175b"))])
    EnvPipeConfig.from_args(args).validate_with_megatron_args(args)  # the GPU's own profile: accepted
