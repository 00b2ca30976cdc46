"""What meeting a deadline means for the optimal planner, and the error for a deadline no plan meets."""

from __future__ import annotations

from megatron_envpipe.planning.basis import PlannerError

# A plan meets its deadline when its simulated makespan is at most D * (1 + FEASIBILITY_RTOL).
FEASIBILITY_RTOL = 1e-12


class InfeasibleDeadline(PlannerError):
    """A deadline no plan can meet (faster than every unit at its fastest clock)."""
