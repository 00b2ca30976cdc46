"""The executor's process-wide state, set by ``install()`` and ``uninstall()``.

Megatron calls the pipeline schedule as a plain function, once per iteration,
so whatever must outlive one call lives in the one :data:`STATE`: the training run
(megatron/training_run.py: the phase machine and the run's other parts), the execution hooks (GPU hooks once the device is
set up), Megatron's own schedule for fallbacks, and the P2P channels per
pipeline. :mod:`megatron_envpipe.megatron.patch` configures and resets it;
the executor reads it. It changes only through its own methods (its row in
tests/test_run_state_ownership.py), device set-up included (:meth:`ExecutorState.device_set_up`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from megatron_envpipe.core.hooks import ExecutionHooks
from megatron_envpipe.core.instructions import Instruction
from megatron_envpipe.megatron.channels import PipelineChannels
from megatron_envpipe.megatron.device_time import DeviceTimeLink
from megatron_envpipe.megatron.runtime import EnvPipeRuntime
from megatron_envpipe.megatron.shape_exchange import ProvedPrograms
from megatron_envpipe.megatron.training_run import TrainingRun

__all__ = ["STATE", "ExecutorState"]


@dataclass
class ExecutorState:
    """What EnvPipe's executor keeps between Megatron's calls."""

    run: TrainingRun | None = None  # the composition root of this install()'s run
    hooks: ExecutionHooks = field(default_factory=ExecutionHooks)
    user_hooks: bool = False  # hooks were given to install(): no device of our own
    device_ready: bool = False  # the device was opened and the pipeline agreed on its facts
    original: Callable[..., Any] | None = None  # Megatron's own 1F1B, for what EnvPipe does not run
    original_interleaved: Callable[..., Any] | None = None  # Megatron's own interleaved schedule, likewise
    warned: set[str] = field(default_factory=set)  # fallback reasons already logged
    # By pipeline ranks, whether they include the wrap-around channels (model chunks) and shape channels.
    channels: dict[tuple[tuple[int, ...], bool, bool], PipelineChannels] = field(default_factory=dict)
    shown_program: tuple[Instruction, ...] | None = None  # the program last printed by --envpipe-verbose
    programs: ProvedPrograms = field(default_factory=ProvedPrograms)  # the programs check_deadlock last passed
    device_time: DeviceTimeLink | None = None  # a simulated GPU's stamps in virtual time (set up with the device)

    @property
    def runtime(self) -> EnvPipeRuntime | None:
        """The run's phase machine (None: not installed)."""
        return self.run.phases if self.run is not None else None

    def configure(self, run: TrainingRun, original: Callable[..., Any],
                  hooks: ExecutionHooks | None = None,
                  original_interleaved: Callable[..., Any] | None = None) -> None:
        """``install()``: a new run and hooks; the device is set up again at the next call.

        Without ``hooks`` the executor opens this rank's GPU at the first
        iteration and drives it; the hooks used so far are closed.
        """
        old = self.hooks
        self.original = original
        self.original_interleaved = original_interleaved
        self.run = run
        self.hooks = hooks or ExecutionHooks()
        self.user_hooks = hooks is not None
        self.device_ready = False
        self.device_time = None
        self.warned = set()
        self.programs = ProvedPrograms()
        if old is not self.hooks:
            old.close()

    def reset(self) -> None:
        """``uninstall()``: close the hooks (resetting clocks) and forget the run-time and channels."""
        self.hooks.close()
        if self.run is not None:  # the per-iteration planner's thread
            self.run.close()
        self.run = None
        self.hooks = ExecutionHooks()
        self.user_hooks = False
        self.device_ready = False
        self.device_time = None
        self.original = None
        self.original_interleaved = None
        self.channels = {}
        self.programs = ProvedPrograms()

    def use_hooks(self, hooks: ExecutionHooks) -> None:
        """Replace the hooks (the first iteration's GPU hooks); the previous ones are closed."""
        old, self.hooks = self.hooks, hooks
        old.close()

    def device_set_up(self, device_time: DeviceTimeLink | None) -> None:
        """The device was opened and the pipeline agreed on its facts (megatron/devices.py); ``device_time``:
        a simulated GPU's link in virtual time."""
        self.device_time = device_time
        self.device_ready = True

    def show_program(self, program: tuple[Instruction, ...]) -> bool:
        """Whether ``program`` differs from the one --envpipe-verbose printed last (it is the last one now)."""
        if self.shown_program == program:
            return False
        self.shown_program = program
        return True

    def warn_once(self, reason: str) -> bool:
        """True the first time ``reason`` is seen since ``install()``."""
        if reason in self.warned:
            return False
        self.warned.add(reason)
        return True

    def channels_for(self, pp_group: Any, ranks: tuple[int, ...], wrap: bool = False,
                     shapes: bool = False) -> PipelineChannels:
        """The P2P channels of the pipeline with these ``ranks`` (created by every rank at once);
        ``wrap``: with the wrap-around channels of model chunks; ``shapes``: with shape channels."""
        channels = self.channels.get((ranks, wrap, shapes))
        if channels is None:
            channels = self.channels[(ranks, wrap, shapes)] = PipelineChannels(pp_group, wrap=wrap, shapes=shapes)
        return channels


# The one state of this process.
STATE = ExecutorState()
