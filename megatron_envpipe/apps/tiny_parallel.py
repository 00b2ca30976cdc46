"""The tiny GPT's processes: the process groups (gloo or NCCL, Megatron's model-parallel groups), whether
local ranks may share a GPU, and the data-parallel replicas' gradient sync and loss sum.

Split from :mod:`megatron_envpipe.apps.train_tiny_gpt` (the training loop), which re-exports these names.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from megatron_envpipe.core.device_backends import backend_traits
from megatron_envpipe.megatron.localhost import free_port

__all__ = ["average_over_replicas", "init_distributed", "sum_over_replicas"]


def _shared_gpu_problem(args: argparse.Namespace, local_ranks: int, device_count: int) -> str | None:
    """Why this run cannot go ahead with ``local_ranks`` ranks on ``device_count`` GPUs, or None.

    Stages sharing a GPU share its clock: no stage can lock it for its own plan,
    so an EnvPipe run there must drive the simulated GPU (timing and energy
    from its profile, arithmetic still on the real device).
    """
    if args.device != "cuda" or local_ranks <= max(device_count, 1):
        return None
    if args.p2p_transport != "host":
        return (f"--device cuda puts {local_ranks} local ranks on {device_count} GPU(s): NCCL needs one GPU per "
                f"rank; add --p2p-transport host (gloo, tensors staged through host memory) to share a GPU")
    gpu = getattr(args, "envpipe_gpu", None) or ""
    # A modelled GPU (simulated:<profile>) keeps its clocks per stage, in the model.
    if not args.no_envpipe and not (backend_traits(gpu).modelled and ":" in gpu):
        return (f"--p2p-transport host puts {local_ranks} local ranks on {device_count} GPU(s): stages sharing a "
                f"GPU cannot control its clocks (--envpipe-gpu {gpu or 'auto'}); add --envpipe-gpu "
                f"simulated:<profile>, e.g. simulated:a40/gpt3-175b, or run --no-envpipe")
    return None


# --------------------------------------------------------------------------- distributed


def init_distributed(args: argparse.Namespace) -> torch.device:
    """Process group (gloo on CPU or with --p2p-transport host, else NCCL on CUDA) and Megatron's
    model-parallel groups."""
    from megatron.core import parallel_state

    if "RANK" not in os.environ:  # started without torchrun: a single-process job
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(free_port()))
    world_size = int(os.environ["WORLD_SIZE"])
    if world_size % args.pipeline_model_parallel_size:
        raise SystemExit(
            f"this example runs one rank per pipeline stage per data-parallel replica (TP = 1): start a multiple "
            f"of {args.pipeline_model_parallel_size} processes, not {world_size}"
        )
    if args.device == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit("--device cuda: no CUDA device visible (use --device cpu)")
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        count = torch.cuda.device_count()
        problem = _shared_gpu_problem(args, int(os.environ.get("LOCAL_WORLD_SIZE", "1")), count)
        if problem is not None:
            raise SystemExit(f"{Path(sys.argv[0]).name}: error: {problem}")
        device = torch.device("cuda", local_rank % count)
        torch.cuda.set_device(device)
        if args.p2p_transport == "host":
            # gloo moves host tensors only: host_p2p stages every transfer (several ranks may share the GPU).
            dist.init_process_group(backend="gloo")
        else:
            # Bound to the device: NCCL communicators are created eagerly, at group creation, not
            # lazily inside the first iteration (EnvPipe's channels then split the pipeline group).
            dist.init_process_group(backend="nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group(backend="gloo")
    parallel_state.initialize_model_parallel(
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=args.virtual_pipeline_model_parallel_size)
    return device


# --------------------------------------------------------------------------- data-parallel replicas


def average_over_replicas(params: list[torch.nn.Parameter], dp_size: int) -> None:
    """The data-parallel gradient sync: every gradient averaged over the replicas (DP = 1: nothing)."""
    if dp_size == 1:
        return
    from megatron.core import parallel_state

    group = parallel_state.get_data_parallel_group()
    for p in params:
        if p.grad is not None:
            dist.all_reduce(p.grad, group=group)
            p.grad.div_(dp_size)


def sum_over_replicas(loss_sum: float, tokens: int, device: torch.device, dp_size: int) -> tuple[float, int]:
    """The iteration's loss sum and tokens over every replica (DP = 1: as given)."""
    if dp_size == 1:
        return loss_sum, tokens
    from megatron.core import parallel_state

    both = torch.tensor([loss_sum, float(tokens)], dtype=torch.float64, device=device)
    dist.all_reduce(both, group=parallel_state.get_data_parallel_group())
    return float(both[0]), int(both[1])
