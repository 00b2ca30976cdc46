"""What the executor runs each iteration: schedule, clock plan, and when to measure.

One :class:`EnvPipeRuntime` per process holds EnvPipe's phases (envpipe.md §1).
Without clock control (a stage's GPU refuses the lock, or no GPU at all) none of them
runs: the pipeline keeps Megatron's own order (1F1B, or interleaved with model chunks),
with no extra warm-up and no clock plan, since a plan whose clocks are never set saves
nothing and its extra warm-up would only hold more activations. Otherwise:

1. **profile** (clock control, no profile given, none cached): real training
   iterations sweep the SM clock in lockstep on every stage (1F1B order) and
   measure each stage's forward and backward time and energy per micro-batch
   and the P2P-blocking power, until energy rises below the valley; the
   profile is cached for the next run;
   **measure** (no profile, clocks that EnvPipe does not set: hooks given to ``install()``, or
   ``baseline`` with ``ours``/``interleaved``): time 1F1B units at the one clock, for the schedule;
   **memory** (``ours`` with ``--envpipe-max-inflight auto`` where memory can be measured):
   the activation memory per micro-batch and the memory free at 1F1B's peak, in the
   1F1B iterations above or, with a profile, in 1F1B iterations of their own; they
   give the activation budget per stage (:mod:`megatron_envpipe.core.memory`);
2. **plan**: the schedule (``ours``: extra warm-up ``r_s``, within the budget) and the clock plan;
3. **reconfigure** (``greedy``/``balanced``): after each iteration, walk the
   measured critical path and raise clocks, until the finish limit;
4. **steady**: keep the plan.

Decisions are made from data every stage of the pipeline has gathered, so all
stages compute the same plan with no extra broadcast. Pure Python: the
executor supplies the data.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping, Sequence
from typing import Any

from megatron_envpipe.config import EnvPipeConfig, load_profile
from megatron_envpipe.core.gpu_specs import GpuSpec, spec_for_nvml_name
from megatron_envpipe.core.instructions import build_programs
from megatron_envpipe.core.interleaved import interleaved_schedule
from megatron_envpipe.core.kinds import plan_kind
from megatron_envpipe.core.measurement import IterationMeasurement
from megatron_envpipe.core.memory import AUTO, Budget, StageMemory, within_budget
from megatron_envpipe.core.plan import FrequencyPlan, format_envpipe
from megatron_envpipe.core.profile import Profile
from megatron_envpipe.core.schedule import Schedule, one_f_one_b
from megatron_envpipe.core.vocabulary import ReconfigPolicy
from megatron_envpipe.gpu.startup import HOOKS_BACKEND, DeviceFacts
from megatron_envpipe.megatron.device_session import ClockTiming, DeviceSession
from megatron_envpipe.megatron.phase_parts import MEMORY_ITERATIONS, BaselineRuns, MadePlan, MeasuredRuns, RunSetup
from megatron_envpipe.megatron.plan_state import IterationPlan, PlanState, table_spec
from megatron_envpipe.megatron.profile_source import ProfileSource
from megatron_envpipe.planning.basis import PlannerConfig, PlanResult, planner_candidates, planning_profile
from megatron_envpipe.planning.deadline import DeadlineFrom, deadline_from_1f1b, deadline_summary, reword_warnings
from megatron_envpipe.planning.planner import plan_envpipe
from megatron_envpipe.planning.reconfig import ClockLadder, Reconfigurer

__all__ = ["EnvPipeRuntime", "IterationPlan"]

log = logging.getLogger("megatron_envpipe")

# Label of the one clock of a profile timed where the clock is not known (no device facts, or hooks
# given to install() on no GPU of the table); never logged by a run whose clocks EnvPipe does not set.
_NOMINAL_CLOCK_MHZ = 1000
# The phase of every iteration without clock control.
_MEGATRON_ORDER = "Megatron's order (no clock control)"


class EnvPipeRuntime:
    """The phase machine of one process (module docstring). Its own state is the iteration count, the plan per
    pipeline size and the last plan made; what it was set up with is the frozen :attr:`setup`; the profile, the
    measurements before the plan and the baseline's iterations are its parts' (megatron/phase_parts.py,
    megatron/profile_source.py). The other parts of a run (megatron/training_run.py) read it and hand it what it
    needs from them as arguments."""

    def __init__(self, config: EnvPipeConfig, gpu: GpuSpec | None = None) -> None:
        self.config = config.validate()
        self.setup = RunSetup(gpu if gpu is not None else table_spec(config.gpu))
        # An unreadable or corrupt --envpipe-profile is an EnvPipeConfigError here, at install().
        self.profiles = ProfileSource(load_profile(config.profile) if config.profile else None)
        self.measured = MeasuredRuns()
        self.baselines = BaselineRuns(config.baseline_iterations)
        self.iteration = 0
        self.made: MadePlan | None = None  # the last plan made
        self._by_m: dict[tuple[int, int], PlanState] = {}
        self._checked: set[tuple[int, int]] = set()  # pipelines whose sizes passed check_pipeline

    # -- facts from the executor ---------------------------------------------------------
    def attach_device(self, facts: DeviceFacts, cache_key: Mapping[str, Any] | None = None,
                      session: DeviceSession | None = None) -> None:
        """Called once, with facts every stage agrees on, before the first prepare(); ``session``: the device
        session decided at set-up (megatron/devices.py), else one made from the facts and the config."""
        if session is None:
            session = DeviceSession(facts, ClockTiming.assumed(facts.modelled, self.config.device_dynamics), cache_key)
        gpu = self.setup.gpu
        if gpu is None and facts.backend == "nvml":
            gpu = spec_for_nvml_name(facts.name)
        self.setup = dataclasses.replace(self.setup, session=session, gpu=gpu)
        if facts.control and not self.config.is_stock:
            self.profiles.use_cached(self.config, session.cache_key)

    def adopt_profile(self, profile: Profile | None, p2p_power_w: float | None) -> None:
        """The profile (and its P2P power) the pipeline agreed on at set-up: the first stage's (each node reads
        its own profile cache)."""
        self.profiles.adopt(profile, p2p_power_w)

    def attach_memory(self, source: str | None) -> None:
        """How the pipeline measures memory for ``--envpipe-max-inflight auto`` ("cuda" or None),
        agreed by every stage; ``--envpipe-sim-memory`` replaces it."""
        self.setup = dataclasses.replace(self.setup, memory_source=source)

    # -- what the other parts read -------------------------------------------------------
    @property
    def device(self) -> DeviceFacts | None:
        """The pipeline's agreed device facts (None before attach_device: offline, or before set-up)."""
        return self.setup.device

    @property
    def gpu(self) -> GpuSpec | None:
        return self.setup.gpu

    @property
    def cache_key(self) -> Mapping[str, Any] | None:
        return self.setup.session.cache_key if self.setup.session is not None else None

    @property
    def profile(self) -> Profile | None:
        return self.profiles.profile

    @property
    def profile_p2p_power_w(self) -> float | None:
        return self.profiles.p2p_power_w

    @property
    def last_result(self) -> PlanResult | None:
        return self.made.result if self.made is not None else None

    @property
    def last_plan_predicts_time(self) -> bool:
        """Whether the last plan's iteration time is a prediction (phase_parts.MadePlan.predicts_time)."""
        return self.made is not None and self.made.predicts_time

    @property
    def planned_with(self) -> tuple[Profile, int, PlannerConfig] | None:
        """What the last plan was made from (profile, micro-batches, planner config)."""
        return self.made.planned_with if self.made is not None else None

    @property
    def planned_at(self) -> int | None:
        """The iteration count when the plan took over."""
        return self.made.planned_at if self.made is not None else None

    @property
    def deadline(self) -> DeadlineFrom | None:
        """--envpipe-deadline-from 1f1b: the deadline the plan was made for, and 1F1B at f_max it came from."""
        return self.made.deadline if self.made is not None else None

    @property
    def budgets(self) -> Mapping[tuple[int, int], Budget]:
        """The activation budget each plan was made with, per (stages, micro-batches)."""
        return self.measured.budgets

    @property
    def measures_energy(self) -> bool:
        """Whether every stage measures energy (facts agreed at start-up: the same on every rank)."""
        return self.device is not None and self.device.energy

    @property
    def sets_clocks(self) -> bool:
        """Whether the plan's clocks reach a GPU: every stage locks clocks, or hooks given to ``install()``
        take them (and with no device facts, offline, they are assumed to)."""
        d = self.device
        return d is None or d.control or d.backend == HOOKS_BACKEND

    @property
    def keeps_megatron_order(self) -> bool:
        """No clock control where the plan would change clocks: run Megatron's own order, plan nothing.

        ``baseline`` changes no clock, so it plans its schedule (e.g. ``ours``) as with control."""
        return not self.sets_clocks and plan_kind(self.config.plan_type).sets_clocks

    @property
    def profiling(self) -> bool:
        return self.profiles.profiling

    # -- per iteration ------------------------------------------------------------------
    def check_pipeline(self, num_stages: int, num_microbatches: int) -> None:
        """The flags against this pipeline (profile stages, extra warm-up length, activation budget).

        Entry points check this at argument parsing (``validate_with_megatron_args``);
        a caller that did not still gets the same one EnvPipeConfigError, on every rank,
        before any unit runs. Once per (stages, micro-batches).
        """
        key = (num_stages, num_microbatches)
        if key not in self._checked:
            self.config.check_pipeline(num_stages, num_microbatches, self.profile if self.config.profile else None)
            self._checked.add(key)

    def prepare(self, num_stages: int, num_microbatches: int, num_chunks: int = 1,
                microbatch_group_size: int | None = None, *, pace_plan: FrequencyPlan | None = None,
                per_iteration_plans: bool = False) -> IterationPlan:
        """This iteration's plan; ``num_chunks`` > 1 (Megatron's virtual pipeline, scheduling
        "interleaved") runs Megatron's interleaved order with ``microbatch_group_size``.

        From the run's other parts: ``pace_plan``, the plan for a data-parallel straggler's pace that replaces
        the steady plan (megatron/stragglers.py); ``per_iteration_plans``: variable-length micro-batches get
        plans of their own (megatron/iteration_plans.py), so the baseline is not measured again."""
        setup = self.setup
        if (num_chunks, microbatch_group_size) != (setup.num_chunks, setup.microbatch_group_size):
            if self._by_m or self.measured.times:
                raise RuntimeError(f"EnvPipe: the model chunks per stage changed from {setup.num_chunks} to "
                                   f"{num_chunks} during training")
            self.setup = dataclasses.replace(setup, num_chunks=num_chunks, microbatch_group_size=microbatch_group_size)
        key = (num_stages, num_microbatches)
        self.check_pipeline(num_stages, num_microbatches)
        state = self._by_m.get(key)
        if state is None and self.keeps_megatron_order:  # nothing to measure or plan
            state = self._by_m[key] = PlanState(self._megatron_schedule(num_stages, num_microbatches), None, None)
        if state is None:
            early = self._before_plan(key)
            if early is not None:
                return early
            state = self._make_state(num_stages, num_microbatches)
            self._by_m[key] = state
        rc = state.reconfigurer
        measure = rc is not None and not rc.finished
        if not measure and not per_iteration_plans and self._repeat_baseline():
            return self._uniform(num_stages, num_microbatches, self.device.clocks_mhz[0], measure=False,
                                 phase=f"baseline again (measurement {self.baselines.refresh.generation}, "
                                       "at the plan's GPU age)")
        plan = rc.plan if rc is not None else state.plan
        phase = "reconfigure" if measure else _MEGATRON_ORDER if self.keeps_megatron_order else "steady"
        if pace_plan is not None and not measure:  # following a straggler: its pace's plan
            plan, phase = pace_plan, "following a straggler"
        programs = state.programs_for(plan, self.config.prefetch)
        schedule = plan.schedule if plan is not None else state.schedule
        return IterationPlan(schedule, plan, programs, measure, phase, unit_times_s=state.unit_times_for(plan))

    def _before_plan(self, key: tuple[int, int]) -> IterationPlan | None:
        """The iteration before a plan is made for ``key``: profile, measure, measure memory, baseline; None
        once none is wanted any more."""
        num_stages, num_microbatches = key
        memory = self.measured.memory_wanted(self.config, self._memory_kind(), key)
        if self.profile is None and not self.config.is_stock:
            if self.device is not None and self.device.control:
                sweep = self.profiles.sweep_for(self.config, self.gpu, self.device)
                if not sweep.done:
                    f = self.profiles.next_clock()
                    return self._uniform(num_stages, num_microbatches, f, measure=True, profiling=True,
                                         phase=f"profile {f} MHz (iteration {sweep.iterations_used + 1})",
                                         measure_memory=memory)
            else:
                done = len(self.measured.times.get(key, []))
                if done < self.config.measure_iterations:
                    return self._uniform(num_stages, num_microbatches, self._nominal_clock(), measure=True,
                                         phase=f"measure {done + 1}/{self.config.measure_iterations}",
                                         measure_memory=memory)
        if memory:
            done = len(self.measured.memory.get(key, []))
            return self._uniform(num_stages, num_microbatches, self._nominal_clock(), measure=False,
                                 measure_memory=True, phase=f"measure activation memory {done + 1}/"
                                 f"{MEMORY_ITERATIONS[self._memory_kind()]}")
        if self._baseline_wanted():  # the energy lines' baseline, where the phases above ran too few
            return self._uniform(num_stages, num_microbatches, self.device.clocks_mhz[0], measure=False,
                                 phase=f"baseline {self.baselines.runs + 1}/{self.config.baseline_iterations}")
        return None

    @property
    def reconfiguring(self) -> bool:
        """Whether online reconfiguration is still correcting a plan (no straggler is followed meanwhile)."""
        return any(st.reconfigurer is not None and not st.reconfigurer.finished for st in self._by_m.values())

    def _megatron_schedule(self, p: int, m: int) -> Schedule:
        """Megatron's own order: 1F1B, or interleaved with model chunks."""
        setup = self.setup
        return (one_f_one_b(p, m) if setup.num_chunks == 1
                else interleaved_schedule(p, m, setup.num_chunks, setup.microbatch_group_size))

    def _uniform(self, p: int, m: int, freq: int, *, measure: bool, phase: str, profiling: bool = False,
                 measure_memory: bool = False) -> IterationPlan:
        self.baselines.ran_uniform(freq, self._at_max_clock(freq))
        sched = self._megatron_schedule(p, m)
        plan = FrequencyPlan.constant(sched, [freq] * p) if self.sets_clocks else None
        return IterationPlan(sched, plan, tuple(build_programs(sched, plan, self.config.prefetch)),
                             measure, phase, profiling, measure_memory)

    def finish(
        self,
        num_stages: int,
        num_microbatches: int,
        measurements: Sequence[IterationMeasurement] | None,
        samples: Sequence[Any] | None = None,
        memory: Sequence[StageMemory] | None = None,
    ) -> None:
        """After an iteration: every stage's measurement (identical on all stages), if measured,
        in profiling iterations every stage's energy samples, and if asked every stage's memory."""
        self.iteration += 1
        key = (num_stages, num_microbatches)
        if memory is not None:
            self.measured.add_memory(key, tuple(memory))
        if samples is not None and self.profiles.profiling:
            self.profiles.record(samples, self.config, self.cache_key, self.device.name if self.device else None)
            return
        if measurements is None:
            return
        state = self._by_m.get(key)
        merged = IterationMeasurement(tuple(m.stages[0] for m in measurements))
        if state is None:
            self.measured.add_times(key, merged)
            return
        if state.reconfigurer is not None and not state.reconfigurer.finished:
            before = state.reconfigurer.plan
            after = state.reconfigurer.observe(merged)
            rc = state.reconfigurer
            if after != before:
                log.info("EnvPipe reconfiguration step %d changed the plan (so far %d raises, %d lowerings)",
                         rc.iterations, rc.raises, rc.lowers)
            if rc.finished:
                log.info("EnvPipe reconfiguration finished after %d iterations (%d raised, %d lowered, at most "
                         "%d possible):\n%s", rc.iterations, rc.raises, rc.lowers, rc.change_bound(),
                         format_envpipe(rc.plan))

    # -- energy reports ------------------------------------------------------------------
    def _at_max_clock(self, freq_mhz: int) -> bool:
        d = self.device
        return d is not None and d.control and d.energy and bool(d.clocks_mhz) and freq_mhz == d.clocks_mhz[0]

    def _baseline_wanted(self) -> bool:
        """Whether to run one more baseline iteration (1F1B at f_max) before planning: clocks under
        control, energy measured, a plan that changes something, fewer than --envpipe-baseline-iterations."""
        d = self.device
        return (d is not None and d.control and d.energy and bool(d.clocks_mhz) and not self.config.is_stock
                and self.baselines.runs < self.config.baseline_iterations)

    def is_baseline_iteration(self, iteration: int) -> bool:
        """Whether iteration ``iteration`` (0-based, just finished) ran Megatron's order at the maximum clock
        before the plan took over, or repeated it once the plan ran: one the measured baseline is made of."""
        if self.baselines.refresh.is_repeat(iteration):
            return True
        before_plan = self.planned_at is None or iteration < self.planned_at
        last = self.baselines.last_clock_mhz
        return before_plan and last is not None and self._at_max_clock(last)

    def is_planned_iteration(self, iteration: int) -> bool:
        """Whether iteration ``iteration`` (0-based) ran under the plan (the comparison's subject)."""
        return (self.planned_at is not None and iteration >= self.planned_at and self.last_result is not None
                and not self.baselines.refresh.is_repeat(iteration))

    def _repeat_baseline(self) -> bool:
        """Whether this iteration measures the baseline again (megatron/baseline_refresh.py): clocks and energy
        under control, a measured baseline asked for, and one plan for every iteration (prepare() asks only
        without per-iteration plans for variable lengths, whose iterations differ anyway)."""
        d = self.device
        if d is None or not (d.control and d.energy and d.clocks_mhz):
            return False
        return self.baselines.refresh.due(self.iteration)

    def baseline_measured(self, energy_j: float, last_iteration: int) -> None:
        """The energy ledger measured a repeat of the baseline (mean pipeline J per iteration, up to 0-based
        ``last_iteration``): the next repeat is scheduled, or none once two agree (baseline_refresh.py)."""
        self.baselines.refresh.measured(energy_j, last_iteration)

    # -- activation budget ---------------------------------------------------------------
    def _memory_kind(self) -> str | None:
        return "model" if self.config.sim_memory is not None else self.setup.memory_source

    def _plan_within(self, profile: Profile, num_microbatches: int, pcfg: PlannerConfig) -> PlanResult:
        """Plan; under ``auto`` plan without the budget first and keep that plan when it fits, so the
        budget changes a plan only where it binds, and log the saving it gives up where it does."""
        budget = pcfg.max_inflight
        if self.config.max_inflight != AUTO or budget is None:
            return plan_envpipe(profile, num_microbatches, pcfg)
        free = plan_envpipe(profile, num_microbatches, dataclasses.replace(pcfg, max_inflight=None))
        peaks = list(free.schedule.peak_inflight())
        if within_budget(peaks, budget):
            log.info("EnvPipe activation budget does not bind: the plan's peak in-flight activations %s fit", peaks)
            return free
        bound = plan_envpipe(profile, num_microbatches, pcfg)
        log.info("EnvPipe activation budget binds: predicted energy saving %.2f%% within it (peak in-flight %s) "
                 "vs %.2f%% without (peak in-flight %s): %.2f points given up",
                 100 * bound.energy_saving, list(bound.schedule.peak_inflight()), 100 * free.energy_saving, peaks,
                 100 * (free.energy_saving - bound.energy_saving))
        return bound

    # -- planning -----------------------------------------------------------------------
    def _nominal_clock(self) -> int:
        if self.device is not None and self.device.clocks_mhz:
            return self.device.clocks_mhz[0]
        known = self.gpu.max_clock_mhz if self.gpu is not None else None
        return known if known is not None else _NOMINAL_CLOCK_MHZ

    def _profile_for(self, num_stages: int, num_microbatches: int) -> Profile:
        if self.profile is not None:  # its stage count passed check_pipeline in prepare()
            return self.profile
        return self.measured.one_clock_profile((num_stages, num_microbatches), self._nominal_clock(),
                                               self.setup.num_chunks)

    def _make_state(self, num_stages: int, num_microbatches: int) -> PlanState:
        cfg, setup = self.config, self.setup
        profile = self._profile_for(num_stages, num_microbatches)
        p2p = cfg.p2p_power_w if cfg.p2p_power_w is not None else self.profile_p2p_power_w
        if p2p is None and self.profile is None:  # timed at one clock, no energy: P2P power cannot matter
            p2p = 0.0
        # Offline we simulate the chosen policy on the profile; online it keeps correcting from measurements.
        budget = self.measured.budget(cfg, self._memory_kind(), (num_stages, num_microbatches))
        chunks = {} if setup.num_chunks == 1 else {"virtual_stages": setup.num_chunks,
                                                   "microbatch_group_size": setup.microbatch_group_size}
        # The plan is scored with the clock latency the hooks lead raises by, decided once by the device
        # session (megatron/device_session.py); none without a device (offline).
        timing = setup.session.planner_timing(cfg.clock_lead == "on") if setup.session is not None else {}
        pcfg = cfg.planner_config(self.gpu, p2p_power_w=p2p, max_inflight=budget, **chunks, **timing)
        if self.gpu is not None and not self.gpu.on_ladder(profile.common_frequencies()):
            pcfg = dataclasses.replace(pcfg, gpu=None)  # profile from another ladder: trust it
        deadline = None
        if cfg.deadline_from is not None:  # 1F1B's f_max time, predicted from this profile (planning/deadline.py)
            deadline = deadline_from_1f1b(profile, num_microbatches, pcfg)
            pcfg = deadline.config
        result = self._plan_within(profile, num_microbatches, pcfg)
        if deadline is not None:
            log.info("EnvPipe %s", deadline_summary(reword_warnings(result), deadline))
        self.made = MadePlan(result, (profile, num_microbatches, pcfg), self.iteration, deadline)
        self.baselines.refresh.plan_started(self.iteration, result.score.iteration_time_s)  # the repeats' schedule
        if not self.sets_clocks:  # baseline without control: a schedule, no clock reaches a GPU
            log.info("EnvPipe schedule %s/%s for %d stages x %d micro-batches from %s: extra warm-up %s, peak "
                     "in-flight activations %s; clocks stay as the driver sets them", cfg.plan_type, cfg.scheduling,
                     num_stages, num_microbatches, profile.source, list(result.schedule.extra_warmup),
                     list(result.schedule.peak_inflight()))
            return PlanState(result.schedule, None, None)
        log.info(
            "EnvPipe plan %s/%s/%s for %d stages x %d micro-batches from %s: extra warm-up %s, "
            "peak in-flight activations %s, %s, iteration time %+.2f%% (%s)",
            cfg.plan_type, cfg.scheduling, cfg.reconfig, num_stages, num_microbatches, profile.source,
            list(result.schedule.extra_warmup), list(result.schedule.peak_inflight()),
            result.saving_text(), 100 * result.slowdown, result.stop_reason,
        )
        log.info("EnvPipe plan (unit, SM clock MHz, predicted receive wait ms; [critical path]):\n%s",
                 format_envpipe(result.plan, result.timeline.recv_wait_ms_rows(), result.timeline.critical_units()))
        rc = None
        control = self.device is None or self.device.control
        if cfg.reconfig != ReconfigPolicy.DEFAULT and len(profile.common_frequencies()) > 1 and control:
            candidates = planner_candidates(profile, pcfg.gpu)
            step = pcfg.effective_reconfig_step_mhz
            target = None
            if result.deadline_s is not None:  # "optimal": correct only iterations slower than its deadline
                target = result.deadline_s * (self.device.time_scale if self.device is not None else 1.0)
            rc = Reconfigurer(result.plan, cfg.reconfig, ClockLadder(candidates, step),
                              finish_limit=cfg.finish_limit, threshold_scale=cfg.threshold_scale,
                              target_time_s=target, window=cfg.reconfig_window,
                              profile=planning_profile(profile, pcfg))
        return PlanState(result.schedule, result.plan, rc, planning_profile(profile, pcfg))
