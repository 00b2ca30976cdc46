"""One stage's run of one iteration: set up once, the run's parts begin, prepare, interpret, parts end.

:class:`StageIteration` is made per call of EnvPipe's schedule (megatron/executor.py). Its
:meth:`~StageIteration.run` reads as the iteration does: the device is set up once per ``install()``
(:mod:`~megatron_envpipe.megatron.devices`); the run's parts begin the iteration
(megatron/training_run.py: the simulated straggler, the per-iteration plans' size exchange); the phase
machine prepares the iteration's plan; Megatron's bookkeeping begins (grad sync, timers, the hooks'
iteration and clock plan); the interpreter runs the stage's instruction program through a handler table
(``isend``/``irecv`` on one communicator per direction and neighbour, Megatron's own ``forward_step`` /
``backward_step``, pseudo-freeing an output only after its send completed); Megatron's bookkeeping ends
(grad sync, ``finalize_model_grads_func``, timers); the measurement goes to the phase machine; the run's
parts end the iteration (energy log, per-iteration plans' window, straggler following).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from megatron_envpipe.config.groups import TransportSettings
from megatron_envpipe.core import instructions as ins
from megatron_envpipe.core.hooks import ExecutionHooks
from megatron_envpipe.core.schedule import B, F, Unit
from megatron_envpipe.errors import InvalidValueError
from megatron_envpipe.megatron.channels import P2PTransfers
from megatron_envpipe.megatron.compat import call_backward_step, call_forward_step
from megatron_envpipe.megatron.device_time import DeviceTimeLink
from megatron_envpipe.megatron.devices import profile_layout_key, setup_device
from megatron_envpipe.megatron.dispatch import Handler, checked_handler_table
from megatron_envpipe.megatron.grad_sync import GradSync, InterleavedSync, OneChunkSync
from megatron_envpipe.megatron.groups import StageGroups
from megatron_envpipe.megatron.iteration_plans import IterationPlans
from megatron_envpipe.megatron.memory import MemoryProbe
from megatron_envpipe.megatron.run_parts import IterationStep
from megatron_envpipe.megatron.runtime import IterationPlan
from megatron_envpipe.megatron.shape_exchange import uses_shape_messages
from megatron_envpipe.megatron.state import STATE
from megatron_envpipe.megatron.timing import UnitTimer
from megatron_envpipe.megatron.training_run import TrainingRun

__all__ = ["StageIteration"]

log = logging.getLogger("megatron_envpipe")

Key = tuple[int, int]  # (micro-batch, chunk)


def _single(value: Any) -> torch.Tensor:
    """Megatron passes stage outputs and input grads as 1-element lists or bare tensors."""
    if isinstance(value, (list, tuple)):
        if len(value) != 1:
            raise InvalidValueError(f"EnvPipe supports one tensor per P2P message, got {len(value)}")
        return value[0]
    return value


class StageIteration:
    """One stage's run of one iteration: dispatches its instruction program.

    Every instruction goes through :attr:`handlers` (instruction type -> bound
    method), built and checked complete at construction. ``models`` and
    ``data_iterators`` hold one entry per model chunk (one without
    ``interleaved``); per-unit state is keyed by (micro-batch, chunk).
    """

    def __init__(self, run: TrainingRun, hooks: ExecutionHooks, forward_step_func: Any,
                 data_iterators: list[Any], models: list[Any], config: Any, num_microbatches: int,
                 seq_length: int, micro_batch_size: int, collect_non_loss_data: bool, first_val_step: bool | None,
                 adjust_tensor_shapes_fn: Callable | None, pg_collection: Any,
                 force_all_reduce: bool | None, *, interleaved: bool = False) -> None:
        self.handlers = self.handler_table()  # first: an incomplete table fails before any work
        from megatron.core.pipeline_parallel import schedules

        self.schedules = schedules  # attributes looked up per call, as Megatron's own calls do
        self.run_parts, self.hooks = run, hooks
        self.runtime = run.phases if run is not None else None  # the phase machine
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
            raise InvalidValueError("EnvPipe: config.pipeline_dtype must be set (as Megatron's own schedule requires)")
        seq = seq_length // self.groups.cp_size
        if config.sequence_parallel:
            seq //= self.groups.tp_size
        shape = (seq, micro_batch_size, config.hidden_size)
        recv, send = [shape], [shape]
        if adjust_tensor_shapes_fn is not None:
            recv, send = adjust_tensor_shapes_fn(recv, send)
        if len(recv) != 1 or len(send) != 1:
            raise InvalidValueError("EnvPipe supports one tensor per P2P message")
        self.recv_shape, self.send_shape = tuple(recv[0]), tuple(send[0])
        pp = self.groups.pp_group
        self.shapes = uses_shape_messages(config)  # sizes vary: a shape message ahead of each data message
        channels = STATE.channels_for(pp, tuple(dist.get_process_group_ranks(pp)), wrap=interleaved,
                                      shapes=self.shapes)
        self.transfers = P2PTransfers(
            channels, self.stage, self.num_stages, transport=run.config.group(TransportSettings),
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

    def _prepare(self) -> IterationPlan:
        """This iteration's plan (for model chunks: Megatron's interleaved order and group size); with
        variable lengths, this iteration's own clocks if they were planned in time."""
        plan = self._prepared()
        if self.iteration_plans is not None:
            plan = self.iteration_plans.install(plan, self.stage)
        return plan

    def _prepared(self) -> IterationPlan:
        if not self.interleaved:
            return self.run_parts.prepare(self.num_stages, self.m)
        plan = self.run_parts.prepare(self.num_stages, self.m, num_chunks=self.num_chunks,
                                      microbatch_group_size=self.config.microbatch_group_size_per_vp_stage)
        if plan.schedule.num_chunks != self.num_chunks:
            raise RuntimeError(f"EnvPipe: the plan has {plan.schedule.num_chunks} model chunks per stage, "
                               f"the model {self.num_chunks}")
        return plan

    def run(self) -> list[Any]:
        """One iteration of this stage (module docstring)."""
        self._set_up_once()
        step = IterationStep(self.groups, self.hooks, self.runtime.iteration, self.m)
        started = time.perf_counter()
        self._begin_parts(step)
        plan = self._prepare()
        order = plan.schedule.orders[self.stage]
        program = self._program(plan)
        embedding_module = self._begin_megatron(plan, order)
        self._interpret(program)
        self.own_wall_s = time.perf_counter() - started  # before the data-parallel gradient sync
        self._end_megatron(embedding_module)
        own_s = self._finish_measurement(order, plan.profiling)
        self.run_parts.end_iteration(dataclasses.replace(step, own_time_s=own_s))
        return self.forward_data_store

    def _set_up_once(self) -> None:
        """Sizes and flags first (a bad combination fails before any GPU is opened or clock touched); then,
        once per install(), the device and the pipeline's agreed profile."""
        self.runtime.check_pipeline(self.num_stages, self.m)
        if not STATE.device_ready:
            layout = profile_layout_key(self.config, self.models[0], self.groups, self.send_shape, self.dtype)
            if self.num_chunks > 1:  # a profile of V model chunks serves only V chunks
                layout["model_chunks"] = self.num_chunks
            if self.interleaved:  # units are chunks: a profile of another chunk count does not apply
                layout["model_chunks"] = self.num_chunks
            if self.shapes:  # units of varying lengths: not a profile of seq_length-token micro-batches
                layout["variable_seq_lengths"] = True
            setup_device(STATE, self.groups, self.device, layout, self.num_chunks)
            # Each node reads its own profile cache: all ranks take the first one's, or a node that found
            # no cached profile would profile while the others plan, and their collectives would hang.
            runtime = self.runtime
            runtime.adopt_profile(*self.groups.agree(
                self.groups.gather_stages((runtime.profile, runtime.profile_p2p_power_w)))[0])
        self.hooks = STATE.hooks
        self.device_time = STATE.device_time

    def _begin_parts(self, step: IterationStep) -> None:
        """Variable lengths: the data iterators read through the look-ahead; then the run's parts begin."""
        if self.shapes:
            self.iteration_plans = self.run_parts.use_iteration_plans(self.seq_length, self.micro_batch_size)
            self.data_iterators = self.iteration_plans.wrap(self.data_iterators, self.m)
        self.run_parts.begin_iteration(step)

    def _program(self, plan: IterationPlan) -> tuple[ins.Instruction, ...]:
        """This stage's program: with shape messages if the lengths vary; proved deadlock-free (with the
        warm-up) once per schedule; printed by --envpipe-verbose when it changes."""
        programs = STATE.programs.programs(plan, self.shapes, self.interleaved)
        program = programs[self.stage].instructions
        if self.runtime.config.verbose and STATE.show_program(program):
            log.info("EnvPipe stage %d program (%s):\n%s", self.stage, plan.phase, programs[self.stage])
        return program

    def _begin_megatron(self, plan: IterationPlan, order: tuple[Unit, ...]) -> Any:
        """Megatron's bookkeeping before the first unit (embedding buffer, timers, grad sync), the hooks'
        iteration and clock plan, the unit timer and memory probe; returns the embedding module."""
        config = self.config
        model_arg = self.models if self.interleaved else self.models[0]
        embedding_module = None
        if config.finalize_model_grads_func is not None:
            embedding_module = self.schedules.clear_embedding_activation_buffer(config, model_arg, self.last)
        if config.timers is not None:
            config.timers("forward-backward", log_level=1).start(barrier=config.barrier_with_L1_time)
        if self.interleaved:
            self.sync = InterleavedSync(config, self.models, self.stage, self.m,
                                        config.microbatch_group_size_per_vp_stage)
        else:
            last_backward = order[-1].microbatch if not order[-1].is_forward else None
            self.sync = OneChunkSync(config, self.models[0], last_backward, self.first)
        self.sync.begin()
        self.hooks.iteration_begin(self.stage, self.runtime.iteration)
        self.hooks.iteration_sizes(self.iteration_plans.sizes if self.iteration_plans is not None else None)
        if plan.plan is not None:  # None: no clock is set (no clock control)
            self.hooks.clock_plan(order, plan.plan.freqs_mhz[self.stage],
                                  plan.unit_times_s[self.stage] if plan.unit_times_s is not None else None)
        device_clock = self.device_time.clock.now if self.device_time is not None else None
        self.timer = UnitTimer(self.device, host_sync=plan.profiling, clock=device_clock) if plan.measure else None
        if plan.measure_memory:
            self.memory = MemoryProbe(self.device, self.runtime.config.sim_memory)
            self.memory.iteration_begin()
        return embedding_module

    def _interpret(self, program: tuple[ins.Instruction, ...]) -> None:
        """The interpreter: every instruction through its handler; nothing may be left alive at the end."""
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

    def _end_megatron(self, embedding_module: Any) -> None:
        """Megatron's bookkeeping after the last unit: grad sync, finalize_model_grads_func, timers."""
        config = self.config
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

    def _finish_measurement(self, order: tuple[Unit, ...], profiling: bool) -> float:
        """Hand the stage's timings (and, profiling, energy samples) to the phase machine; the pipeline's
        own iteration time (device seconds, without the wait for other data-parallel pipelines)."""
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
        self.runtime.finish(self.num_stages, self.m, gathered, samples, memory)
        link, scale = self.device_time, self.runtime.device.time_scale if self.runtime.device else 1.0
        return link.own_time_s if link is not None else (self.own_wall_s or 0.0) / scale

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
