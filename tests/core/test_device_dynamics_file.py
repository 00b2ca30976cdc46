"""A device-dynamics TOML (--envpipe-sim-dynamics FILE, the demo's sim_dynamics, gpu-check's calibrated-gpu.toml):
every figure bounded before conversion, every figure but blocking_power_w required, no table but [dynamics],
a one-line source (issue 39)."""

from __future__ import annotations

from pathlib import Path

import pytest

from megatron_envpipe.core.calibration import calibration_from_figures, preset_text
from megatron_envpipe.core.device_dynamics import EXACT, DeviceDynamics, DeviceDynamicsError, load_dynamics
from megatron_envpipe.core.resources import configs_dir

BIG = "1" + "0" * 400
REALISTIC = (configs_dir() / "realistic-gpu.toml").read_text()


def _load(tmp_path: Path, text: str) -> DeviceDynamics:
    path = tmp_path / "dyn.toml"
    path.write_text(text)
    return load_dynamics(str(path), configs_dir())


def _refused(tmp_path: Path, text: str, *words: str) -> str:
    with pytest.raises(DeviceDynamicsError) as info:
        _load(tmp_path, text)
    message = str(info.value)
    assert "\n" not in message and "dyn.toml" in message and len(message) < 500, message
    for word in words:
        assert word in message, message
    return message


@pytest.mark.parametrize("key", ["clock_latency_ms", "nvml_call_ms", "counter_period_ms", "power_average_ms",
                                 "thermal_drift", "thermal_tau_s", "blocking_power_w"])
@pytest.mark.parametrize("value", [BIG, f"-{BIG}", "1" + "0" * 5000, "nan", "inf"])
def test_a_number_too_large_for_a_float_is_one_line(tmp_path, key, value):
    lines = [line for line in REALISTIC.splitlines() if not line.startswith(f"{key} ")]
    _refused(tmp_path, "\n".join([*lines, f"{key} = {value}"]) + "\n")


def test_the_range_named_is_the_files_unit(tmp_path):
    text = REALISTIC.replace("clock_latency_ms = 15", f"clock_latency_ms = {BIG}")
    _refused(tmp_path, text, "clock_latency_ms", "at most 1000 ms")


def test_an_empty_dynamics_table_is_not_the_exact_gpu(tmp_path):
    _refused(tmp_path, "[dynamics]\n", "lacks clock_latency_ms", "thermal_tau_s")


@pytest.mark.parametrize("drop", ["clock_latency_ms", "nvml_call_ms", "counter_period_ms", "power_average_ms",
                                  "thermal_drift", "thermal_tau_s"])
def test_every_figure_but_blocking_power_is_required(tmp_path, drop):
    text = "\n".join(line for line in REALISTIC.splitlines() if not line.startswith(f"{drop} "))
    _refused(tmp_path, text, f"lacks {drop}")


def test_a_complete_file_loads_and_blocking_power_and_source_are_optional(tmp_path):
    got = _load(tmp_path, "\n".join(line for line in REALISTIC.splitlines() if not line.startswith("source")))
    assert got.clock_latency_s == pytest.approx(0.015) and got.blocking_power_w is None and got.source == "dyn.toml"
    assert got != EXACT


@pytest.mark.parametrize("extra", ["[dynamic]\nclock_latency_ms = 5\n", "[other]\n", "stray = 1\n"])
def test_a_second_table_is_an_error(tmp_path, extra):
    text = extra + REALISTIC if extra.startswith("stray") else REALISTIC + extra
    _refused(tmp_path, text, "next to [dynamics]")


def test_a_newline_in_source_cannot_split_the_error_line(tmp_path):
    text = REALISTIC.replace('source = "', 'source = "x\\nERROR: forged ')
    message = _refused(tmp_path, text, "source", "\\n")
    assert "must be one line" in message


def test_a_newline_in_source_is_refused_in_code_too():
    with pytest.raises(DeviceDynamicsError, match="one line"):
        DeviceDynamics(source="a\nb")


def test_direct_construction_with_a_huge_integer_is_a_usage_error():
    with pytest.raises(DeviceDynamicsError, match="digits"):
        DeviceDynamics(clock_latency_s=10**400)


def test_gpu_checks_preset_round_trips(tmp_path):
    """calibrated-gpu.toml as gpu-check writes it is a complete file the loader reads."""
    base = load_dynamics("realistic", configs_dir())
    cal = calibration_from_figures({"clock_changes": {"sm_settle_s": 0.02, "nvml_call_s": 0.012}}, base,
                                   base_name="realistic-gpu.toml", date_utc="2026-01-01T00:00:00")
    got = _load(tmp_path, preset_text(cal))
    assert got.clock_latency_s == pytest.approx(0.02) and got.nvml_call_s == pytest.approx(0.012)
