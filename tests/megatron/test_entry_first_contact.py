"""The Megatron-LM entry's first contact (issue 35): a node without CUDA, and ``--envpipe-check-args``'s output.

In-process, with a stand-in torch (the devices) and a stand-in
``megatron.training`` that prints as much as Megatron's does: the entry must
say one line (the answer, or one per problem) whatever Megatron prints.
"""

from __future__ import annotations

import argparse
import logging
import sys
import types
import warnings

import pytest

from megatron_envpipe.megatron import preflight, pretrain_gpt

FLAGS = ["--pipeline-model-parallel-size", "4", "--num-layers", "24", "--envpipe-type", "envelope",
         "--envpipe-scheduling", "ours"]


def fake_torch(cuda: str | None, available: bool, devices: int, nccl: bool = True) -> types.SimpleNamespace:
    return types.SimpleNamespace(
        __version__="2.13.0", version=types.SimpleNamespace(cuda=cuda),
        cuda=types.SimpleNamespace(is_available=lambda: available, device_count=lambda: devices),
        distributed=types.SimpleNamespace(is_nccl_available=lambda: nccl))


@pytest.mark.parametrize(("torch", "env", "says"), [
    (fake_torch(None, False, 0), {"LOCAL_WORLD_SIZE": "8"}, "needs a CUDA GPU per rank (8 here); torch 2.13.0 is a CPU build"),
    (fake_torch("13.0", False, 0), {"LOCAL_WORLD_SIZE": "8"}, "built for CUDA 13.0, but it finds no CUDA GPU or driver here"),
    (fake_torch("13.0", True, 4), {"LOCAL_WORLD_SIZE": "8", "CUDA_VISIBLE_DEVICES": "0,1,2,3"},
     "8 ranks on this node, 4 GPU(s) visible (CUDA_VISIBLE_DEVICES=0,1,2,3)"),
    (fake_torch("13.0", True, 8, nccl=False), {"LOCAL_WORLD_SIZE": "8"}, "runs over NCCL"),
])
def test_what_megatrons_training_lacks_is_named(torch, env, says):
    assert says in preflight.training_blocker(torch, env)


def test_a_node_with_a_gpu_per_rank_and_nccl_passes():
    assert preflight.training_blocker(fake_torch("13.0", True, 8), {"LOCAL_WORLD_SIZE": "8"}) is None
    # gloo needs no NCCL (Megatron still needs the GPUs)
    assert preflight.training_blocker(fake_torch("13.0", True, 8, nccl=False), {"LOCAL_WORLD_SIZE": "8"}, "gloo") is None


@pytest.mark.parametrize(("env", "prints"), [({"LOCAL_RANK": "0", "RANK": "8"}, True),
                                             ({"LOCAL_RANK": "3", "RANK": "3"}, False), ({}, True)])
def test_one_rank_per_node_says_it_and_every_rank_exits_2(env, prints, capsys):
    assert preflight.report_blocker("prog", "no GPU", env) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == (1 if prints else 0), err
    if prints:
        assert err.startswith("prog: error: no GPU: ") and "--envpipe-check-args" in err and "train_tiny_gpt.py" in err


def test_the_entry_stops_before_megatron_loads_on_a_node_without_cuda(monkeypatch, capsys):
    """main() says the reason and returns 2 before it looks for megatron.training."""
    monkeypatch.setattr(pretrain_gpt, "training_blocker_here", lambda pre, argv: "no CUDA GPU here")
    monkeypatch.setattr(pretrain_gpt, "check_megatron_training", lambda script: pytest.fail("Megatron was loaded"))
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.delenv("MEGATRON_LM", raising=False)
    assert pretrain_gpt.main(FLAGS) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("pretrain_gpt (megatron-envpipe): error: no CUDA GPU here: check the command")


def test_check_args_and_help_need_no_gpu():
    pre, _ = pretrain_gpt._envpipe_parser().parse_known_args([*FLAGS, pretrain_gpt.CHECK_FLAG])
    assert pretrain_gpt.training_blocker_here(pre, [*FLAGS, pretrain_gpt.CHECK_FLAG]) is None
    pre, _ = pretrain_gpt._envpipe_parser().parse_known_args([*FLAGS, "--help"])
    assert pretrain_gpt.training_blocker_here(pre, [*FLAGS, "--help"]) is None


NOISE_LINES = 900


@pytest.fixture
def noisy_megatron(monkeypatch):
    """A ``megatron.training`` that prints like Megatron's (dump, warnings, log lines) and validates with asserts."""
    pytest.importorskip("megatron.core")  # the fake hangs off the real package; install() patches its schedules
    state = {"refuse": None}

    def parse_args(extra_args_provider=None, ignore_unknown_args=False):
        parser = argparse.ArgumentParser(prog=sys.argv[0], allow_abbrev=False)
        for name in ("--num-layers", "--pipeline-model-parallel-size"):
            parser.add_argument(name, type=int, default=1)
        warnings.warn("Transformer Engine and Apex are not installed", UserWarning, stacklevel=1)
        return extra_args_provider(parser).parse_args(sys.argv[1:])

    def validate_args(args, defaults=None):
        logging.getLogger("megatron.training").warning("a Megatron warning")
        print("------------------------ arguments ------------------------")
        for i in range(NOISE_LINES):
            print(f"  arg_{i} ........ {i}")
        assert state["refuse"] is None, state["refuse"]
        args.world_size, args.data_parallel_size = 8, 2
        return args

    training = types.ModuleType("megatron.training")
    arguments = types.ModuleType("megatron.training.arguments")
    arguments.parse_args, arguments.validate_args = parse_args, validate_args
    initialize = types.ModuleType("megatron.training.initialize")
    training.arguments, training.initialize = arguments, initialize
    training.pretrain = lambda *args, **kwargs: None  # >= 0.18: no extra_args_provider
    for name, module in (("megatron.training", training), ("megatron.training.arguments", arguments),
                         ("megatron.training.initialize", initialize)):
        monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.setattr(pretrain_gpt, "check_supported", lambda args, version: None)
    monkeypatch.delenv("MEGATRON_LM", raising=False)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setattr(sys, "argv", ["pretrain_gpt"])
    return state


def run_main(argv: list[str]) -> int:
    with pytest.raises(SystemExit) as info:
        pretrain_gpt.main(argv)
    return info.value.code


def test_check_args_prints_the_one_answer_line_only(noisy_megatron, capsys):
    assert run_main([*FLAGS, pretrain_gpt.CHECK_FLAG]) == 0
    out, err = capsys.readouterr()
    (line,) = out.splitlines()
    assert "arguments OK: Megatron parsed and validated 24 layers" in line and "type envelope" in line
    assert err == ""


def test_check_args_verbose_shows_megatrons_output(noisy_megatron, capsys):
    assert run_main([*FLAGS, pretrain_gpt.VERBOSE_CHECK_FLAG]) == 0
    out, _ = capsys.readouterr()
    assert out.count("\n") > NOISE_LINES and "arguments OK" in out.splitlines()[-1]


def test_check_args_says_each_problem_in_one_line(noisy_megatron, capsys):
    noisy_megatron["refuse"] = "micro-batch size times DP must divide the global batch size"
    assert run_main([*FLAGS, pretrain_gpt.CHECK_FLAG]) == 2
    out, err = capsys.readouterr()
    (line,) = err.splitlines()
    assert out == "" and "validate_args refused the command line: micro-batch size times DP" in line
    # argparse's refusal: its usage block (Megatron's lists every flag) is held back, its error line is not
    assert run_main([*FLAGS, "--num-layerz", "2", pretrain_gpt.CHECK_FLAG]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line == f"{pretrain_gpt.PROG}: error: unrecognized arguments: --num-layerz 2"
