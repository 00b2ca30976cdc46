"""What every planner starts from: its config, its result, and the planning basis.

:class:`PlannerConfig` names a plan (type, unit order, reconfiguration policy,
communication model, budgets); :func:`planning_basis` derives what both the
EnvPipe planner and the optimal planner need from it (sizes, candidate clocks,
the per-stage energy valley, and the 1F1B-at-f_max baseline they are scored
against); :class:`PlanResult` is what a planner returns.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from megatron_envpipe.core.clock_lead import ClockLead
from megatron_envpipe.core.gpu_specs import GpuSpec
from megatron_envpipe.core.instructions import paired_hold_dependencies
from megatron_envpipe.core.kinds import build_schedule, plan_kind, plan_type_names, scheduling_kind
from megatron_envpipe.core.memory import AUTO
from megatron_envpipe.core.plan import FrequencyPlan
from megatron_envpipe.core.profile import Profile, ProfileError
from megatron_envpipe.core.schedule import ClampedWarmup, Schedule, ScheduleError, one_f_one_b
from megatron_envpipe.core.timeline import Dependency, PlanEvaluator, PlanScore, Timeline
from megatron_envpipe.core.vocabulary import (
    RECONFIG_POLICIES,
    SCHEDULINGS,
    CommModel,
    PlanType,
    ReconfigPolicy,
    Scheduling,
    coerce_enum,
)
from megatron_envpipe.errors import UsageError
from megatron_envpipe.planning.switching import (
    check_switching,
    default_switch_cost_j,
    steady_clock_changes,
    switch_energy_j,
)

_DEFAULT_RECONFIG_STEP_MHZ = 30
_MAX_VIRTUAL_STAGES = 64  # model chunks per rank; Megatron needs at least one layer per chunk
SLOWDOWN_WARNING = 0.01  # a plan slower than baseline by more than this carries a warning


class PlannerError(UsageError, ValueError):
    """Planner input that cannot give a plan (wrong names, sizes, budgets)."""


# Beyond half a unit's time the margin would stop every clock change: a mistaken unit, not jitter.
_MAX_TIMING_MARGIN = 0.5


@dataclass(frozen=True)
class PlannerConfig:
    plan_type: PlanType = PlanType.ENVELOPE
    scheduling: Scheduling = Scheduling.OURS
    reconfig: ReconfigPolicy = ReconfigPolicy.BALANCED
    gpu: GpuSpec | None = None
    p2p_power_w: float | None = None  # None: the GPU table's value (an error where unknown; 0 W without a GPU)
    reconfig_step_mhz: int | None = None  # None: the GPU table's value (30 MHz)
    # Activation budget: one for every stage or one per stage, None = no limit. "auto" (training's
    # default: the run-time derives it from memory) means no limit to a planner on its own.
    max_inflight: int | tuple[int | None, ...] | None = None
    extra_warmup: tuple[int, ...] | None = None  # override EnvPipe's r_s (clamped anyway)
    p2p_latency_s: float = 0.0
    max_iterations: int = 100_000
    extra_dependencies: tuple[Dependency, ...] = ()
    # "per-direction" (what our executor runs: no extra dependency) or "paired"
    # (EnvPipe-KISTI / §8.5: an activation is held until a gradient arrives).
    comm: CommModel = CommModel.PER_DIRECTION
    # plan_type "optimal": deadline = (1 + max_slowdown) x 1F1B at f_max, or target_time_s
    # (energy then counted until the target: faster plans block at P2P power).
    max_slowdown: float = 0.0
    target_time_s: float | None = None
    # Fewer clock changes (planning/switching.py): merge neighbouring units' clocks while that gives up
    # less than switch_cost_j per change (0: off; None: the derived default for "optimal" plans, off for
    # EnvPipe's own plan types, which is what the CLI and training use), then enforce max_clock_changes
    # per rank per iteration (None: no budget).
    switch_cost_j: float | None = 0.0
    max_clock_changes: int | None = None
    # Model chunks per rank: > 1 only with scheduling "interleaved" (Megatron's virtual pipeline).
    virtual_stages: int = 1
    # Megatron's microbatch_group_size_per_vp_stage for the interleaved order (None: P, Megatron's default).
    microbatch_group_size: int | None = None
    # Slack kept behind every unit planned below f_max, as a fraction of its time (planned as if it
    # ran that much longer), so unit-time jitter does not delay the iteration. Predictions stay nominal.
    timing_margin: float = 0.0
    # Clock changes that take time to land (core/clock_transitions.py): > 0 scores the plan and its baseline as
    # they run when a lock reaches the SMs this many seconds after its request (clock_call_s of it on the clock
    # worker), raises led ahead of their boundary when clock_lead (--envpipe-clock-lead on). 0: at once (today).
    clock_latency_s: float = 0.0
    clock_call_s: float = 0.0
    clock_lead: bool = True

    def __post_init__(self) -> None:
        # Strings ("optimal", "ours") become the vocabulary's members, which compare equal to them.
        for name, enum in (("plan_type", PlanType), ("scheduling", Scheduling), ("reconfig", ReconfigPolicy),
                           ("comm", CommModel)):
            object.__setattr__(self, name, coerce_enum(enum, getattr(self, name)))
        if self.max_inflight == AUTO:
            object.__setattr__(self, "max_inflight", None)
        elif isinstance(self.max_inflight, list):
            object.__setattr__(self, "max_inflight", tuple(self.max_inflight))

    def validate(self) -> "PlannerConfig":
        if str(self.plan_type) not in plan_type_names():  # the registered ones (core/kinds.py)
            raise PlannerError(f"unknown plan type {self.plan_type!r}; choose one of {', '.join(plan_type_names())}")
        if self.scheduling not in SCHEDULINGS:
            raise PlannerError(f"unknown scheduling {self.scheduling!r}; choose one of {', '.join(SCHEDULINGS)}")
        self._validate_virtual_stages()
        if self.reconfig not in RECONFIG_POLICIES:
            raise PlannerError(
                f"unknown reconfiguration policy {self.reconfig!r}; choose one of {', '.join(RECONFIG_POLICIES)}"
            )
        if self.reconfig_step_mhz is not None and self.reconfig_step_mhz <= 0:
            raise PlannerError(f"reconfiguration step must be positive, got {self.reconfig_step_mhz} MHz")
        # `not 0 <= x < inf` rather than `x < 0`: nan passes every comparison and would poison every score.
        if self.p2p_power_w is not None and not 0 <= self.p2p_power_w < math.inf:
            raise PlannerError(f"P2P blocking power must be a finite number >= 0 W, got {self.p2p_power_w}")
        if not 0 <= self.p2p_latency_s < math.inf:
            raise PlannerError(f"P2P latency must be a finite number >= 0 s, got {self.p2p_latency_s}")
        if self.extra_warmup is not None and any(not r >= 0 for r in self.extra_warmup):
            raise PlannerError(f"extra warm-up values must be >= 0, got {list(self.extra_warmup)}")
        budgets = self.max_inflight if isinstance(self.max_inflight, tuple) else (self.max_inflight,)
        if any(b is not None and (isinstance(b, bool) or not isinstance(b, int) or b < 1) for b in budgets):
            raise PlannerError(f"activation budget (max-inflight) must be whole numbers >= 1 (micro-batch "
                               f"activations) or None for no limit, got {self.max_inflight!r}")
        if self.max_iterations < 1:
            raise PlannerError("max_iterations must be >= 1")
        if self.comm not in ("per-direction", "paired"):
            raise PlannerError(f"unknown communication model {self.comm!r}; choose per-direction or paired")
        if not 0 <= self.max_slowdown < math.inf:
            raise PlannerError(
                f"max_slowdown must be a finite number >= 0 (a fraction: 0.05 = 5 %), got {self.max_slowdown}"
            )
        if self.target_time_s is not None and not 0 < self.target_time_s < math.inf:
            raise PlannerError(f"target iteration time must be a finite number > 0 s, got {self.target_time_s}")
        if self.max_slowdown and self.target_time_s is not None:
            raise PlannerError("give a maximum slowdown or a target iteration time, not both: "
                               "the target alone sets the deadline")
        if not plan_kind(self.plan_type).has_deadline and (self.max_slowdown or self.target_time_s is not None):
            raise PlannerError("a maximum slowdown or target iteration time needs plan type 'optimal'")
        check_switching(self.switch_cost_j, self.max_clock_changes)
        order = scheduling_kind(self.scheduling)
        if not order.extra_warmup and not order.model_chunks and self.max_inflight is not None:
            # (model chunks refuse a budget below, with their own reason)
            # 1F1B's own order holds at most P - s activations on stage s: a budget would silently do nothing.
            raise PlannerError("--max-inflight (an activation budget) applies to --scheduling ours, whose extra "
                               "warm-up it limits; 1f1b keeps Megatron's order and memory: drop --max-inflight")
        if not 0 <= self.timing_margin <= _MAX_TIMING_MARGIN:
            raise PlannerError(f"timing margin must be a fraction between 0 and {_MAX_TIMING_MARGIN:g} of a unit's "
                               f"time (0.02 = 2 %), got {self.timing_margin}")
        ClockLead(self.clock_latency_s, self.clock_lead)  # ClockLeadError (a UsageError): what is wrong
        if not isinstance(self.clock_call_s, int | float) or not 0 <= self.clock_call_s <= self.clock_latency_s:
            raise PlannerError(f"clock call time must be between 0 and the clock latency ({self.clock_latency_s:g} s), "
                               f"got {self.clock_call_s!r}")
        return self

    @property
    def clock_lead_rule(self) -> ClockLead | None:
        """The clock-lead rule plans are scored with (None: clock changes land at once)."""
        if self.clock_latency_s == 0:
            return None
        return ClockLead(latency_s=self.clock_latency_s, enabled=self.clock_lead)

    def _validate_virtual_stages(self) -> None:
        """Interleaved needs V >= 2 chunks per rank and keeps Megatron's order; 1f1b and ours plan one chunk."""
        v = self.virtual_stages
        if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= _MAX_VIRTUAL_STAGES:
            raise PlannerError(f"virtual stages (model chunks per rank, --virtual-stages) must be a whole number "
                               f"between 1 and {_MAX_VIRTUAL_STAGES}, got {v!r}")
        if not scheduling_kind(self.scheduling).model_chunks:
            if self.microbatch_group_size is not None:
                raise PlannerError("a micro-batch group size applies to --scheduling interleaved only")
            if v != 1:
                raise PlannerError(f"--virtual-stages {v} needs --scheduling interleaved: 1f1b and ours plan one "
                                   "model chunk per rank (Megatron runs its interleaved schedule for V > 1)")
            return
        if v < 2:
            raise PlannerError("--scheduling interleaved needs --virtual-stages V >= 2 (Megatron's "
                               "--virtual-pipeline-model-parallel-size); with one model chunk per rank use 1f1b or ours")
        # EnvPipe's extra warm-up does not carry over (interleaved.md finding (b): a slope of extra forwards
        # deadlocks through the wrap-around edge, the best feasible shapes gain < 1 point).
        for flag, given in (("--extra-warmup", self.extra_warmup is not None),
                            ("--max-inflight", self.max_inflight is not None),
                            ("--comm paired", self.comm == CommModel.PAIRED)):
            if given:
                raise PlannerError(f"{flag} applies to EnvPipe's own orders (1f1b/ours); interleaved keeps "
                                   f"Megatron's order and plans only clocks: drop {flag}")

    @property
    def baseline_name(self) -> str:
        """What plans are scored against: the same order at f_max (interleaved) or 1F1B at f_max."""
        if scheduling_kind(self.scheduling).own_baseline:
            return f"interleaved V={self.virtual_stages} at f_max"
        return "1F1B at f_max"

    @property
    def effective_p2p_power_w(self) -> float:
        """The given P2P power, else the GPU table's; P2PPowerUnknownError (a UsageError) where the
        table has none, rather than planning with 0 W."""
        if self.p2p_power_w is not None:
            return self.p2p_power_w
        return self.gpu.known_p2p_power_w() if self.gpu is not None else 0.0

    @property
    def effective_switch_cost_j(self) -> float:
        """Joules a clock change costs, what plans are charged per change: the given cost, or (None) the
        derived default for 'optimal' plans (the GPU's clock latency model: settle time x P2P power) and 0
        for EnvPipe's plan types."""
        if self.switch_cost_j is not None:
            return float(self.switch_cost_j)
        if not plan_kind(self.plan_type).optimized:  # only the LP charges clock changes
            return 0.0
        if self.gpu is not None:
            return default_switch_cost_j(self.effective_p2p_power_w, self.gpu.clock_latency)
        return default_switch_cost_j(self.effective_p2p_power_w)

    @property
    def effective_reconfig_step_mhz(self) -> int:
        if self.reconfig_step_mhz is not None:
            return self.reconfig_step_mhz
        return self.gpu.reconfig_step_mhz if self.gpu is not None else _DEFAULT_RECONFIG_STEP_MHZ

    def dependencies(self, schedule: Schedule) -> tuple[Dependency, ...]:
        """Edges beyond the iteration DAG that plans of ``schedule`` are scored with."""
        deps = tuple(self.extra_dependencies)
        if self.comm == CommModel.PAIRED:
            deps += tuple(paired_hold_dependencies(schedule))
        return deps


@dataclass
class PlanResult:
    """A plan, how it was found, and how it scores against 1F1B at f_max.

    **Energy with clock changes.** ``score`` is the simulated iteration (units at their clocks, idle
    time at P2P power). What the plan is worth, :attr:`energy_j`, adds ``switch_cost_j`` (the config's
    effective switch cost: 0 unless a cost is given or the type is 'optimal') for every clock change
    it makes when iterations repeat (:func:`~megatron_envpipe.planning.switching.steady_clock_changes`).
    The baseline is charged the same way (every unit at f_max: no change). :attr:`energy_saving`
    compares the two; the LP gap, the energies at a target time, the frontier and the training log
    use the same numbers.
    """

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
    # --extra-warmup as given, as the plan runs it, and why a stage was lowered: the clamp the planner ran
    # (the CLI's note reads it rather than clamping again); None where no warm-up was given.
    warmup_clamp: ClampedWarmup | None = None

    @property
    def schedule(self) -> Schedule:
        return self.plan.schedule

    @property
    def switch_cost_j(self) -> float:
        """Joules charged per clock change (the config's effective switch cost)."""
        return self.config.effective_switch_cost_j

    @property
    def charged_clock_changes(self) -> tuple[int, ...]:
        """Per rank, the clock changes one repeating iteration makes (what is charged)."""
        return steady_clock_changes(self.plan)

    @property
    def switch_energy_j(self) -> float:
        return switch_energy_j(self.plan, self.switch_cost_j)

    @property
    def baseline_switch_energy_j(self) -> float:
        return switch_energy_j(self.baseline_plan, self.switch_cost_j)

    @property
    def energy_j(self) -> float:
        """What the plan is worth: simulated energy + its clock changes' cost (class docstring)."""
        return self.score.energy_j + self.switch_energy_j

    @property
    def baseline_energy_j(self) -> float:
        return self.baseline.energy_j + self.baseline_switch_energy_j

    @property
    def energy_saving(self) -> float:
        """Fraction of the baseline's energy saved, clock changes counted (0 when the profile has no energy data)."""
        if self.baseline.energy_j <= 0:
            return 0.0
        return 1.0 - self.energy_j / self.baseline_energy_j

    @property
    def slowdown(self) -> float:
        return self.score.iteration_time_s / self.baseline.iteration_time_s - 1.0

    def saving_text(self) -> str:
        """``predicted energy saving X% (N clock changes per iteration x C J counted)``: the saving a run is
        measured against, as the training log and ``envpipe plan`` say it."""
        text = f"predicted energy saving {100 * self.energy_saving:.2f}%"
        if self.switch_cost_j:
            text += (f" ({sum(self.charged_clock_changes)} clock changes per iteration x {self.switch_cost_j:.3g} J "
                     f"= {self.switch_energy_j:.1f} J counted)")
        return text


def _stage_valley_clocks(
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
    baseline_plan: FrequencyPlan  # 1F1B (interleaved: the same schedule), every unit at f_max
    baseline_timeline: Timeline
    baseline: PlanScore


def planning_profile(profile: Profile, config: PlannerConfig) -> Profile:
    """``profile`` with one set of costs per model chunk for ``config.virtual_stages`` chunks
    (a profile without a chunk column is split evenly: each chunk costs 1/V of its stage's unit)."""
    if config.virtual_stages == 1:
        return profile
    try:
        return profile.for_chunks(config.virtual_stages)
    except ProfileError as exc:
        raise PlannerError(str(exc)) from None


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
    if config.gpu is not None and config.gpu.max_clock_mhz is not None and f_max < config.gpu.max_clock_mhz:
        warnings.append(
            f"the profile stops at {f_max} MHz, below {config.gpu.key}'s maximum {config.gpu.max_clock_mhz} MHz: "
            f"the baseline runs at {f_max} MHz"
        )
    valley = _stage_valley_clocks(profile, candidates, p2p_power)
    if scheduling_kind(config.scheduling).own_baseline:  # the same order at f_max: interleaved shortens 1F1B's bubble itself
        try:
            baseline_schedule = build_schedule(config.scheduling, p, num_microbatches,
                                               num_chunks=config.virtual_stages,
                                               microbatch_group_size=config.microbatch_group_size)
        except ScheduleError as exc:
            raise PlannerError(f"--scheduling interleaved --virtual-stages {config.virtual_stages}: {exc}") from None
    else:
        baseline_schedule = one_f_one_b(p, num_microbatches)
    baseline_eval = PlanEvaluator(baseline_schedule, profile, p2p_power, config.p2p_latency_s)
    baseline_plan = FrequencyPlan.constant(baseline_schedule, [f_max] * p)
    baseline_timeline = baseline_eval.simulate(baseline_plan.flat())
    baseline_score = baseline_eval.score(baseline_plan.flat(), baseline_timeline)
    return PlanningBasis(p, p2p_power, candidates, f_max, valley, warnings, baseline_plan, baseline_timeline,
                         baseline_score)

