"""--envpipe-* flags and start-up validation."""

from __future__ import annotations

import argparse

import pytest

from megatron_envpipe.config import EnvPipeConfig, EnvPipeConfigError, add_envpipe_args


def parse(argv):
    return EnvPipeConfig.from_args(add_envpipe_args(argparse.ArgumentParser()).parse_args(argv))


def test_defaults_are_stock_megatron():
    cfg = parse([])
    assert cfg.is_stock and cfg.plan_type == "baseline" and cfg.scheduling == "1f1b"


def test_the_headline_flags():
    cfg = parse(["--envpipe-type", "envelope", "--envpipe-scheduling", "ours", "--envpipe-reconfig", "balanced",
                 "--envpipe-gpu", "a40", "--envpipe-profile", "a40/gpt3-175b", "--envpipe-extra-warmup", "3,2,1,0"])
    assert (cfg.plan_type, cfg.scheduling, cfg.reconfig, cfg.gpu) == ("envelope", "ours", "balanced", "a40")
    assert cfg.extra_warmup == (3, 2, 1, 0) and not cfg.is_stock


@pytest.mark.parametrize(
    "argv,needle",
    [
        (["--envpipe-extra-warmup", "1,0"], "only applies to --envpipe-scheduling ours"),
        (["--envpipe-gpu", "b9000"], "unknown GPU 'b9000'"),
        (["--envpipe-profile", "/no/such.csv"], "no such file"),
        (["--envpipe-comm-timeout", "0"], "must be > 0 seconds"),
        (["--envpipe-prefetch", "0"], "prefetch must be >= 1"),
    ],
)
def test_impossible_combinations_fail_at_start_up(argv, needle):
    with pytest.raises(EnvPipeConfigError, match=needle):
        parse(argv)


def test_megatron_args_checks():
    cfg = parse(["--envpipe-scheduling", "ours"])
    with pytest.raises(EnvPipeConfigError, match="no interleaved"):
        cfg.validate_with_megatron_args(argparse.Namespace(virtual_pipeline_model_parallel_size=2))
    with pytest.raises(EnvPipeConfigError, match="pipeline-model-parallel-size >= 2"):
        cfg.validate_with_megatron_args(argparse.Namespace(pipeline_model_parallel_size=1))
    parse([]).validate_with_megatron_args(argparse.Namespace(virtual_pipeline_model_parallel_size=2))


def test_bad_choice_is_argparse_error(capsys):
    with pytest.raises(SystemExit):
        parse(["--envpipe-type", "turbo"])
    assert "invalid choice: 'turbo'" in capsys.readouterr().err
