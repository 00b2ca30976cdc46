"""EnvPipe's instruction executor: a drop-in for Megatron's non-interleaved 1F1B.

:func:`envpipe_forward_backward` has the keyword signature of
``megatron.core.pipeline_parallel.schedules.forward_backward_pipelining_without_interleaving``.
It asks the :class:`~megatron_envpipe.megatron.runtime.EnvPipeRuntime` for this
iteration's schedule and clock plan, then runs the stage's instruction program
(:mod:`megatron_envpipe.core.instructions`) with ``isend``/``irecv`` on one
communicator per direction and neighbour, Megatron's own ``forward_step`` /
``backward_step``, and all of Megatron's bookkeeping (no-sync and grad sync,
``finalize_model_grads_func``, ``total_num_tokens``, timers, pseudo-freeing an
output only after its send completed, ``forward_data_store``). The math is
Megatron's: only the order of units and the clocks change.

Anything it does not support (forward-only evaluation, virtual pipelines,
shape handshakes, partial activation checkpointing, CUDA graphs, multi-module
pipelines, ...) goes to Megatron's original schedule, logged once per reason.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import time
from typing import Any, Callable

import torch
import torch.distributed as dist

from megatron_envpipe.core import instructions as ins
from megatron_envpipe.core.hooks import ExecutionHooks
from megatron_envpipe.core.measurement import IterationMeasurement, UnitTiming
from megatron_envpipe.core.schedule import B, F
from megatron_envpipe.errors import EnvPipeError
from megatron_envpipe.megatron.compat import call_backward_step, call_forward_step
from megatron_envpipe.megatron.runtime import EnvPipeRuntime

log = logging.getLogger("megatron_envpipe")


class CommError(EnvPipeError, RuntimeError):
    """A P2P transfer failed: the peer died, or it did not complete in time."""


class CommTimeoutError(CommError):
    """A P2P transfer did not complete within ``--envpipe-comm-timeout``."""


class _State:
    """Process-wide executor state, set by :func:`megatron_envpipe.install`."""

    runtime: EnvPipeRuntime | None = None
    hooks: ExecutionHooks = ExecutionHooks()
    user_hooks: bool = False  # hooks given to install(): no device of our own
    device_ready: bool = False
    original: Callable[..., Any] | None = None
    warned: set[str] = set()
    channels: dict[tuple[int, ...], "_Channels"] = {}
    shown_program: Any = None  # the program last printed by --envpipe-verbose


def _fallback(reason: str, kwargs: dict[str, Any]) -> list[Any]:
    if reason not in _State.warned:
        _State.warned.add(reason)
        log.warning("EnvPipe: %s: running Megatron's own schedule for these calls", reason)
    if _State.original is None:
        raise RuntimeError("EnvPipe executor called before megatron_envpipe.install()")
    return _State.original(**kwargs)


def _unsupported(model: Any, config: Any, kwargs: dict[str, Any]) -> str | None:
    if kwargs.get("forward_only"):
        return "forward-only (evaluation) iterations"
    if config.overlap_p2p_comm:
        return "overlap_p2p_comm"
    if getattr(config, "variable_seq_lengths", False) or getattr(config, "mtp_standalone", False):
        return "variable sequence lengths (shape handshake)"
    if config.num_microbatches_with_partial_activation_checkpoints is not None:
        return "partial activation checkpointing (num_microbatches_with_partial_activation_checkpoints)"
    if getattr(config, "cuda_graph_impl", "none") not in (None, "none") or getattr(config, "enable_cuda_graph", False):
        return "CUDA graphs"
    if getattr(config, "moe_paged_stash", False) or getattr(config, "fine_grained_activation_offloading", False):
        return "MoE paged stash / fine-grained activation offloading"
    if getattr(config, "overlap_moe_expert_parallel_comm", False):
        return "overlap_moe_expert_parallel_comm (combined 1F1B)"
    if getattr(config, "defer_embedding_wgrad_compute", False):
        return "defer_embedding_wgrad_compute"
    from megatron.core.enums import ModelType
    from megatron.core.utils import get_model_type

    if get_model_type(model) == getattr(ModelType, "encoder_and_decoder", object()):
        return "encoder-decoder models"
    pgc = kwargs.get("pg_collection")
    if pgc is not None and type(pgc).__name__ != "ProcessGroupCollection":
        return f"{type(pgc).__name__} process groups"
    if (kwargs.get("p2p_communicator") is None) != (pgc is None):
        return "p2p_communicator without pg_collection (or the reverse)"
    return None


def _default_pg_collection() -> Any:
    """Megatron's default process groups, as its own schedule builds them."""
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import schedules

    build = getattr(schedules, "_build_default_pg_collection", None)
    if build is not None:
        return build()
    from megatron.core.process_groups_config import ProcessGroupCollection

    pgc = ProcessGroupCollection()
    pgc.tp = parallel_state.get_tensor_model_parallel_group()
    pgc.pp = parallel_state.get_pipeline_model_parallel_group()
    pgc.cp = parallel_state.get_context_parallel_group()
    pgc.embd = parallel_state.get_embedding_group(check_initialized=False)
    pgc.pos_embd = parallel_state.get_position_embedding_group(check_initialized=False)
    pgc.dp_cp = parallel_state.get_data_parallel_group(with_context_parallel=True, partial_data_parallel=False)
    return pgc


class _Channels:
    """One process group per direction and neighbouring pair of this pipeline.

    Separate communicators keep activations and gradients on separate NCCL
    streams, so neither can queue behind the other (the deadlock of a shared
    per-pair stream, envpipe.md §8.3). Every rank must create every group in
    the same order, so the pipelines' rank lists are gathered first.
    """

    def __init__(self, pp_group: Any) -> None:
        mine = dist.get_process_group_ranks(pp_group)
        everyone: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mine)
        self.act: dict[int, Any] = {}  # stage -> group for activations stage -> stage+1
        self.grad: dict[int, Any] = {}  # stage -> group for gradients stage+1 -> stage
        for ranks in sorted({tuple(r) for r in everyone}):
            for s in range(len(ranks) - 1):
                pair = [ranks[s], ranks[s + 1]]
                g_act = dist.new_group(pair)
                g_grad = dist.new_group(pair)
                if tuple(ranks) == tuple(mine):
                    self.act[s], self.grad[s] = g_act, g_grad
        self.ranks = tuple(mine)


class _Clock:
    """Marks of unit boundaries.

    CUDA: events on the compute stream (no synchronization), except in
    profiling iterations, where each mark synchronizes and reads the host clock
    so that windows line up with the energy monitor's samples. CPU: the host
    clock. Host marks are absolute ``time.perf_counter()`` values.
    """

    def __init__(self, device: torch.device, host_sync: bool = False) -> None:
        self.cuda = device.type == "cuda"
        self.host = not self.cuda or host_sync
        self.marks: list[Any] = []

    def mark(self) -> int:
        if not self.host:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.marks.append(event)
        else:
            if self.cuda:
                torch.cuda.synchronize()
            self.marks.append(time.perf_counter())
        return len(self.marks) - 1

    @property
    def origin(self) -> float | None:
        """Absolute host time of the first mark (host marks only)."""
        return self.marks[0] if self.host and self.marks else None

    def seconds(self) -> list[float]:
        """Every mark relative to the first one (synchronizes once on GPU)."""
        if not self.marks:
            return []
        if not self.host:
            self.marks[-1].synchronize()
            first = self.marks[0]
            return [first.elapsed_time(e) / 1000.0 for e in self.marks]
        return [t - self.marks[0] for t in self.marks]


def envpipe_forward_backward(
    *,
    forward_step_func: Any,
    data_iterator: Any,
    model: Any,
    num_microbatches: int,
    seq_length: int,
    micro_batch_size: int,
    decoder_seq_length: int | None = None,
    forward_only: bool = False,
    collect_non_loss_data: bool = False,
    first_val_step: bool | None = None,
    adjust_tensor_shapes_fn: Callable | None = None,
    p2p_communicator: Any = None,
    pg_collection: Any = None,
    force_all_reduce: bool | None = False,
    **extra: Any,
) -> list[Any]:
    """Run one training iteration of this pipeline stage in EnvPipe's order."""
    kwargs = dict(
        forward_step_func=forward_step_func, data_iterator=data_iterator, model=model,
        num_microbatches=num_microbatches, seq_length=seq_length, micro_batch_size=micro_batch_size,
        decoder_seq_length=decoder_seq_length, forward_only=forward_only,
        collect_non_loss_data=collect_non_loss_data, first_val_step=first_val_step,
        adjust_tensor_shapes_fn=adjust_tensor_shapes_fn, p2p_communicator=p2p_communicator,
        pg_collection=pg_collection, force_all_reduce=force_all_reduce, **extra,
    )
    if extra:
        return _fallback(f"unknown schedule arguments {sorted(extra)}", kwargs)
    if isinstance(model, list):
        if len(model) != 1:
            return _fallback("virtual pipeline (model chunks)", kwargs)
        model = model[0]
    if isinstance(data_iterator, list):
        if len(data_iterator) != 1:
            return _fallback("virtual pipeline (data iterators)", kwargs)
        data_iterator = data_iterator[0]
    from megatron.core.utils import get_model_config

    config = get_model_config(model)
    reason = _unsupported(model, config, kwargs)
    if reason:
        return _fallback(reason, kwargs)
    runtime = _State.runtime
    if runtime is None:
        raise RuntimeError("EnvPipe executor called before megatron_envpipe.install()")
    if pg_collection is None:
        pg_collection = _default_pg_collection()
    return _Iteration(
        runtime, _State.hooks, forward_step_func, data_iterator, model, config, num_microbatches,
        seq_length, micro_batch_size, collect_non_loss_data, first_val_step,
        adjust_tensor_shapes_fn, pg_collection, force_all_reduce,
    ).run()


class _Iteration:
    """One stage's run of one iteration: dispatches its instruction program."""

    def __init__(self, runtime, hooks, forward_step_func, data_iterator, model, config, num_microbatches,
                 seq_length, micro_batch_size, collect_non_loss_data, first_val_step,
                 adjust_tensor_shapes_fn, pg_collection, force_all_reduce) -> None:
        self.runtime, self.hooks = runtime, hooks
        self.forward_step_func, self.data_iterator = forward_step_func, data_iterator
        self.model, self.config = model, config
        self.m = num_microbatches
        self.collect_non_loss_data, self.first_val_step = collect_non_loss_data, first_val_step
        self.pgc, self.force_all_reduce = pg_collection, force_all_reduce
        pp = pg_collection.pp
        self.pp_group = pp
        self.stage, self.num_stages = pp.rank(), pp.size()
        self.first, self.last = self.stage == 0, self.stage == self.num_stages - 1
        self.cp_size = pg_collection.cp.size() if getattr(pg_collection, "cp", None) is not None else 1
        self.device = next(model.parameters()).device
        self.dtype = config.pipeline_dtype
        if self.dtype is None:
            raise ValueError("EnvPipe: config.pipeline_dtype must be set (as Megatron's own schedule requires)")
        tp = pg_collection.tp.size() if getattr(pg_collection, "tp", None) is not None else 1
        seq = seq_length // self.cp_size
        if config.sequence_parallel:
            seq //= tp
        shape = (seq, micro_batch_size, config.hidden_size)
        recv, send = [shape], [shape]
        if adjust_tensor_shapes_fn is not None:
            recv, send = adjust_tensor_shapes_fn(recv, send)
        if len(recv) != 1 or len(send) != 1:
            raise ValueError("EnvPipe supports one tensor per P2P message")
        self.recv_shape, self.send_shape = tuple(recv[0]), tuple(send[0])
        key = tuple(dist.get_process_group_ranks(pp))
        channels = _State.channels.get(key)
        if channels is None:
            channels = _State.channels[key] = _Channels(pp)
        self.channels = channels
        self.prev_rank = channels.ranks[self.stage - 1] if not self.first else None
        self.next_rank = channels.ranks[self.stage + 1] if not self.last else None
        self.timeout = datetime.timedelta(seconds=runtime.config.comm_timeout_s)
        # Per-micro-batch state, emptied by the end of the iteration.
        self.pending: dict[tuple[str, bool, int], tuple[Any, torch.Tensor]] = {}
        self.reaped: set[tuple[str, bool, int]] = set()  # activation sends found complete (and freed) early
        self.inputs: dict[int, Any] = {}
        self.outputs: dict[int, Any] = {}
        self.grads_in: dict[int, Any] = {}
        self.grads_out: dict[int, Any] = {}
        self.forward_data_store: list[Any] = []
        self.total_num_tokens = torch.zeros([], dtype=torch.int, device=self.device)
        self.no_sync_context = None

    # -- grad sync, as Megatron's schedule does it -------------------------------------
    def _disable_grad_sync(self) -> None:
        if self.no_sync_context is None:
            func = self.config.no_sync_func or contextlib.nullcontext
            self.no_sync_context = func()
            self.no_sync_context.__enter__()

    def _enable_grad_sync(self) -> None:
        if self.no_sync_context is not None:
            self.no_sync_context.__exit__(None, None, None)
            self.no_sync_context = None

    def run(self) -> list[Any]:
        config = self.config
        if not _State.device_ready:
            _setup_device(self)
        plan = self.runtime.prepare(self.num_stages, self.m)
        program = plan.programs[self.stage].instructions
        if self.runtime.config.verbose and _State.shown_program != program:
            _State.shown_program = program
            log.info("EnvPipe stage %d program (%s):\n%s", self.stage, plan.phase, plan.programs[self.stage])
        embedding_module = None
        if config.finalize_model_grads_func is not None:
            from megatron.core.pipeline_parallel.schedules import clear_embedding_activation_buffer

            embedding_module = clear_embedding_activation_buffer(config, self.model, self.last)
        if config.timers is not None:
            config.timers("forward-backward", log_level=1).start(barrier=config.barrier_with_L1_time)
        self._disable_grad_sync()
        self.hooks.iteration_begin(self.stage, self.runtime.iteration)
        clock = _Clock(self.device, host_sync=plan.profiling) if plan.measure else None
        order = plan.schedule.orders[self.stage]
        marks: list[tuple[int, int, int]] = []  # per unit: (wait begin, compute begin, compute end)
        wait_mark = None
        last_backward = order[-1].microbatch if not order[-1].is_forward else None
        tell = self.hooks.instruction if self.hooks.wants_instructions else None
        try:
            for instr in program:
                if tell is not None:
                    tell(instr)
                if clock is not None and isinstance(instr, (ins.RecvActivationFinish, ins.RecvGradFinish)):
                    wait_mark = clock.mark()
                if isinstance(instr, ins.Forward):
                    c0 = clock.mark() if clock else 0
                    self.hooks.unit_begin(F(instr.microbatch))
                    self._forward(instr.microbatch)
                    self.hooks.unit_end(F(instr.microbatch))
                    if clock:
                        c1 = clock.mark()
                        marks.append((wait_mark if wait_mark is not None else c0, c0, c1))
                        wait_mark = None
                elif isinstance(instr, ins.Backward):
                    mb = instr.microbatch
                    if mb == last_backward and (config.grad_sync_func is None or self.first):
                        self._enable_grad_sync()
                    c0 = clock.mark() if clock else 0
                    self.hooks.unit_begin(B(mb))
                    self._backward(mb)
                    self.hooks.unit_end(B(mb))
                    if clock:
                        c1 = clock.mark()
                        marks.append((wait_mark if wait_mark is not None else c0, c0, c1))
                        wait_mark = None
                elif isinstance(instr, ins.SetFrequency):
                    self.hooks.set_frequency(instr.freq_mhz)
                elif isinstance(instr, ins.Free):
                    self.inputs.pop(instr.microbatch, None)
                    self.outputs.pop(instr.microbatch, None)
                    self.grads_out.pop(instr.microbatch, None)
                else:
                    self._comm(instr)
                self._reap_sends()
        except BaseException:
            self._abandon()
            raise
        if self.pending or self.inputs or self.outputs:
            raise RuntimeError(
                f"EnvPipe stage {self.stage}: program ended with live state "
                f"(pending {sorted(self.pending)}, inputs {sorted(self.inputs)}, outputs {sorted(self.outputs)})"
            )
        if self.no_sync_context is not None:
            self._enable_grad_sync()
            if config.grad_sync_func is not None:
                config.grad_sync_func(self.model.parameters())
        if config.finalize_model_grads_func is not None:
            from megatron.core.pipeline_parallel.schedules import finish_embedding_wgrad_compute

            finish_embedding_wgrad_compute(config, embedding_module, self.last, self.pgc.tp)
            config.finalize_model_grads_func(
                [self.model],
                self.total_num_tokens if config.calculate_per_token_loss else None,
                pg_collection=self.pgc,
                force_all_reduce=self.force_all_reduce,
            )
        if config.timers is not None:
            config.timers("forward-backward").stop()
        measurement = None
        gathered = None
        samples = None
        if clock is not None:
            t = clock.seconds()
            measurement = IterationMeasurement(
                (tuple(UnitTiming(u, t[c0], t[c1], t[c0] - t[w]) for u, (w, c0, c1) in zip(order, marks)),)
            )
            gathered = [None] * self.num_stages
            dist.all_gather_object(gathered, measurement, group=self.pp_group)
            gathered = _agree(self, gathered)
        self.hooks.iteration_end(measurement)
        if plan.profiling and clock is not None:
            o = clock.origin
            windows = [(u.kind, o + t[c0], o + t[c1]) for u, (w, c0, c1) in zip(order, marks)]
            blocking = [(o + t[w], o + t[c0]) for (w, c0, c1) in marks if c0 != w and t[c0] > t[w]]
            mine = self.hooks.stage_samples(windows, blocking)
            samples = [None] * self.num_stages
            dist.all_gather_object(samples, mine, group=self.pp_group)
            samples = _agree(self, samples)
        iteration = self.runtime.iteration
        self.runtime.finish(self.num_stages, self.m, gathered, samples)
        _report_energy(self, iteration)
        return self.forward_data_store

    # -- units ---------------------------------------------------------------------------
    def _forward(self, mb: int) -> None:
        from megatron.core.pipeline_parallel.schedules import check_first_val_step

        input_tensor = self.inputs.get(mb)
        output, num_tokens = call_forward_step(
            self.forward_step_func, self.data_iterator, self.model, self.m, input_tensor,
            self.forward_data_store, self.config,
            cp_group_size=self.cp_size, is_last_stage=self.last,
            collect_non_loss_data=self.collect_non_loss_data,
            checkpoint_activations_microbatch=None,
            is_first_microbatch=check_first_val_step(self.first_val_step, False, mb == 0),
            current_microbatch=mb,
        )
        self.total_num_tokens += num_tokens
        self.inputs[mb] = input_tensor
        self.outputs[mb] = output

    def _backward(self, mb: int) -> None:
        grad = self.grads_in.pop(mb, None)
        self.grads_out[mb] = call_backward_step(self.inputs[mb], self.outputs[mb], grad, self.config)

    # -- communication ---------------------------------------------------------------------
    def _comm(self, instr: ins.CommInstruction) -> None:
        mb, kind = instr.microbatch, instr.kind
        if kind == ins.ACT:
            peer = self.next_rank if instr.is_send else self.prev_rank
            group = self.channels.act[self.stage if instr.is_send else self.stage - 1]
        else:
            peer = self.prev_rank if instr.is_send else self.next_rank
            group = self.channels.grad[self.stage - 1 if instr.is_send else self.stage]
        key = (kind, instr.is_send, mb)
        if instr.is_start:
            if instr.is_send:
                tensor = _single(self.outputs[mb]) if kind == ins.ACT else _single(self.grads_out[mb])
                work = dist.isend(tensor, dst=peer, group=group)
            else:
                shape = self.recv_shape if kind == ins.ACT else self.send_shape
                # requires_grad so the stage's backward produces the input gradient.
                tensor = torch.empty(shape, dtype=self.dtype, device=self.device, requires_grad=kind == ins.ACT)
                work = dist.irecv(tensor, src=peer, group=group)
            self.pending[key] = (work, tensor)
            return
        entry = self.pending.pop(key, None)
        if entry is None:
            if instr.is_send and kind == ins.ACT and key in self.reaped:
                self.reaped.discard(key)
                return
            raise RuntimeError(f"EnvPipe stage {self.stage}: {instr} has no matching start")
        work, tensor = entry
        self._wait(work, instr, peer)
        if instr.is_send:
            if kind == ins.ACT:
                self._deallocate(mb)
        elif kind == ins.ACT:
            self.inputs[mb] = tensor
        else:
            self.grads_in[mb] = tensor

    def _wait(self, work: Any, instr: ins.Instruction, peer: int | None) -> None:
        t0 = time.monotonic()
        limit = self.timeout.total_seconds()
        where = f"EnvPipe stage {self.stage} (rank {dist.get_rank()}): {instr} with peer rank {peer}"
        try:
            ok = work.wait(self.timeout)
        except RuntimeError as exc:
            waited = time.monotonic() - t0
            if waited >= 0.9 * limit or "timed out" in str(exc).lower() or "timeout" in str(exc).lower():
                raise CommTimeoutError(
                    f"{where} did not complete within {limit:g} s: that stage is stuck or has died "
                    f"(raise --envpipe-comm-timeout if it is legitimately slow). Transport said: {exc}"
                ) from exc
            raise CommError(f"{where} failed after {waited:.1f} s: {exc}") from exc
        if ok is False:
            raise CommTimeoutError(f"{where} did not complete within {limit:g} s")

    def _deallocate(self, mb: int) -> None:
        from megatron.core.pipeline_parallel.schedules import deallocate_output_tensor

        output = self.outputs.get(mb)
        if output is not None:
            deallocate_output_tensor(_single(output), self.config.deallocate_pipeline_outputs)

    def _reap_sends(self) -> None:
        """Pseudo-free outputs whose activation send already completed (never blocks).

        Megatron frees an output right after its blocking send; with async sends
        we free it as soon as we see the send done, at the latest before the
        micro-batch's backward (SendActivationFinish).
        """
        done = [k for k, (w, _) in self.pending.items() if k[0] == ins.ACT and k[1] and w.is_completed()]
        if not done:
            return
        for key in done:
            work, _ = self.pending.pop(key)
            work.wait()  # completed: returns at once, and surfaces a transport error
            self._deallocate(key[2])
            self.reaped.add(key)

    def _abandon(self) -> None:
        """On error: drop references so a retry does not leak; leave open no-sync."""
        self.pending.clear()
        self.inputs.clear()
        self.outputs.clear()
        self.grads_in.clear()
        self.grads_out.clear()
        if self.no_sync_context is not None:
            with contextlib.suppress(Exception):
                self._enable_grad_sync()


def _single(value: Any) -> torch.Tensor:
    """Megatron passes stage outputs and input grads as 1-element lists or bare tensors."""
    if isinstance(value, (list, tuple)):
        if len(value) != 1:
            raise ValueError(f"EnvPipe supports one tensor per P2P message, got {len(value)}")
        return value[0]
    return value


def _setup_device(it: "_Iteration") -> None:
    """First iteration: open this rank's GPU, check permissions, agree on facts.

    Runs on every rank of the pipeline at the same point, so the facts (clock
    list, control, energy) are gathered and combined identically everywhere.
    """
    from megatron_envpipe.gpu import open_gpu
    from megatron_envpipe.gpu.hooks import GpuHooks
    from megatron_envpipe.megatron.runtime import DeviceFacts

    runtime, cfg = it.runtime, it.runtime.config
    mine: dict[str, Any]
    if _State.user_hooks:
        mine = {"backend": "none", "name": "none", "driver": "", "clocks": (), "control": False,
                "energy": False, "simulated": False}
    else:
        cuda = it.device.type == "cuda"
        device = open_gpu(cfg.gpu or "auto", torch.cuda.current_device() if cuda else None,
                          stage=it.stage, num_stages=it.num_stages, time_scale=cfg.sim_time_scale,
                          p2p_power_w=cfg.p2p_power_w, cuda=cuda)
        info = device.info()
        control = clock_control(device, cfg, it.stage)
        hooks = GpuHooks(device, control=control, cuda=cuda, time_scale=cfg.sim_time_scale if device.simulated else 1.0)
        old, _State.hooks = _State.hooks, hooks
        it.hooks = hooks
        old.close()
        mine = {"backend": device.backend, "name": info.name, "driver": info.driver_version,
                "clocks": tuple(device.supported_clocks_mhz()), "control": control,
                "energy": device.backend != "none", "simulated": device.simulated}
    everyone: list[Any] = [None] * it.num_stages
    dist.all_gather_object(everyone, mine, group=it.pp_group)
    everyone = _agree(it, everyone)
    common = set(everyone[0]["clocks"])
    for other in everyone[1:]:
        common &= set(other["clocks"])
    facts = DeviceFacts(
        backend=everyone[0]["backend"], name=everyone[0]["name"], driver_version=everyone[0]["driver"],
        clocks_mhz=tuple(sorted(common, reverse=True)),
        control=all(e["control"] for e in everyone) and bool(common),
        energy=all(e["energy"] for e in everyone), simulated=any(e["simulated"] for e in everyone),
    )
    runtime.attach_device(facts, _cache_key(it, facts))
    _State.device_ready = True


def clock_control(device: Any, cfg: Any, stage: int) -> bool:
    """Whether this rank will lock clocks; fails fast without permission (unless monitoring).

    Only plans that lower clocks need control: ``baseline`` runs at the driver's
    default clocks and needs no privilege.
    """
    from megatron_envpipe.gpu import PERMISSION_HINT, GpuPermissionError

    info = device.info()
    if cfg.plan_type == "baseline":
        return False
    if device.backend == "none":
        log.warning("EnvPipe: no GPU clock control (%s): the schedule is EnvPipe's, clocks stay as they are",
                    info.name)
        return False
    if device.can_set_clocks():
        return True
    reason = getattr(device, "permission_reason", lambda: "")()
    if cfg.on_no_permission == "fail":
        raise GpuPermissionError(f"EnvPipe stage {stage}: {info.label()}: {reason} {PERMISSION_HINT}".strip())
    log.warning("EnvPipe stage %d: cannot lock clocks on %s (%s): measuring energy only "
                "(--envpipe-on-no-permission monitor)", stage, info.label(), reason)
    return False


def _cache_key(it: "_Iteration", facts: Any) -> dict[str, Any]:
    """What a stage profile depends on: architecture, layout, batch shape, GPU and driver."""
    c = it.config
    model = {name: getattr(c, name, None) for name in (
        "num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups",
        "kv_channels", "recompute_granularity", "recompute_method", "num_moe_experts")}
    model["class"] = type(it.model).__name__
    return {
        "model": model,
        "tensor_parallel": it.pgc.tp.size() if getattr(it.pgc, "tp", None) is not None else 1,
        "pipeline_parallel": it.num_stages,
        "context_parallel": it.cp_size,
        "micro_batch_size": it.send_shape[1],
        "seq_length": it.send_shape[0],
        "dtype": str(it.dtype),
        "gpu_name": facts.name,
        "driver_version": facts.driver_version,
        "clocks": list(facts.clocks_mhz),
    }


def _report_energy(it: "_Iteration", iteration: int) -> None:
    """Every log interval: the pipeline's energy, average power per stage, saving."""
    runtime = it.runtime
    if runtime.device is None or not runtime.device.energy:
        return
    if (iteration + 1) % runtime.config.log_interval:
        return
    mine = _stage_energy(it, getattr(it.hooks, "last_energy", None))
    everyone: list[Any] = [None] * it.num_stages
    dist.all_gather_object(everyone, mine, group=it.pp_group)
    if any(e is None for e in everyone):
        return
    report = runtime.report_energy(iteration + 1, everyone)
    # Megatron prints training progress on the last rank (print_rank_last).
    if report is None or dist.get_rank() != dist.get_world_size() - 1:
        return
    log.info("%s", report.line())
    writer = _tensorboard_writer()
    if writer is not None:
        writer.add_scalar("envpipe/iteration-energy-J", report.energy_j, iteration + 1)
        writer.add_scalar("envpipe/iteration-time-s", report.time_s, iteration + 1)
        if report.saving is not None:
            writer.add_scalar("envpipe/energy-saving", report.saving, iteration + 1)
        for s, p in enumerate(report.stage_power_w):
            writer.add_scalar(f"envpipe/stage{s}-power-W", p, iteration + 1)


def _tensorboard_writer() -> Any:
    """Megatron's TensorBoard writer when megatron.training set one up."""
    try:
        from megatron.training.global_vars import get_tensorboard_writer
    except Exception:  # noqa: BLE001 - no megatron.training here
        return None
    try:
        return get_tensorboard_writer()
    except Exception:  # noqa: BLE001 - not initialised
        return None


def _model_parallel_groups(it: "_Iteration") -> list[Any]:
    groups = []
    for name in ("tp", "cp"):
        g = getattr(it.pgc, name, None)
        if g is not None and g.size() > 1:
            groups.append(g)
    return groups


def _agree(it: "_Iteration", value: Any) -> Any:
    """Make every TP/CP rank of a stage use the first one's data.

    Tensor-parallel peers must run the same schedule and clocks, or their
    collectives inside forward/backward would hang; feeding identical data to
    the deterministic planner guarantees it.
    """
    for group in _model_parallel_groups(it):
        box = [value]
        dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0), group=group)
        value = box[0]
    return value


def _stage_energy(it: "_Iteration", mine: Any) -> Any:
    """A stage's energy is that of all its GPUs: sum over its TP/CP ranks."""
    from dataclasses import replace

    for group in _model_parallel_groups(it):
        parts: list[Any] = [None] * group.size()
        dist.all_gather_object(parts, mine, group=group)
        if any(p is None for p in parts):
            return None
        mine = replace(parts[0], energy_j=sum(p.energy_j for p in parts),
                       start_s=min(p.start_s for p in parts), end_s=max(p.end_s for p in parts))
    return mine
