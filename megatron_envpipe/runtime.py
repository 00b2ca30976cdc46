"""What the executor runs each iteration: schedule, clock plan, and when to measure.

One :class:`EnvPipeRuntime` per process holds EnvPipe's phases (envpipe.md §1):

1. **measure** (only without a profile): run Megatron's 1F1B for
   ``measure_iterations`` iterations and time every unit;
2. **plan**: from the given profile, or from the measured per-stage forward and
   backward times (one clock: nothing to lower without clock control), build
   the schedule (``ours``: extra warm-up ``r_s``) and the clock plan;
3. **reconfigure** (``greedy``/``balanced``): after each iteration, walk the
   measured critical path and raise clocks, until the finish limit;
4. **steady**: keep the plan.

Decisions are made from data every stage of the pipeline has gathered, so all
stages compute the same plan with no extra broadcast. Pure Python: the
executor supplies the gathering.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable, Sequence

from .config import EnvPipeConfig
from .gpu_specs import GpuSpec, get_gpu_spec
from .instructions import StageProgram, build_programs
from .plan import FrequencyPlan, format_envpipe
from .planner import (
    ClockLadder,
    IterationMeasurement,
    PlannerConfig,
    PlanResult,
    Reconfigurer,
    UnitTiming,
    plan_envpipe,
    planner_candidates,
)
from .profile import Profile, ProfilePoint
from .resources import shipped_profile
from .schedule import Schedule, one_f_one_b

log = logging.getLogger("megatron_envpipe")

# Label of the one clock a run without clock control has; it is never set.
NOMINAL_CLOCK_MHZ = 1000


@dataclass(frozen=True)
class IterationPlan:
    """Everything the executor needs for one iteration of one stage."""

    schedule: Schedule
    plan: FrequencyPlan
    programs: tuple[StageProgram, ...]
    measure: bool  # time every unit and hand the measurement back
    phase: str


class EnvPipeRuntime:
    def __init__(self, config: EnvPipeConfig, gpu: GpuSpec | None = None) -> None:
        self.config = config.validate()
        self.gpu = gpu if gpu is not None else (get_gpu_spec(config.gpu) if config.gpu and not config.gpu.startswith("simulated") else None)
        self.profile: Profile | None = (
            Profile.from_csv(shipped_profile(config.profile)) if config.profile else None
        )
        self.iteration = 0
        self._by_m: dict[tuple[int, int], _PlanState] = {}
        self._measured: dict[tuple[int, int], list[IterationMeasurement]] = {}
        self.last_result: PlanResult | None = None

    # -- per iteration ------------------------------------------------------------------
    def prepare(self, num_stages: int, num_microbatches: int) -> IterationPlan:
        key = (num_stages, num_microbatches)
        state = self._by_m.get(key)
        if state is None:
            if self.profile is None and not self.config.is_stock:
                done = len(self._measured.get(key, []))
                if done < self.config.measure_iterations:
                    sched = one_f_one_b(num_stages, num_microbatches)
                    plan = FrequencyPlan.constant(sched, [self._nominal_clock()] * num_stages)
                    return IterationPlan(sched, plan, tuple(build_programs(sched, plan, self.config.prefetch)),
                                         True, f"measure {done + 1}/{self.config.measure_iterations}")
            state = self._make_state(num_stages, num_microbatches)
            self._by_m[key] = state
        rc = state.reconfigurer
        measure = rc is not None and not rc.finished
        plan = rc.plan if rc is not None else state.plan
        programs = state.programs_for(plan, self.config.prefetch)
        return IterationPlan(state.schedule, plan, programs, measure, "reconfigure" if measure else "steady")

    def finish(self, num_stages: int, num_microbatches: int, measurements: Sequence[IterationMeasurement] | None) -> None:
        """After an iteration: ``measurements`` of every stage (same on all stages), if measured."""
        self.iteration += 1
        if measurements is None:
            return
        key = (num_stages, num_microbatches)
        state = self._by_m.get(key)
        merged = IterationMeasurement(tuple(m.stages[0] for m in measurements))
        if state is None:
            self._measured.setdefault(key, []).append(merged)
            return
        if state.reconfigurer is not None and not state.reconfigurer.finished:
            before = state.reconfigurer.plan
            after = state.reconfigurer.observe(merged)
            if after != before:
                log.info("EnvPipe reconfiguration step %d changed the plan", state.reconfigurer.iterations)
            if state.reconfigurer.finished:
                log.info("EnvPipe reconfiguration finished after %d iterations", state.reconfigurer.iterations)

    # -- planning -----------------------------------------------------------------------
    def _nominal_clock(self) -> int:
        return self.gpu.max_clock_mhz if self.gpu is not None else NOMINAL_CLOCK_MHZ

    def _profile_for(self, num_stages: int, num_microbatches: int) -> Profile:
        if self.profile is not None:
            if self.profile.num_stages != num_stages:
                raise ValueError(
                    f"--envpipe-profile {self.config.profile} has {self.profile.num_stages} stages but the "
                    f"pipeline has {num_stages}: profile this model and parallel layout"
                )
            return self.profile
        runs = self._measured.get((num_stages, num_microbatches), [])
        if not runs:  # stock run without a profile: a one-clock profile of unit times 1 s
            points = {(s, i): [ProfilePoint(self._nominal_clock(), 1.0, 0.0)] for s in range(num_stages) for i in ("forward", "backward")}
            return Profile(points, source="<uniform>")
        points = {}
        for s in range(num_stages):
            for kind, ins in (("F", "forward"), ("B", "backward")):
                times = [t.end_s - t.start_s for run in runs for t in run.stages[s] if t.unit.kind == kind]
                mean = sum(times) / len(times)
                # Energy is unknown without a GPU backend: time only.
                points[(s, ins)] = [ProfilePoint(self._nominal_clock(), max(mean, 1e-9), 0.0)]
        return Profile(points, source=f"<measured over {len(runs)} iteration(s)>")

    def _make_state(self, num_stages: int, num_microbatches: int) -> "_PlanState":
        cfg = self.config
        profile = self._profile_for(num_stages, num_microbatches)
        pcfg = PlannerConfig(
            plan_type=cfg.plan_type,
            scheduling=cfg.scheduling,
            # Offline we simulate the chosen policy on the profile; online it keeps
            # correcting from measurements.
            reconfig=cfg.reconfig,
            gpu=self.gpu,
            p2p_power_w=cfg.p2p_power_w,
            reconfig_step_mhz=cfg.reconfig_step_mhz,
            max_inflight=cfg.max_inflight,
            extra_warmup=cfg.extra_warmup,
        )
        result = plan_envpipe(profile, num_microbatches, pcfg)
        self.last_result = result
        log.info(
            "EnvPipe plan %s/%s/%s for %d stages x %d micro-batches from %s: extra warm-up %s, "
            "peak in-flight activations %s, predicted saving %.2f%% at %.2f%% slowdown (%s)",
            cfg.plan_type, cfg.scheduling, cfg.reconfig, num_stages, num_microbatches, profile.source,
            list(result.schedule.extra_warmup), list(result.schedule.peak_inflight()),
            100 * result.energy_saving, 100 * result.slowdown, result.stop_reason,
        )
        log.info("EnvPipe plan:\n%s", format_envpipe(result.plan))
        rc = None
        if cfg.reconfig != "default" and len(profile.common_frequencies()) > 1:
            candidates = planner_candidates(profile, self.gpu)
            step = pcfg.effective_reconfig_step_mhz
            rc = Reconfigurer(result.plan, cfg.reconfig, ClockLadder(candidates, step),
                              finish_limit=cfg.finish_limit, threshold_scale=cfg.threshold_scale)
        return _PlanState(result.schedule, result.plan, rc)


class _PlanState:
    def __init__(self, schedule: Schedule, plan: FrequencyPlan, reconfigurer: Reconfigurer | None) -> None:
        self.schedule = schedule
        self.plan = plan
        self.reconfigurer = reconfigurer
        self._programs: dict[FrequencyPlan, tuple[StageProgram, ...]] = {}

    def programs_for(self, plan: FrequencyPlan, prefetch: int) -> tuple[StageProgram, ...]:
        progs = self._programs.get(plan)
        if progs is None:
            progs = tuple(build_programs(self.schedule, plan, prefetch))
            self._programs = {plan: progs}  # keep only the current plan's programs
        return progs


def measurement_from_records(
    order: Sequence, records: Sequence[tuple[float, float, float]]
) -> IterationMeasurement:
    """One stage's measurement from (start, end, recv_wait) per unit, in order."""
    return IterationMeasurement((tuple(UnitTiming(u, a, b, w) for u, (a, b, w) in zip(order, records)),))


GatherFn = Callable[[IterationMeasurement], list[IterationMeasurement]]
