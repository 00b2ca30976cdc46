"""The largest pipelines each planner and command serves, checked before any work starts.

The flags allow up to 1,000 stages, 10,000 micro-batches and 64 virtual stages each, but
not all at once: the work grows with the pipeline's size ``P x M x V`` (stage x micro-batch x
virtual-stage slots; each holds one forward and one backward unit) and, for the planners,
faster than linearly. Beyond these limits a run takes minutes or ends in ``MemoryError``, so
it is refused up front, with the limit and the reason, as a :class:`SizeLimitError` (a
``UsageError``: CLI exit status 2).

Measured with ``python3 bench/plan_limits.py`` (fresh process per case; peak RSS includes
~25 MiB of interpreter) on this project's 2-core machine while other jobs ran on it, so
the times are up to 3x an idle machine's (``bench/plan_speed.py --scale`` gives P = 32,
M = 256 ``optimal`` in ~5 s idle)::

    case                             P x M x V     time    peak RSS
    optimal     P=8    M=256             2,048      2.3 s   128 MiB
    optimal     P=8    M=1024            8,192     19.6 s   379 MiB
    optimal     P=32   M=256             8,192     14.4 s   410 MiB   (the README's scale goal)
    optimal     P=32   M=256  V=2       16,384     23.7 s   466 MiB   (issue 24; CPU s, from a short LP's start)
    optimal     P=8    M=2048           16,384     12.6 s   325 MiB   (issue 24; CPU s, from a short LP's start)
    optimal     P=8    M=1536           12,288     58.8 s   555 MiB
    optimal     P=8    M=2048           16,384    110.5 s   814 MiB   (before issue 24's nested LP start)
    frontier    P=8    M=256 (20 pts)    2,048     14.3 s   117 MiB
    envelope    P=8    M=4096           32,768     21.8 s   142 MiB
    envelope    P=8    M=10000          80,000     44.1 s   308 MiB
    envelope    P=32   M=1000           32,000    > 150 s
    envelope    P=100  M=100            10,000    > 150 s
    envelope    P=1000 M=8               8,000     46.4 s    65 MiB
    envelope    P=100  M=20              2,000      9.6 s    31 MiB
    envelope    P=8    M=16   V=32       4,096     14.4 s    45 MiB
    baseline    P=8    M=10000          80,000     12.5 s   294 MiB
    simulate    P=100  M=1000          100,000     33.5 s   198 MiB
    schedule    P=100  M=1600          160,000     11.9 s   255 MiB   (prints 320,000 units)
    schedule    P=100  M=10000       1,000,000    > 90 s    > 800 MiB

Pure Python, stdlib only.
"""

from __future__ import annotations

from megatron_envpipe.errors import UsageError

# P x M x V of one plan by type: the LP planner's time grows ~P x M squared (12,288 already ~1 min).
_MAX_OPTIMAL_SIZE = 8_192
# ... except long steady states (M >= 8 P, V <= 2), whose LP starts from a short pipeline's
# (planning/optimal/model.py, shorter_pipeline_start): measured on a loaded 2-core machine (CPU s),
# P = 32, M = 256, V = 2 (repeated gpt3-175b) 23.7 s, 466 MiB; P = 8, M = 2048 (1F1B) 12.6 s, 325 MiB.
_MAX_OPTIMAL_LONG_SIZE = 16_384
_OPTIMAL_LONG_MICROBATCHES_PER_STAGE = 8
_OPTIMAL_LONG_MAX_VIRTUAL_STAGES = 2
# The frontier solves one LP (and a rounding) per point: P x M x V x points.
_MAX_FRONTIER_WORK = 81_920
# EnvPipe's offline reconfiguration simulates the whole iteration once per step; the steps grow
# with the critical path's turns, ~min(P, M), and per stage: P x M x V x min(P, M) and x P.
_MAX_RECONFIGURED_SIZE = 80_000
_MAX_RECONFIGURED_TURN_WORK = 640_000
_MAX_RECONFIGURED_STAGE_WORK = 8_000_000
# One simulation (baseline plans, simulate) or one printed schedule: P x M x V.
MAX_SIMULATED_SIZE = 100_000
_MAX_SCHEDULE_SIZE = 400_000


class SizeLimitError(UsageError, ValueError):
    """A pipeline too large for the planner or command asked for: refused before any work."""


def pipeline_size(num_stages: int, num_microbatches: int, virtual_stages: int = 1) -> int:
    """``P x M x V``: stage x micro-batch x model-chunk slots (each a forward and a backward unit)."""
    return num_stages * num_microbatches * virtual_stages


def _sizes(num_stages: int, num_microbatches: int, virtual_stages: int) -> str:
    return f"{num_stages} x {num_microbatches} x {virtual_stages} = {pipeline_size(num_stages, num_microbatches, virtual_stages):,}"


def check_plan_size(plan_type: str, num_stages: int, num_microbatches: int | None, virtual_stages: int = 1,
                    error: type[UsageError] = SizeLimitError) -> None:
    """Refuse a plan of ``plan_type`` too large to compute in about a minute and 2 GB (``error``: the class
    raised; the training flags raise their own). ``num_microbatches`` None: not known yet, nothing checked."""
    if num_microbatches is None:
        return
    size = pipeline_size(num_stages, num_microbatches, virtual_stages)
    what = f"stages x micro-batches x virtual stages; {_sizes(num_stages, num_microbatches, virtual_stages)}"
    if str(plan_type) == "optimal":
        long = (num_microbatches >= _OPTIMAL_LONG_MICROBATCHES_PER_STAGE * num_stages
                and virtual_stages <= _OPTIMAL_LONG_MAX_VIRTUAL_STAGES)
        if size > (_MAX_OPTIMAL_LONG_SIZE if long else _MAX_OPTIMAL_SIZE):
            raise error(f"plan type 'optimal' plans at most {_MAX_OPTIMAL_SIZE:,} slots, {_MAX_OPTIMAL_LONG_SIZE:,} "
                        f"with at least {_OPTIMAL_LONG_MICROBATCHES_PER_STAGE} micro-batches per stage and at most "
                        f"{_OPTIMAL_LONG_MAX_VIRTUAL_STAGES} virtual stages ({what} would take "
                        "minutes and GBs): use plan type 'envelope', or fewer micro-batches or stages")
        return
    reconfigured = str(plan_type) != "baseline"
    limit = _MAX_RECONFIGURED_SIZE if reconfigured else MAX_SIMULATED_SIZE
    if size > limit:
        raise error(f"plan type '{plan_type}' plans at most {limit:,} slots ({what} would take minutes): "
                    "use fewer micro-batches or stages")
    if not reconfigured:
        return
    for steps, factor, per in ((_MAX_RECONFIGURED_TURN_WORK, min(num_stages, num_microbatches), "min(stages, "
                                "micro-batches)"), (_MAX_RECONFIGURED_STAGE_WORK, num_stages, "stages")):
        if size * factor > steps:
            raise error(f"plan type '{plan_type}' reconfigures at most {steps:,} slots x {per} ({what} slots x "
                        f"{factor}: one simulation per step, more steps the longer the pipeline, would take "
                        "minutes): use fewer micro-batches or stages")


def check_frontier_size(num_stages: int, num_microbatches: int, virtual_stages: int, points: int) -> None:
    """Refuse a frontier (one optimal plan per point) too large to compute in about a minute."""
    check_plan_size("optimal", num_stages, num_microbatches, virtual_stages)
    work = pipeline_size(num_stages, num_microbatches, virtual_stages) * points
    # Points are plans: the long-steady-state allowance (one plan up to _MAX_OPTIMAL_LONG_SIZE, ~20 s) times
    # several points would take minutes, so a frontier keeps the plain per-plan limit.
    if pipeline_size(num_stages, num_microbatches, virtual_stages) > _MAX_OPTIMAL_SIZE:
        raise SizeLimitError(
            f"a frontier plans at most {_MAX_OPTIMAL_SIZE:,} slots per point ({_sizes(num_stages, num_microbatches, virtual_stages)}"
            "; one optimal plan per point would take minutes): use fewer micro-batches or stages")
    if work > _MAX_FRONTIER_WORK:
        raise SizeLimitError(
            f"a frontier plans at most {_MAX_FRONTIER_WORK:,} slots x points ({_sizes(num_stages, num_microbatches, virtual_stages)} "
            f"slots x {points} points = {work:,}: one optimal plan per point would take minutes): "
            "use fewer points, micro-batches or stages")


def check_schedule_size(num_stages: int, num_microbatches: int, virtual_stages: int = 1,
                        limit: int = _MAX_SCHEDULE_SIZE, what: str = "a schedule") -> None:
    """Refuse ``what`` (a schedule, a simulation) beyond ``limit`` slots, before any unit is built."""
    if pipeline_size(num_stages, num_microbatches, virtual_stages) > limit:
        raise SizeLimitError(
            f"{what} holds at most {limit:,} slots (stages x micro-batches x virtual stages; "
            f"{_sizes(num_stages, num_microbatches, virtual_stages)} would exhaust time and memory): "
            "use fewer micro-batches or stages")
