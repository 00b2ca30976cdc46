"""Rank-side helpers to run EnvPipe's executor inside the gloo test harness.

``envpipe_schedule(config, record_dir)`` is a picklable stand-in for Megatron's
schedule function: in each rank it installs EnvPipe (once per config), runs
the executor, and writes what the stage did to ``record_dir/rank<r>-<n>.json``
(the instructions it dispatched, the program it was given, the live-tensor
count after the call) so tests can check it against the plan.
``planned_schedule(config, record_dir, iterations)`` lets EnvPipe open its own
(simulated) GPUs, profile, plan and run that many iterations, and writes each
rank's final clock plan and profile, so tests can check that ranks agree. The
executor is called through :func:`~megatron_envpipe.testing.harness.run_schedule`,
so each result names it as the function that ran.
"""

from __future__ import annotations

import dataclasses
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
from megatron_envpipe.core.instructions import with_shape_messages
from megatron_envpipe.core.kinds import scheduling_kind
from megatron_envpipe.megatron.executor import envpipe_forward_backward, envpipe_interleaved_forward_backward
from megatron_envpipe.megatron.patch import install
from megatron_envpipe.megatron.shape_exchange import uses_shape_messages
from megatron_envpipe.megatron.state import STATE
from megatron_envpipe.testing.harness import rank_batches, run_schedule

_installed: dict[str, Any] = {"config": None, "hooks": None, "calls": 0}


def _pipeline_position() -> tuple[int, int]:
    """(pipeline size, this rank's stage): with TP or DP the world is larger than the pipeline."""
    from megatron.core import parallel_state

    return parallel_state.get_pipeline_model_parallel_world_size(), parallel_state.get_pipeline_model_parallel_rank()


def _model_of(kwargs: dict[str, Any]) -> Any:
    return kwargs["model"][0] if isinstance(kwargs["model"], list) else kwargs["model"]


def _zero_grads(kwargs: dict[str, Any]) -> None:
    for model in kwargs["model"] if isinstance(kwargs["model"], list) else [kwargs["model"]]:
        model.zero_grad(set_to_none=True)


def _chunks(kwargs: dict[str, Any]) -> int:
    return len(kwargs["model"]) if isinstance(kwargs["model"], list) else 1


def _executor(kwargs: dict[str, Any]) -> Any:
    """EnvPipe's replacement of the schedule Megatron would pick: interleaved for model chunks."""
    return envpipe_interleaved_forward_backward if _chunks(kwargs) > 1 else envpipe_forward_backward


def _prepare(runtime: Any, p: int, m: int, kwargs: dict[str, Any]) -> Any:
    """What the executor will be given (prepare is pure)."""
    v = _chunks(kwargs)
    if v == 1:
        return runtime.prepare(p, m)
    group = _model_of(kwargs).config.microbatch_group_size_per_vp_stage
    return runtime.prepare(p, m, num_chunks=v, microbatch_group_size=group)


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
    start, start_sizes = len(hooks.instructions), len(hooks.sizes)
    runtime = STATE.runtime
    m = kwargs["num_microbatches"]
    p, stage = _pipeline_position()
    executor = _executor(kwargs)
    # Model chunks under another scheduling fall back to Megatron's schedule: no program to expect.
    runs_program = _chunks(kwargs) == 1 or scheduling_kind(config.scheduling).model_chunks
    plan = _prepare(runtime, p, m, kwargs) if runs_program else None
    store = run_schedule(executor, **kwargs)
    live = [_live_tensors()]
    if repeat > 1:
        # More iterations on the same model, as a training loop would run them.
        for _i in range(1, repeat):
            _zero_grads(kwargs)
            again = dict(kwargs, data_iterator=rank_batches(m))
            run_schedule(executor, **again)
            live.append(_live_tensors())
    rank = torch.distributed.get_rank()
    if record_dir is not None:
        program = plan.programs[stage] if plan is not None else None
        if program is not None and uses_shape_messages(_model_of(kwargs).config):  # variable lengths
            program = with_shape_messages(program)
        record = {
            "executed": hooks.instructions[start:],
            "planned": [str(i) for i in program.instructions] if program is not None else [],
            "phase": plan.phase if plan is not None else "Megatron's schedule",
            "extra_warmup": list(plan.schedule.extra_warmup) if plan is not None else [],
            "live_tensors": live,
            # hooks.iteration_sizes per iteration: (tokens, attention_tokens2) per micro-batch, or None
            "sizes": [None if sizes is None else [[x.tokens, x.attention_tokens2] for x in sizes]
                      for sizes in hooks.sizes[start_sizes:]],
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


def _run_planned(config: EnvPipeConfig, record_dir: str, iterations: int, replica_caches: tuple[str, ...] | None,
                 **kwargs: Any) -> list[Any]:
    if replica_caches is not None:  # as if each replica ran on its own node, with its own cache
        from megatron.core import parallel_state

        config = dataclasses.replace(config, profile_cache=replica_caches[parallel_state.get_data_parallel_rank()])
    install(config)  # no hooks: the executor opens this rank's (simulated) GPU and profiles it
    _installed["config"] = None  # envpipe_schedule installs its recording hooks again
    runtime = STATE.runtime
    m = kwargs["num_microbatches"]
    p, _ = _pipeline_position()
    executor = _executor(kwargs)
    phases, store = [], []
    for i in range(iterations):
        if i:  # the same model and data again, as if the optimizer had not stepped
            _zero_grads(kwargs)
            kwargs = dict(kwargs, data_iterator=rank_batches(m))
        # The device is opened by the first call; from then on prepare() says what the call will do.
        phases.append(_prepare(runtime, p, m, kwargs).phase if runtime.device is not None else "start-up")
        store = run_schedule(executor, **kwargs)
    final = _prepare(runtime, p, m, kwargs)
    record = {
        "phases": phases,
        "plan": final.plan.to_dict() if final.plan is not None else None,
        "profile": runtime.profile.to_csv_text() if runtime.profile is not None else None,
        "profile_p2p_power_w": runtime.profile_p2p_power_w,
        "planned_at": runtime.planned_at,
        "profile_cache": config.profile_cache,
    }
    write_json_atomic(Path(record_dir) / f"rank{torch.distributed.get_rank()}.json", record, indent=None)
    return store  # the last iteration's


def planned_schedule(config: EnvPipeConfig, record_dir: str, iterations: int,
                     replica_caches: tuple[str, ...] | None = None) -> Any:
    """A picklable schedule function: ``iterations`` iterations of EnvPipe on its own devices.

    ``install(config)`` without hooks, so ``config.gpu`` (e.g. ``simulated:a40/gpt3-175b``)
    is opened, swept and planned for; every iteration runs the same data on the same
    weights (grads zeroed in between), so the last one's losses and grads are comparable
    with one stock iteration. Each rank writes ``record_dir/rank<global rank>.json``:
    the phase of every iteration, the final clock plan, the profile it was planned from.
    ``replica_caches`` gives each data-parallel replica its own profile cache directory.
    """
    return functools.partial(_run_planned, config, record_dir, iterations, replica_caches)


def _bench(config: EnvPipeConfig, iterations: int, out_path: str, **kwargs: Any) -> list[Any]:
    """Alternate Megatron's schedule and EnvPipe's executor on one model; time each."""
    install(config)
    native = STATE.original
    model = _model_of(kwargs)
    m = kwargs["num_microbatches"]
    times: dict[str, list[float]] = {"native": [], "envpipe": []}
    store: list[Any] = []
    for i in range(iterations + 2):  # the first two rounds warm up (allocator, group creation)
        for name, fn in (("native", native), ("envpipe", envpipe_forward_backward)):
            model.zero_grad(set_to_none=True)
            args = dict(kwargs, data_iterator=rank_batches(m))
            torch.distributed.barrier()
            t0 = time.perf_counter()
            store = fn(**args)
            torch.distributed.barrier()
            if i >= 2:
                times[name].append(time.perf_counter() - t0)
    if torch.distributed.get_rank() == 0:
        Path(out_path).write_text(json.dumps(times, allow_nan=False))
    return store


def bench_schedule(config: EnvPipeConfig, iterations: int, out_path: str) -> Any:
    """A picklable schedule function that benchmarks the executor against Megatron's."""
    return functools.partial(_bench, config, iterations, out_path)
