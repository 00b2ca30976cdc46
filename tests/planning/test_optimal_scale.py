"""Planning at scale (issue 13): synthetic deep pipelines and the LP answered once per deadline."""

from __future__ import annotations

import pytest

from megatron_envpipe.core.gpu_specs import get_gpu_spec
from megatron_envpipe.core.kinds import build_schedule
from megatron_envpipe.core.profile import ProfileError
from megatron_envpipe.core.schedule import one_f_one_b
from megatron_envpipe.core.vocabulary import INSTRUCTIONS
from megatron_envpipe.planning.basis import PlannerConfig
from megatron_envpipe.planning.optimal.entry import optimal_setup, rank_schedules
from megatron_envpipe.planning.optimal.model import TimeEnergyModel
from megatron_envpipe.planning.optimal.rows import ConstraintRows
from megatron_envpipe.planning.optimal.search import SEARCH_SKIP_GAP
from megatron_envpipe.testing.synthetic import deepened

A40 = get_gpu_spec("a40")


def test_deepened_keeps_ends_and_cycles_the_middle(gpt3_profile):
    src = gpt3_profile.num_stages
    deep = deepened(gpt3_profile, 2 * src + 3)
    assert deep.num_stages == 2 * src + 3
    expected = [0] + [1 + (i - 1) % (src - 2) for i in range(1, deep.num_stages - 1)] + [src - 1]
    for new, old in enumerate(expected):
        for ins in INSTRUCTIONS:
            assert deep.points(new, ins) == gpt3_profile.points(old, ins)
    # The source is untouched and the 2-stage case keeps first and last.
    assert gpt3_profile.num_stages == src
    two = deepened(gpt3_profile, 2)
    assert two.points(1, "forward") == gpt3_profile.points(src - 1, "forward")


@pytest.mark.parametrize("bad", [1, 0, -3, 5000, 2.0, True, "16"])
def test_deepened_rejects_bad_stage_counts(gpt3_profile, bad):
    with pytest.raises(ProfileError, match="num_stages"):
        deepened(gpt3_profile, bad)


def test_lp_answer_is_reused_only_for_the_same_question(gpt3_profile):
    pytest.importorskip("highspy")
    model = TimeEnergyModel(one_f_one_b(8, 12), gpt3_profile, gpt3_profile.common_frequencies(), A40.p2p_power_w)
    deadline = model.fastest_time_s() * 1.05
    first = model.solve_lp(deadline, 0.0)
    calls = []
    solve = model._lp.solve

    def counting_solve():
        calls.append(1)
        return solve()

    model._lp.solve = counting_solve
    again = model.solve_lp(deadline, 0.0)
    assert again == first and not calls  # same deadline and weight: no second solve
    again[0][0] = -1.0  # the caller's list is its own copy
    assert model.solve_lp(deadline, 0.0) == first
    tighter = model.solve_lp(model.fastest_time_s(), 0.0)
    assert len(calls) == 1 and tighter[1] <= model.fastest_time_s() * (1 + 1e-9)
    assert tighter[2] >= first[2]  # less time never costs less energy


@pytest.mark.parametrize("scheduling", ["1f1b", "ours"])
def test_one_go_lp_rows_equal_the_row_by_row_build(scheduling, gpt3_profile):
    np = pytest.importorskip("numpy")
    pytest.importorskip("highspy")
    sched = build_schedule(scheduling, 8, 12, [3, 2, 2, 1, 1, 0, 0, 0] if scheduling == "ours" else None)
    model = TimeEnergyModel(sched, gpt3_profile, gpt3_profile.common_frequencies(), A40.p2p_power_w, 0.002)
    model.solve_lp(model.fastest_time_s() * 1.01, 0.0)
    lp = model._lp.h.getLp()
    rows = ConstraintRows()
    first, count, t0 = model.seg_first.tolist(), model.seg_count.tolist(), model.t0.tolist()
    rows.add_schedule(model.preds, model.t_col, lambda v: ([(first[v] + j, 1.0) for j in range(count[v])], t0[v]))
    start, index, value = rows.csc(np, lp.num_col_)
    assert np.array_equal(lp.a_matrix_.start_, start) and np.array_equal(lp.a_matrix_.index_, index)
    assert np.array_equal(lp.a_matrix_.value_, value)
    assert np.array_equal(lp.row_lower_, rows.lo) and np.array_equal(lp.row_upper_, rows.up)
    # every unit's segments: its hull, fastest vertex first
    for v in range(model.n):
        hull = [model.times[v][i] for i in model.hulls[v]]
        assert t0[v] == hull[0] and count[v] == len(hull) - 1
        lengths = lp.col_upper_[first[v]: first[v] + count[v]]
        assert np.allclose(np.cumsum(lengths), np.array(hull[1:]) - hull[0], rtol=1e-12, atol=0)


def test_candidates_cut_off_could_not_have_won(gpt3_profile):
    """``ours`` at P = 16: LPs stopped early are proven worse than the chosen one (full solves agree)."""
    pytest.importorskip("highspy")
    prof = deepened(gpt3_profile, 16)
    cfg = PlannerConfig("optimal", "ours", "default", gpu=A40)
    setup = optimal_setup(prof, 48, cfg)
    deadline = setup.baseline.iteration_time_s
    cut: list[str] = []
    ranked = rank_schedules(setup, prof, cfg, deadline, False, cut)
    assert cut, "no candidate was cut off: the test checks nothing"
    # every candidate solved to the end, cold, on its own
    full = {label: setup.model(s, prof, cfg).solve_lp(deadline, setup.p2p_power_w * 16)[2]
            for label, s in setup.schedules}
    best = min(full, key=lambda k: (full[k], [lab for lab, _ in setup.schedules].index(k)))
    assert ranked[0].label == best
    assert ranked[0].lp_bound_j == pytest.approx(full[best], rel=1e-9)
    for r in ranked[1:]:
        assert full[r.label] >= full[best] * (1 - 1e-9)
        if r.label in cut:
            assert r.lp_bound_j == float("inf")
        else:
            assert r.lp_bound_j == pytest.approx(full[r.label], rel=1e-9)


def _cold_and_started(schedule, prof):
    """(model solved from the shorter pipeline's start, model solved cold) and the deadline (no slack)."""
    kw = (prof.common_frequencies(), A40.p2p_power_w)
    started, cold = TimeEnergyModel(schedule, prof, *kw), TimeEnergyModel(schedule, prof, *kw)
    cold.shorter_pipeline_start = lambda *a: None
    return started, cold, cold.fastest_time_s()


def test_shorter_pipeline_start_keeps_the_lp_exact_and_saves_iterations(gpt3_profile):
    np = pytest.importorskip("numpy")
    pytest.importorskip("highspy")
    p, m = 16, 96
    prof = deepened(gpt3_profile, p)
    started, cold, deadline = _cold_and_started(one_f_one_b(p, m), prof)
    weight = A40.p2p_power_w * p
    start = started.shorter_pipeline_start(deadline, weight)
    assert start is not None and len(start) == started._lp_num_cols
    d_s, t_s, obj_s = started.solve_lp(deadline, weight)
    d_c, t_c, obj_c = cold.solve_lp(deadline, weight)
    assert obj_s == pytest.approx(obj_c, rel=1e-9) and t_s <= deadline * (1 + 1e-9)
    # the LP's durations meet the deadline either way
    assert started.graph.simulate(d_s).iteration_time_s <= deadline * (1 + 1e-9)
    iters_started = started._lp.h.getInfo().simplex_iteration_count
    iters_cold = cold._lp.h.getInfo().simplex_iteration_count
    assert iters_started < 0.6 * iters_cold, (iters_started, iters_cold)
    # no slack: the extended optimum of the short pipeline is the long one's (the start is feasible, too)
    c = np.asarray(started._lp.h.getLp().col_cost_)
    assert float(c @ start) + started.base_cost == pytest.approx(obj_c, rel=1e-9)
    assert start[started.t_col] <= deadline and max(start[: started.n]) <= deadline * (1 + 1e-9)


def test_shorter_pipeline_start_only_where_it_fits(gpt3_profile):
    pytest.importorskip("highspy")
    cases = [
        build_schedule("1f1b", 8, 96),  # 1536 units: a cold solve is quick, and P = 8 plans stay as they were
        build_schedule("1f1b", 32, 150),  # 9600 units but M < 2 x 3 x 32: the steady state is too short
        build_schedule("ours", 16, 256, [40] * 15 + [0]),  # warm-ups of 15 + 40 forwards: M < 2 x 3 x 55
        # interleaved (issue 24: started too, in groups of P): 3072 units, but M < M_s + 2P = 80 + 32
        build_schedule("interleaved", 16, 96, num_chunks=2),
    ]
    for sched in cases:
        prof = deepened(gpt3_profile, sched.num_stages).for_chunks(sched.num_chunks)
        model = TimeEnergyModel(sched, prof, prof.common_frequencies(), A40.p2p_power_w)
        model._build_lp()
        assert model.shorter_pipeline_start(model.fastest_time_s(), 0.0) is None, sched.name
    # the same 1F1B fits, with or without slack (issue 24: the short LP gets the same relative slack)
    model = TimeEnergyModel(one_f_one_b(16, 96), deepened(gpt3_profile, 16), gpt3_profile.common_frequencies(),
                            A40.p2p_power_w)
    assert model.shorter_pipeline_start(model.fastest_time_s(), 0.0) is not None
    assert model.shorter_pipeline_start(model.fastest_time_s() * 1.03, 0.0) is not None


def test_searches_run_only_where_the_rounding_leaves_a_gap(gpt3_profile):
    """The local searches can gain at most the rounded plan's gap to the LP bound: skipped below
    SEARCH_SKIP_GAP, run (and never worse than the rounding) above it."""
    for scheduling, m in (("1f1b", 24), ("ours", 96)):
        setup = optimal_setup(gpt3_profile, m, PlannerConfig("optimal", scheduling, "default", gpu=A40))
        deadline = setup.baseline.iteration_time_s
        ranked = rank_schedules(setup, gpt3_profile, setup_config(scheduling), deadline, False)
        model = ranked[0].model
        d_lp, t_lp, _ = model.solve_lp(deadline, model.p2p_power_w * model.num_stages)
        target = min(deadline, max(t_lp, model.fastest_time_s()))
        rounded = model.search().round(d_lp, target)
        sol = model.solve(deadline)
        gap = model.plan_energy_j(rounded, deadline, False) / sol.lp_bound_j - 1
        searched = sol.stats["search_trials"] > 0
        assert searched == (gap > SEARCH_SKIP_GAP), (scheduling, m, gap, sol.stats)
        assert sol.score.energy_j <= model.plan_energy_j(rounded, deadline, False) * (1 + 1e-12)
        if not searched:
            assert sol.score.energy_j <= sol.lp_bound_j * (1 + SEARCH_SKIP_GAP)


def setup_config(scheduling: str) -> PlannerConfig:
    return PlannerConfig("optimal", scheduling, "default", gpu=A40)


def test_large_problems_overlap_their_lps_and_rounding_without_changing_the_plan(gpt3_profile):
    """plan_optimal at > 800 units builds the other candidates' models during the first LP, runs their
    LPs side by side and rounds the first meanwhile: the same ranking and plan as one at a time."""
    import threading

    from megatron_envpipe.planning.optimal.entry import plan_optimal

    cfg = PlannerConfig("optimal", "ours", "default", gpu=A40)
    setup = optimal_setup(gpt3_profile, 96, cfg)  # 1536 units, three extra warm-up candidates
    deadline = setup.baseline.iteration_time_s
    assert len(setup.schedules) == 3
    one_by_one = rank_schedules(setup, gpt3_profile, cfg, deadline, padded=False)
    threads = set()

    def round_first(model):
        threads.add(threading.current_thread().name)
        return model.solve(deadline)

    speculated: dict = {}
    side_by_side = rank_schedules(optimal_setup(gpt3_profile, 96, cfg), gpt3_profile, cfg, deadline, False,
                                  None, round_first, speculated)
    assert [(r.label, r.lp_bound_j) for r in side_by_side] == [
        (r.label, pytest.approx(r.lp_bound_j, rel=1e-9)) for r in one_by_one]
    # The first candidate was rounded on the main thread while the others' LPs ran (here another wins).
    first = next(r for r in side_by_side if r.label == setup.schedules[0][0])
    assert list(speculated) == [id(first.model)] and threads == {threading.main_thread().name}
    same_first = next(r for r in one_by_one if r.label == first.label)
    assert speculated[id(first.model)].freqs_mhz == same_first.model.solve(deadline).freqs_mhz
    # plan_optimal's plan is the one-at-a-time ranking's best, rounded.
    result = plan_optimal(gpt3_profile, 96, cfg)
    assert [f for row in result.plan.freqs_mhz for f in row] == one_by_one[0].model.solve(deadline).freqs_mhz
    assert result.details["extra_warmup_chosen"] == one_by_one[0].label
