"""`python -m megatron_envpipe.megatron.pretrain_gpt`: clear one-line failures where Megatron-LM cannot run."""

from __future__ import annotations

import argparse
import subprocess
import sys
import types
from pathlib import Path

import pytest

from megatron_envpipe.config import add_envpipe_args, num_microbatches_of
from megatron_envpipe.megatron import pretrain_gpt

REPO = Path(__file__).resolve().parents[2]


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=REPO, capture_output=True, text=True, timeout=120)


def test_without_megatron_training_it_says_why_in_one_line():
    try:
        import megatron.training  # noqa: F401
    except Exception:  # noqa: BLE001 - absent (0.16) or not importable on 3.11 (0.19): our case
        pass
    else:
        pytest.skip("megatron.training imports here: the success path applies instead")
    for cmd in (["-m", "megatron_envpipe.megatron.pretrain_gpt", "--help"], ["examples/pretrain_gpt.py", "--help"]):
        proc = run(*cmd)
        assert proc.returncode == 2
        lines = [line for line in proc.stderr.splitlines() if "error:" in line]
        assert len(lines) == 1 and "megatron.training" in lines[0], proc.stderr
        assert "Traceback" not in proc.stderr


def test_bad_envpipe_flags_fail_before_anything_starts():
    proc = run("-m", "megatron_envpipe.megatron.pretrain_gpt", "--envpipe-type", "turbo")
    assert proc.returncode == 2 and "invalid choice: 'turbo'" in proc.stderr


def test_impossible_envpipe_setting_fails_first_in_one_line():
    """Checked before Megatron-LM is looked for: the user's to fix wherever it runs."""
    proc = run("-m", "megatron_envpipe.megatron.pretrain_gpt", "--pipeline-model-parallel-size", "4",
               "--num-layers", "24", "--envpipe-scheduling", "ours", "--envpipe-extra-warmup", "1,0")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    (line,) = [line for line in proc.stderr.splitlines() if line.strip()]
    assert line.startswith("pretrain_gpt (megatron-envpipe): error: --envpipe-extra-warmup 1,0 has 2 entries")


def test_the_pre_parse_takes_no_abbreviations_and_reads_the_batch_sizes(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "16")
    pre, rest = pretrain_gpt._envpipe_parser().parse_known_args(
        ["--num-layers", "24", "--pipeline-model-parallel-size", "4", "--micro-batch-size", "2",
         "--global-batch-size", "64", "--tensor-model-parallel-size", "2"])
    # Megatron's --num-layers is not --num-layers-per-virtual-pipeline-stage (no interleaving here).
    assert pre.num_layers_per_virtual_pipeline_stage is None and rest == ["--num-layers", "24"]
    assert num_microbatches_of(pre, 4) == 64 // (2 * (16 // (2 * 4)))
    assert pretrain_gpt.check_parsed_args(pre) is pre
    with pytest.raises(SystemExit) as info:  # 1F1B holds 4 activations on stage 0 of 4 stages
        pretrain_gpt.check_parsed_args(argparse.Namespace(**{**vars(pre), "envpipe_scheduling": "ours",
                                                             "envpipe_max_inflight": 3}))
    assert info.value.code == 2


def test_megatrons_own_parse_is_checked_too(monkeypatch, capsys):
    """The namespace Megatron's parser returns goes through the same checks (one line, exit 2)."""
    pytest.importorskip("megatron.core")  # the fake megatron.training hangs off the real package
    argv = ["--pipeline-model-parallel-size", "4", "--envpipe-type", "envelope", "--envpipe-profile", "a40/gpt3-175b"]

    def parse_args(extra_args_provider=None, ignore_unknown_args=False):
        parser = argparse.ArgumentParser(allow_abbrev=False)
        parser.add_argument("--pipeline-model-parallel-size", type=int, default=1)
        return extra_args_provider(parser).parse_args(argv)

    training = types.ModuleType("megatron.training")
    arguments = types.ModuleType("megatron.training.arguments")
    arguments.parse_args = parse_args
    training.arguments = arguments
    training.pretrain = lambda *args, **kwargs: None  # >= 0.18: no extra_args_provider
    initialize = types.ModuleType("megatron.training.initialize")  # binds nothing to wrap here
    training.initialize = initialize
    monkeypatch.setitem(sys.modules, "megatron.training", training)
    monkeypatch.setitem(sys.modules, "megatron.training.arguments", arguments)
    monkeypatch.setitem(sys.modules, "megatron.training.initialize", initialize)
    pretrain_gpt._teach_megatron_parser(add_envpipe_args)
    with pytest.raises(SystemExit) as info:
        arguments.parse_args()
    assert info.value.code == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert "--envpipe-profile a40/gpt3-175b has 8 stages" in line and "--pipeline-model-parallel-size 4" in line
