"""What Megatron-LM's training needs on this machine, checked before Megatron loads.

Megatron's ``initialize_megatron`` asserts CUDA, gives each local rank its own
device and starts an NCCL process group. Without them every rank used to print
a long traceback after loading all of Megatron (tens of seconds, a thousand
lines under torchrun). :func:`cpu_build_blocker` reads torch's version
without importing it, :func:`training_blocker` asks torch alone (about a second) and :func:`report_blocker` has one rank per node say so in one line;
every rank exits 2 at once. Under torchrun, its own failure summary follows (it
always prints one when a worker exits non-zero, listing each rank's exit code,
and exits 1 itself); nothing a worker does can silence it.
"""

from __future__ import annotations

import importlib.metadata
import os
import sys
from collections.abc import Mapping
from typing import Any

__all__ = ["CPU_ALTERNATIVES", "cpu_build_blocker", "report_blocker", "training_blocker"]

CPU_ALTERNATIVES = ("check the command without a GPU with --envpipe-check-args "
                    "(WORLD_SIZE=N python -m megatron_envpipe.megatron.pretrain_gpt <flags> --envpipe-check-args), "
                    "or see EnvPipe train on CPU with simulated GPUs: envpipe demo, or the tiny GPT "
                    "(torchrun --nproc-per-node 4 examples/train_tiny_gpt.py --device cpu; docs/tiny-gpt.md)")


def _ranks(env: Mapping[str, str]) -> int:
    return int(env.get("LOCAL_WORLD_SIZE", "1") or "1")


def cpu_build_blocker(env: Mapping[str, str]) -> str | None:
    """The reason when the installed torch is a CPU build (read from its metadata, without importing it), else None."""
    try:
        version = importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        return None  # Megatron's own import names what is missing
    if version.endswith("+cpu"):
        return f"Megatron-LM's training needs a CUDA GPU per rank ({_ranks(env)} here); torch {version} is a CPU build"
    return None


def training_blocker(torch: Any, env: Mapping[str, str], backend: str = "nccl") -> str | None:
    """Why Megatron's training cannot start on this node, or None.

    ``torch``: the torch module (a stand-in in tests); ``env``: the rank's
    environment (torchrun sets ``LOCAL_WORLD_SIZE``); ``backend``: Megatron's
    ``--distributed-backend``.
    """
    ranks = _ranks(env)
    build = f"torch {torch.__version__}"
    if not torch.cuda.is_available():
        cuda = getattr(torch.version, "cuda", None)
        why = "a CPU build" if not cuda else f"built for CUDA {cuda}, but it finds no CUDA GPU or driver here"
        return f"Megatron-LM's training needs a CUDA GPU per rank ({ranks} here); {build} is {why}"
    devices = torch.cuda.device_count()
    if devices < ranks:
        return (f"Megatron-LM's training needs a CUDA GPU per rank: {ranks} ranks on this node, "
                f"{devices} GPU(s) visible (CUDA_VISIBLE_DEVICES={env.get('CUDA_VISIBLE_DEVICES', 'unset')})")
    if backend == "nccl" and not torch.distributed.is_nccl_available():
        return f"Megatron-LM's training runs over NCCL (--distributed-backend nccl); {build} has no NCCL"
    return None


def report_blocker(prog: str, reason: str, env: Mapping[str, str] | None = None) -> int:
    """Say ``reason`` in one line from local rank 0 only; the exit code for every rank: 2.

    No torchrun error file is written: its summary would then repeat the line
    once per rank.
    """
    env = os.environ if env is None else env
    line = f"{prog}: error: {reason}: {CPU_ALTERNATIVES}"
    if env.get("LOCAL_RANK", env.get("RANK", "0")) == "0":
        print(line, file=sys.stderr, flush=True)
    return 2
