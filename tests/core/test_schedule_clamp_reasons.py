"""core/schedule.clamp_extra_warmup_explained: the clamp says why it lowered each stage (the CLI's note prints
these reasons instead of working them out again), and clamps exactly as clamp_extra_warmup."""

from __future__ import annotations

import random

from megatron_envpipe.core.schedule import clamp_extra_warmup, clamp_extra_warmup_explained


def test_each_limit_is_named_where_it_binds():
    clamp = clamp_extra_warmup_explained(4, 8, [9, 1, 3, 2], max_inflight=[6, None, None, None])
    assert clamp.clamped == (2, 1, 1, 0)
    budget, kept, order, last = clamp.reasons
    assert budget == "activation budget 6 (--max-inflight) less 1F1B's own 4 leaves 2"
    assert kept is None
    assert order.startswith("no more than the stage before (1)")
    assert last == "the last stage has no extra warm-up"
    left = clamp_extra_warmup_explained(4, 5, [3, 0, 0, 0]).reasons[0]
    assert left == "only M - (P - s) = 5 - 4 = 1 forwards are left after 1F1B's own warm-up"


def test_same_clamp_and_a_reason_exactly_for_each_lowered_stage():
    rng = random.Random(7)
    for _ in range(300):
        p, m = rng.randint(1, 8), rng.randint(1, 16)
        raw = [rng.randint(0, 12) for _ in range(p)]
        budget = rng.choice([None, [rng.randint(min(m, p - s), 20) for s in range(p)]])
        clamp = clamp_extra_warmup_explained(p, m, raw, budget)
        assert clamp.clamped == clamp_extra_warmup(p, m, raw, budget)
        assert [w is not None for w in clamp.reasons] == [c != r for c, r in zip(clamp.clamped, raw)]
