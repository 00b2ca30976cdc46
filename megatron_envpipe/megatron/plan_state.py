"""What the phase machine hands the executor per iteration (:class:`IterationPlan`), and what it keeps per
pipeline size once a plan is made (:class:`PlanState`): the schedule, the clock plan, its online corrector,
and the programs and predicted unit times of the plan running now."""

from __future__ import annotations

from dataclasses import dataclass, field

from megatron_envpipe.core.device_backends import model_profile, named_backend
from megatron_envpipe.core.gpu_specs import GpuSpec, get_gpu_spec, spec_for_profile_source
from megatron_envpipe.core.instructions import StageProgram, build_programs
from megatron_envpipe.core.plan import FrequencyPlan
from megatron_envpipe.core.profile import Profile, ProfileError, instruction_of
from megatron_envpipe.core.schedule import Schedule
from megatron_envpipe.planning.reconfig import Reconfigurer

__all__ = ["IterationPlan", "PlanState", "table_spec"]


@dataclass(frozen=True)
class IterationPlan:
    """Everything the executor needs for one iteration of one stage."""

    schedule: Schedule
    plan: FrequencyPlan | None  # None: no clock is set (the programs hold no SetFrequency)
    programs: tuple[StageProgram, ...]
    measure: bool  # time every unit and hand the measurement back
    phase: str
    profiling: bool = False  # attribute energy to every unit (sweep iteration)
    measure_memory: bool = False  # measure activation and free memory, hand them back (1F1B iteration)
    # Per stage, each unit's predicted time (s) at its planned clock, from the profile planned with;
    # None where not known (profiling and measuring iterations): the GPU hooks' clock lead needs it.
    unit_times_s: tuple[tuple[float, ...], ...] | None = None


def table_spec(key: str | None) -> GpuSpec | None:
    source = model_profile(key)
    if source is not None:  # a modelled GPU: its profile's GPU, if the table has it
        return spec_for_profile_source(source)
    if not key or named_backend(key) is not None:  # auto, none, nvml: known at run time
        return None
    return get_gpu_spec(key)


@dataclass
class PlanState:
    schedule: Schedule
    plan: FrequencyPlan | None  # None: no clock is set
    reconfigurer: Reconfigurer | None
    profile: Profile | None = None  # planned with (one row per model chunk): predicted unit times
    _programs: dict = field(default_factory=dict)
    _times: dict = field(default_factory=dict)

    def programs_for(self, plan: FrequencyPlan | None, prefetch: int) -> tuple[StageProgram, ...]:
        progs = self._programs.get(plan)
        if progs is None:  # a straggler's pace plan carries its own schedule
            progs = tuple(build_programs(plan.schedule if plan is not None else self.schedule, plan, prefetch))
            self._programs = {plan: progs}  # keep only the current plan's programs
        return progs

    def unit_times_for(self, plan: FrequencyPlan | None) -> tuple[tuple[float, ...], ...] | None:
        """Each unit's predicted time at its clock in ``plan`` (None: a clock the profile lacks, or no plan)."""
        if self.profile is None or plan is None:
            return None
        if plan not in self._times:
            try:
                times = tuple(tuple(self.profile.time_s(s, instruction_of(u.kind), f, u.chunk)
                                    for u, f in zip(order, plan.freqs_mhz[s], strict=True))
                              for s, order in enumerate(plan.schedule.orders))
            except ProfileError:
                times = None
            self._times = {plan: times}  # keep only the current plan's
        return self._times[plan]
