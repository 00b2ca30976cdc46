"""EnvPipe's planner: initial plan types, reconfiguration policies, termination.

Plan types (envpipe.md §3): ``baseline`` (every unit at f_max), ``uniform``
(each stage at its energy-valley clock), ``envelope`` (the outer envelope at
f_max, everything else at the valley clock). Reconfiguration policies (§4):
``default`` (none), ``greedy`` (raise the first non-max unit from the end of
the critical path by 3 steps), ``balanced`` (raise every critical unit at the
path's minimum clock by one step), repeated until the critical path *is* the
outer envelope.

Unlike Perseus's re-implementation, which loops forever when the last stage
is not the heaviest, the loop always terminates: offline the simulation is
deterministic, so an iteration with nothing left to raise is final and we stop
and say why; online (measured, noisy) the :class:`Reconfigurer` stops after
``finish_limit`` iterations without progress, as EnvPipe does.
"""

from __future__ import annotations

import bisect
import time
from dataclasses import dataclass, field
from typing import Sequence

from .gpu_specs import GpuSpec
from .plan import FrequencyPlan
from .profile import Profile
from .schedule import (
    Schedule,
    ScheduleError,
    Unit,
    build_schedule,
    clamp_extra_warmup,
    one_f_one_b,
    raw_extra_warmup,
)
from .timeline import Dependency, PlanEvaluator, PlanScore, Timeline, outer_envelope

PLAN_TYPES = ("baseline", "uniform", "envelope", "optimal")  # optimal: see optimal.py
RECONFIG_POLICIES = ("default", "greedy", "balanced")
GREEDY_STEP_FACTOR = 3  # EnvPipe: greedy raises 3 steps so it moves as fast as balanced
DEFAULT_RECONFIG_STEP_MHZ = 30
DEFAULT_FINISH_LIMIT = 10
SLOWDOWN_WARNING = 0.01


class PlannerError(ValueError):
    """Planner input that cannot give a plan (wrong names, sizes, budgets)."""


@dataclass(frozen=True)
class PlannerConfig:
    plan_type: str = "envelope"
    scheduling: str = "ours"
    reconfig: str = "balanced"
    gpu: GpuSpec | None = None
    p2p_power_w: float | None = None  # None: the GPU table's value (0 if unknown)
    reconfig_step_mhz: int | None = None  # None: the GPU table's value (30 MHz)
    max_inflight: int | tuple[int | None, ...] | None = None  # activation budget per stage
    extra_warmup: tuple[int, ...] | None = None  # override EnvPipe's r_s (clamped anyway)
    p2p_latency_s: float = 0.0
    max_iterations: int = 100_000
    extra_dependencies: tuple[Dependency, ...] = ()
    # "per-direction" (what our executor runs: no extra dependency) or "paired"
    # (EnvPipe-KISTI / §8.5: an activation is held until a gradient arrives).
    comm: str = "per-direction"
    # plan_type "optimal": deadline = (1 + max_slowdown) x 1F1B at f_max, or target_time_s
    # (energy then counted until the target: faster plans block at P2P power).
    max_slowdown: float = 0.0
    target_time_s: float | None = None

    def validate(self) -> "PlannerConfig":
        if self.plan_type not in PLAN_TYPES:
            raise PlannerError(f"unknown plan type {self.plan_type!r}; choose one of {', '.join(PLAN_TYPES)}")
        if self.scheduling not in ("1f1b", "ours"):
            raise PlannerError(f"unknown scheduling {self.scheduling!r}; choose 1f1b or ours")
        if self.reconfig not in RECONFIG_POLICIES:
            raise PlannerError(
                f"unknown reconfiguration policy {self.reconfig!r}; choose one of {', '.join(RECONFIG_POLICIES)}"
            )
        if self.reconfig_step_mhz is not None and self.reconfig_step_mhz <= 0:
            raise PlannerError(f"reconfiguration step must be positive, got {self.reconfig_step_mhz} MHz")
        if self.p2p_power_w is not None and self.p2p_power_w < 0:
            raise PlannerError(f"P2P blocking power must be >= 0 W, got {self.p2p_power_w}")
        if self.max_iterations < 1:
            raise PlannerError("max_iterations must be >= 1")
        if self.comm not in ("per-direction", "paired"):
            raise PlannerError(f"unknown communication model {self.comm!r}; choose per-direction or paired")
        if not self.max_slowdown >= 0:
            raise PlannerError(f"max_slowdown must be >= 0 (a fraction: 0.05 = 5 %), got {self.max_slowdown}")
        if self.target_time_s is not None and not self.target_time_s > 0:
            raise PlannerError(f"target iteration time must be > 0 s, got {self.target_time_s}")
        if self.plan_type != "optimal" and (self.max_slowdown or self.target_time_s is not None):
            raise PlannerError("a maximum slowdown or target iteration time needs plan type 'optimal'")
        return self

    @property
    def effective_p2p_power_w(self) -> float:
        if self.p2p_power_w is not None:
            return self.p2p_power_w
        return self.gpu.p2p_power_w if self.gpu is not None else 0.0

    @property
    def effective_reconfig_step_mhz(self) -> int:
        if self.reconfig_step_mhz is not None:
            return self.reconfig_step_mhz
        return self.gpu.reconfig_step_mhz if self.gpu is not None else DEFAULT_RECONFIG_STEP_MHZ

    def dependencies(self, schedule: Schedule) -> tuple[Dependency, ...]:
        """Edges beyond the iteration DAG that plans of ``schedule`` are scored with."""
        deps = tuple(self.extra_dependencies)
        if self.comm == "paired":
            from .instructions import paired_hold_dependencies

            deps += tuple(paired_hold_dependencies(schedule))
        return deps


@dataclass
class PlanResult:
    """A plan, how it was found, and how it scores against 1F1B at f_max."""

    config: PlannerConfig
    plan: FrequencyPlan
    score: PlanScore
    timeline: Timeline
    baseline_plan: FrequencyPlan
    baseline: PlanScore
    baseline_timeline: Timeline
    f_max_mhz: int
    valley_mhz: tuple[int, ...]
    candidates_mhz: tuple[int, ...]
    iterations: int
    converged: bool
    stop_reason: str
    planner_seconds: float
    warnings: list[str] = field(default_factory=list)
    deadline_s: float | None = None  # plan type "optimal": the iteration time it had to meet
    lower_bound_j: float | None = None  # "optimal": no plan meeting the deadline uses less
    details: dict = field(default_factory=dict)

    @property
    def schedule(self) -> Schedule:
        return self.plan.schedule

    @property
    def energy_saving(self) -> float:
        """Fraction of the baseline's energy saved (0 when the profile has no energy data)."""
        if self.baseline.energy_j <= 0:
            return 0.0
        return 1.0 - self.score.energy_j / self.baseline.energy_j

    @property
    def slowdown(self) -> float:
        return self.score.iteration_time_s / self.baseline.iteration_time_s - 1.0


@dataclass(frozen=True)
class UnitTiming:
    """One unit as measured by the executor (seconds from the iteration's start)."""

    unit: Unit
    start_s: float
    end_s: float
    recv_wait_s: float  # time blocked waiting for this unit's input message


@dataclass(frozen=True)
class IterationMeasurement:
    """Per stage, its units in execution order, as one training iteration ran them."""

    stages: tuple[tuple[UnitTiming, ...], ...]

    def recv_wait_s(self) -> list[list[float]]:
        return [[t.recv_wait_s for t in stage] for stage in self.stages]

    def iteration_time_s(self) -> float:
        return max((t.end_s for stage in self.stages for t in stage), default=0.0)


class ClockLadder:
    """The candidate clocks and how a reconfiguration step moves along them."""

    def __init__(self, candidates_mhz: Sequence[int], step_mhz: int) -> None:
        if not candidates_mhz:
            raise PlannerError("no candidate clocks")
        self.ascending = sorted(set(int(f) for f in candidates_mhz))
        self.f_max = self.ascending[-1]
        self.step_mhz = step_mhz

    def raised(self, freq_mhz: int, steps: int = 1) -> int:
        """The lowest candidate at least ``steps*step`` above ``freq``, capped at f_max."""
        target = freq_mhz + steps * self.step_mhz
        if target >= self.f_max:
            return self.f_max
        i = bisect.bisect_left(self.ascending, target)
        return self.ascending[i]


class Reconfigurer:
    """One EnvPipe reconfiguration step per iteration, from a critical path.

    Used offline by :func:`plan_envpipe` (exact simulated path) and online by
    the executor (path walked from measured receive waits, as EnvPipe does).
    """

    def __init__(
        self,
        plan: FrequencyPlan,
        policy: str,
        ladder: ClockLadder,
        finish_limit: int = DEFAULT_FINISH_LIMIT,
        threshold_scale: float = 4.0,
        target_time_s: float | None = None,
        time_tolerance: float = 0.01,
    ) -> None:
        if policy not in RECONFIG_POLICIES:
            raise PlannerError(f"unknown reconfiguration policy {policy!r}")
        self.schedule = plan.schedule
        self.freqs = [list(row) for row in plan.freqs_mhz]
        self.policy = policy
        self.ladder = ladder
        self.envelope = outer_envelope(plan.schedule)
        # Position of each unit in its stage's order (the schedule never changes).
        self._index = [{u: i for i, u in enumerate(order)} for order in plan.schedule.orders]
        self.finish_limit = finish_limit
        self.threshold_scale = threshold_scale
        self.threshold_s: float | None = None
        # Plans with a deadline (type "optimal"): correct only iterations measured slower than
        # target_time_s * (1 + time_tolerance), whatever the path; the envelope rule does not apply.
        self.target_time_s = target_time_s
        self.time_tolerance = time_tolerance
        self.finish_count = 0
        self.iterations = 0
        # "default" never reconfigures: EnvPipe starts it finished.
        self.finished = policy == "default"

    @property
    def plan(self) -> FrequencyPlan:
        return FrequencyPlan(self.schedule, tuple(tuple(r) for r in self.freqs))

    def freqs_flat(self) -> list[int]:
        return [f for row in self.freqs for f in row]

    def on_envelope(self, path: Sequence[tuple[int, Unit]]) -> bool:
        return all(node in self.envelope for node in path)

    def apply(self, path: Sequence[tuple[int, Unit]]) -> bool:
        """Raise clocks on ``path`` (ordered from the end of the iteration backwards).

        Returns whether any clock changed. A path already on the envelope
        changes nothing (unless the reconfigurer has a target time: then an
        empty path, i.e. an iteration on time, is what changes nothing).
        """
        if self.policy == "default" or not path or (self.target_time_s is None and self.on_envelope(path)):
            return False
        index = self._index
        f_max = self.ladder.f_max
        if self.policy == "greedy":
            for s, u in path:
                i = index[s][u]
                if self.freqs[s][i] < f_max:
                    self.freqs[s][i] = self.ladder.raised(self.freqs[s][i], GREEDY_STEP_FACTOR)
                    return True
            return False
        # balanced
        f_min = min(self.freqs[s][index[s][u]] for s, u in path)
        if f_min >= f_max:
            return False
        new = self.ladder.raised(f_min)
        for s, u in path:
            i = index[s][u]
            if self.freqs[s][i] == f_min:
                self.freqs[s][i] = new
        return True

    def step(self, path: Sequence[tuple[int, Unit]]) -> FrequencyPlan:
        """Online use: one iteration's critical path in, the next iteration's plan out.

        After ``finish_limit`` iterations in a row without progress (or with the
        path on the envelope) the reconfigurer is finished and keeps its plan.
        """
        if self.finished:
            return self.plan
        self.iterations += 1
        if self.apply(path):
            self.finish_count = 0
        else:
            self.finish_count += 1
            if self.finish_count > self.finish_limit:
                self.finished = True
        return self.plan

    def observe(self, measurement: IterationMeasurement) -> FrequencyPlan:
        """Online use: the executor's measurement of one iteration in, the next plan out."""
        for s, (stage, order) in enumerate(zip(measurement.stages, self.schedule.orders)):
            if tuple(t.unit for t in stage) != order:
                raise PlannerError(
                    f"stage {s}: measured units {' '.join(str(t.unit) for t in stage[:6])} ... do not "
                    f"follow the planned order {' '.join(str(u) for u in order[:6])} ..."
                )
        path = self.measured_critical_path(measurement.recv_wait_s())
        if self.target_time_s is not None and (
            measurement.iteration_time_s() <= self.target_time_s * (1 + self.time_tolerance)
        ):
            path = []  # on time: nothing to correct
        return self.step(path)

    def measured_critical_path(self, recv_wait_s: Sequence[Sequence[float]]) -> list[tuple[int, Unit]]:
        """EnvPipe's walk (envpipe.md §3.1) over measured receive waits.

        From stage 0's last unit: if the unit waited for its input at least the
        threshold, jump to the stage that produced it, else step to the previous
        unit of the same stage. Threshold = scale x the smallest non-zero wait
        on the last stage, fixed at the first call (EnvPipe's convention).
        """
        sched = self.schedule
        last = sched.num_stages - 1
        if self.threshold_s is None:
            nonzero = [w for w in recv_wait_s[last] if w > 0]
            self.threshold_s = self.threshold_scale * (min(nonzero) if nonzero else 0.0)
        threshold = self.threshold_s
        index = self._index
        s, i = 0, len(sched.orders[0]) - 1
        path = []
        for _ in range(sum(len(o) for o in sched.orders) + 1):
            unit = sched.orders[s][i]
            path.append((s, unit))
            if s == 0 and i == 0:
                break
            waited = recv_wait_s[s][i] >= threshold and recv_wait_s[s][i] > 0
            has_cross = (unit.is_forward and s > 0) or (not unit.is_forward and s < last)
            if (waited or i == 0) and has_cross:
                s = s - 1 if unit.is_forward else s + 1
                i = index[s][unit]
            elif i > 0:
                i -= 1
            else:
                break
        return path


def stage_valley_clocks(
    profile: Profile, candidates_mhz: Sequence[int], p2p_power_w: float
) -> tuple[int, ...]:
    """Per stage, the clock minimising one micro-batch's F+B energy at fixed iteration time.

    Slowing a unit by dt lengthens busy time by dt and shortens idle time by
    the same dt, so the relevant cost is ``E(f) - P_p2p * t(f)`` — which is what
    EnvPipe's whole-iteration measurement minimises too. Ties: the faster clock.
    """
    valley = []
    for s in range(profile.num_stages):
        best = min(
            candidates_mhz,
            key=lambda f: (
                sum(
                    profile.energy_j(s, ins, f) - p2p_power_w * profile.time_s(s, ins, f)
                    for ins in ("forward", "backward")
                ),
                -f,
            ),
        )
        valley.append(best)
    return tuple(valley)


def planner_candidates(profile: Profile, gpu: GpuSpec | None) -> tuple[int, ...]:
    """Clocks profiled for every stage and instruction, within the GPU's range."""
    common = profile.common_frequencies()
    if not common:
        raise PlannerError(f"{profile.source}: no clock is profiled for every stage and instruction")
    return gpu.candidate_clocks(common) if gpu is not None else common


@dataclass
class PlanningBasis:
    """What every plan type of one (profile, M, config) starts from: clocks and the baseline."""

    num_stages: int
    p2p_power_w: float
    candidates_mhz: tuple[int, ...]
    f_max_mhz: int
    valley_mhz: tuple[int, ...]
    warnings: list[str]
    baseline_plan: FrequencyPlan  # 1F1B, every unit at f_max
    baseline_timeline: Timeline
    baseline: PlanScore


def planning_basis(
    profile: Profile, num_microbatches: int, config: PlannerConfig, num_stages: int | None = None
) -> PlanningBasis:
    """Check the sizes, pick the candidate clocks and score the baseline (``config`` already validated)."""
    p = profile.num_stages if num_stages is None else num_stages
    if p != profile.num_stages:
        raise PlannerError(f"--stages {p} does not match the profile's {profile.num_stages} stages ({profile.source})")
    if num_microbatches < 1:
        raise PlannerError(f"need at least one micro-batch, got {num_microbatches}")
    p2p_power = config.effective_p2p_power_w
    candidates = tuple(planner_candidates(profile, config.gpu))
    if not candidates:
        raise PlannerError(f"{profile.source}: no candidate clocks: no profiled clock lies in {config.gpu.key}'s range")
    f_max = max(candidates)
    warnings: list[str] = []
    if config.gpu is not None and f_max < config.gpu.max_clock_mhz:
        warnings.append(
            f"the profile stops at {f_max} MHz, below {config.gpu.key}'s maximum {config.gpu.max_clock_mhz} MHz: "
            f"the baseline runs at {f_max} MHz"
        )
    valley = stage_valley_clocks(profile, candidates, p2p_power)
    baseline_schedule = one_f_one_b(p, num_microbatches)
    baseline_eval = PlanEvaluator(baseline_schedule, profile, p2p_power, config.p2p_latency_s)
    baseline_plan = FrequencyPlan.constant(baseline_schedule, [f_max] * p)
    baseline_timeline = baseline_eval.simulate(baseline_plan.flat())
    baseline_score = baseline_eval.score(baseline_plan.flat(), baseline_timeline)
    return PlanningBasis(p, p2p_power, candidates, f_max, valley, warnings, baseline_plan, baseline_timeline,
                         baseline_score)


def plan_envpipe(
    profile: Profile,
    num_microbatches: int,
    config: PlannerConfig = PlannerConfig(),
    num_stages: int | None = None,
) -> PlanResult:
    """Plan one iteration EnvPipe's way on the simulated timeline (``optimal``: see optimal.py)."""
    t0 = time.perf_counter()
    config.validate()
    if config.plan_type == "optimal":
        from .optimal import plan_optimal

        return plan_optimal(profile, num_microbatches, config, num_stages)
    basis = planning_basis(profile, num_microbatches, config, num_stages)
    p, p2p_power, candidates = basis.num_stages, basis.p2p_power_w, basis.candidates_mhz
    f_max, valley, warnings = basis.f_max_mhz, basis.valley_mhz, basis.warnings
    ladder = ClockLadder(candidates, config.effective_reconfig_step_mhz)
    inner = valley if config.plan_type != "baseline" else (f_max,) * p

    if config.scheduling == "ours":
        raw = (
            list(config.extra_warmup)
            if config.extra_warmup is not None
            else raw_extra_warmup(
                p,
                [profile.time_s(s, "backward", f_max) for s in range(p)],
                [profile.time_s(s, "forward", inner[s]) for s in range(p)],
            )
        )
        try:
            r = clamp_extra_warmup(p, num_microbatches, raw, config.max_inflight)
        except ScheduleError as exc:
            raise PlannerError(str(exc)) from None
        schedule = build_schedule("ours", p, num_microbatches, r)
    else:
        schedule = one_f_one_b(p, num_microbatches)

    evaluator = PlanEvaluator(schedule, profile, p2p_power, config.p2p_latency_s, config.dependencies(schedule))
    plan = initial_plan(schedule, config.plan_type, f_max, inner)
    reconf = Reconfigurer(plan, config.reconfig, ladder)
    iterations, converged, reason = 0, False, ""
    timeline = evaluator.simulate(plan.flat())
    if config.reconfig == "default":
        converged = reconf.on_envelope(timeline.critical_units())
        reason = "no reconfiguration (policy 'default')"
    else:
        while True:
            path = timeline.critical_units()
            if reconf.on_envelope(path):
                converged, reason = True, "critical path is the outer envelope"
                break
            if iterations >= config.max_iterations:
                reason = f"stopped after max_iterations={config.max_iterations}"
                break
            if not reconf.apply(path):
                if all(f == f_max for f in reconf.freqs_flat()):
                    converged, reason = True, "nothing to reconfigure: every unit runs at f_max"
                    break
                off = [f"S{s} {u}" for s, u in path if (s, u) not in reconf.envelope]
                reason = (
                    "stalled: the critical path leaves the outer envelope (at "
                    + ", ".join(off[:3])
                    + (" ..." if len(off) > 3 else "")
                    + ") but every unit on it already runs at f_max; the last stage is not the "
                    "heaviest, so EnvPipe's stopping rule cannot be met"
                )
                break
            iterations += 1
            timeline = evaluator.simulate(reconf.freqs_flat())
        plan = reconf.plan
    score = evaluator.score(plan.flat(), timeline)
    result = PlanResult(
        config=config,
        plan=plan,
        score=score,
        timeline=timeline,
        baseline_plan=basis.baseline_plan,
        baseline=basis.baseline,
        baseline_timeline=basis.baseline_timeline,
        f_max_mhz=f_max,
        valley_mhz=valley,
        candidates_mhz=tuple(sorted(candidates, reverse=True)),
        iterations=iterations,
        converged=converged,
        stop_reason=reason,
        planner_seconds=0.0,
        warnings=warnings,
    )
    if result.slowdown > SLOWDOWN_WARNING:
        warnings.append(
            f"this plan is {100 * result.slowdown:.2f}% slower than the baseline (1F1B at {f_max} MHz); "
            + (
                "reconfiguration stalled before reaching the envelope"
                if not converged and config.reconfig != "default"
                else "try --reconfig balanced or --type optimal"
                if config.reconfig == "default"
                else "the envelope itself is slower than the baseline"
            )
        )
    result.planner_seconds = time.perf_counter() - t0
    return result


def initial_plan(schedule: Schedule, plan_type: str, f_max: int, inner_mhz: Sequence[int]) -> FrequencyPlan:
    """The plan before any reconfiguration (envpipe.md §3)."""
    if plan_type == "baseline":
        return FrequencyPlan.constant(schedule, [f_max] * schedule.num_stages)
    if plan_type == "uniform":
        return FrequencyPlan.constant(schedule, inner_mhz)
    if plan_type == "envelope":
        env = outer_envelope(schedule)
        return FrequencyPlan(
            schedule,
            tuple(
                tuple(f_max if (s, u) in env else int(inner_mhz[s]) for u in order)
                for s, order in enumerate(schedule.orders)
            ),
        )
    raise PlannerError(f"unknown plan type {plan_type!r}")
