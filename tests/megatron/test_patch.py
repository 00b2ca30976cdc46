"""install()/uninstall(): idempotent, reversible rebinding of Megatron's schedule."""

from __future__ import annotations

import pytest

pytest.importorskip("torch", reason="needs torch and megatron-core: pip install -e '.[megatron]' (install.sh does)")
pytest.importorskip("megatron.core", reason="needs torch and megatron-core: pip install -e '.[megatron]' (install.sh does)")

import megatron_envpipe
from megatron_envpipe.config import EnvPipeConfig, EnvPipeConfigError


def test_install_uninstall_roundtrip():
    from megatron.core.pipeline_parallel import get_forward_backward_func, schedules

    from megatron_envpipe.megatron import executor
    from megatron_envpipe.megatron.state import STATE

    original = schedules.forward_backward_pipelining_without_interleaving
    assert not megatron_envpipe.is_installed()
    try:
        megatron_envpipe.install(EnvPipeConfig(plan_type="envelope", scheduling="ours", profile="a40/gpt3-175b"))
        megatron_envpipe.install(EnvPipeConfig())  # idempotent: re-configures, never double-wraps
        assert schedules.forward_backward_pipelining_without_interleaving is executor.envpipe_forward_backward
        # Megatron's dispatcher now returns our executor for PP > 1 without virtual stages...
        assert get_forward_backward_func(pp_size=2, vp_size=None) is executor.envpipe_forward_backward
        # ...and leaves the interleaved and no-pipelining schedules alone.
        assert get_forward_backward_func(pp_size=2, vp_size=2) is schedules.forward_backward_pipelining_with_interleaving
        assert get_forward_backward_func(pp_size=1, vp_size=None) is schedules.forward_backward_no_pipelining
        assert STATE.original is original
        assert STATE.runtime.config == EnvPipeConfig()
    finally:
        megatron_envpipe.uninstall()
    assert schedules.forward_backward_pipelining_without_interleaving is original
    assert not megatron_envpipe.is_installed()
    assert STATE.runtime is None and STATE.original is None  # uninstall() reset the executor state
    megatron_envpipe.uninstall()  # safe when not installed


def test_install_validates_config():
    with pytest.raises(EnvPipeConfigError, match="only applies to --envpipe-scheduling ours"):
        megatron_envpipe.install(EnvPipeConfig(extra_warmup=(1, 0)))
    assert not megatron_envpipe.is_installed()


def test_executor_without_install_is_a_clear_error():
    from megatron_envpipe.megatron.executor import envpipe_forward_backward

    with pytest.raises(RuntimeError, match="before megatron_envpipe.install"):
        envpipe_forward_backward(forward_step_func=None, data_iterator=None, model=[object(), object()],
                                 num_microbatches=1, seq_length=1, micro_batch_size=1)


def test_install_checks_megatron_args_before_rebinding(monkeypatch, tmp_path):
    import argparse
    import sys
    import types

    from megatron.core.pipeline_parallel import schedules

    original = schedules.forward_backward_pipelining_without_interleaving
    profile_of_8 = EnvPipeConfig(plan_type="envelope", profile="a40/gpt3-175b")
    with pytest.raises(EnvPipeConfigError, match="has 8 stages but the pipeline has 4 stages"):
        megatron_envpipe.install(profile_of_8, megatron_args=argparse.Namespace(pipeline_model_parallel_size=4))
    assert not megatron_envpipe.is_installed()
    # Without megatron_args: whatever megatron.training parsed in this process.
    global_vars = types.ModuleType("megatron.training.global_vars")
    global_vars.get_args = lambda: argparse.Namespace(pipeline_model_parallel_size=4)
    monkeypatch.setitem(sys.modules, "megatron.training.global_vars", global_vars)
    with pytest.raises(EnvPipeConfigError, match="has 8 stages"):
        megatron_envpipe.install(profile_of_8)

    def not_parsed():
        raise AssertionError("args is not initialized.")  # what Megatron's get_args does before parsing

    global_vars.get_args = not_parsed
    corrupt = tmp_path / "p.csv"
    corrupt.write_text("stage,instruction,frequency,time,energy\n0,forward,1500,-1,2\n")
    with pytest.raises(EnvPipeConfigError, match="--envpipe-profile.*time must be > 0"):
        megatron_envpipe.install(EnvPipeConfig(plan_type="envelope", profile=str(corrupt)))
    assert not megatron_envpipe.is_installed()
    assert schedules.forward_backward_pipelining_without_interleaving is original
