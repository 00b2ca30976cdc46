"""--envpipe-sim-dynamics and its single-figure flags: parsed once into DeviceDynamics, refused where they do nothing."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from megatron_envpipe.apps.demo import _DemoConfig, _training_runs
from megatron_envpipe.config import EnvPipeConfig, add_envpipe_args
from megatron_envpipe.core import device_dynamics as dd
from megatron_envpipe.core.flag_ranges import RANGES
from megatron_envpipe.core.resources import configs_dir
from megatron_envpipe.flag_types import EnvPipeConfigError

SIM = ["--envpipe-gpu", "simulated:a40/gpt3-175b"]


def config(argv: list[str]) -> EnvPipeConfig:
    return EnvPipeConfig.from_args(add_envpipe_args(argparse.ArgumentParser()).parse_args(argv))


def test_default_is_exact():
    assert config(SIM).device_dynamics == dd.EXACT
    assert config([]).device_dynamics.exact


def test_realistic_preset_with_single_figures_over_it():
    realistic = dd.load_dynamics("realistic", configs_dir())
    assert realistic.clock_latency_s == pytest.approx(0.015) and realistic.counter_period_s == pytest.approx(0.1)
    assert realistic.thermal_drift == pytest.approx(0.03) and not realistic.exact
    got = config(SIM + ["--envpipe-sim-dynamics", "realistic", "--envpipe-sim-clock-latency-ms", "30",
                        "--envpipe-sim-thermal-drift", "0"]).device_dynamics
    assert got.clock_latency_s == pytest.approx(0.030) and got.thermal_drift == 0.0
    assert got.counter_period_s == realistic.counter_period_s and "set per run" in got.source


def test_single_figures_over_exact():
    got = config(SIM + ["--envpipe-sim-clock-latency-ms", "15", "--envpipe-sim-counter-period-ms", "100",
                        "--envpipe-sim-thermal-drift", "0.03"]).device_dynamics
    assert (got.clock_latency_s, got.counter_period_s, got.thermal_drift) == pytest.approx((0.015, 0.1, 0.03))
    assert got.nvml_call_s == 0.0  # exact has no call time; the latency is all settle


@pytest.mark.parametrize("flag, value", [("--envpipe-sim-dynamics", "realistic"),
                                         ("--envpipe-sim-clock-latency-ms", "15"),
                                         ("--envpipe-sim-counter-period-ms", "100"),
                                         ("--envpipe-sim-thermal-drift", "0.03")])
def test_refused_without_a_simulated_gpu(flag, value):
    with pytest.raises(EnvPipeConfigError) as info:
        config([flag, value])
    assert f"{flag} {value} shapes the simulated GPU only" in str(info.value) and "\n" not in str(info.value)


def _toml(tmp_path: Path, text: str) -> str:
    path = tmp_path / "dyn.toml"
    path.write_text(text)
    return str(path)


# Every figure but blocking_power_w (and source) must be in the file: these complete one.
_REST = ("nvml_call_ms = 0\ncounter_period_ms = 0\npower_average_ms = 0\nthermal_drift = 0\n"
         "thermal_tau_s = 60\n")


@pytest.mark.parametrize("text, words", [
    ("[dynamics]\nclock_latency_ms = 2000\n", "clock_latency_ms = 2000: must be at most 1000 ms"),
    ("[dynamics]\nclock_lag_ms = 5\n", "unknown key(s) clock_lag_ms"),
    ("[other]\nx = 1\n", "needs a [dynamics] table"),
    ("[dynamics]\nthermal_drift = 'hot'\n", "thermal_drift = 'hot': must be a number"),
    ("[dynamics]\nclock_latency_ms = 5\n" + _REST.replace("nvml_call_ms = 0", "nvml_call_ms = 10"),
     "cannot exceed it"),
    ("[dynamics\n", "not valid TOML"),
])
def test_bad_dynamics_file_is_one_line_naming_it(tmp_path, text, words):
    path = _toml(tmp_path, text)
    with pytest.raises(EnvPipeConfigError) as info:
        config(SIM + ["--envpipe-sim-dynamics", path])
    message = str(info.value)
    assert words in message and path in message and "\n" not in message, message


def test_unknown_preset_names_the_choices():
    with pytest.raises(EnvPipeConfigError) as info:
        config(SIM + ["--envpipe-sim-dynamics", "realstic"])
    assert "exact, realistic" in str(info.value)


def test_a_dynamics_file_is_read(tmp_path):
    path = _toml(tmp_path, "[dynamics]\nclock_latency_ms = 7\nsource = 'mine'\n"
                 + _REST.replace("counter_period_ms = 0", "counter_period_ms = 50"))
    got = config(SIM + ["--envpipe-sim-dynamics", path]).device_dynamics
    assert (got.clock_latency_s, got.counter_period_s, got.source) == (pytest.approx(0.007), pytest.approx(0.05),
                                                                        "mine")


def test_flag_bounds_are_the_models_bounds():
    assert RANGES["sim_clock_latency_ms"].high / 1000 == dd.MAX_LATENCY_S
    assert RANGES["sim_counter_period_ms"].high / 1000 == dd._MAX_COUNTER_PERIOD_S
    assert RANGES["sim_thermal_drift"].high == dd._MAX_THERMAL_DRIFT


def test_clock_lead_flag():
    assert config(SIM).clock_lead == "on"
    # (with a plan that changes clocks: with baseline it would do nothing, refused in tests/config/test_flag_table.py)
    assert config(SIM + ["--envpipe-type", "envelope", "--envpipe-clock-lead", "off"]).clock_lead == "off"


def test_demo_runs_with_realistic_dynamics_by_default(tmp_path):
    cfg = _DemoConfig.load()
    assert cfg.sim_dynamics == "realistic"
    for _, flags, _ in _training_runs(cfg, "simulated:a40/gpt3-175b", tmp_path):
        assert flags[flags.index("--envpipe-sim-dynamics") + 1] == "realistic"
    # on a real GPU the flag would be refused: it is not passed
    for _, flags, _ in _training_runs(cfg, "auto", tmp_path):
        assert "--envpipe-sim-dynamics" not in flags
