"""Start-up checks made before any rank runs work (config/launch_checks.py): the straggler's replica against the
data-parallel size from the launcher's world size, its start iteration, and --variable-seq-lengths on a simulated
GPU that cannot cost sized units (issue 39, class 2). In-process: the tiny GPT's and the Megatron-LM entry's
own argument checks, no ranks."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from megatron_envpipe.apps.train_tiny_gpt import parse_args
from megatron_envpipe.config import EnvPipeConfig
from megatron_envpipe.core.resources import shipped_profile
from megatron_envpipe.flag_types import EnvPipeConfigError, sim_straggler_arg

SIM = ["--pipeline-model-parallel-size", "2", "--envpipe-gpu", "simulated:a40/gpt3-175b"]


def _tiny(argv: list[str], world: int, monkeypatch) -> EnvPipeConfig:
    monkeypatch.setenv("WORLD_SIZE", str(world))
    args = parse_args(argv)
    return EnvPipeConfig.from_args(args).validate_with_megatron_args(args)


def _refused(argv: list[str], world: int, monkeypatch, *words: str) -> None:
    with pytest.raises(EnvPipeConfigError) as info:
        _tiny(argv, world, monkeypatch)
    message = str(info.value)
    assert "\n" not in message, message
    for word in words:
        assert word in message, message


@pytest.mark.parametrize("world, replica, words", [
    (4, 2, ["replica 2 does not exist", "data-parallel size is 2"]),   # DP = 4 / PP 2
    (2, 1, ["has 1", "no replica to fall behind"]),                     # DP = 1
    (2, 0, ["has 1"]),
])
def test_a_straggler_without_its_replica_fails_at_start_up(monkeypatch, world, replica, words):
    _refused(SIM + ["--envpipe-sim-straggler", f"{replica}:1.15"], world, monkeypatch, *words)


def test_a_straggler_with_its_replica_is_accepted(monkeypatch):
    assert _tiny(SIM + ["--envpipe-sim-straggler", "1:1.15"], 4, monkeypatch).sim_straggler.replica == 1


def test_a_straggler_starting_after_the_last_iteration_is_refused(monkeypatch):
    _refused(SIM + ["--envpipe-sim-straggler", "1:1.15@10", "--train-iters", "10"], 4, monkeypatch,
             "--train-iters 10 ends before it")
    assert _tiny(SIM + ["--envpipe-sim-straggler", "1:1.15@9", "--train-iters", "10"], 4, monkeypatch)


def test_megatron_lm_args_give_the_data_parallel_size_from_world_size_tp_pp(monkeypatch):
    """The Megatron-LM entry's pre-parsed namespace has no data_parallel_size: WORLD_SIZE / (TP x PP x CP)."""
    monkeypatch.setenv("WORLD_SIZE", "8")
    args = argparse.Namespace(pipeline_model_parallel_size=2, tensor_model_parallel_size=2, context_parallel_size=1,
                              micro_batch_size=1, global_batch_size=8, train_iters=5)
    config = EnvPipeConfig(gpu="simulated:a40/gpt3-175b", sim_straggler=sim_straggler_arg("2:1.1"))
    with pytest.raises(EnvPipeConfigError, match="data-parallel size is 2"):
        config.validate_with_megatron_args(args)


def test_an_empty_start_iteration_is_refused():
    with pytest.raises(argparse.ArgumentTypeError):
        sim_straggler_arg("1:1.15@")


def test_variable_lengths_on_a_profile_without_a_length_model_fail_at_start_up(monkeypatch, tmp_path):
    plain = tmp_path / "plain.csv"
    plain.write_text(Path(shipped_profile("a40/gpt3-175b")).read_text())  # no sized rows, not a shipped name
    _refused(["--pipeline-model-parallel-size", "2", "--envpipe-gpu", f"simulated:{plain}", "--variable-seq-lengths"],
             2, monkeypatch, "--variable-seq-lengths", "cannot cost")
    _tiny(SIM + ["--variable-seq-lengths"], 2, monkeypatch)  # a shipped profile has its default length model
