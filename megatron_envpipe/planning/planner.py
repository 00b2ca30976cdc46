"""The planner entry point: one call for every plan type.

``plan_envpipe(profile, M, config)`` returns a :class:`PlanResult` for
``baseline``/``uniform``/``envelope`` (EnvPipe's initial plans plus offline
reconfiguration, :mod:`megatron_envpipe.planning.envpipe`) and for
``optimal`` (minimum energy per unit under a deadline,
:mod:`megatron_envpipe.planning.optimal`).
"""

from __future__ import annotations

from megatron_envpipe.core.profile import Profile
from megatron_envpipe.core.vocabulary import PlanType
from megatron_envpipe.planning.basis import PlannerConfig, PlanResult
from megatron_envpipe.planning.envpipe import plan_reconfigured
from megatron_envpipe.planning.optimal import plan_optimal


def plan_envpipe(
    profile: Profile,
    num_microbatches: int,
    config: PlannerConfig = PlannerConfig(),
    num_stages: int | None = None,
) -> PlanResult:
    """Plan one pipeline iteration on the simulated timeline of ``profile``."""
    config.validate()
    if config.plan_type == PlanType.OPTIMAL:
        return plan_optimal(profile, num_microbatches, config, num_stages)
    return plan_reconfigured(profile, num_microbatches, config, num_stages)
