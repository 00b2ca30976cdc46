"""Run one training iteration of a pipeline-parallel tiny GPT on CPU ranks over gloo.

``run_pipeline(P, runs)`` starts ``P`` rank processes (``TP x P x DP`` with
``tensor_parallel_size`` / ``data_parallel_size``), initialises Megatron's
model-parallel state with ``initialize_model_parallel`` and, for every
requested run, builds the model afresh (identical weights each time), calls a
schedule function for one iteration and records each rank's losses and
parameter gradients. Data-parallel replicas read their own micro-batches and
average their grads at the end of the iteration
(:func:`~megatron_envpipe.testing.tiny_gpt.average_data_parallel_grads`). The schedule is Megatron's own 1F1B by default, or any
picklable callable with the same keyword signature: that is how an alternative
executor is compared with it bit for bit.

Every result also says which schedule function ran on that rank
(:class:`ScheduleIdentity`, recorded in the rank when it was called) and
whether EnvPipe was installed in that process. A same-math test compares an
alternative executor with a *separate* ``run_pipeline`` call of stock Megatron
and checks both identities: ``install()`` rebinds Megatron's schedule for the
rest of a process, so a reference run in the same ranks after it would compare
EnvPipe with itself.

Starting ranks is dominated by importing torch and megatron (5 s per process,
several times that when P processes import at once on two cores). Ranks are
therefore forked from a forkserver that preloads both, paid once per parent
process (:func:`start_ranks`, also for tests' own gloo ranks), and several runs
can share one set of ranks. Every rank forked from it is still a fresh process:
nothing one rank does (``install()``) reaches the next. The parent stops and
waits for its forkserver at exit, so that the ranks' CPU time is counted in
the parent's (``/usr/bin/time pytest``) like that of any child it waits for.
"""

from __future__ import annotations

import atexit
import functools
import gc
import multiprocessing
import os
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from multiprocessing import forkserver
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from megatron_envpipe.megatron.compat import check_megatron_installed, cpu_shims
from megatron_envpipe.testing.sync_events import EVENTS, install_recorders
from megatron_envpipe.testing.tiny_gpt import (
    Batch,
    TinyGPTSpec,
    build_config,
    build_model,
    forward_step_func,
    synthetic_batches,
)

__all__ = [
    "MEGATRON_1F1B",
    "MEGATRON_INTERLEAVED",
    "PipelineRun",
    "ScheduleFn",
    "ScheduleIdentity",
    "StageResult",
    "compare_results",
    "identify",
    "join_ranks",
    "megatron_1f1b",
    "megatron_interleaved",
    "rank_batches",
    "run_pipeline",
    "run_schedule",
    "start_ranks",
    "stop_forkserver",
]

# Megatron-core's own non-interleaved 1F1B and interleaved schedules, by module and qualified name.
MEGATRON_1F1B = "megatron.core.pipeline_parallel.schedules.forward_backward_pipelining_without_interleaving"
MEGATRON_INTERLEAVED = "megatron.core.pipeline_parallel.schedules.forward_backward_pipelining_with_interleaving"
_MEGATRON_1F1B_FILE = ("megatron", "core", "pipeline_parallel", "schedules.py")

_HOST = "127.0.0.1"
# Imported once by the forkserver, inherited by every rank it forks. The server
# forks from a single-threaded state, unlike forking the (threaded) parent.
_PRELOAD = [
    "torch",
    "megatron.core.parallel_state",
    "megatron.core.pipeline_parallel.schedules",
    "megatron.core.models.gpt",
    "megatron.core.models.gpt.gpt_layer_specs",
    __name__,
]


class ScheduleFn(Protocol):
    """Megatron's ``forward_backward_func`` keyword interface; returns forward_data_store."""

    def __call__(self, **kwargs: Any) -> list[Any]: ...


@dataclass(frozen=True)
class ScheduleIdentity:
    """Which schedule function ran on a rank, recorded in the rank at call time."""

    name: str  # __module__.__qualname__
    # File of its code object: functools.wraps copies names onto a wrapper, not code.
    source: str
    # megatron_envpipe's install() was in force in that process when it ran.
    envpipe_installed: bool

    @property
    def is_stock_megatron(self) -> bool:
        """Megatron's own 1F1B or interleaved schedule, in a process where EnvPipe was not installed."""
        return (self.name in (MEGATRON_1F1B, MEGATRON_INTERLEAVED) and not self.envpipe_installed
                and Path(self.source).parts[-len(_MEGATRON_1F1B_FILE):] == _MEGATRON_1F1B_FILE)


def _envpipe_installed() -> bool:
    # Looked up, not imported: a stock run must not load EnvPipe's patch (or executor).
    patch = sys.modules.get("megatron_envpipe.megatron.patch")
    return bool(patch is not None and patch.is_installed())


def identify(fn: Callable[..., Any]) -> ScheduleIdentity:
    """The identity of ``fn`` (a ``functools.partial`` is named by its function)."""
    while isinstance(fn, functools.partial):
        fn = fn.func
    name = f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', type(fn).__qualname__)}"
    code = getattr(fn, "__code__", None)
    return ScheduleIdentity(name, code.co_filename if code is not None else "", _envpipe_installed())


# The schedule functions called in this rank during the current run, in order.
_ran: list[ScheduleIdentity] = []


def run_schedule(fn: Callable[..., list[Any]], **kwargs: Any) -> list[Any]:
    """Call the schedule function ``fn``, recording its identity for this run's results.

    Schedules passed to :class:`PipelineRun` call their real schedule through
    this, so the result names the function that ran, not the wrapper.
    """
    identity = identify(fn)
    if identity not in _ran:
        _ran.append(identity)
    return fn(**kwargs)


def megatron_1f1b(**kwargs: Any) -> list[Any]:
    """Megatron's own non-interleaved 1F1B; refuses to run anything else.

    Looked up when called, in the rank process: if EnvPipe (or anything) has
    rebound the name there, this raises instead of running the replacement.
    """
    from megatron.core.pipeline_parallel import schedules

    return _stock(schedules.forward_backward_pipelining_without_interleaving, MEGATRON_1F1B, kwargs)


def megatron_interleaved(**kwargs: Any) -> list[Any]:
    """Megatron's own interleaved schedule (model chunks); refuses to run anything else, like :func:`megatron_1f1b`."""
    from megatron.core.pipeline_parallel import schedules

    return _stock(schedules.forward_backward_pipelining_with_interleaving, MEGATRON_INTERLEAVED, kwargs)


def _stock(fn: Callable[..., list[Any]], name: str, kwargs: dict[str, Any]) -> list[Any]:
    identity = identify(fn)
    if not identity.is_stock_megatron or identity.name != name:
        raise RuntimeError(
            f"stock reference: Megatron's {name.rsplit('.', 1)[1]} is {identity.name} here (EnvPipe installed: "
            f"{identity.envpipe_installed}); a stock reference must run in ranks where install() was never called"
        )
    return run_schedule(fn, **kwargs)


@dataclass(frozen=True)
class PipelineRun:
    """One ``forward_backward_func`` call: an iteration over ``num_microbatches``.

    ``schedule=None`` takes whatever ``get_forward_backward_func()`` returns, as
    megatron.training does. A replacement must be picklable (a module-level
    function or a ``functools.partial`` of one): it is sent to the rank processes.
    ``forward_only`` makes it an evaluation step (no backward, no gradients).
    """

    num_microbatches: int
    schedule: ScheduleFn | None = None
    forward_only: bool = False
    # Record the schedule's no-sync / grad-sync / param-sync calls and forwards (StageResult.events).
    record_sync: bool = False


@dataclass(frozen=True)
class StageResult:
    """What one rank produced in one run; tensors are detached CPU copies."""

    rank: int
    # Megatron's forward_data_store: one report dict per micro-batch on the last
    # stage ({"lm loss": masked loss sum, "num_tokens": ...}), empty elsewhere.
    losses: list[dict[str, torch.Tensor]]
    # Every parameter of the stage, by name (``chunk<v>.<name>`` with model chunks); None if it
    # received no gradient.
    grads: dict[str, torch.Tensor | None] = field(default_factory=dict)
    # The schedule functions this rank called in this run (normally one); see run_schedule.
    schedules: tuple[ScheduleIdentity, ...] = ()
    # Where the rank sits: pipeline stage, tensor-parallel rank, data-parallel replica.
    stage: int = 0
    tp_rank: int = 0
    dp_rank: int = 0
    # With PipelineRun.record_sync: the rank's sync and forward events, in order (testing/sync_events.py).
    events: tuple[tuple[Any, ...], ...] = ()


def run_pipeline(
    pipeline_size: int,
    runs: Sequence[PipelineRun],
    *,
    spec: TinyGPTSpec | None = None,
    timeout_s: float = 300.0,
    tensor_parallel_size: int = 1,
    data_parallel_size: int = 1,
    virtual_pipeline_size: int | None = None,
) -> list[list[StageResult]]:
    """Start ``TP x pipeline_size x DP`` gloo ranks, execute ``runs`` in order, return results.

    ``spec`` defaults to ``TinyGPTSpec()``. Result ``[i][r]`` is run ``i`` on
    global rank ``r``, laid out as Megatron's ``initialize_model_parallel`` does
    (TP fastest, then DP, then PP); with TP = DP = 1, rank == pipeline stage.
    ``virtual_pipeline_size`` V: each stage holds V model chunks (Megatron's
    interleaved pipeline), each with its own data iterator over the same data.
    A rank that raises aborts all ranks and its error is re-raised here with its
    traceback; ranks still alive after ``timeout_s`` (e.g. a P2P deadlock) are
    killed and ``TimeoutError`` is raised.
    """
    if pipeline_size < 2:
        raise ValueError("pipeline tests need at least 2 stages")
    if tensor_parallel_size < 1 or data_parallel_size < 1:
        raise ValueError("tensor_parallel_size and data_parallel_size must be >= 1")
    if virtual_pipeline_size is not None and virtual_pipeline_size < 2:
        raise ValueError("virtual_pipeline_size must be None or >= 2")
    world_size = tensor_parallel_size * pipeline_size * data_parallel_size
    check_megatron_installed()
    spec = spec or TinyGPTSpec()
    runs = list(runs)
    # The parent owns the rendezvous store: binding port 0 here and handing the
    # chosen port to the ranks leaves no window for another process to take it.
    store = dist.TCPStore(_HOST, 0, is_master=True, wait_for_workers=False)
    with tempfile.TemporaryDirectory(prefix="envpipe-harness-") as tmp:
        out_dir = Path(tmp)
        context = start_ranks(_rank_main, (world_size, store.port, runs, spec, str(out_dir), pipeline_size,
                                           tensor_parallel_size, virtual_pipeline_size), world_size)
        join_ranks(context, timeout_s)
        per_rank = [
            torch.load(out_dir / f"rank{rank}.pt", weights_only=False)
            for rank in range(world_size)
        ]
    return [[per_rank[rank][i] for rank in range(world_size)] for i in range(len(runs))]


def start_ranks(fn: Callable[..., None], args: tuple[Any, ...], nprocs: int) -> mp.ProcessContext:
    """Start ``fn(rank, *args)`` in ``nprocs`` fresh processes forked from this process's forkserver.

    Like ``torch.multiprocessing.start_processes(..., start_method="spawn")`` (``fn`` and ``args`` are
    pickled; each process starts clean), without each process importing torch and megatron-core again:
    the forkserver imported them once. Wait with :func:`join_ranks`.
    """
    # Only takes effect if this process has not started its forkserver yet.
    multiprocessing.set_forkserver_preload(_PRELOAD)
    atexit.unregister(_stop_at_exit)  # registered once, however many times ranks start
    atexit.register(_stop_at_exit, os.getpid())
    return mp.start_processes(fn, args=args, nprocs=nprocs, join=False, start_method="forkserver")


def stop_forkserver() -> None:
    """Stop this process's forkserver, if it started one, and wait for it (registered at exit by start_ranks).

    The forkserver waits for the ranks it forks, so their CPU time is in its own children's; a parent
    that never waits for the forkserver (multiprocessing leaves it to exit on its own) would not count it.
    """
    server = forkserver._forkserver
    if getattr(server, "_forkserver_pid", None) is not None:
        server._stop()  # closes its 'alive' pipe, then waitpid()s it


def _stop_at_exit(parent_pid: int) -> None:
    if os.getpid() == parent_pid:  # not in a child that os.fork() copied the handler into
        stop_forkserver()


def join_ranks(context: mp.ProcessContext, timeout_s: float) -> None:
    """Wait for every process of ``context``; a rank's error is raised here with its traceback.

    Ranks still alive after ``timeout_s`` (e.g. a P2P deadlock) are killed and ``TimeoutError`` is raised.
    """
    deadline = time.monotonic() + timeout_s
    while not context.join(timeout=max(0.0, min(1.0, deadline - time.monotonic()))):
        if time.monotonic() >= deadline:
            for process in context.processes:
                if process.is_alive():
                    process.kill()
            for process in context.processes:
                process.join()
            raise TimeoutError(f"pipeline ranks still running after {timeout_s:.0f} s")


def _rank_main(
    rank: int,
    world_size: int,
    port: int,
    runs: list[PipelineRun],
    spec: TinyGPTSpec,
    out_dir: str,
    pipeline_size: int,
    tensor_parallel_size: int,
    virtual_pipeline_size: int | None,
) -> None:
    # What the forkserver imported lives as long as the rank: keep the garbage collector off it, so that a
    # collection (or a live-tensor count) walks only what the rank made, not torch's and megatron's ~400k
    # objects (0.3 CPU-s each time, and a copy of every page it touches).
    gc.freeze()
    # One intra-op thread per rank: P ranks would oversubscribe a small machine,
    # and CPU kernels' reduction splits must not depend on its core count.
    torch.set_num_threads(1)
    from megatron.core import parallel_state

    store = dist.TCPStore(_HOST, port, is_master=False)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size)
    try:
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=tensor_parallel_size,
                                                 pipeline_model_parallel_size=pipeline_size,
                                                 virtual_pipeline_model_parallel_size=virtual_pipeline_size)
        with cpu_shims("cpu"):
            results = [_run_once(rank, run, spec, pipeline_size, tensor_parallel_size, virtual_pipeline_size)
                       for run in runs]
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


# The data of the run in progress in this rank, for schedules that run more iterations.
_data: dict[str, Any] = {}


def rank_batches(num_microbatches: int) -> Iterator[Batch] | list[Iterator[Batch]]:
    """This rank's micro-batches of the current run again, from the first one.

    For schedule functions that run several iterations on the model of one run
    (:mod:`~megatron_envpipe.testing.envpipe_runs`): the same data each time;
    with model chunks, a list of one iterator per chunk.
    """
    chunks = _data["chunks"]
    if chunks is None:
        return synthetic_batches(_data["spec"], num_microbatches, _data["replica"])
    return [synthetic_batches(_data["spec"], num_microbatches, _data["replica"]) for _ in range(chunks)]


def _run_once(rank: int, run: PipelineRun, spec: TinyGPTSpec, pipeline_size: int,
              tensor_parallel_size: int, virtual_pipeline_size: int | None = None) -> StageResult:
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import get_forward_backward_func

    replica = parallel_state.get_data_parallel_rank()
    data_parallel_size = parallel_state.get_data_parallel_world_size()
    config = build_config(spec, pipeline_size, tensor_parallel_size, data_parallel_size, virtual_pipeline_size)
    chunks = [None] if virtual_pipeline_size is None else list(range(virtual_pipeline_size))
    models = [build_model(spec, config, vp_stage=v) for v in chunks]
    _data.update(spec=spec, replica=replica, chunks=virtual_pipeline_size)
    step = install_recorders(config, models, forward_step_func) if run.record_sync else forward_step_func
    kwargs: dict[str, Any] = dict(
        forward_step_func=step,
        data_iterator=rank_batches(run.num_microbatches),
        model=models,
        num_microbatches=run.num_microbatches,
        seq_length=spec.seq_length,
        micro_batch_size=spec.micro_batch_size,
        decoder_seq_length=None,
        forward_only=run.forward_only,
    )
    _ran.clear()
    if run.schedule is None:
        store = run_schedule(get_forward_backward_func(), **kwargs)
    else:
        store = run.schedule(**kwargs)
    # A schedule that did not report its function is named by itself.
    ran = tuple(_ran) or (identify(run.schedule),)
    losses = [{key: value.detach().cpu().clone() for key, value in item.items()} for item in store]
    grads = {
        (name if v is None else f"chunk{v}.{name}"): None if param.grad is None else param.grad.detach().cpu().clone()
        for v, model in zip(chunks, models, strict=True)
        for name, param in model.named_parameters()
    }
    events = tuple(EVENTS) if run.record_sync else ()
    return StageResult(rank=rank, losses=losses, grads=grads, schedules=ran, events=events,
                       stage=parallel_state.get_pipeline_model_parallel_rank(),
                       tp_rank=parallel_state.get_tensor_model_parallel_rank(), dp_rank=replica)


def compare_results(expected: Sequence[StageResult], actual: Sequence[StageResult]) -> list[str]:
    """Every bitwise difference between two runs' per-rank results (empty if identical).

    Tensors must match in dtype, shape and every bit (``torch.equal``), so a
    reordered floating-point reduction shows up as a difference.
    """
    problems: list[str] = []
    if len(expected) != len(actual):
        return [f"rank count {len(expected)} != {len(actual)}"]
    for want, got in zip(expected, actual, strict=True):
        where = f"rank {want.rank}"
        if len(want.losses) != len(got.losses):
            problems.append(f"{where}: {len(want.losses)} loss reports != {len(got.losses)}")
        for mb, (a, b) in enumerate(zip(want.losses, got.losses, strict=False)):
            problems += _diff_tensors(f"{where} micro-batch {mb}", a, b)
        problems += _diff_tensors(f"{where} grad", want.grads, got.grads)
    return problems


def _diff_tensors(
    where: str, a: Mapping[str, torch.Tensor | None], b: Mapping[str, torch.Tensor | None]
) -> list[str]:
    if a.keys() != b.keys():
        return [f"{where}: keys differ: {sorted(a.keys() ^ b.keys())}"]
    problems = []
    for key in a:
        x, y = a[key], b[key]
        if x is None or y is None:
            if (x is None) != (y is None):
                problems.append(f"{where} {key}: one side has no tensor")
        elif x.dtype != y.dtype or x.shape != y.shape or not torch.equal(x, y):
            problems.append(f"{where} {key}: differs")
    return problems
