"""``envpipe torchrun`` (megatron/launch.py): one check per node before torchrun starts EnvPipe's Megatron-LM entry.

In-process: torchrun's own ``main`` is replaced by a recorder, so each test
sees whether the ranks would have started and with which arguments; the node
check itself is the shipped one (this host has no CUDA GPU, or a test says
what the node has).
"""

from __future__ import annotations

import pytest

torchrun = pytest.importorskip("torch.distributed.run")

from megatron_envpipe.apps import cli  # noqa: E402
from megatron_envpipe.megatron import launch, pretrain_gpt  # noqa: E402

ENTRY = ["-m", "megatron_envpipe.megatron.pretrain_gpt"]
FLAGS = ["--pipeline-model-parallel-size", "4", "--num-layers", "24", "--micro-batch-size", "1",
         "--global-batch-size", "64", "--envpipe-type", "envelope", "--envpipe-scheduling", "ours"]


@pytest.fixture
def started(monkeypatch):
    """The argument lists torchrun's main was called with (the ranks it would start)."""
    calls: list[list[str]] = []
    monkeypatch.setattr(torchrun, "main", lambda argv=None: calls.append(list(argv)))
    return calls


def gpus(monkeypatch, blocker):
    """The node's answer to "a CUDA GPU per rank and NCCL?" (``blocker(env)``: a reason, or None)."""
    monkeypatch.setattr(pretrain_gpt, "cpu_build_blocker", lambda env: None)
    monkeypatch.setattr(pretrain_gpt, "training_blocker", lambda torch, env, backend="nccl": blocker(env))


def test_a_node_without_cuda_gets_one_line_exit_2_and_no_rank_starts(started, capsys):
    code = cli.main(["torchrun", "--nproc-per-node", "8", *ENTRY, *FLAGS])
    out, err = capsys.readouterr()
    assert code == 2 and started == [] and out == ""
    (line,) = err.splitlines()
    assert line.startswith("envpipe torchrun: error: Megatron-LM's training needs a CUDA GPU per rank (8 here)"), line
    assert "--envpipe-check-args" in line, line


def test_the_node_is_asked_with_torchruns_rank_count(started, monkeypatch, capsys):
    seen = []
    gpus(monkeypatch, lambda env: seen.append(env["LOCAL_WORLD_SIZE"]) or "2 GPU(s) visible")
    assert cli.main(["torchrun", "--nnodes", "2", "--nproc-per-node=4", *ENTRY, *FLAGS]) == 2
    assert seen == ["4"] and started == []
    assert "2 GPU(s) visible" in capsys.readouterr().err


def test_a_node_that_can_run_the_job_starts_torchrun_with_the_same_arguments(started, monkeypatch):
    gpus(monkeypatch, lambda env: None)
    argv = ["--nproc-per-node", "8", "--master-port", "29555", *ENTRY, *FLAGS]
    assert cli.main(["torchrun", *argv]) == 0
    assert started == [argv]


def test_a_bad_envpipe_flag_is_one_line_before_the_gpus_are_asked(started, monkeypatch, capsys):
    gpus(monkeypatch, lambda env: pytest.fail("the node was asked after a bad flag"))
    code = launch.main(["--nproc-per-node", "8", *ENTRY, *FLAGS, "--envpipe-scheduling", "interleaved"])
    err = capsys.readouterr().err
    assert code == 2 and started == [] and len(err.splitlines()) == 1, err
    assert err.startswith("envpipe torchrun: error: ") and "interleaved" in err, err


def test_check_args_needs_no_gpu_and_goes_to_the_ranks(started, monkeypatch):
    gpus(monkeypatch, lambda env: pytest.fail("--envpipe-check-args needs no GPU"))
    argv = ["--nproc-per-node", "1", *ENTRY, *FLAGS, "--envpipe-check-args"]
    assert launch.main(argv) == 0 and started == [argv]


def test_other_programs_are_launched_as_torchrun_would(started, monkeypatch, tmp_path):
    gpus(monkeypatch, lambda env: pytest.fail("the tiny GPT needs no CUDA check"))
    argv = ["--nproc-per-node", "4", "examples/train_tiny_gpt.py", "--device", "cpu", "--envpipe-type", "bogus"]
    assert launch.main(argv) == 0 and started == [argv]


def test_the_entry_given_as_a_file_is_checked_too(started, capsys):
    argv = ["--nproc-per-node", "2", pretrain_gpt.__file__, *FLAGS]
    assert launch.main(argv) == 2 and started == []
    assert "needs a CUDA GPU per rank (2 here)" in capsys.readouterr().err


def test_gpu_rank_count_without_cuda_still_names_what_is_missing(started, monkeypatch, capsys):
    gpus(monkeypatch, lambda env: f"no CUDA GPU ({env['LOCAL_WORLD_SIZE']} rank)")
    monkeypatch.setattr(torchrun, "determine_local_world_size",
                        lambda nproc: (_ for _ in ()).throw(ValueError("Cuda is not available.")))
    assert launch.main(["--nproc-per-node", "gpu", *ENTRY, *FLAGS]) == 2 and started == []
    assert "no CUDA GPU (1 rank)" in capsys.readouterr().err


def test_a_torchrun_usage_error_is_one_line(started, capsys):
    with pytest.raises(SystemExit) as exit_:
        launch.main(["--nproc-per-node"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and started == [] and len(err.splitlines()) == 1, err
    assert err.startswith("envpipe torchrun: error: "), err


def test_the_data_parallel_size_is_torchruns_world_not_the_shells(started, monkeypatch, capsys):
    """A straggler replica is checked against nnodes x nproc / PP, whatever WORLD_SIZE the shell exports."""
    gpus(monkeypatch, lambda env: None)
    monkeypatch.setenv("WORLD_SIZE", "64")  # stale, from the job script: 16 replicas if it were read
    straggler = ["--envpipe-type", "optimal", "--envpipe-gpu", "simulated:a40/gpt3-175b",
                 "--envpipe-sim-straggler", "3:1.15"]
    argv = ["--nnodes", "1", "--nproc-per-node", "8", *ENTRY, *FLAGS[:-4], *straggler]
    assert launch.main(argv) == 2 and started == []
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "replica" in err and "2" in err, err
    argv = ["--nnodes", "2", "--nproc-per-node", "8", *ENTRY, *FLAGS[:-4], *straggler]
    assert launch.main(argv) == 0 and started == [argv]  # 16 ranks / PP 4: replicas 0-3
