"""Rank-side helpers to run EnvPipe's executor inside the gloo test harness.

``envpipe_schedule(config, record_dir)`` is a picklable stand-in for Megatron's
schedule function: in each rank it installs EnvPipe (once per config), runs
the executor, and writes what the stage did to ``record_dir/rank<r>-<n>.json``
(the instructions it dispatched, the program it was given, the live-tensor
count after the call) so tests can check it against the plan. The executor is
called through :func:`~megatron_envpipe.testing.harness.run_schedule`, so each
result names it as the function that ran.
"""

from __future__ import annotations

import functools
import gc
import json
import time
from pathlib import Path
from typing import Any

import torch

from megatron_envpipe.config import EnvPipeConfig
from megatron_envpipe.core.atomic import write_json_atomic
from megatron_envpipe.core.hooks import RecordingHooks
from megatron_envpipe.megatron.executor import envpipe_forward_backward
from megatron_envpipe.megatron.patch import install
from megatron_envpipe.megatron.state import STATE
from megatron_envpipe.testing.harness import run_schedule
from megatron_envpipe.testing.tiny_gpt import TinyGPTSpec, synthetic_batches

_installed: dict[str, Any] = {"config": None, "hooks": None, "calls": 0}


def _live_tensors() -> int:
    gc.collect()
    return sum(1 for o in gc.get_objects() if isinstance(o, torch.Tensor))


def _run(config: EnvPipeConfig, record_dir: str | None, repeat: int = 1, stall_rank: int | None = None,
         **kwargs: Any) -> list[Any]:
    if stall_rank == torch.distributed.get_rank():
        # This stage hangs (as a crashed or wedged GPU would) past its peers' timeout.
        time.sleep(3 * config.comm_timeout_s)
        return []

    if _installed["config"] != config:
        _installed["hooks"] = RecordingHooks()
        install(config, hooks=_installed["hooks"])
        _installed["config"] = config
        _installed["calls"] = 0
    hooks: RecordingHooks = _installed["hooks"]
    start = len(hooks.instructions)
    runtime = STATE.runtime
    m, p = kwargs["num_microbatches"], torch.distributed.get_world_size()
    plan = runtime.prepare(p, m)  # what the executor will be given (prepare is pure)
    store = run_schedule(envpipe_forward_backward, **kwargs)
    live = [_live_tensors()]
    if repeat > 1:
        # More iterations on the same model, as a training loop would run them.
        model = kwargs["model"][0] if isinstance(kwargs["model"], list) else kwargs["model"]
        for _i in range(1, repeat):
            model.zero_grad(set_to_none=True)
            again = dict(kwargs, data_iterator=synthetic_batches(TinyGPTSpec(), kwargs["num_microbatches"]))
            run_schedule(envpipe_forward_backward, **again)
            live.append(_live_tensors())
    rank = torch.distributed.get_rank()
    if record_dir is not None:
        record = {
            "executed": hooks.instructions[start:],
            "planned": [str(i) for i in plan.programs[rank].instructions],
            "phase": plan.phase,
            "extra_warmup": list(plan.schedule.extra_warmup),
            "live_tensors": live,
        }
        path = Path(record_dir) / f"rank{rank}-{_installed['calls']}.json"
        write_json_atomic(path, record, indent=None)
    _installed["calls"] += 1
    return store


def envpipe_schedule(config: EnvPipeConfig, record_dir: str | None = None, repeat: int = 1,
                     stall_rank: int | None = None) -> Any:
    """A picklable schedule function running EnvPipe with ``config``.

    ``repeat > 1`` runs that many iterations on the same model (fresh synthetic
    data, grads zeroed in between) and records the live-tensor count after each.
    ``stall_rank`` makes one rank skip the iteration (to test stuck transfers).
    """
    return functools.partial(_run, config, record_dir, repeat, stall_rank)


def _bench(config: EnvPipeConfig, iterations: int, out_path: str, **kwargs: Any) -> list[Any]:
    """Alternate Megatron's schedule and EnvPipe's executor on one model; time each."""
    install(config)
    native = STATE.original
    model = kwargs["model"][0] if isinstance(kwargs["model"], list) else kwargs["model"]
    m = kwargs["num_microbatches"]
    times: dict[str, list[float]] = {"native": [], "envpipe": []}
    store: list[Any] = []
    for i in range(iterations + 2):  # the first two rounds warm up (allocator, group creation)
        for name, fn in (("native", native), ("envpipe", envpipe_forward_backward)):
            model.zero_grad(set_to_none=True)
            args = dict(kwargs, data_iterator=synthetic_batches(TinyGPTSpec(), m))
            torch.distributed.barrier()
            t0 = time.perf_counter()
            store = fn(**args)
            torch.distributed.barrier()
            if i >= 2:
                times[name].append(time.perf_counter() - t0)
    if torch.distributed.get_rank() == 0:
        Path(out_path).write_text(json.dumps(times))
    return store


def bench_schedule(config: EnvPipeConfig, iterations: int, out_path: str) -> Any:
    """A picklable schedule function that benchmarks the executor against Megatron's."""
    return functools.partial(_bench, config, iterations, out_path)
