"""Clock plans per iteration for variable-length micro-batches (issue 25, part 3: the planning side).

With micro-batches of different sizes every iteration costs differently, and so does its stock run
(Megatron's order at the maximum clock). :class:`IterationPlanner` is built once per (profile, length
model, M, config): it checks the config, picks the candidate clocks and fixes the order (1F1B,
interleaved, or ``ours`` with the extra warm-up the optimal planner chooses for the reference size).
:meth:`IterationPlanner.plan` then plans one iteration's clocks for that order from the micro-batches'
sizes: the deadline is the stock order at f_max *for those sizes* times ``1 + max_slowdown`` (zero
slowdown by default, as ``--max-slowdown``), and the plan is ``--type optimal``'s LP and rounding
(:class:`~megatron_envpipe.planning.optimal.model.TimeEnergyModel`) on the unit costs the length model
gives per micro-batch (:class:`~megatron_envpipe.core.timeline.PlanEvaluator` with ``microbatch_sizes``).

Why the optimal planner: its work per iteration is one LP over a fixed graph plus a rounding (the graph
is shared, :meth:`~megatron_envpipe.core.timeline.PipelineGraph.shared`), it meets the deadline exactly
by construction, and it is the one whose cost is bounded by a count of unit visits rather than by
EnvPipe's whole-iteration reconfiguration steps. At P = 8, M = 32 on the shipped profiles it plans an
iteration in well under 5 % of the simulated iteration (``bench/variable_lengths.py`` measures it).
Clock changes are charged at the config's effective switch cost (as :class:`PlanResult` does); the
switching pass is not run per iteration.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

from megatron_envpipe.core.kinds import plan_kind
from megatron_envpipe.core.length_costs import LengthCostError, LengthCostModel, MicrobatchSize
from megatron_envpipe.core.plan import FrequencyPlan
from megatron_envpipe.core.profile import Profile
from megatron_envpipe.core.schedule import Schedule
from megatron_envpipe.core.timeline import PlanEvaluator, PlanScore
from megatron_envpipe.core.vocabulary import INSTRUCTIONS
from megatron_envpipe.planning.basis import PlannerConfig, PlannerError
from megatron_envpipe.planning.optimal.deadline import InfeasibleDeadline
from megatron_envpipe.planning.optimal.entry import optimal_setup, plan_optimal
from megatron_envpipe.planning.optimal.model import TimeEnergyModel
from megatron_envpipe.planning.optimal.options import clock_options
from megatron_envpipe.planning.switching import switch_energy_j


@dataclass(frozen=True)
class IterationPlan:
    """One iteration's plan for its micro-batches' sizes, and what it and the stock run cost.

    Energies include the clock changes the plan makes when iterations repeat, at the config's effective
    switch cost (the stock run, at one clock, makes none). ``fallback``: why the plan is the fixed order with
    every unit at f_max (empty when it is a real plan): that order cannot meet the deadline for these sizes.
    """

    plan: FrequencyPlan
    sizes: tuple[MicrobatchSize, ...]
    iteration_time_s: float
    energy_j: float
    baseline_time_s: float  # the stock order at f_max, for the same sizes
    baseline_energy_j: float
    deadline_s: float
    planner_seconds: float
    fallback: str = ""

    @property
    def energy_saving(self) -> float:
        """Fraction of the stock run's energy this plan saves."""
        return 1.0 - self.energy_j / self.baseline_energy_j if self.baseline_energy_j > 0 else 0.0

    @property
    def slowdown(self) -> float:
        return self.iteration_time_s / self.baseline_time_s - 1.0


class IterationPlanner:
    """Plans each iteration's clocks from its micro-batches' sizes, for one fixed order (module docstring)."""

    def __init__(self, profile: Profile, length_model: LengthCostModel, num_microbatches: int,
                 config: PlannerConfig, schedule: Schedule | None = None) -> None:
        """``schedule``: the order to plan (e.g. the run-time's start-up plan's, so that programs differ only
        in their clocks); None: the one the optimal planner chooses at the reference size."""
        config.validate()
        if not plan_kind(config.plan_type).per_iteration_plans:
            raise PlannerError(f"per-iteration plans use --type optimal's clock planner, got --type "
                               f"{config.plan_type}: use --type optimal with variable-length micro-batches")
        unsupported = [name for name, off in (("a target iteration time", config.target_time_s is None),
                                              ("a timing margin", config.timing_margin == 0),
                                              ("a clock latency", config.clock_latency_s == 0)) if not off]
        if unsupported:
            raise PlannerError(f"per-iteration plans do not support {', '.join(unsupported)} yet: the deadline "
                               "is the stock order at f_max for each iteration's sizes (--max-slowdown)")
        if not isinstance(length_model, LengthCostModel):
            raise LengthCostError(f"per-iteration plans need a LengthCostModel, got {type(length_model).__name__}")
        self.profile = profile
        self.length_model = length_model
        self.num_microbatches = num_microbatches
        self.config = config
        setup = optimal_setup(profile, num_microbatches, config)
        self.p2p_power_w = setup.p2p_power_w
        self.candidates_mhz = setup.candidates_mhz
        self.f_max_mhz = setup.f_max_mhz
        self.baseline_schedule: Schedule = setup.baseline_plan.schedule
        self.switch_cost_j = config.effective_switch_cost_j
        self.schedule: Schedule = schedule if schedule is not None else setup.schedules[0][1]
        if schedule is None and len(setup.schedules) > 1:  # ours: the extra warm-up the planner chooses at the reference size
            chosen = plan_optimal(profile, num_microbatches, config).details["extra_warmup_chosen"]
            self.schedule = dict(setup.schedules)[chosen]
        self.dependencies = config.dependencies(self.schedule)
        self._stock_profile = profile.restricted([self.f_max_mhz])  # the stock run's one clock: scaled alone
        self._planning_profile = _worth_scaling(profile.for_chunks(self.schedule.num_chunks), length_model,
                                                self.candidates_mhz, self.p2p_power_w)

    def _check_sizes(self, sizes: Sequence[MicrobatchSize]) -> tuple[MicrobatchSize, ...]:
        sizes = tuple(sizes)
        if len(sizes) != self.num_microbatches:
            raise LengthCostError(f"{len(sizes)} micro-batch sizes for an iteration of {self.num_microbatches} "
                                  "micro-batches: give one size per micro-batch")
        return sizes

    def score(self, plan: FrequencyPlan, sizes: Sequence[MicrobatchSize]) -> PlanScore:
        """What ``plan`` (any order) costs on micro-batches of ``sizes`` (simulated, without clock changes)."""
        sizes = self._check_sizes(sizes)
        deps = () if plan.schedule is self.baseline_schedule else self.dependencies
        profile = self._stock_profile if set(plan.flat()) == {self.f_max_mhz} else self.profile
        evaluator = PlanEvaluator(plan.schedule, profile, self.p2p_power_w, self.config.p2p_latency_s, deps,
                                  microbatch_sizes=sizes, length_model=self.length_model)
        return evaluator.score(plan.flat())

    def energy_j(self, plan: FrequencyPlan, score: PlanScore) -> float:
        """``score``'s energy plus the plan's clock changes at the switch cost (what IterationPlan reports)."""
        return score.energy_j + switch_energy_j(plan, self.switch_cost_j)

    def stock(self, sizes: Sequence[MicrobatchSize]) -> tuple[FrequencyPlan, PlanScore]:
        """The stock run for ``sizes``: Megatron's order, every unit at f_max."""
        plan = FrequencyPlan.constant(self.baseline_schedule, [self.f_max_mhz] * self.baseline_schedule.num_stages)
        return plan, self.score(plan, sizes)

    def plan(self, sizes: Sequence[MicrobatchSize]) -> IterationPlan:
        """The minimum-energy clocks of the fixed order for micro-batches of ``sizes`` (one per micro-batch)."""
        t0 = time.perf_counter()
        sizes = self._check_sizes(sizes)
        stock_plan, stock = self.stock(sizes)
        deadline = stock.iteration_time_s * (1.0 + self.config.max_slowdown)
        model = TimeEnergyModel(self.schedule, self._planning_profile, self.candidates_mhz, self.p2p_power_w,
                                self.config.p2p_latency_s, self.dependencies,
                                microbatch_sizes=sizes, length_model=self.length_model)
        fallback = ""
        try:
            sol = model.solve(deadline)
            plan, score = FrequencyPlan.from_flat(self.schedule, sol.freqs_mhz), sol.score
        except InfeasibleDeadline as exc:
            # The fixed order cannot keep up with these sizes: it runs at f_max. Never the stock order: a
            # plan of another order would change the programs, which are proved for the fixed order only.
            plan = FrequencyPlan.constant(self.schedule, [self.f_max_mhz] * self.schedule.num_stages)
            score, fallback = self.score(plan, sizes), f"the fixed order at f_max: {exc}"
        return IterationPlan(
            plan=plan, sizes=sizes, iteration_time_s=score.iteration_time_s, energy_j=self.energy_j(plan, score),
            baseline_time_s=stock.iteration_time_s, baseline_energy_j=self.energy_j(stock_plan, stock),
            deadline_s=deadline, planner_seconds=time.perf_counter() - t0, fallback=fallback,
        )


def _worth_scaling(profile: Profile, model: LengthCostModel, candidates_mhz: Sequence[int], p2p_power_w: float
                   ) -> Profile:
    """``profile`` keeping, per unit type the model scales alike at every clock, only its clock options at the
    reference size (the same options at any size: time, energy and so effective energy all scale by one
    factor, which keeps their order), so each iteration scales a third of the rows; other unit types keep
    every row. Planning time is mostly scaling rows and sorting options: this is the saving."""
    kept = {}
    for stage in range(profile.num_stages):
        for chunk in range(profile.num_chunks):
            for ins in INSTRUCTIONS:
                points = profile.points(stage, ins, chunk)
                if model.scales_alike(stage, chunk, ins, [p.freq_mhz for p in points]):
                    worth = {o.freq_mhz for o in clock_options(points, p2p_power_w, candidates_mhz)}
                    points = tuple(p for p in points if p.freq_mhz in worth)
                kept[(stage, ins, chunk)] = points
    return Profile(kept, source=profile.source)
