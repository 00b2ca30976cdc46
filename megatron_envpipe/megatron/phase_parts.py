"""What the phase machine (megatron/runtime.py) was set up with, and the state each of its jobs keeps.

:class:`~megatron_envpipe.megatron.runtime.EnvPipeRuntime` is the phase machine alone: its phases, the plan
per pipeline size and the iteration count. What it reads or records sits here, one object per job:

* :class:`RunSetup` (frozen): the GPU table entry, the device session, how memory is measured, the model
  chunks; each is decided once (at ``install()``, at device set-up, at the first ``prepare()``) and the
  object is replaced whole, never changed in place;
* :class:`MadePlan` (frozen): the last plan made, what it was made from, when it took over, its deadline;
* :class:`MeasuredRuns`: the unit times and the memory measured before the plan, and the activation budget
  each plan was made with;
* :class:`BaselineRuns`: the 1F1B iterations at the maximum clock handed out before the plan, and the repeats
  of the baseline once it runs (megatron/baseline_refresh.py);

and :class:`~megatron_envpipe.megatron.profile_source.ProfileSource`: the profile and the start-up sweep.
The mutable ones change only through their own methods (tests/test_run_state_ownership.py).
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass

from megatron_envpipe.config import EnvPipeConfig
from megatron_envpipe.core.gpu_specs import GpuSpec
from megatron_envpipe.core.kinds import scheduling_kind
from megatron_envpipe.core.measurement import IterationMeasurement
from megatron_envpipe.core.memory import AUTO, Budget, StageMemory, budget_line, derive_budget
from megatron_envpipe.core.profile import Profile, ProfilePoint
from megatron_envpipe.gpu.startup import DeviceFacts
from megatron_envpipe.megatron.baseline_refresh import BaselineRefresh
from megatron_envpipe.megatron.device_session import DeviceSession
from megatron_envpipe.planning.basis import PlannerConfig, PlanResult
from megatron_envpipe.planning.deadline import DeadlineFrom

__all__ = ["MEMORY_ITERATIONS", "BaselineRuns", "MadePlan", "MeasuredRuns", "RunSetup"]

log = logging.getLogger("megatron_envpipe")

_Key = tuple[int, int]  # (stages, micro-batches): one pipeline size
# 1F1B iterations whose memory the activation budget is derived from. CUDA: two, because
# optimizer state (Adam's moments) is allocated by the first optimizer step, after iteration 1.
MEMORY_ITERATIONS = {"cuda": 2, "model": 1}
# The source of the stand-in profile a stock run plans its schedule from when it measured nothing.
_UNIFORM_PROFILE_SOURCE = "<uniform>"


@dataclass(frozen=True)
class RunSetup:
    """What the phase machine was set up with (module docstring)."""

    gpu: GpuSpec | None  # the GPU table's entry (an NVML device's, once its name is known)
    session: DeviceSession | None = None  # the device facts and clock latency, decided once at device set-up
    memory_source: str | None = None  # "cuda" when every stage can measure its memory
    # Model chunks per stage (Megatron's virtual pipeline) and its micro-batch group size, from prepare().
    num_chunks: int = 1
    microbatch_group_size: int | None = None

    @property
    def device(self) -> DeviceFacts | None:
        return self.session.facts if self.session is not None else None


@dataclass(frozen=True)
class MadePlan:
    """The last plan made: the straggler follower and the per-iteration planner plan from what it was made from."""

    result: PlanResult
    planned_with: tuple[Profile, int, PlannerConfig]  # profile, micro-batches, planner config
    planned_at: int  # the iteration count when the plan took over
    deadline: DeadlineFrom | None  # --envpipe-deadline-from 1f1b: the deadline and 1F1B at f_max it came from

    @property
    def predicts_time(self) -> bool:
        """Whether the plan's iteration time is a prediction: not when it was made from the stand-in profile of
        a stock run that measured nothing (unit times of 1 s: its schedule is right, its times say nothing)."""
        return self.planned_with[0].source != _UNIFORM_PROFILE_SOURCE


class MeasuredRuns:
    """What 1F1B iterations before the plan measured, per pipeline size, and the budgets planned within."""

    def __init__(self) -> None:
        self.times: dict[_Key, list[IterationMeasurement]] = {}  # unit times at one clock (no profile)
        self.memory: dict[_Key, list[tuple[StageMemory, ...]]] = {}  # every stage's memory, per iteration
        self.budgets: dict[_Key, Budget] = {}  # the activation budget each plan was made with
        self._told_no_memory = False

    def add_times(self, key: _Key, merged: IterationMeasurement) -> None:
        self.times.setdefault(key, []).append(merged)

    def add_memory(self, key: _Key, memory: tuple[StageMemory, ...]) -> None:
        self.memory.setdefault(key, []).append(memory)

    def memory_wanted(self, config: EnvPipeConfig, kind: str | None, key: _Key) -> bool:
        """Whether this 1F1B iteration should measure memory: ``ours`` with an auto budget, a way to
        measure (``kind``), extra warm-up possible at all (M > P), and fewer measured iterations than needed."""
        num_stages, num_microbatches = key
        if (config.max_inflight != AUTO or not scheduling_kind(config.scheduling).extra_warmup or kind is None
                or num_microbatches <= num_stages):
            return False
        return len(self.memory.get(key, [])) < MEMORY_ITERATIONS[kind]

    def budget(self, config: EnvPipeConfig, kind: str | None, key: _Key) -> Budget:
        """The activation budget to plan with, kept in :attr:`budgets`: the flag's, or under ``auto`` the one
        derived from the measured memory (logged), or no limit when nothing could be measured (logged once)."""
        self.budgets[key] = budget = self._budget(config, kind, key)
        return budget

    def _budget(self, config: EnvPipeConfig, kind: str | None, key: _Key) -> Budget:
        num_stages, num_microbatches = key
        if not scheduling_kind(config.scheduling).extra_warmup:  # only ours plans within a budget (interleaved: checked at start-up)
            return None
        if config.max_inflight != AUTO:
            return config.max_inflight
        runs = self.memory.get(key)
        if not runs:
            if num_microbatches > num_stages and not self._told_no_memory:
                self._told_no_memory = True
                log.info("EnvPipe: --envpipe-max-inflight auto: this device's memory cannot be measured (not CUDA, "
                         "no --envpipe-sim-memory): no activation budget, as with --envpipe-max-inflight none")
            return None
        merged = [functools.reduce(StageMemory.merge, stage) for stage in zip(*runs, strict=True)]
        budget = derive_budget(num_microbatches, merged)
        source = ("memory model --envpipe-sim-memory" if kind == "model"
                  else f"measured over {len(runs)} 1F1B iteration(s)")
        log.info("EnvPipe %s", budget_line(budget, merged, source))
        return budget

    def one_clock_profile(self, key: _Key, clock_mhz: int, num_chunks: int) -> Profile:
        """A profile of the unit times measured at one clock (time only: energy is unknown at one clock), or,
        with nothing measured (a stock run without a profile), one of unit times 1 s."""
        num_stages = key[0]
        runs = self.times.get(key, [])
        if not runs:
            points = {(s, i): [ProfilePoint(clock_mhz, 1.0, 0.0)] for s in range(num_stages)
                      for i in ("forward", "backward")}
            return Profile(points, source=_UNIFORM_PROFILE_SOURCE)
        points = {}
        for s in range(num_stages):
            for kind, ins in (("F", "forward"), ("B", "backward")):
                for chunk in range(num_chunks):  # model chunks (interleaved): one row each
                    times = [t.end_s - t.start_s for run in runs for t in run.stages[s]
                             if t.unit.kind == kind and t.unit.chunk == chunk]
                    mean = sum(times) / len(times)
                    points[(s, ins, chunk)] = [ProfilePoint(clock_mhz, max(mean, 1e-9), 0.0)]
        return Profile(points, source=f"<timed at one clock over {len(runs)} iteration(s)>")


class BaselineRuns:
    """The iterations the measured baseline is made of: 1F1B at the maximum clock before the plan, counted as
    they are handed out (the energy ledger, megatron/energy_ledger.py, sums their energy), and its repeats at
    the plan's GPU age (:attr:`refresh`)."""

    def __init__(self, iterations: int) -> None:
        self.runs = 0  # handed out at the maximum clock before the plan
        self.last_clock_mhz: int | None = None  # the uniform clock of the last pre-plan iteration
        self.refresh = BaselineRefresh(iterations)

    def ran_uniform(self, freq_mhz: int, at_max_clock: bool) -> None:
        """An iteration of Megatron's order at one clock was handed out."""
        self.last_clock_mhz = freq_mhz
        if at_max_clock:
            self.runs += 1
