"""EnvPipe's instruction executor: a drop-in for Megatron's 1F1B and interleaved schedules.

:func:`envpipe_forward_backward` has the keyword signature of
``megatron.core.pipeline_parallel.schedules.forward_backward_pipelining_without_interleaving``,
:func:`envpipe_interleaved_forward_backward` that of
``forward_backward_pipelining_with_interleaving`` (model chunks: a list of V
modules and V data iterators; chunk v of rank s is virtual stage v*P+s).
It asks the :class:`~megatron_envpipe.megatron.runtime.EnvPipeRuntime` for this
iteration's schedule and clock plan, then :class:`StageIteration` runs the
stage's instruction program (:mod:`megatron_envpipe.core.instructions`)
through a handler table: ``isend``/``irecv`` on one communicator per direction
and neighbour (:mod:`~megatron_envpipe.megatron.channels`), Megatron's own
``forward_step`` / ``backward_step``, and all of Megatron's bookkeeping
(no-sync and grad sync, ``finalize_model_grads_func``, ``total_num_tokens``,
timers, pseudo-freeing an output only after its send completed,
``forward_data_store``; per chunk: ``vp_stage``, input and output tensors,
grad and param sync as :mod:`~megatron_envpipe.megatron.grad_sync` says). The
math is Megatron's: only the order of units and the clocks change. Before a
schedule's programs run for the first time, they are proved deadlock-free
(``check_deadlock`` with lazy communicators and the channels' warm-up). With
Megatron's ``variable_seq_lengths`` each data message is preceded by a shape
message on channels of its own (:mod:`~megatron_envpipe.megatron.shape_exchange`).
Device set-up is :mod:`~megatron_envpipe.megatron.devices`, energy reports
:mod:`~megatron_envpipe.megatron.reporting`.

Anything it does not support (forward-only evaluation, virtual pipelines
unless EnvPipe's scheduling is ``interleaved``, standalone MTP stages, partial
activation checkpointing, CUDA graphs, multi-module pipelines, ...:
:mod:`~megatron_envpipe.megatron.support`) goes to Megatron's original
schedule, logged once per reason.

Megatron-core is imported inside functions: ``install()`` and the gloo test
harness import this module with torch alone, before Megatron is set up.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from megatron_envpipe.core import instructions as ins
from megatron_envpipe.core.hooks import ExecutionHooks
from megatron_envpipe.core.schedule import B, F, Unit
from megatron_envpipe.core.vocabulary import Scheduling
from megatron_envpipe.megatron.channels import CommError, CommTimeoutError, P2PTransfers
from megatron_envpipe.megatron.compat import call_backward_step, call_forward_step
from megatron_envpipe.megatron.device_time import DeviceTimeLink
from megatron_envpipe.megatron.devices import profile_layout_key, setup_device
from megatron_envpipe.megatron.dispatch import Handler, checked_handler_table
from megatron_envpipe.megatron.grad_sync import GradSync, InterleavedSync, OneChunkSync
from megatron_envpipe.megatron.groups import StageGroups
from megatron_envpipe.megatron.iteration_plans import IterationPlans, iteration_plans_for
from megatron_envpipe.megatron.memory import MemoryProbe
from megatron_envpipe.megatron.reporting import report_energy
from megatron_envpipe.megatron.runtime import EnvPipeRuntime
from megatron_envpipe.megatron.shape_exchange import uses_shape_messages
from megatron_envpipe.megatron.state import STATE
from megatron_envpipe.megatron.stragglers import apply_sim_straggler, follow_stragglers
from megatron_envpipe.megatron.support import default_pg_collection, interleaved_unsupported_reason, unsupported_reason
from megatron_envpipe.megatron.timing import UnitTimer

__all__ = ["CommError", "CommTimeoutError", "StageIteration", "envpipe_forward_backward",
           "envpipe_interleaved_forward_backward"]

log = logging.getLogger("megatron_envpipe")

Key = tuple[int, int]  # (micro-batch, chunk)


def _fallback(reason: str, kwargs: dict[str, Any], interleaved: bool = False) -> list[Any]:
    if STATE.warn_once(reason):
        log.warning("EnvPipe: %s: running Megatron's own schedule for these calls", reason)
    original = STATE.original_interleaved if interleaved else STATE.original
    if original is None:
        raise RuntimeError("EnvPipe executor called before megatron_envpipe.install()")
    plans = getattr(STATE.runtime, "iteration_plans", None)
    if plans is not None:  # variable lengths: read through the look-ahead, or its read-ahead would be skipped
        kwargs = {**kwargs, "data_iterator": plans.passed_on(kwargs["data_iterator"])}
    return original(**kwargs)


def _call_kwargs(**kwargs: Any) -> dict[str, Any]:
    extra = kwargs.pop("extra")
    return {**kwargs, **extra}


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
    kwargs = _call_kwargs(
        forward_step_func=forward_step_func, data_iterator=data_iterator, model=model,
        num_microbatches=num_microbatches, seq_length=seq_length, micro_batch_size=micro_batch_size,
        decoder_seq_length=decoder_seq_length, forward_only=forward_only,
        collect_non_loss_data=collect_non_loss_data, first_val_step=first_val_step,
        adjust_tensor_shapes_fn=adjust_tensor_shapes_fn, p2p_communicator=p2p_communicator,
        pg_collection=pg_collection, force_all_reduce=force_all_reduce, extra=extra,
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
    reason = unsupported_reason(model, config, kwargs)
    if reason:
        return _fallback(reason, kwargs)
    return _iteration(kwargs, [model], [data_iterator], config, interleaved=False).run()


def envpipe_interleaved_forward_backward(
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
    """Run one training iteration of this rank's model chunks in EnvPipe's (interleaved) order."""
    kwargs = _call_kwargs(
        forward_step_func=forward_step_func, data_iterator=data_iterator, model=model,
        num_microbatches=num_microbatches, seq_length=seq_length, micro_batch_size=micro_batch_size,
        decoder_seq_length=decoder_seq_length, forward_only=forward_only,
        collect_non_loss_data=collect_non_loss_data, first_val_step=first_val_step,
        adjust_tensor_shapes_fn=adjust_tensor_shapes_fn, p2p_communicator=p2p_communicator,
        pg_collection=pg_collection, force_all_reduce=force_all_reduce, extra=extra,
    )
    if extra:
        return _fallback(f"unknown schedule arguments {sorted(extra)}", kwargs, interleaved=True)
    runtime = STATE.runtime
    if runtime is not None and runtime.config.scheduling != Scheduling.INTERLEAVED:
        return _fallback(f"virtual pipeline with --envpipe-scheduling {runtime.config.scheduling} (EnvPipe runs "
                         f"model chunks only with --envpipe-scheduling interleaved)", kwargs, interleaved=True)
    if not isinstance(model, list) or not isinstance(data_iterator, list) or len(model) < 2 \
            or len(data_iterator) != len(model):
        return _fallback("virtual pipeline without one model chunk and data iterator per chunk", kwargs,
                         interleaved=True)
    from megatron.core.utils import get_model_config

    config = get_model_config(model[0])
    reason = unsupported_reason(model[0], config, kwargs, interleaved=True) or interleaved_unsupported_reason(
        config, len(model), num_microbatches, kwargs)
    if reason:
        return _fallback(reason, kwargs, interleaved=True)
    return _iteration(kwargs, model, data_iterator, config, interleaved=True).run()


def _iteration(kwargs: dict[str, Any], models: list[Any], data_iterators: list[Any], config: Any,
               interleaved: bool) -> StageIteration:
    runtime = STATE.runtime
    if runtime is None:
        raise RuntimeError("EnvPipe executor called before megatron_envpipe.install()")
    pg_collection = kwargs["pg_collection"]
    if pg_collection is None:
        pg_collection = default_pg_collection()
    return StageIteration(
        runtime, STATE.hooks, kwargs["forward_step_func"], data_iterators, models, config,
        kwargs["num_microbatches"], kwargs["seq_length"], kwargs["micro_batch_size"],
        kwargs["collect_non_loss_data"], kwargs["first_val_step"], kwargs["adjust_tensor_shapes_fn"],
        pg_collection, kwargs["force_all_reduce"], interleaved=interleaved,
    )


def _single(value: Any) -> torch.Tensor:
    """Megatron passes stage outputs and input grads as 1-element lists or bare tensors."""
    if isinstance(value, (list, tuple)):
        if len(value) != 1:
            raise ValueError(f"EnvPipe supports one tensor per P2P message, got {len(value)}")
        return value[0]
    return value


class StageIteration:
    """One stage's run of one iteration: dispatches its instruction program.

    Every instruction goes through :attr:`handlers` (instruction type -> bound
    method), built and checked complete at construction. ``models`` and
    ``data_iterators`` hold one entry per model chunk (one without
    ``interleaved``); per-unit state is keyed by (micro-batch, chunk).
    """

    def __init__(self, runtime: EnvPipeRuntime, hooks: ExecutionHooks, forward_step_func: Any,
                 data_iterators: list[Any], models: list[Any], config: Any, num_microbatches: int,
                 seq_length: int, micro_batch_size: int, collect_non_loss_data: bool, first_val_step: bool | None,
                 adjust_tensor_shapes_fn: Callable | None, pg_collection: Any,
                 force_all_reduce: bool | None, *, interleaved: bool = False) -> None:
        self.handlers = self.handler_table()  # first: an incomplete table fails before any work
        from megatron.core.pipeline_parallel import schedules

        self.schedules = schedules  # attributes looked up per call, as Megatron's own calls do
        self.runtime, self.hooks = runtime, hooks
        self.forward_step_func, self.data_iterators = forward_step_func, data_iterators
        self.models, self.config = models, config
        self.interleaved = interleaved
        self.num_chunks = len(models)
        self.m = num_microbatches
        self.seq_length, self.micro_batch_size = seq_length, micro_batch_size
        self.collect_non_loss_data, self.first_val_step = collect_non_loss_data, first_val_step
        self.pgc, self.force_all_reduce = pg_collection, force_all_reduce
        self.groups = StageGroups.of(pg_collection)
        self.stage, self.num_stages = self.groups.stage, self.groups.num_stages
        self.first, self.last = self.groups.first, self.groups.last
        self.device = next(models[0].parameters()).device
        self.dtype = config.pipeline_dtype
        if self.dtype is None:
            raise ValueError("EnvPipe: config.pipeline_dtype must be set (as Megatron's own schedule requires)")
        seq = seq_length // self.groups.cp_size
        if config.sequence_parallel:
            seq //= self.groups.tp_size
        shape = (seq, micro_batch_size, config.hidden_size)
        recv, send = [shape], [shape]
        if adjust_tensor_shapes_fn is not None:
            recv, send = adjust_tensor_shapes_fn(recv, send)
        if len(recv) != 1 or len(send) != 1:
            raise ValueError("EnvPipe supports one tensor per P2P message")
        self.recv_shape, self.send_shape = tuple(recv[0]), tuple(send[0])
        pp = self.groups.pp_group
        self.shapes = uses_shape_messages(config)  # sizes vary: a shape message ahead of each data message
        channels = STATE.channels_for(pp, tuple(dist.get_process_group_ranks(pp)), wrap=interleaved,
                                      shapes=self.shapes)
        self.transfers = P2PTransfers(
            channels, self.stage, self.num_stages, timeout_s=runtime.config.comm_timeout_s,
            recv_shape=self.recv_shape, send_shape=self.send_shape, dtype=self.dtype, device=self.device,
            shapes=self.shapes,
        )
        # Per-(micro-batch, chunk) state, emptied by the end of the iteration.
        self.inputs: dict[Key, Any] = {}
        self.outputs: dict[Key, Any] = {}
        self.grads_in: dict[Key, Any] = {}
        self.grads_out: dict[Key, Any] = {}
        self.forward_data_store: list[Any] = []
        self.total_num_tokens = torch.zeros([], dtype=torch.int, device=self.device)
        self.sync: GradSync | None = None  # set by run(): Megatron's grad/param sync rules
        self.timer: UnitTimer | None = None  # set by run() when the plan measures
        self.device_time: DeviceTimeLink | None = None  # set by run(): a simulated GPU in virtual time
        self.memory: MemoryProbe | None = None  # set by run() when the plan measures memory
        self.own_wall_s: float | None = None  # wall time up to the gradient sync (stragglers, no virtual time)
        self.iteration_plans: IterationPlans | None = None  # set by run() with variable sequence lengths

    def handler_table(self) -> dict[type[ins.Instruction], Handler]:
        """Instruction type -> bound handler; raises HandlerTableError if one is missing."""
        return checked_handler_table({
            ins.SetFrequency: self._set_frequency,
            ins.Forward: self._forward,
            ins.Backward: self._backward,
            ins.Free: self._free,
            ins.RecvActivationStart: self._recv_start,
            ins.RecvActivationFinish: self._recv_activation_finish,
            ins.SendActivationStart: self._send_activation_start,
            ins.SendActivationFinish: self._send_activation_finish,
            ins.RecvGradStart: self._recv_start,
            ins.RecvGradFinish: self._recv_grad_finish,
            ins.SendGradStart: self._send_grad_start,
            ins.SendGradFinish: self._send_grad_finish,
            # Shape messages (variable sequence lengths): P2PTransfers turns a data tensor into its size.
            ins.RecvActivationShapeStart: self._recv_start,
            ins.RecvActivationShapeFinish: self._recv_shape_finish,
            ins.SendActivationShapeStart: self._send_activation_start,
            ins.SendActivationShapeFinish: self._send_grad_finish,
            ins.RecvGradShapeStart: self._recv_start,
            ins.RecvGradShapeFinish: self._recv_shape_finish,
            ins.SendGradShapeStart: self._send_grad_start,
            ins.SendGradShapeFinish: self._send_grad_finish,
        })

    def _prepare(self) -> Any:
        """This iteration's plan (for model chunks: Megatron's interleaved order and group size)."""
        if not self.interleaved:
            return self.runtime.prepare(self.num_stages, self.m)
        plan = self.runtime.prepare(self.num_stages, self.m, num_chunks=self.num_chunks,
                                    microbatch_group_size=self.config.microbatch_group_size_per_vp_stage)
        if plan.schedule.num_chunks != self.num_chunks:
            raise RuntimeError(f"EnvPipe: the plan has {plan.schedule.num_chunks} model chunks per stage, "
                               f"the model {self.num_chunks}")
        return plan


    def run(self) -> list[Any]:
        config = self.config
        # Sizes and flags first: a bad combination fails before any GPU is opened or clock touched.
        self.runtime.check_pipeline(self.num_stages, self.m)
        if not STATE.device_ready:
            layout = profile_layout_key(config, self.models[0], self.groups, self.send_shape, self.dtype)
            if self.num_chunks > 1:  # a profile of V model chunks serves only V chunks
                layout["model_chunks"] = self.num_chunks
            if self.interleaved:  # units are chunks: a profile of another chunk count does not apply
                layout["model_chunks"] = self.num_chunks
            if self.shapes:  # units of varying lengths: not a profile of seq_length-token micro-batches
                layout["variable_seq_lengths"] = True
            setup_device(STATE, self.groups, self.device, layout, self.num_chunks)
            self.hooks = STATE.hooks
            # Each node reads its own profile cache: all ranks take the first one's, or a node that found
            # no cached profile would profile while the others plan, and their collectives would hang.
            runtime = self.runtime
            runtime.profile, runtime.profile_p2p_power_w = self.groups.agree(
                self.groups.gather_stages((runtime.profile, runtime.profile_p2p_power_w)))[0]
        self.device_time = STATE.device_time
        started = time.perf_counter()
        apply_sim_straggler(self.runtime.config, self.hooks, self.groups, self.runtime.iteration)
        sizes = None  # micro-batch sizes: known (one iteration ahead) only where they vary
        if self.shapes:
            self.iteration_plans = iteration_plans_for(self.runtime, self.seq_length, self.micro_batch_size)
            self.data_iterators = self.iteration_plans.wrap(self.data_iterators, self.m)
            sizes = self.iteration_plans.exchange(self.groups, self.m)
        plan = self._prepare()
        if self.iteration_plans is not None:  # this iteration's own clocks, if planned in time
            plan = self.iteration_plans.install(plan, self.stage)
        # With shape messages if the lengths vary; proved deadlock-free (with the warm-up) once per schedule.
        programs = STATE.programs.programs(plan, self.shapes, self.interleaved)
        program = programs[self.stage].instructions
        if self.runtime.config.verbose and STATE.shown_program != program:
            STATE.shown_program = program
            log.info("EnvPipe stage %d program (%s):\n%s", self.stage, plan.phase, programs[self.stage])
        model_arg = self.models if self.interleaved else self.models[0]
        embedding_module = None
        if config.finalize_model_grads_func is not None:
            embedding_module = self.schedules.clear_embedding_activation_buffer(config, model_arg, self.last)
        if config.timers is not None:
            config.timers("forward-backward", log_level=1).start(barrier=config.barrier_with_L1_time)
        order = plan.schedule.orders[self.stage]
        if self.interleaved:
            self.sync = InterleavedSync(config, self.models, self.stage, self.m,
                                        config.microbatch_group_size_per_vp_stage)
        else:
            last_backward = order[-1].microbatch if not order[-1].is_forward else None
            self.sync = OneChunkSync(config, self.models[0], last_backward, self.first)
        self.sync.begin()
        self.hooks.iteration_begin(self.stage, self.runtime.iteration)
        self.hooks.iteration_sizes(sizes)
        if plan.plan is not None:  # None: no clock is set (no clock control)
            self.hooks.clock_plan(order, plan.plan.freqs_mhz[self.stage],
                                  plan.unit_times_s[self.stage] if plan.unit_times_s is not None else None)
        device_clock = self.device_time.clock.now if self.device_time is not None else None
        self.timer = UnitTimer(self.device, host_sync=plan.profiling, clock=device_clock) if plan.measure else None
        if plan.measure_memory:
            self.memory = MemoryProbe(self.device, self.runtime.config.sim_memory)
            self.memory.iteration_begin()
        handlers = self.handlers
        tell = self.hooks.instruction if self.hooks.wants_instructions else None
        try:
            for instr in program:
                if tell is not None:
                    tell(instr)
                handlers[type(instr)](instr)
                self._reap_sends()
        except BaseException:
            self._abandon()
            raise
        if self.transfers.pending or self.inputs or self.outputs:
            raise RuntimeError(
                f"EnvPipe stage {self.stage}: program ended with live state "
                f"(pending {sorted(self.transfers.pending)}, inputs {sorted(self.inputs)}, "
                f"outputs {sorted(self.outputs)})"
            )
        self.own_wall_s = time.perf_counter() - started  # before the data-parallel gradient sync
        self.sync.finish()
        if config.finalize_model_grads_func is not None:
            self.schedules.finish_embedding_wgrad_compute(config, embedding_module, self.last, self.pgc.tp)
            config.finalize_model_grads_func(
                self.models,
                self.total_num_tokens if config.calculate_per_token_loss else None,
                pg_collection=self.pgc,
                force_all_reduce=self.force_all_reduce,
            )
        if config.timers is not None:
            config.timers("forward-backward").stop()
        self._finish_measurement(order, plan.profiling)
        return self.forward_data_store

    def _finish_measurement(self, order: tuple[Unit, ...], profiling: bool) -> None:
        """Hand the stage's timings (and, profiling, energy samples) to the run-time; report energy."""
        timer = self.timer
        measurement = gathered = samples = memory = None
        if timer is not None:
            measurement = timer.measurement(order)
            gathered = self.groups.agree(self.groups.gather_stages(measurement))
        elif self.runtime.measures_energy:
            # Every energy window ends at one point of the pipeline, measured iteration or not: a
            # stage done early idles (at P2P power) until the last finishes, and that idle time is
            # the iteration's too. Without it, unmeasured iterations would drop the cool-down bubble
            # (~3 % of a 4-stage iteration's energy) that measured ones count. The condition is the
            # pipeline's, so every rank joins or none does.
            self.groups.gather_stages(None)
        if self.device_time is not None:  # virtual time: the same, on the device clocks
            self.device_time.iteration_end()
        self.hooks.iteration_end(measurement)
        if profiling and timer is not None:
            windows, blocking = timer.host_windows(order)
            mine = self.hooks.stage_samples(windows, blocking, [u.chunk for u in order] if self.interleaved else ())
            samples = self.groups.agree(self.groups.gather_stages(mine))
        if self.memory is not None:
            memory = self.groups.agree(self.groups.gather_stages(self.memory.result()))
        iteration = self.runtime.iteration
        self.runtime.finish(self.num_stages, self.m, gathered, samples, memory)
        link, scale = self.device_time, self.runtime.device.time_scale if self.runtime.device else 1.0
        own_s = link.own_time_s if link is not None else (self.own_wall_s or 0.0) / scale
        report_energy(self.runtime, self.hooks, self.groups, iteration)
        if self.iteration_plans is not None:
            self.iteration_plans.after_iteration(self.groups, iteration)
        follow_stragglers(self.runtime, self.groups, iteration, own_s)  # switches from the next iteration on

    # -- handlers: compute -------------------------------------------------------------
    def _run_unit(self, unit: Unit, compute: Callable[[int, int], None]) -> None:
        timer, link = self.timer, self.device_time
        if link is not None:  # virtual time: the device waits for its input's device time
            link.before_unit(unit)
        begin = timer.compute_begins() if timer is not None else 0
        self.hooks.unit_begin(unit)
        compute(unit.microbatch, unit.chunk)
        self.hooks.unit_end(unit)
        if link is not None:
            link.after_unit(unit)
        if timer is not None:
            timer.compute_ends(begin)

    def _forward(self, instr: ins.Forward) -> None:
        probe = self.memory
        before = probe.forward_begin() if probe is not None else 0
        unit = F(instr.microbatch, instr.chunk)
        self.sync.before_forward(unit)
        self._run_unit(unit, self._forward_step)
        if probe is not None:
            probe.forward_end(before)

    def _backward(self, instr: ins.Backward) -> None:
        unit = B(instr.microbatch, instr.chunk)
        self.sync.before_backward(unit)
        self._run_unit(unit, self._backward_step)
        self.sync.after_backward(unit)

    def _forward_step(self, mb: int, chunk: int) -> None:
        key = (mb, chunk)
        input_tensor = self.inputs.get(key)
        output, num_tokens = call_forward_step(
            self.forward_step_func, self.data_iterators[chunk], self.models[chunk], self.m, input_tensor,
            self.forward_data_store, self.config,
            cp_group_size=self.groups.cp_size, is_last_stage=self.last and chunk == self.num_chunks - 1,
            collect_non_loss_data=self.collect_non_loss_data,
            checkpoint_activations_microbatch=None,
            is_first_microbatch=self.schedules.check_first_val_step(self.first_val_step, False, mb == 0),
            current_microbatch=mb,
            vp_stage=chunk if self.interleaved else None,
        )
        self.total_num_tokens += num_tokens
        self.inputs[key] = input_tensor
        self.outputs[key] = output

    def _backward_step(self, mb: int, chunk: int) -> None:
        key = (mb, chunk)
        grad = self.grads_in.pop(key, None)
        self.grads_out[key] = call_backward_step(self.inputs[key], self.outputs[key], grad, self.config)

    def _set_frequency(self, instr: ins.SetFrequency) -> None:
        self.hooks.set_frequency(instr.freq_mhz)

    def _free(self, instr: ins.Free) -> None:
        key = (instr.microbatch, instr.chunk)
        self.inputs.pop(key, None)
        self.outputs.pop(key, None)
        self.grads_out.pop(key, None)

    # -- handlers: communication ---------------------------------------------------------
    def _recv_start(self, instr: ins.CommInstruction) -> None:
        self.transfers.start_recv(instr)

    def _mark_wait(self) -> None:
        """A receive's finish: the next unit's wait for its input begins."""
        if self.timer is not None:
            self.timer.wait_begins()

    def _recv_shape_finish(self, instr: ins.CommInstruction) -> None:
        self._mark_wait()  # the wait for the input begins at its shape, just before its data
        self.transfers.finish(instr)

    def _recv_activation_finish(self, instr: ins.RecvActivationFinish) -> None:
        if not self.shapes:
            self._mark_wait()
        self.inputs[(instr.microbatch, instr.chunk)] = self.transfers.finish(instr)

    def _recv_grad_finish(self, instr: ins.RecvGradFinish) -> None:
        if not self.shapes:
            self._mark_wait()
        self.grads_in[(instr.microbatch, instr.chunk)] = self.transfers.finish(instr)

    def _send_activation_start(self, instr: ins.SendActivationStart) -> None:
        self.transfers.start_send(instr, _single(self.outputs[(instr.microbatch, instr.chunk)]))

    def _send_activation_finish(self, instr: ins.SendActivationFinish) -> None:
        if self.transfers.finish(instr) is not None:  # None: already reaped and freed
            self._deallocate((instr.microbatch, instr.chunk))

    def _send_grad_start(self, instr: ins.SendGradStart) -> None:
        self.transfers.start_send(instr, _single(self.grads_out[(instr.microbatch, instr.chunk)]))

    def _send_grad_finish(self, instr: ins.SendGradFinish) -> None:
        self.transfers.finish(instr)

    def _deallocate(self, key: Key) -> None:
        output = self.outputs.get(key)
        if output is not None:
            self.schedules.deallocate_output_tensor(_single(output), self.config.deallocate_pipeline_outputs)

    def _reap_sends(self) -> None:
        """Pseudo-free outputs whose activation send already completed (never blocks)."""
        for key in self.transfers.reap_activation_sends():
            self._deallocate(key)
        if self.shapes:
            self.transfers.post_known_receives()

    def _abandon(self) -> None:
        """On error: drop references so a retry does not leak; leave open no-sync."""
        self.transfers.clear()
        self.inputs.clear()
        self.outputs.clear()
        self.grads_in.clear()
        self.grads_out.clear()
        if self.device_time is not None:
            self.device_time.abandon()
        if self.sync is not None:
            self.sync.abandon()
