"""Megatron-core's interleaved 1F1B (virtual pipeline) order, as a :class:`~megatron_envpipe.core.units.Schedule`.

Read off ``megatron/core/pipeline_parallel/schedules.py`` of megatron-core
0.16.1 and 0.19.2, whose ``get_schedule_table``, ``get_pp_rank_microbatches``,
``get_model_chunk_id`` and the training path of
``forward_backward_pipelining_with_interleaving`` are identical
(tests/megatron/test_interleaved_order.py checks both against this module):

* P ranks, V model chunks per rank (chunk v of rank s is virtual stage v*P+s),
  M micro-batches, group size N = ``microbatch_group_size_per_vp_stage`` (default P).
* The schedule table has one entry per virtual micro-batch k = 0..M*V-1:
  micro-batches in groups of N (the last group takes the rest), within a group
  every micro-batch of chunk 0, then of chunk 1, ...
* Forward k runs ``table[k]``; backward k runs the same micro-batch on chunk
  ``V-1-table[k].chunk`` (backwards walk the chunks in reverse).
* Rank s runs ``W_s = min(M*V, 2*(P-s-1) + (V-1)*N)`` warm-up forwards, then
  pairs ``F(k+W_s) B(k)``, then the remaining backwards.
* Sizes Megatron accepts: ``P <= N <= M`` (ValueError there) and the last
  group either full or of at least P micro-batches (RuntimeError there).
  Older megatron-core releases also required M to be a multiple of P; both
  supported versions accept any M that passes these two checks.

Not modelled: ``overlap_moe_expert_parallel_comm`` (one more warm-up forward)
and forward-only evaluation (every forward first); EnvPipe plans training
iterations without MoE overlap. Pure Python, no torch.
"""

from __future__ import annotations

import numbers

from megatron_envpipe.core.sizes import check_schedule_size
from megatron_envpipe.core.units import B, F, Schedule, ScheduleError, Unit

__all__ = [
    "check_interleaved_sizes",
    "interleaved_schedule",
]

_NAME = "interleaved"


def _whole(value: object, what: str, low: int) -> int:
    whole = isinstance(value, numbers.Integral) or (isinstance(value, float) and value.is_integer())
    if isinstance(value, bool) or not whole:
        raise ScheduleError(f"{what} must be a whole number, got {value!r}")
    if int(value) < low:  # type: ignore[call-overload]
        raise ScheduleError(f"{what} must be at least {low}, got {value}")
    return int(value)  # type: ignore[call-overload]


def check_interleaved_sizes(
    num_stages: int, num_microbatches: int, num_chunks: int, microbatch_group_size: int | None = None
) -> int:
    """The group size N (default P) after checking the sizes the way Megatron-core does; ScheduleError if not.

    Megatron-core (0.16, 0.19) runs the interleaved schedule only for
    ``P <= N <= M`` and ``M mod N`` either 0 or at least P; it needs P >= 2
    (one stage runs without pipelining). V = 1 is accepted, as Megatron runs
    its interleaved function whenever a virtual size is set.
    """
    p = _whole(num_stages, "pipeline stages (P) for interleaved scheduling", 2)
    m = _whole(num_microbatches, "micro-batches (M)", 1)
    _whole(num_chunks, "model chunks per stage (virtual stages V)", 1)
    n = p if microbatch_group_size is None else _whole(microbatch_group_size, "micro-batch group size (N)", 1)
    if m < p:
        raise ScheduleError(
            f"interleaved scheduling needs at least as many micro-batches as pipeline stages: M={m} < P={p} "
            f"(Megatron-core refuses it); use M >= {p}"
        )
    if not p <= n <= m:
        raise ScheduleError(
            f"micro-batch group size N={n} (Megatron's microbatch_group_size_per_vp_stage) must lie in "
            f"[P={p}, M={m}]; leave it unset for N = P"
        )
    rest = m % n
    if 0 < rest < p:
        fix = f"a multiple of {n}" + (f" or with M mod {n} >= {p}" if n > p else "")
        raise ScheduleError(
            f"M={m} micro-batches in groups of N={n} leave a last group of {rest} < P={p}, which Megatron-core "
            f"refuses (dependency bubbles): use M {fix}"
        )
    return n


def _interleaved_schedule_table(
    num_microbatches: int, num_chunks: int, microbatch_group_size: int
) -> tuple[tuple[int, int], ...]:
    """``(micro-batch, chunk)`` of every virtual micro-batch k, as Megatron's ``get_schedule_table``."""
    m, v, n = num_microbatches, num_chunks, microbatch_group_size
    table: list[tuple[int, int]] = []
    for low in range(0, m, n):
        high = min(low + n, m)  # the last group takes what is left
        table += [(mb, chunk) for chunk in range(v) for mb in range(low, high)]
    return tuple(table)


def _interleaved_warmup_counts(
    num_stages: int, num_microbatches: int, num_chunks: int, microbatch_group_size: int | None = None
) -> tuple[int, ...]:
    """Warm-up forwards per rank, ``W_s = min(M*V, 2*(P-s-1) + (V-1)*N)`` (``get_pp_rank_microbatches``)."""
    n = check_interleaved_sizes(num_stages, num_microbatches, num_chunks, microbatch_group_size)
    total = num_microbatches * num_chunks
    return tuple(min(total, 2 * (num_stages - s - 1) + (num_chunks - 1) * n) for s in range(num_stages))


def _interleaved_order(
    stage: int, num_stages: int, num_microbatches: int, num_chunks: int, microbatch_group_size: int | None = None
) -> tuple[Unit, ...]:
    """The units rank ``stage`` runs, in Megatron's order: warm-up, steady 1F1B pairs, cool-down."""
    n = check_interleaved_sizes(num_stages, num_microbatches, num_chunks, microbatch_group_size)
    if not 0 <= stage < num_stages:
        raise ScheduleError(f"stage {stage} is outside 0..{num_stages - 1}")
    table = _interleaved_schedule_table(num_microbatches, num_chunks, n)
    warmup = _interleaved_warmup_counts(num_stages, num_microbatches, num_chunks, n)[stage]
    last = num_chunks - 1

    def forward(k: int) -> Unit:
        mb, chunk = table[k]
        return F(mb, chunk)

    def backward(k: int) -> Unit:
        mb, chunk = table[k]
        return B(mb, last - chunk)

    total = len(table)
    order = [forward(k) for k in range(warmup)]
    for k in range(total - warmup):
        order += [forward(k + warmup), backward(k)]
    order += [backward(k) for k in range(total - warmup, total)]
    return tuple(order)


def interleaved_schedule(
    num_stages: int, num_microbatches: int, num_chunks: int, microbatch_group_size: int | None = None
) -> Schedule:
    """Megatron-core's interleaved 1F1B for P ranks x V chunks, M micro-batches, group size N (default P)."""
    check_interleaved_sizes(num_stages, num_microbatches, num_chunks, microbatch_group_size)
    check_schedule_size(num_stages, num_microbatches, num_chunks)  # before a unit is built
    orders = tuple(
        _interleaved_order(s, num_stages, num_microbatches, num_chunks, microbatch_group_size)
        for s in range(num_stages)
    )
    return Schedule(
        int(num_microbatches), orders, name=_NAME, extra_warmup=(0,) * int(num_stages), num_chunks=int(num_chunks)
    )
