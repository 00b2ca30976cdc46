"""core.interleaved against the installed megatron-core's interleaved schedule (run under 0.16 and 0.19).

Two sources, both Megatron's own code:

* its table and warm-up helpers, ``get_schedule_table`` and
  ``get_pp_rank_microbatches``, called directly for a large grid of P, V, M
  and group sizes N (the helper reads P, the rank and V from the communicator
  it is given; a plain object carries those three numbers);
* the order itself, recorded per rank in a real multi-process gloo run of
  stock ``forward_backward_pipelining_with_interleaving`` (tiny GPT on CPU,
  testing/harness.py): each forward records Megatron's own micro-batch id
  (``current_microbatch``, which it sets on the chunk's layers) and chunk, and
  tags its output so that the backward through it records the same unit.
  Sizes Megatron refuses must fail there and in ``check_interleaved_sizes``.

The same file runs under the megatron-core 0.19 venv (CI does), so both
supported versions are checked; their helpers and training path are identical.
"""

# ruff: noqa: E402 - megatron and the harness are imported after the importorskip lines

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import pytest

torch = pytest.importorskip("torch", reason="needs torch and megatron-core: pip install -e '.[megatron]' (install.sh does)")
pytest.importorskip("megatron.core", reason="needs torch and megatron-core: pip install -e '.[megatron]' (install.sh does)")

from megatron.core.pipeline_parallel.schedules import get_pp_rank_microbatches, get_schedule_table

from megatron_envpipe.core.interleaved import (
    _interleaved_order,
    _interleaved_schedule_table,
    _interleaved_warmup_counts,
    check_interleaved_sizes,
)
from megatron_envpipe.core.schedule import ScheduleError
from megatron_envpipe.testing.harness import PipelineRun, megatron_interleaved, run_pipeline
from megatron_envpipe.testing.sync_events import EVENTS
from megatron_envpipe.testing.tiny_gpt import TinyGPTSpec

pytestmark = pytest.mark.filterwarnings("ignore:(Transformer Engine and )?Apex (is|are) not installed")


# -- Megatron's helpers ------------------------------------------------------------------------


class _Group:
    def __init__(self, size: int, rank: int) -> None:
        self._size, self._rank = size, rank

    def size(self) -> int:
        return self._size

    def rank(self) -> int:
        return self._rank


@dataclass
class _Sizes:
    """What get_pp_rank_microbatches reads from its p2p_communicator: the pipeline group and V."""

    pp_group: _Group
    virtual_pipeline_model_parallel_size: int


def megatron_sizes_ok(p: int, m: int, n: int) -> bool:
    """The two checks at the top of forward_backward_pipelining_with_interleaving, as written there."""
    return not (n > m or n < p) and not (0 < m % n < p)


def helper_grid():
    for p in range(2, 9):
        for v in (1, 2, 3, 4):
            for m in range(1, 4 * p + 2):
                for n in sorted({p, p + 1, p + 3, m, max(1, p - 1)}):
                    yield p, v, m, n


def test_table_and_warmups_equal_megatrons_helpers():
    checked = 0
    for p, v, m, n in helper_grid():
        if not megatron_sizes_ok(p, m, n):
            with pytest.raises(ScheduleError):
                check_interleaved_sizes(p, m, v, n)
            continue
        assert check_interleaved_sizes(p, m, v, n) == n
        assert list(_interleaved_schedule_table(m, v, n)) == get_schedule_table(m, v, n), (p, v, m, n)
        ours = _interleaved_warmup_counts(p, m, v, n)
        for s in range(p):
            _total, _all, warmup, _rest = get_pp_rank_microbatches(m, v, n, p2p_communicator=_Sizes(_Group(p, s), v))
            assert ours[s] == warmup, (p, v, m, n, s)
        checked += 1
    assert checked > 800


# -- Megatron's schedule, run for real ---------------------------------------------------------


class _Tag(torch.autograd.Function):
    """Identity whose backward records the unit it belongs to (a copy: Megatron frees sent outputs in place)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, mb: int, chunk: int) -> torch.Tensor:
        ctx.unit = (mb, chunk)
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        EVENTS.append(("B", *ctx.unit))
        return grad, None, None


def recording_interleaved(group_size: int | None = None, **kwargs: Any) -> list[Any]:
    """Stock Megatron interleaved schedule with a forward step that records every forward and backward in EVENTS."""
    from megatron.core.utils import get_model_config

    models = kwargs["model"]
    if group_size is not None:
        get_model_config(models[0]).microbatch_group_size_per_vp_stage = group_size
    chunk_of = {id(model): v for v, model in enumerate(models)}
    step = kwargs["forward_step_func"]
    counts = [0] * len(models)

    def forward_step(data_iterator: Any, model: Any) -> Any:
        chunk = chunk_of[id(model)]
        mb = model.decoder.layers[0].current_microbatch  # set by Megatron's forward_step just before
        assert mb == counts[chunk], "a chunk's micro-batches must be read in order"
        counts[chunk] += 1
        EVENTS.append(("F", mb, chunk))
        output, loss_func = step(data_iterator, model)
        return _Tag.apply(output, mb, chunk), loss_func

    return megatron_interleaved(**{**kwargs, "forward_step_func": forward_step})


def spec_for(p: int, v: int) -> TinyGPTSpec:
    # P = 2 as Megatron-LM allows it (overlapped P2P; 0.16 must then keep sent outputs), as in
    # tests/megatron/test_interleaved_executor.py.
    if p == 2:
        return TinyGPTSpec(layers_per_stage=v, overlap_p2p_comm=True, deallocate_pipeline_outputs=False)
    return TinyGPTSpec(layers_per_stage=v)


def recorded_order(events: tuple[tuple[Any, ...], ...]) -> list[str]:
    return [f"{e[0]}{e[1]}" + (f"v{e[2]}" if e[2] else "") for e in events if e[0] in ("F", "B")]


# (P, V): [(M, N or None for P), ...]
RUN_GRID = {
    (2, 2): [(2, None), (4, None), (6, None), (5, 3)],
    (2, 3): [(2, None), (4, None), (6, None)],
    (4, 2): [(4, None), (8, None), (12, None), (10, 6)],
    (4, 3): [(4, None), (8, None), (12, None)],
}


@pytest.mark.parametrize("p,v", sorted(RUN_GRID))
def test_order_equals_megatrons_recorded_in_a_gloo_run(p, v):
    cases = RUN_GRID[(p, v)]
    runs = [PipelineRun(m, functools.partial(recording_interleaved, group_size=n), record_sync=True) for m, n in cases]
    results = run_pipeline(p, runs, virtual_pipeline_size=v, spec=spec_for(p, v), timeout_s=300)
    for (m, n), per_rank in zip(cases, results, strict=True):
        for result in per_rank:
            assert all(ident.is_stock_megatron for ident in result.schedules), result.schedules
            got = recorded_order(result.events)
            assert len(got) == 2 * m * v
            want = [str(u) for u in _interleaved_order(result.stage, p, m, v, n)]
            assert got == want, f"P={p} V={v} M={m} N={n} rank {result.stage}"


@pytest.mark.parametrize("m,n,megatron_says", [
    (3, None, "should be 0, or larger than or equal to the pipeline-parallel size"),
    (2, 3, r"should range in \[PP=2 , M=2\]"),
])
def test_sizes_megatron_refuses_fail_in_megatron_and_here(m, n, megatron_says):
    with pytest.raises(ScheduleError):
        check_interleaved_sizes(2, m, 2, n)
    with pytest.raises(Exception, match=megatron_says):
        run_pipeline(2, [PipelineRun(m, functools.partial(recording_interleaved, group_size=n))],
                     virtual_pipeline_size=2, spec=spec_for(2, 2), timeout_s=120)
