"""Minimum-energy per-unit clock plans for an iteration-time deadline (``--type optimal``).

The problem: choose one profiled SM clock per unit of a schedule so that the
simulated iteration takes at most a deadline ``D`` and the iteration energy
(Perseus's formula, :func:`~megatron_envpipe.core.timeline.score_timeline`) is
minimal. With the makespan ``T`` and ``P`` stages,

    E = sum_units E(f) + P_p2p * sum_stages (T - busy_s)
      = sum_units [E(f) - P_p2p * t(f)] + P_p2p * P * T,

so each unit costs its *effective* energy ``E(f) - P_p2p t(f)`` (slowing a unit
trades blocking time for busy time) plus one term in ``T``.

Method (deterministic):

1. **Options.** Per (stage, instruction), the clocks that are Pareto-optimal in
   (time, effective energy), fastest first, ending at the cheapest one: a
   slower *and* costlier clock is never worth choosing.
2. **Time–cost LP** over the iteration DAG (the same edges as
   :class:`~megatron_envpipe.core.timeline.PipelineGraph`, latencies and extra
   dependencies included): each unit's cost is replaced by the lower convex
   hull of its options, written incrementally (``d_v = t_fast + sum_j x_vj``,
   ``0 <= x_vj <= segment length``, cost slope per segment) so the only rows
   are precedence constraints; ``end_v <= T <= D``. Solved with HiGHS
   (``highspy``, warm-started across deadlines; or ``scipy.optimize.linprog``).
   Its optimum is a lower bound on every plan's energy. Costs are read per
   (stage, model chunk, instruction) through the evaluator's ``cost_keys``.
   At scale (the LP is most of the time from P = 16 on): the matrix is built
   in one go in numpy (:func:`.rows.schedule_csc`); ``ours``'s extra warm-up
   candidates start from the best one's optimal basis so far and stop as soon
   as their bound cannot win (HiGHS's objective bound: a candidate cut off
   could not have been the plan); a long steady state with no slack (1F1B at
   zero slowdown, M >= 6 max(P, warm-up), >= 3000 units) starts from the
   optimum of a 3x shorter pipeline with its middle micro-batch repeated,
   which the exact solve then only has to confirm or correct, starting from
   the short optimum's basis mapped onto the long LP (no crossover; interleaved
   too, in groups of P micro-batches)
   (:meth:`.model.TimeEnergyModel.shorter_pipeline_start`); HiGHS prices
   with Devex (faster than steepest edge on these LPs).
3. **Rounding** to real clocks: a forward pass in topological order gives each
   unit the slowest option that still lets it finish by its latest finish time
   computed from target durations (so the plan is feasible by construction),
   and the mirror-image backward pass. Targets: the LP durations, and the LP
   durations *dithered* onto hull vertices (error diffusion along each stage,
   so identical units between two far-apart clocks alternate between them in
   the LP's proportion); options: the hull's vertices only, or every option.
   Each rounding is *settled* by alternating forward/backward passes that slow
   units down wherever slack remains; the cheapest of six is kept.
4. **Local search** (bounded by a count of unit visits, not by a clock, so
   results do not depend on the machine): speed one unit up by 1-3 clock steps
   and settle again; exchange time between neighbours (speed one up, slow a
   neighbour down; slow one down, buy its time from up to three neighbours),
   each move checked by simulation; keep what lowers the energy.
5. **Repair** (a safety net against LP tolerances): while the simulated
   iteration overshoots the deadline, raise the clock of the unit on the
   critical path with the cheapest marginal energy per second saved.

On the shipped A40 profiles (8 stages, M = 12..96) a plan takes 0.1-0.4 s and
lands within 0.01-1 % of the LP bound (1F1B's gap is mostly the bound's: the
discrete clocks cannot fill the steady state's slack exactly); on small
instances it is within 0.5 % of the exact MILP optimum (:mod:`.milp`, tests).

Pure Python apart from the LP (``numpy`` + ``highspy`` or ``scipy``, imported
only in :mod:`.lp` and :mod:`.model`, only when an optimal plan is asked for).

Modules: :mod:`.options` (step 1), :mod:`.lp` and :mod:`.rows` (the LP's
backends (also the MILP's solver) and constraint rows; the MILP oracle builds its own),
:mod:`.model` (the problem and step 2), :mod:`.search` (steps 3-5; :mod:`.moves`: the exchange moves it checks),
:mod:`.entry` (candidate schedules and :func:`plan_optimal`),
:mod:`.deadline` (what meeting a deadline means).
"""

from megatron_envpipe.planning.optimal.deadline import FEASIBILITY_RTOL, InfeasibleDeadline
from megatron_envpipe.planning.optimal.entry import (
    OptimalSetup,
    RankedSchedule,
    extra_warmup_candidates,
    optimal_setup,
    plan_optimal,
    rank_schedules,
)
from megatron_envpipe.planning.optimal.lp import LpBackend, SolverUnavailable, lp_backend
from megatron_envpipe.planning.optimal.model import Solution, TimeEnergyModel
from megatron_envpipe.planning.optimal.options import ClockOption, clock_options, lower_hull
from megatron_envpipe.planning.optimal.rows import ConstraintRows
from megatron_envpipe.planning.optimal.search import (
    DEFAULT_SEARCH_WORK,
    MAX_FAILED_CHECKS,
    MAX_SEARCH_ROUNDS,
    MIN_SEARCH_TRIALS,
    ClockSearch,
)

__all__ = [
    "DEFAULT_SEARCH_WORK",
    "FEASIBILITY_RTOL",
    "MAX_FAILED_CHECKS",
    "MAX_SEARCH_ROUNDS",
    "MIN_SEARCH_TRIALS",
    "ClockOption",
    "ClockSearch",
    "ConstraintRows",
    "InfeasibleDeadline",
    "LpBackend",
    "OptimalSetup",
    "RankedSchedule",
    "Solution",
    "SolverUnavailable",
    "TimeEnergyModel",
    "clock_options",
    "extra_warmup_candidates",
    "lower_hull",
    "lp_backend",
    "optimal_setup",
    "plan_optimal",
    "rank_schedules",
]
