"""The clock search at scale (issue 24): incremental re-timing gives the answers of whole passes.

Every shortcut here must be exact: each test compares the fast path with the
plain computation it replaces (whole passes, whole simulations, the plain
settle) on random plans, bit for bit.
"""

from __future__ import annotations

import random
from bisect import bisect_right

import pytest

from megatron_envpipe.core.gpu_specs import get_gpu_spec
from megatron_envpipe.core.graph import earliest_times, latest_times
from megatron_envpipe.core.kinds import build_schedule
from megatron_envpipe.core.schedule import one_f_one_b
from megatron_envpipe.core.timeline import Dependency
from megatron_envpipe.planning.optimal.deadline import FEASIBILITY_RTOL
from megatron_envpipe.planning.optimal.model import TimeEnergyModel
from megatron_envpipe.planning.optimal.retiming import Retimer
from megatron_envpipe.planning.optimal.search import MAX_FAILED_CHECKS, ClockSearch
from megatron_envpipe.testing.graph_choosing import earliest_times_choosing, latest_times_choosing
from megatron_envpipe.testing.synthetic import deepened, repeated

A40 = get_gpu_spec("a40")


def _extra_dependency(schedule) -> Dependency:
    """A gradient held until a later forward on the next stage: a unit with three inputs."""
    s0, s1 = schedule.orders[0], schedule.orders[1]
    src, dst = s0[len(s0) // 2], s1[len(s1) // 2 + 1]
    return Dependency(0, src, 1, dst, 0.0)


# Each walk the re-timer has: zero-latency pairs (the first two), flat steps with a P2P latency, the general loop
# (a unit with three inputs); test_the_fixtures_cover_every_walk holds them to it.
@pytest.fixture(scope="module", params=["1f1b-deep-gpt3", "ours-rep-bloom", "1f1b-latency", "1f1b-extra-dep"])
def model(request, gpt3_profile, bloom_profile):
    latency_s = 0.0
    if request.param == "1f1b-deep-gpt3":
        sched, prof, deps = one_f_one_b(12, 36), deepened(gpt3_profile, 12), ()
    elif request.param == "ours-rep-bloom":
        prof = repeated(bloom_profile, 2)
        sched, deps = build_schedule("ours", 16, 40, [3] * 4 + [2] * 4 + [1] * 4 + [0] * 4), ()
    elif request.param == "1f1b-latency":
        sched, prof, deps, latency_s = one_f_one_b(8, 24), gpt3_profile, (), 2e-3
    else:
        sched, prof = one_f_one_b(8, 24), gpt3_profile
        deps = (_extra_dependency(sched),)
    return TimeEnergyModel(sched, prof, prof.common_frequencies(), A40.p2p_power_w, latency_s, deps)


def test_the_fixtures_cover_every_walk(model, request):
    """The comparisons below see the walk each fixture is meant for (else a walk would go untested)."""
    preds, succs = model.graph.preds, ClockSearch(model).succs
    # per fixture, forward and backward: "pairs", "steps" or "loop" (the general one)
    expected = {"1f1b-deep-gpt3": ("pairs", "pairs"), "ours-rep-bloom": ("pairs", "pairs"),
                "1f1b-latency": ("steps", "steps"), "1f1b-extra-dep": ("loop", "pairs")}  # 3 inputs, 2 outputs
    walks = tuple("loop" if e.steps() is None else "steps" if e.pairs() is None else "pairs" for e in (preds, succs))
    assert walks == expected[request.node.callspec.params["model"]]


def _random_plan(model, rng) -> list[int]:
    return [rng.randrange(len(t)) for t in model.times]


def _changed(model, idx, rng, count) -> tuple[list[int], list[int]]:
    out = list(idx)
    diff = rng.sample(range(model.n), count)
    for v in diff:
        out[v] = rng.randrange(len(model.times[v]))
    return out, [v for v in diff if out[v] != idx[v]]


def test_full_passes_equal_the_reference_walks(model):
    """The flat-step passes (and the general loop, where a unit has three inputs) choose as core.graph's walks."""
    search, rng = ClockSearch(model), random.Random(1)
    order, preds, succs = model.graph.order, model.graph.preds, search.succs
    for trial in range(4):
        idx = _random_plan(model, rng)
        d = model.durations(idx)
        deadline = model.makespan(idx) * (1.0 + 0.02 * trial)
        eps = FEASIBILITY_RTOL * deadline
        for hull_only in (False, True):
            opts = search.hull_times if hull_only else model.times

            def pick(v, room, chosen, opts=opts, hull_only=hull_only, eps=eps):
                k = max(0, bisect_right(opts[v], room + eps) - 1)
                chosen[v] = model.hulls[v][k] if hull_only else k
                return opts[v][k]

            lf = latest_times(order, succs, d, deadline)[1]
            fwd: dict[int, int] = {}
            earliest_times_choosing(order, preds, lambda v, t, fwd=fwd, lf=lf: pick(v, lf[v] - t, fwd))
            assert search.forward_pass(idx, d, deadline, hull_only) == [fwd[v] for v in range(model.n)]
            es = earliest_times(order, preds, d)[0]
            bwd: dict[int, int] = {}
            latest_times_choosing(order, succs, deadline, lambda v, f, bwd=bwd, es=es: pick(v, f - es[v], bwd))
            assert search.backward_pass(idx, d, deadline, hull_only) == [bwd[v] for v in range(model.n)]


@pytest.mark.parametrize("forward", [True, False])
def test_incremental_passes_equal_full_passes(model, forward):
    search, rng = ClockSearch(model), random.Random(2 + forward)
    retimer: Retimer = search.retimer
    base = _random_plan(model, rng)
    deadline = model.makespan(base) * 1.01
    ref = retimer.full_pass(forward, base, deadline)
    narrow = 0
    for count in [1, 1, 2, 3, 1, 2] * 5 + [model.n // 4]:  # the last one is wide: the full pass answers
        inp, diff = _changed(model, base, rng, count)
        before = retimer.visits
        got, moved = retimer.next_slack_pass(ref, inp, diff)
        full = retimer.full_pass(forward, inp, deadline)
        assert got == full  # every list, bit for bit
        assert sorted(moved) == [v for v in range(model.n) if full.out[v] != ref.out[v]]
        narrow += 0 < retimer.visits - before <= model.n // 16
    assert narrow >= 5  # small changes were re-timed on a few units, not the whole graph


@pytest.mark.parametrize("forward", [True, False])
def test_resumed_passes_equal_full_passes(model, forward):
    """A wide change's pass, resumed where the walks first meet a change (zero-latency graphs; else None: the full
    pass), is the full pass bit for bit; next_slack_pass answers with it when the heap gives up."""
    search, rng = ClockSearch(model), random.Random(6 + forward)
    retimer: Retimer = search.retimer
    base = _random_plan(model, rng)
    deadline = model.makespan(base) * 1.01
    ref = retimer.full_pass(forward, base, deadline)
    resumed = model.graph.preds.pairs() is not None and search.succs.pairs() is not None
    for count in [1, 2, 3, 5, model.n // 8, model.n // 2]:
        inp, diff = _changed(model, base, rng, count)
        got = retimer.resumed_pass(ref, inp, diff)
        full = retimer.full_pass(forward, inp, deadline)
        assert (got is not None) == (resumed and bool(diff))
        if got is not None:
            assert got == full  # every list, bit for bit
            ref = got  # the next change starts from a resumed pass
            base = inp
    # next_slack_pass giving up at once (every change too wide for the heap): the same passes.
    retimer.wide_part = 10**9
    for count in [1, 2, 4]:
        inp, diff = _changed(model, base, rng, count)
        assert retimer.next_slack_pass(ref, inp, diff)[0] == retimer.full_pass(forward, inp, deadline)


def test_retime_gives_the_simulations_verdict_and_ends(model):
    search, rng = ClockSearch(model), random.Random(4)
    retimer: Retimer = search.retimer
    for trial in range(40):
        idx = _random_plan(model, rng)
        d = model.durations(idx)
        end = model.graph.simulate(d).end_s
        # Mostly within the limit; every fourth plan is already late (the whole simulation decides).
        limit = max(end) * (0.999 if trial % 4 == 0 else 1.0 + 0.003 * (trial % 3))
        new, _ = _changed(model, idx, rng, 1 + trial % 3)
        changed = {v: model.times[v][new[v]] for v in range(model.n) if new[v] != idx[v]}
        got = retimer.retime(d, end, changed, limit)
        sim = model.graph.simulate(model.durations(new))
        if sim.iteration_time_s > limit:
            assert got is None
        else:
            assert got is not None
            ends = list(end)
            for v, e in got.items():
                ends[v] = e
            assert ends == sim.end_s


class _PlainSearch(ClockSearch):
    """The search as it was: every trial settled with whole passes, every move checked by a whole simulation."""

    def _settle_near(self, chain, idx, diff):
        idx = self.settle(idx, chain.deadline, first="f", max_passes=self.LOCAL_PASSES)
        return idx, self.model.cost(idx)

    def _apply_moves(self, cur, cands, limit, max_checks, d, end):
        cands.sort()
        touched: set[int] = set()
        checks = accepted = failures = 0
        for _gain, w, j, used in cands:
            if checks >= max_checks or failures >= MAX_FAILED_CHECKS:
                break
            if w in touched or any(u in touched for u, _ in used):
                continue
            trial = list(cur)
            trial[w] = j
            for u, k in used:
                trial[u] -= k
            checks += 1
            if self.graph.simulate(self.model.durations(trial)).iteration_time_s <= limit:
                cur = trial
                touched.add(w)
                touched.update(u for u, _ in used)
                accepted += 1
                failures = 0
            else:
                failures += 1
        return cur, checks, accepted, accepted > 0


@pytest.mark.parametrize("wide_part", [16, 1])
def test_searches_return_the_plans_of_whole_passes(model, wide_part):
    """Local, pair and exchange searches: the same plans, trials and moves as with whole passes
    (``wide_part`` 1: never falling back to a whole pass, however far a change reaches)."""
    rng = random.Random(5)
    fast, plain = ClockSearch(model), _PlainSearch(model)
    fast.retimer.wide_part = wide_part
    accepted = 0
    for slack in (1.0, 1.03):
        target = model.durations(_random_plan(model, rng))
        deadline = model.graph.simulate(target).iteration_time_s * slack
        start = fast.settle(fast.forward_pass([0] * model.n, target, deadline), deadline, first="b")
        got = fast.local_search(start, deadline, 60)
        assert got == plain.local_search(start, deadline, 60)
        accepted += got[2]
        for name in ("pair_search", "exchange_search"):
            moved = getattr(fast, name)(got[0], deadline, 200)
            assert moved == getattr(plain, name)(got[0], deadline, 200)
            accepted += moved[2]
    assert accepted > 0  # the comparison saw moves taken, not only rejected ones


def test_a_search_whose_listing_outweighs_its_checks_is_not_run(model):
    """Listing candidates visits ~6 x window units per unit: with fewer checks than that, no search (counts only)."""
    search = ClockSearch(model)
    target = model.durations([len(t) // 2 for t in model.times])
    deadline = model.graph.simulate(target).iteration_time_s
    start = search.forward_pass([0] * model.n, target, deadline)
    for name, window in (("pair_search", 4), ("exchange_search", 3)):
        assert getattr(search, name)(start, deadline, 6 * window - 1) == (start, 0, 0)
        ran = getattr(search, name)(start, deadline, 6 * window)
        assert ran[1] > 0  # enough checks: candidates listed and checked
