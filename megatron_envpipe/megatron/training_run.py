"""The composition root of a training run: one object owns the parts, each with its own state.

:class:`TrainingRun` (one per ``install()``, in the executor state) holds

* ``phases``: the phase machine (:class:`~megatron_envpipe.megatron.runtime.EnvPipeRuntime`): profile,
  measure, plan, reconfigure, steady; it owns the plan, its frozen set-up (``phases.setup``, with the
  device session, :class:`~megatron_envpipe.megatron.device_session.DeviceSession`: the agreed device facts
  and the clock latency, decided once at set-up and handed to the hooks and the planner alike) and its
  parts (``profiles``, ``measured``, ``baselines``: megatron/profile_source.py, megatron/phase_parts.py);
* ``energy``: the energy ledger (:class:`~megatron_envpipe.megatron.energy_ledger.EnergyLedger`): sums,
  measured baseline, reports; the log lines are :mod:`~megatron_envpipe.megatron.reporting`'s;
* ``stragglers``: data-parallel straggler following (:class:`~megatron_envpipe.megatron.stragglers.StragglerFollow`),
  made at the first iteration's end; it owns the pace plan the phase machine is handed;
* ``iteration_plans``: per-iteration plans for variable-length micro-batches
  (:class:`~megatron_envpipe.megatron.iteration_plans.IterationPlans`), made at the first such call.

Each part reads the others through their public attributes and changes only its own state, its
containers included (tests/test_run_state_ownership.py checks it). They join each iteration through
:class:`~megatron_envpipe.megatron.run_parts.RunPart`: :meth:`TrainingRun.begin_iteration` before the
phase machine prepares the iteration, :meth:`TrainingRun.end_iteration` after it finished, each in one
fixed order on every rank (the parts run collectives).
"""

from __future__ import annotations

from megatron_envpipe.config import EnvPipeConfig
from megatron_envpipe.config.groups import StragglerSettings
from megatron_envpipe.core.gpu_specs import GpuSpec
from megatron_envpipe.megatron.energy_ledger import EnergyLedger
from megatron_envpipe.megatron.iteration_plans import IterationPlans, SizeMapping
from megatron_envpipe.megatron.reporting import EnergyReporting
from megatron_envpipe.megatron.run_parts import IterationStep, RunPart
from megatron_envpipe.megatron.runtime import EnvPipeRuntime, IterationPlan
from megatron_envpipe.megatron.stragglers import SimStraggler, StragglerFollow

__all__ = ["TrainingRun"]


class TrainingRun:
    """The parts of one training run of this process (module docstring)."""

    def __init__(self, config: EnvPipeConfig, gpu: GpuSpec | None = None) -> None:
        # Reads --envpipe-profile: an unreadable or corrupt one is an EnvPipeConfigError here, at install().
        self.phases = EnvPipeRuntime(config, gpu)
        self.energy = EnergyLedger(self.phases)
        self.stragglers: StragglerFollow | None = None  # made at the first iteration's end
        self.iteration_plans: IterationPlans | None = None  # variable lengths: made at the first such call
        self._sim_straggler = SimStraggler(self.phases.config.group(StragglerSettings))
        self._reporting = EnergyReporting(self)

    @property
    def config(self) -> EnvPipeConfig:
        return self.phases.config

    def use_iteration_plans(self, seq_length: int, micro_batch_size: int) -> IterationPlans:
        """The run's per-iteration plans (variable-length micro-batches), made at the first call."""
        if self.iteration_plans is None:
            self.iteration_plans = IterationPlans(
                self.phases, SizeMapping.for_run(self.config, seq_length, micro_batch_size))
        return self.iteration_plans

    # -- each iteration -------------------------------------------------------------------
    def begin_iteration(self, step: IterationStep) -> None:
        """Before the phase machine prepares the iteration: the simulated straggler slows its GPU, then
        the per-iteration plans exchange sizes (a collective over the pipeline)."""
        parts: list[RunPart] = [self._sim_straggler]
        if self.iteration_plans is not None:
            parts.append(self.iteration_plans)
        for part in parts:
            part.begin_iteration(step)

    def prepare(self, num_stages: int, num_microbatches: int, num_chunks: int = 1,
                microbatch_group_size: int | None = None) -> IterationPlan:
        """The phase machine's plan, handed what the other parts decided: a straggler's pace plan, and
        whether iterations get plans of their own."""
        pace = self.stragglers.pace_plan if self.stragglers is not None else None
        return self.phases.prepare(num_stages, num_microbatches, num_chunks, microbatch_group_size,
                                   pace_plan=pace, per_iteration_plans=self.iteration_plans is not None)

    def end_iteration(self, step: IterationStep) -> None:
        """After the phase machine took the iteration's measurements: the energy log, the per-iteration
        plans' window, straggler following (which switches plans from the next iteration on)."""
        parts: list[RunPart] = [self._reporting]
        if self.iteration_plans is not None:
            parts.append(self.iteration_plans)
        for part in parts:
            part.end_iteration(step)
        if self.stragglers is None:  # after the first energy line, which runs without one (as it always has)
            self.stragglers = StragglerFollow(self.phases)
        self.stragglers.end_iteration(step)

    def close(self) -> None:
        """``uninstall()``: stop the per-iteration planner's thread."""
        if self.iteration_plans is not None:
            self.iteration_plans.close()
