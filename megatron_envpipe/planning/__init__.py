"""Layer 2, pure planners (numpy/HiGHS are imported only when an LP is solved).

``planner.plan_envpipe`` is the entry point for every plan type: EnvPipe's
initial plans and offline reconfiguration (``envpipe``), the optimal per-unit
clock plan (``optimal/``), their shared basis (``basis``), the online
``Reconfigurer`` (``reconfig``), the time-energy frontier and the
Perseus-compatible EnvPipe re-implementation (noisy offline runs of a plan and the
exact MILP reference are test support: ``testing.noisy_run``, ``testing.milp``).
"""
