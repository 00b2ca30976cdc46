"""Per-stage forward/backward unit orders: Megatron's 1F1B, EnvPipe's "ours", and by name Megatron's interleaved.

A schedule is data, in the style of ``torch.distributed.pipelining``: one list
of units per stage, which prints (``S0: F0 F1 B0 ...``), parses back, and
validates (:mod:`~megatron_envpipe.core.units`; its types are re-exported
here). Megatron's interleaved order (model chunks) is built in
:mod:`~megatron_envpipe.core.interleaved`. Pure Python, no torch.

EnvPipe's "ours" keeps every forward in its 1F1B slot but runs ``r_s`` extra
warm-up forwards on stage ``s`` before its first backward, so the slack that
1F1B leaves before ``B(s, 0)`` sits right after forwards that can then run at a
lower clock (reference notes, envpipe.md §2).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from dataclasses import dataclass

from megatron_envpipe.core.interleaved import interleaved_schedule
from megatron_envpipe.core.sizes import check_schedule_size
from megatron_envpipe.core.units import (
    BACKWARD,
    FORWARD,
    B,
    F,
    Schedule,
    ScheduleError,
    Unit,
    UnitDag,
    execution_order,
    message_source,
    unit_dag,
    unit_index,
)

# The schedule data types live in core.units (core.interleaved builds on them); they are re-exported here.
__all__ = [
    "BACKWARD",
    "FORWARD",
    "B",
    "F",
    "Schedule",
    "ScheduleError",
    "Unit",
    "UnitDag",
    "check_extra_warmup",
    "ClampedWarmup",
    "clamp_extra_warmup",
    "clamp_extra_warmup_explained",
    "envpipe_schedule",
    "execution_order",
    "interleaved_schedule",
    "message_source",
    "one_f_one_b",
    "raw_extra_warmup",
    "unit_dag",
    "unit_index",
]


def _stage_order(num_microbatches: int, warmup: int) -> tuple[Unit, ...]:
    """Megatron's non-interleaved loop for one stage with ``warmup`` warm-up forwards.

    warm-up: F0..F(w-1); steady: F(w+i) B(i) for i < M-w; cool-down: the remaining B.
    """
    m = num_microbatches
    w = max(0, min(warmup, m))
    order = [F(i) for i in range(w)]
    for i in range(m - w):
        order += [F(w + i), B(i)]
    order += [B(i) for i in range(m - w, m)]
    return tuple(order)


def one_f_one_b(num_stages: int, num_microbatches: int) -> Schedule:
    """Megatron-core's non-interleaved 1F1B: stage s warms up with min(P-s-1, M) forwards."""
    _check_sizes(num_stages, num_microbatches)
    orders = tuple(
        _stage_order(num_microbatches, num_stages - s - 1) for s in range(num_stages)
    )
    return Schedule(num_microbatches, orders, name="1f1b", extra_warmup=(0,) * num_stages)


def envpipe_schedule(num_stages: int, num_microbatches: int, extra_warmup: Sequence[int]) -> Schedule:
    """EnvPipe's "ours": stage s warms up with min(M, P-s-1+r_s) forwards.

    ``extra_warmup`` must already be clamped (see :func:`clamp_extra_warmup`).
    """
    _check_sizes(num_stages, num_microbatches)
    r = check_extra_warmup(num_stages, extra_warmup)
    problem = _extra_warmup_problem(num_stages, num_microbatches, r)
    if problem:
        raise ScheduleError(problem)
    orders = tuple(
        _stage_order(num_microbatches, num_stages - s - 1 + r[s]) for s in range(num_stages)
    )
    return Schedule(num_microbatches, orders, name="ours", extra_warmup=r)


def _check_sizes(num_stages: int, num_microbatches: int) -> None:
    if num_stages < 1:
        raise ScheduleError(f"need at least 1 pipeline stage, got {num_stages}")
    if num_microbatches < 1:
        raise ScheduleError(f"need at least 1 micro-batch, got {num_microbatches}")
    check_schedule_size(num_stages, num_microbatches)  # before a unit is built: MemoryError otherwise


def check_extra_warmup(num_stages: int, extra_warmup: Sequence[int]) -> tuple[int, ...]:
    """``extra_warmup`` as ints, after checking it has one whole number >= 0 per stage.

    Clamping fixes values a schedule cannot run; a wrong count or a negative
    value is a mistake in the input, so it is reported (ScheduleError) instead.
    """
    try:
        values = list(extra_warmup)
    except TypeError:
        raise ScheduleError(f"extra warm-up must be a list of whole numbers, got {extra_warmup!r}") from None
    if len(values) != num_stages:
        raise ScheduleError(
            f"extra warm-up has {len(values)} value(s) {values} for {num_stages} stages: give {num_stages} "
            "whole numbers >= 0, one per stage (the last stage's is always 0)"
        )
    out = []
    for s, value in enumerate(values):
        # bool is an int subclass; an integral float (from JSON, say) is fine, 2.5 or nan is not.
        whole = isinstance(value, numbers.Integral) or (isinstance(value, float) and value.is_integer())
        if isinstance(value, bool) or not whole:
            raise ScheduleError(f"extra warm-up of stage {s} is {value!r}, not a whole number")
        if value < 0:
            raise ScheduleError(f"extra warm-up of stage {s} is negative ({value}): give values >= 0")
        out.append(int(value))
    return tuple(out)


def _extra_warmup_problem(num_stages: int, num_microbatches: int, r: Sequence[int]) -> str | None:
    for s, value in enumerate(r):
        if value < 0:
            return f"extra warm-up of stage {s} is negative ({value})"
        if value > max(0, num_microbatches - (num_stages - s)):
            return (
                f"extra warm-up of stage {s} is {value}, above M-(P-s) = "
                f"{max(0, num_microbatches - (num_stages - s))}"
            )
    if r and r[-1] != 0:
        return f"the last stage cannot run extra warm-up forwards (got {r[-1]})"
    for s in range(len(r) - 1):
        if r[s + 1] > r[s]:
            return (
                f"extra warm-up must be non-increasing over stages: stage {s + 1} has {r[s + 1]} "
                f"> stage {s}'s {r[s]}"
            )
    return None


def raw_extra_warmup(
    num_stages: int,
    backward_time_fmax_s: Sequence[float],
    forward_time_fopt_s: Sequence[float],
) -> list[int]:
    """EnvPipe's unclamped ``r_s = floor((P-s-1) * T_B(f_max) / T_F(f_opt))``.

    The bubble before stage s's first backward is (P-s-1) downstream backwards
    long; r_s forwards at the slow clock fit into it. Last stage: 0.
    """
    r = []
    for s in range(num_stages):
        tf = forward_time_fopt_s[s]
        if tf <= 0:
            raise ScheduleError(f"stage {s}: forward time must be positive to size the warm-up")
        # Tiny epsilon so that an exact ratio (e.g. 3.0 computed as 2.9999999) floors right.
        r.append(int(math.floor((num_stages - s - 1) * backward_time_fmax_s[s] / tf + 1e-9)))
    if r:
        r[-1] = 0
    return r


@dataclass(frozen=True)
class ClampedWarmup:
    """:func:`clamp_extra_warmup_explained`'s result: the r_s a schedule runs, and why each lowered stage was."""

    raw: tuple[int, ...]
    clamped: tuple[int, ...]
    reasons: tuple[str | None, ...]  # per stage: None (kept as given) or why it was lowered

    @property
    def lowered(self) -> bool:
        return self.raw != self.clamped


def clamp_extra_warmup(
    num_stages: int,
    num_microbatches: int,
    raw: Sequence[int],
    max_inflight: Sequence[int | None] | int | None = None,
) -> tuple[int, ...]:
    """Clamp EnvPipe's r_s: memory budget, ``M-(P-s)``, then non-increasing over stages
    (:func:`clamp_extra_warmup_explained` also says why each stage was lowered).

    ``max_inflight`` is the activation-memory budget per stage, counted in
    in-flight micro-batch activations (1F1B needs ``P-s``); ``None`` = unbounded.

    Saturated-stage exception (envpipe.md §2.2): EnvPipe lets a stage that
    already runs all its forwards first be followed by a stage with a *larger*
    r. With the KISTI communication order this can deadlock (§8.3), so we do
    not allow it: r is strictly non-increasing. The cost is nil in practice —
    the next stage only loses extra forwards that its own bubble rarely fits.

    ``raw`` needs one value >= 0 per stage (:func:`check_extra_warmup`): only
    values a schedule cannot run are clamped, input mistakes raise ScheduleError.
    """
    return clamp_extra_warmup_explained(num_stages, num_microbatches, raw, max_inflight).clamped


def clamp_extra_warmup_explained(
    num_stages: int,
    num_microbatches: int,
    raw: Sequence[int],
    max_inflight: Sequence[int | None] | int | None = None,
) -> ClampedWarmup:
    """:func:`clamp_extra_warmup`, with the reason of every stage it lowered, in its order of limits: the
    activation budget, the ``M - (P - s)`` forwards left after 1F1B's own ``P - s`` warm-up, 0 on the last
    stage, never more than the stage before."""
    raw = check_extra_warmup(num_stages, raw)
    if isinstance(max_inflight, int) or max_inflight is None:
        budgets: list[int | None] = [max_inflight] * num_stages
    else:
        budgets = list(max_inflight)
        if len(budgets) != num_stages:
            raise ScheduleError(
                f"activation budget (max-inflight) {','.join(str(b).lower() for b in budgets)} has {len(budgets)} "
                f"entries but the pipeline has {num_stages} stages: give one per stage, first stage first"
            )
    r: list[int] = []
    why: list[str | None] = []
    for s in range(num_stages):
        value = raw[s]
        budget = budgets[s]
        base = min(num_microbatches, num_stages - s)  # what 1F1B already holds
        left = max(0, num_microbatches - (num_stages - s))
        cap = left
        if budget is not None:
            if budget < base:
                raise ScheduleError(
                    f"stage {s}: activation budget (max-inflight) {budget} is below the {base} in-flight "
                    f"activations that 1F1B itself needs there: give at least {base} for stage {s}"
                )
            cap = min(cap, budget - base)
        reason = None
        if cap < value:  # the budget's words only where it, not M - (P - s), is the tighter limit
            reason = (f"activation budget {budget} (--max-inflight) less 1F1B's own {base} leaves {budget - base}"
                      if budget is not None and budget - base < left else
                      f"only M - (P - s) = {num_microbatches} - {num_stages - s} = {left} forwards are left after "
                      "1F1B's own warm-up")
        r.append(min(value, cap))
        why.append(reason)
    if r and r[-1]:
        r[-1], why[-1] = 0, "the last stage has no extra warm-up"
    elif r and raw[-1]:
        why[-1] = "the last stage has no extra warm-up"
    for s in range(1, num_stages):
        if r[s] > r[s - 1]:
            r[s] = r[s - 1]
            why[s] = (f"no more than the stage before ({r[s - 1]}): r never grows down the pipeline, "
                      "which could deadlock")
    reasons = tuple(w if r[s] != raw[s] else None for s, w in enumerate(why))
    return ClampedWarmup(tuple(raw), tuple(r), reasons)

