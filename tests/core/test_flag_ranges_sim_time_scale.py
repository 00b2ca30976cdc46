"""--envpipe-sim-time-scale of 1/1000 or less (core/flag_ranges.py, issue 39): in wall time the host's own
milliseconds then become seconds of simulated GPU time (1e-300 gave energy lines of 1e302 J). Refused at
start-up, one line; the documented values are accepted. In-process: the tiny GPT's own checks, no ranks."""

from __future__ import annotations

import pytest

from megatron_envpipe.apps.train_tiny_gpt import parse_args
from megatron_envpipe.config import EnvPipeConfig
from megatron_envpipe.flag_types import EnvPipeConfigError

WALL = ["--pipeline-model-parallel-size", "2", "--envpipe-gpu", "simulated:a40/gpt3-175b", "--envpipe-sim-time", "wall"]


def _validate(scale: str, monkeypatch) -> EnvPipeConfig:
    monkeypatch.setenv("WORLD_SIZE", "2")
    args = parse_args([*WALL, "--envpipe-sim-time-scale", scale])
    return EnvPipeConfig.from_args(args).validate_with_megatron_args(args)


@pytest.mark.parametrize("scale", ["1e-300", "1e-9", "0.001"])
def test_a_time_scale_that_would_make_host_time_gpu_seconds_is_refused(monkeypatch, scale):
    with pytest.raises(EnvPipeConfigError) as info:
        _validate(scale, monkeypatch)
    assert "\n" not in str(info.value) and "--envpipe-sim-time-scale" in str(info.value) and "> 0.001" in str(info.value)


@pytest.mark.parametrize("scale", ["0.0011", "0.02", "0.3"])
def test_the_documented_time_scales_are_accepted(monkeypatch, scale):
    assert _validate(scale, monkeypatch).sim_time_scale == float(scale)
