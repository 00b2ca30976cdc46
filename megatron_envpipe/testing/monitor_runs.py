"""Rank-side helper: EnvPipe on its own devices, recording what each stage ran and logged.

``monitored_schedule(config, record_dir, iterations, refuse_locks)`` installs EnvPipe
without hooks (so it opens this rank's device as a training run does: no GPU on a CPU
rank, or ``config.gpu``'s simulated GPU), runs ``iterations`` iterations on the same
model and data (grads zeroed in between), and writes ``record_dir/rank<r>.json`` (the
units each iteration ran, in order, and what the run-time planned and measured) and
``record_dir/rank<r>.log`` (everything EnvPipe logged on this rank, INFO and up).
``refuse_locks`` makes the simulated GPU refuse every clock lock, as a GPU does for a
job without root (the simulated GPU's ``lock_refusal``).
"""

from __future__ import annotations

import functools
import logging
from pathlib import Path
from typing import Any

import torch

from megatron_envpipe.config import EnvPipeConfig
from megatron_envpipe.core.atomic import write_json_atomic
from megatron_envpipe.core.hooks import ExecutionHooks
from megatron_envpipe.core.schedule import Unit
from megatron_envpipe.gpu import open_gpu, stage_gpu
from megatron_envpipe.gpu.devices.simulated import SimulatedGpu
from megatron_envpipe.megatron.executor import envpipe_forward_backward
from megatron_envpipe.megatron.patch import install
from megatron_envpipe.megatron.state import STATE
from megatron_envpipe.testing.harness import rank_batches, run_schedule

__all__ = ["monitored_schedule"]


def _refusing_open_gpu(reason: str, *args: Any, **kwargs: Any) -> Any:
    device = open_gpu(*args, **kwargs)
    if isinstance(device, SimulatedGpu):
        device.lock_refusal = reason
    return device


def _record_units(executed: list[str]) -> None:
    """Record every unit the stage's hooks are told of, from the first iteration's GPU hooks on."""
    use_hooks = STATE.use_hooks

    def recording(hooks: ExecutionHooks) -> None:
        use_hooks(hooks)
        begin = hooks.unit_begin

        def unit_begin(unit: Unit) -> None:
            executed.append(str(unit))
            begin(unit)

        hooks.unit_begin = unit_begin  # type: ignore[method-assign]

    STATE.use_hooks = recording  # type: ignore[method-assign]


def _run(config: EnvPipeConfig, record_dir: str, iterations: int, refuse_locks: str | None,
         **kwargs: Any) -> list[Any]:
    rank = torch.distributed.get_rank()
    handler = logging.FileHandler(Path(record_dir) / f"rank{rank}.log")
    handler.setFormatter(logging.Formatter("%(levelname)s %(message)s"))
    logger = logging.getLogger("megatron_envpipe")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    if refuse_locks is not None:
        stage_gpu.open_gpu = functools.partial(_refusing_open_gpu, refuse_locks)
    install(config)  # no hooks: the executor opens this rank's device itself
    executed: list[str] = []
    _record_units(executed)
    run = STATE.run
    runtime = run.phases
    m = kwargs["num_microbatches"]
    orders, store = [], []
    for i in range(iterations):
        if i:  # the same model and data again, as if the optimizer had not stepped
            for model in kwargs["model"]:
                model.zero_grad(set_to_none=True)
            kwargs = dict(kwargs, data_iterator=rank_batches(m))
        start = len(executed)
        store = run_schedule(envpipe_forward_backward, **kwargs)
        orders.append(executed[start:])
    handler.close()
    logger.removeHandler(handler)
    record = {
        "orders": orders,
        "control": runtime.device.control,
        "backend": runtime.device.backend,
        "planned_at": runtime.planned_at,
        "planned": runtime.last_result is not None,
        "energy_j": [r.energy_j for r in run.energy.energy_log],
    }
    write_json_atomic(Path(record_dir) / f"rank{rank}.json", record, indent=None)
    return store  # the last iteration's: one iteration's losses and grads


def monitored_schedule(config: EnvPipeConfig, record_dir: str, iterations: int,
                       refuse_locks: str | None = None) -> Any:
    """A picklable schedule function: ``iterations`` iterations of EnvPipe on its own devices (module doc)."""
    return functools.partial(_run, config, record_dir, iterations, refuse_locks)
