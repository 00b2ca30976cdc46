"""configs/demo.toml: the embedded default of `envpipe demo`, validated on load."""

from __future__ import annotations

import pytest

from megatron_envpipe.apps.demo import _DemoConfig
from megatron_envpipe.apps.demo_errors import DemoError
from megatron_envpipe.core.gpu_specs import get_gpu_spec
from megatron_envpipe.planning.basis import PlannerConfig


def test_shipped_demo_config_loads():
    cfg = _DemoConfig.load()
    assert cfg.stages == 4 and cfg.profile == "a40/gpt3-175b"
    assert (cfg.plan_type, cfg.scheduling, cfg.reconfig) == ("envelope", "ours", "balanced")


@pytest.mark.parametrize(
    "body,needle",
    [
        ("[demo]\nstagez = 4\n", "unknown key 'stagez'"),
        ("[demo]\nstages = 'four'\n", "stages = 'four' should be a int"),
        ("[demo]\nstages = 1\n", "needs stages >= 2"),
        ("[demo]\nsim_jitter = 0.3\n", r"sim_jitter = 0.3: needs sim_jitter >= 0 and <= 0.25"),
        ("[demo]\nsim_jitter = nan\n", r"sim_jitter = nan: must be a finite number"),
        ("[demo\n", "not valid TOML"),
    ],
)
def test_bad_demo_config_names_file_and_key(tmp_path, body, needle):
    path = tmp_path / "demo.toml"
    path.write_text(body)
    with pytest.raises(DemoError, match=needle) as info:
        _DemoConfig.load(path)
    assert str(path) in str(info.value)


def test_demo_plans_through_envpipe_config():
    cfg = _DemoConfig.load()
    gpu = get_gpu_spec("a40")
    # The demo plans as training does: with training's default timing margin (1 %).
    assert cfg.envpipe_config().planner_config(gpu) == PlannerConfig(cfg.plan_type, cfg.scheduling, cfg.reconfig,
                                                                     gpu=gpu, timing_margin=0.01)


def test_jitter_demo_config_loads():
    from megatron_envpipe.core.resources import configs_dir

    cfg = _DemoConfig.load(configs_dir() / "demo-jitter.toml")
    assert (cfg.iterations, cfg.sim_jitter) == (50, 0.03) and _DemoConfig.load().sim_jitter == 0.0
