"""``envpipe torchrun``: PyTorch's torchrun, after one check per node of what the launched entry needs.

    envpipe torchrun --nproc-per-node 8 -m megatron_envpipe.megatron.pretrain_gpt <flags>

The arguments are torchrun's, unchanged, and so is everything it does once
the ranks start. Before it starts them, when the program is EnvPipe's
Megatron-LM entry, the node is asked what each rank would ask first (its
``--envpipe-*`` flags, the checkout, a CUDA GPU per rank, NCCL). A node that
cannot run the job says so in one line and exits 2 within seconds, where
plain torchrun would start every rank, let each fail, and add its own
failure summary (``ChildFailedError``, exit 1): nothing a worker does can
change what the launcher prints. Any other program is launched as torchrun
would launch it.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from megatron_envpipe.megatron.pretrain_gpt import node_startup_error

__all__ = ["PROG", "main"]

PROG = "envpipe torchrun"
_ENTRY_MODULE = "megatron_envpipe.megatron.pretrain_gpt"
EXIT_USAGE = 2


def _launches_entry(args: Any) -> bool:
    """Whether torchrun's parsed ``args`` start EnvPipe's Megatron-LM entry (``-m`` module or its file)."""
    target = str(args.training_script)
    if args.module:
        return target == _ENTRY_MODULE
    entry_file = Path(__file__).resolve().with_name("pretrain_gpt.py")
    try:
        return Path(target).resolve() == entry_file
    except OSError:
        return False


def _node_error(args: Any, env: Mapping[str, str], local_world_size: Any) -> str | None:
    """The one line that stops the launch on this node, or None; ``local_world_size(nproc)``: torchrun's own."""
    if not _launches_entry(args):
        return None
    try:
        ranks = int(local_world_size(args.nproc_per_node))
    except ValueError:  # e.g. --nproc-per-node gpu without CUDA: one rank's view of the node still says why
        ranks = 1
    nodes = str(args.nnodes)
    world = str(int(nodes) * ranks) if nodes.isdigit() else ""  # "1:4": elastic, the world is not known yet
    rank_env = {**env, "LOCAL_WORLD_SIZE": str(ranks), "LOCAL_RANK": "0", "WORLD_SIZE": world}
    return node_startup_error(list(args.training_script_args), rank_env)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        from torch.distributed import run as torchrun
    except ImportError as exc:
        print(f"{PROG}: error: torchrun needs torch ({exc}): install it with bash install.sh "
              f"(or pip install 'megatron-envpipe[megatron]')", file=sys.stderr)
        return EXIT_USAGE
    parser = torchrun.get_args_parser()
    parser.prog = PROG
    parser.error = _one_line_error  # torchrun's usage errors as one line, not its 20-line usage block
    args = parser.parse_args(argv)
    error = _node_error(args, os.environ, torchrun.determine_local_world_size)
    if error is not None:
        print(f"{PROG}: error: {error}", file=sys.stderr, flush=True)
        return EXIT_USAGE
    torchrun.main(argv)  # stock torchrun from here on, its exit status and failure summary included
    return 0


def _one_line_error(message: str) -> None:
    print(f"{PROG}: error: {message} (torchrun's arguments: envpipe torchrun --help)", file=sys.stderr)
    raise SystemExit(EXIT_USAGE)
