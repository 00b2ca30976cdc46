"""The README's Megatron-LM command, as written, gets past Megatron's argument parsing (issue 22).

The command is read out of README.md (the ```bash line that starts with
``torchrun`` and runs ``-m megatron_envpipe.megatron.pretrain_gpt``). Its
arguments run verbatim through ``python -m`` with what torchrun gives rank 0
(``WORLD_SIZE`` = nodes x processes per node, ``RANK=0``), plus
``--envpipe-check-args``: Megatron's own parser and ``validate_args`` must
accept every flag and EnvPipe must validate its own, on a CPU, before any
process group starts. Needs ``megatron.training`` (megatron-core >= 0.17 on
Python >= 3.12, the CI's 3.12 phase); elsewhere those tests skip saying so.
"""

from __future__ import annotations

import math
import os
import re
import shlex
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from megatron_envpipe.megatron.pretrain_gpt import CHECK_FLAG

REPO = Path(__file__).resolve().parents[2]
README = REPO / "README.md"
ENTRY = "megatron_envpipe.megatron.pretrain_gpt"
CPU_WARNINGS = pytest.mark.filterwarnings("ignore:(Transformer Engine and )?Apex (is|are) not installed")


def readme_command() -> list[str]:
    """The README's Megatron-LM command: a ```bash block line ``envpipe torchrun ... -m <ENTRY>``, joined."""
    text = README.read_text()
    for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
        joined = re.sub(r"\\\n\s*", " ", block)
        for line in joined.splitlines():
            if line.startswith(("envpipe torchrun", "torchrun")) and f"-m {ENTRY}" in line:
                return shlex.split(line, comments=True)
    raise AssertionError(f"README.md has no ```bash line starting with (envpipe) torchrun and running -m {ENTRY}")


def torchrun_args(command: list[str]) -> list[str]:
    """The command's arguments to torchrun (after ``torchrun`` or ``envpipe torchrun``)."""
    return command[command.index("torchrun") + 1:]


def split_torchrun(command: list[str]) -> tuple[int, list[str]]:
    """(world size torchrun would start, the entry's own arguments)."""
    command = ["torchrun", *torchrun_args(command)]
    at = command.index("-m")
    launcher, entry_args = command[1:at], command[at + 2:]
    assert command[at + 1] == ENTRY, command

    def option(name: str, default: str) -> str:
        for i, arg in enumerate(launcher):
            if arg == name:
                return launcher[i + 1]
            if arg.startswith(name + "="):
                return arg.split("=", 1)[1]
        return default

    return int(option("--nproc-per-node", "1")) * int(option("--nnodes", "1")), entry_args


def flag(args: list[str], name: str, default: str) -> str:
    return args[args.index(name) + 1] if name in args else default


def needs_megatron_training() -> None:
    try:
        import megatron.training  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - absent (0.16) or not importable on 3.11 (0.17+)
        pytest.skip(f"needs megatron.training (megatron-core >= 0.17 on Python >= 3.12; CI's 3.12 phase): {exc}")


def run_entry(args: list[str], world_size: int) -> subprocess.CompletedProcess:
    env = {**os.environ, "WORLD_SIZE": str(world_size), "RANK": "0", "LOCAL_RANK": "0"}
    env.pop("MEGATRON_LM", None)  # the README's command runs without a checkout
    return subprocess.run([sys.executable, "-m", ENTRY, *args], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=600)


def test_the_readme_command_is_concrete_and_needs_no_checkout():
    command = readme_command()
    _, args = split_torchrun(command)
    assert not [a for a in command if a.startswith("<")], f"placeholder left in the README command: {command}"
    assert "--megatron-lm" not in args and "--envpipe-type" in args


def test_the_readme_command_gets_past_argument_parsing():
    needs_megatron_training()
    world_size, args = split_torchrun(readme_command())
    proc = run_entry([*args, CHECK_FLAG], world_size)
    assert proc.returncode == 0, proc.stderr[-3000:]
    # One line, nothing else: Megatron's argument dump and warnings only with --envpipe-check-args-verbose.
    (line,) = proc.stdout.splitlines()
    assert "arguments OK" in line and not proc.stderr.strip(), (proc.stdout[-2000:], proc.stderr[-2000:])
    tp = int(flag(args, "--tensor-model-parallel-size", "1"))
    pp = int(flag(args, "--pipeline-model-parallel-size", "1"))
    # The figures come from the namespace Megatron's parser built and validate_args completed.
    assert f"Megatron parsed and validated {flag(args, '--num-layers', '?')} layers" in line, line
    assert f"world {world_size} = TP {tp} x PP {pp} x DP {world_size // (tp * pp)}" in line, line
    for name in ("--envpipe-type", "--envpipe-scheduling", "--envpipe-reconfig"):
        assert f"{name.removeprefix('--envpipe-')} {flag(args, name, '?')}" in line, line


def test_the_readme_command_with_help_prints_megatrons_and_envpipes_flags():
    needs_megatron_training()
    world_size, args = split_torchrun(readme_command())
    proc = run_entry([*args, "--help"], world_size)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "--num-layers" in proc.stdout and "--envpipe-type" in proc.stdout and CHECK_FLAG in proc.stdout


def test_a_mistyped_megatron_flag_fails_the_check():
    """The check is Megatron's own strict parser, not a rubber stamp."""
    needs_megatron_training()
    world_size, args = split_torchrun(readme_command())
    proc = run_entry([*args, "--num-layerz", "2", CHECK_FLAG], world_size)
    assert proc.returncode == 2 and "arguments OK" not in proc.stdout, proc.stdout[-2000:]
    assert "unrecognized arguments: --num-layerz 2" in proc.stderr, proc.stderr[-2000:]


def test_a_checkout_goes_first_on_sys_path_and_a_missing_module_is_named(tmp_path):
    """With --megatron-lm DIR the checkout's ``megatron`` is what loads (no PYTHONPATH); what it lacks is one line.

    The checkout here is a stand-in whose ``megatron.training`` imports a module that
    does not exist: the entry must find it ahead of any installed megatron-core and
    name the missing module and the extra that installs Megatron-LM's requirements.
    """
    (tmp_path / "pretrain_gpt.py").write_text("raise SystemExit('the entry must stop before running this')\n")
    (tmp_path / "megatron" / "training").mkdir(parents=True)
    (tmp_path / "megatron" / "training" / "__init__.py").write_text("import envpipe_test_absent_module\n")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "MEGATRON_LM")}
    proc = subprocess.run([sys.executable, "-m", ENTRY, "--megatron-lm", str(tmp_path), "--help"], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    (line,) = [line for line in proc.stderr.splitlines() if line.strip()]
    assert "'envpipe_test_absent_module'" in line and ".[megatron-lm]" in line, line


def test_a_missing_checkout_is_one_line():
    proc = subprocess.run([sys.executable, "-m", ENTRY, "--megatron-lm", "/nonexistent/Megatron-LM", "--help"],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    (line,) = [line for line in proc.stderr.splitlines() if line.strip()]
    assert "/nonexistent/Megatron-LM/pretrain_gpt.py does not exist" in line and "git clone --branch core_v" in line


def test_context_parallel_keeps_an_early_and_a_late_chunk():
    torch = pytest.importorskip("torch")
    from megatron_envpipe.megatron.gpt_provider import slice_for_context_parallel

    seq = torch.arange(8).repeat(2, 1)  # [b=2, s=8]
    mask = torch.arange(64).view(1, 1, 8, 8).repeat(2, 1, 1, 1)
    got = [slice_for_context_parallel({"tokens": seq, "attention_mask": mask, "labels": None}, 2, r) for r in (0, 1)]
    assert got[0]["tokens"][0].tolist() == [0, 1, 6, 7] and got[1]["tokens"][0].tolist() == [2, 3, 4, 5]
    assert got[1]["attention_mask"].shape == (2, 1, 4, 8) and got[1]["attention_mask"][0, 0, :, 0].tolist() == [16, 24, 32, 40]
    assert got[0]["labels"] is None
    assert slice_for_context_parallel({"tokens": seq}, 1, 0)["tokens"] is seq


def test_flags_only_megatron_lms_script_handles_are_refused_in_one_line():
    import argparse

    from megatron_envpipe.megatron.gpt_provider import CheckoutNeeded, check_supported

    check_supported(argparse.Namespace(sft=False, mtp_num_layers=None), "0.19.2")
    with pytest.raises(CheckoutNeeded, match=r"^--mtp-num-layers needs Megatron-LM's own pretrain_gpt.py: "
                                             r"git clone --branch core_v0.19.2 .* --megatron-lm DIR"):
        check_supported(argparse.Namespace(mtp_num_layers=1), "0.19.2")


BUILTIN_GPT_ON_CPU = textwrap.dedent("""
    import math, os, sys
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[1])
    import torch, torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.training import arguments
    from megatron.training.global_vars import set_global_variables
    from megatron_envpipe.megatron import gpt_provider
    from megatron_envpipe.megatron.compat import cpu_shims, model_parallel_manual_seed
    sys.argv = ["pretrain_gpt", "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
                "--seq-length", "32", "--max-position-embeddings", "32", "--micro-batch-size", "2",
                "--global-batch-size", "2", "--train-iters", "1", "--lr", "1e-4", "--mock-data",
                "--tokenizer-type", "NullTokenizer", "--vocab-size", "128", "--transformer-impl", "local",
                "--use-cpu-initialization", "--no-gradient-accumulation-fusion", "--no-persist-layer-norm",
                "--no-masked-softmax-fusion", "--no-bias-gelu-fusion", "--no-bias-dropout-fusion", "--no-rope-fusion"]
    args = arguments.parse_args()
    arguments.validate_args(args, dict(gpt_provider.ARGS_DEFAULTS))
    set_global_variables(args)
    dist.init_process_group("gloo", rank=0, world_size=1)
    parallel_state.initialize_model_parallel()
    train, _, _ = gpt_provider.train_valid_test_datasets_provider([4, 0, 0])
    batch = {k: torch.stack([torch.as_tensor(train[i][k]) for i in range(2)]) for k in gpt_provider.BATCH_KEYS}
    with cpu_shims(torch.device("cpu")):
        model_parallel_manual_seed(1234)
        model = gpt_provider.gpt_model_provider()
        output, loss_of = gpt_provider.forward_step(iter([batch]), model)
        loss, tokens, report = loss_of(output)
    print("RESULT", type(train).__name__, int(tokens), float(loss) / int(tokens), math.log(args.padded_vocab_size))
""")


@CPU_WARNINGS
def test_envpipes_own_gpt_pieces_train_a_step_on_cpu():
    """Datasets provider, forward step, loss and (<= 0.18) model provider work with the installed Megatron."""
    needs_megatron_training()
    port = str(29400 + os.getpid() % 500)
    proc = subprocess.run([sys.executable, "-c", BUILTIN_GPT_ON_CPU, port], cwd=REPO, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (line,) = [line for line in proc.stdout.splitlines() if line.startswith("RESULT")]
    _, dataset, tokens, loss_per_token, uniform = line.split()
    # An untrained model's cross-entropy is about ln(vocab) per token: 2 x 32 tokens, all counted.
    assert dataset == "MockGPTDataset" and int(tokens) == 64
    assert math.isclose(float(loss_per_token), float(uniform), rel_tol=0.1), line


def test_the_readme_command_on_a_node_without_cuda_says_one_line_and_exits_2():
    """The README's command as written (``envpipe torchrun``), where Megatron's training cannot run.

    The node is asked once, before torchrun starts a rank: exactly one line
    (what is missing, what to do), exit 2, nothing from torchrun or a rank.
    """
    import time

    torch = pytest.importorskip("torch")
    if torch.cuda.is_available() and torch.distributed.is_nccl_available():
        pytest.skip("this node has CUDA and NCCL: the README command would train here")
    command = readme_command()
    assert command[:2] == ["envpipe", "torchrun"], command[:2]
    env = {k: v for k, v in os.environ.items() if k not in ("MEGATRON_LM", "LOCAL_RANK", "RANK", "WORLD_SIZE")}
    start = time.monotonic()
    # `envpipe` is this checkout's CLI (python -m, so the console script of another install cannot stand in).
    proc = subprocess.run([sys.executable, "-m", "megatron_envpipe.apps.cli", *command[1:]], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120)
    print(f"envpipe torchrun stopped after {time.monotonic() - start:.1f} s (wall, this host)")
    assert proc.returncode == 2 and proc.stdout == "", (proc.returncode, proc.stdout[-2000:])
    (line,) = proc.stderr.splitlines()
    assert line.startswith("envpipe torchrun: error: Megatron-LM's training needs a CUDA GPU per rank (8 here)"), line
    assert CHECK_FLAG in line, line


def test_plain_torchrun_on_a_node_without_cuda_stops_each_rank_in_one_line_within_30_s():
    """The same arguments under stock torchrun: one line from EnvPipe, every rank exits 2.

    torchrun itself always adds its failure summary (it lists each rank's exit
    code) and exits 1; no worker may add a traceback or Megatron's output.
    """
    import time

    torch = pytest.importorskip("torch")
    if torch.cuda.is_available() and torch.distributed.is_nccl_available():
        pytest.skip("this node has CUDA and NCCL: the README command would train here")
    command = readme_command()
    env = {k: v for k, v in os.environ.items() if k not in ("MEGATRON_LM", "LOCAL_RANK", "RANK", "WORLD_SIZE")}
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", *torchrun_args(command)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120)
    took_s = time.monotonic() - start
    output = proc.stdout + proc.stderr
    ours = [line for line in output.splitlines() if line.startswith("pretrain_gpt (megatron-envpipe): error:")]
    assert len(ours) == 1, output[-3000:]
    assert "needs a CUDA GPU per rank" in ours[0] and CHECK_FLAG in ours[0], ours[0]
    assert took_s < 30, f"took {took_s:.1f} s"
    assert proc.returncode != 0 and "exitcode  : 2" in output, output[-3000:]
    # torchrun's own traceback (ChildFailedError) only: nothing from the ranks, nothing from Megatron
    assert output.count("Traceback (most recent call last)") <= 1 and "AssertionError" not in output, output[-3000:]
    assert "megatron.training" not in output and "arguments" not in output.lower(), output[-3000:]
