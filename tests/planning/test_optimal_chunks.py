"""``--type optimal`` on a profile whose model chunks differ: costs read per (stage, chunk, instruction)."""

from __future__ import annotations

import itertools

import pytest

pytest.importorskip("numpy")

from megatron_envpipe.core.gpu_specs import get_gpu_spec  # noqa: E402
from megatron_envpipe.core.kinds import build_schedule  # noqa: E402
from megatron_envpipe.core.profile import Profile, ProfilePoint  # noqa: E402
from megatron_envpipe.core.timeline import PipelineGraph, PlanEvaluator  # noqa: E402
from megatron_envpipe.core.vocabulary import INSTRUCTIONS  # noqa: E402
from megatron_envpipe.planning.basis import PlannerConfig  # noqa: E402
from megatron_envpipe.planning.optimal import TimeEnergyModel  # noqa: E402
from megatron_envpipe.planning.planner import plan_envpipe  # noqa: E402
from megatron_envpipe.testing.milp import unit_clocks  # noqa: E402

A40 = get_gpu_spec("a40")
P2P = A40.p2p_power_w
TIGHT = 1 + 1e-9


def uneven_chunks(gpt3: Profile, clocks: list[int]) -> Profile:
    """Two stages, two chunks: chunk 1 takes 1.8x chunk 0's time and 1.5x its energy (say, the LM head)."""
    even = gpt3.for_pipeline(2).restricted(clocks).for_chunks(2)
    points = {}
    for s in range(2):
        for ins in INSTRUCTIONS:
            points[(s, ins, 0)] = list(even.points(s, ins, 0))
            points[(s, ins, 1)] = [ProfilePoint(p.freq_mhz, 1.8 * p.time_s, 1.5 * p.energy_j)
                                   for p in even.points(s, ins, 1)]
    return Profile(points, source="<2 stages, 2 uneven chunks>")


def test_model_reads_each_chunks_costs(gpt3_profile):
    prof = uneven_chunks(gpt3_profile, [1740, 1350, 900])
    sched = build_schedule("interleaved", 2, 4, num_chunks=2)
    model = TimeEnergyModel(sched, prof, prof.common_frequencies(), P2P)
    ev = PlanEvaluator(sched, prof, P2P)
    seen = set()
    for v, (s, unit) in enumerate(model.graph.nodes):
        for k, opt in enumerate(model.options[v]):
            freqs = [model.options[u][0].freq_mhz for u in range(model.n)]
            freqs[v] = opt.freq_mhz
            assert model.times[v][k] == ev.durations(freqs)[v] == opt.time_s, (s, unit)
            assert opt.energy_j == ev.unit_energies(freqs)[v]
        seen.add((unit.chunk, model.times[v][0]))
    # the chunks really differ, so reading chunk 0 for both would be caught above
    assert len({t for c, t in seen if c == 1} - {t for c, t in seen if c == 0}) > 0


@pytest.mark.parametrize("slowdown", [0.0, 0.05])
def test_uneven_chunks_plan_matches_brute_force(slowdown, gpt3_profile):
    prof = uneven_chunks(gpt3_profile, [1740, 1200])
    cfg = PlannerConfig("optimal", "interleaved", "default", gpu=A40, virtual_stages=2, switch_cost_j=0.0,
                        max_slowdown=slowdown)
    res = plan_envpipe(prof, 2, cfg)
    sched = res.schedule
    assert sched.num_chunks == 2
    ev = PlanEvaluator(sched, prof, P2P)
    deadline = ev.score([1740] * len(res.plan.flat())).iteration_time_s * (1 + slowdown)
    # every clock assignment (2^16), scored by the evaluator alone
    best = min(
        sc.energy_j
        for freqs in itertools.product((1740, 1200), repeat=len(res.plan.flat()))
        if (sc := ev.score(freqs)).iteration_time_s <= deadline * TIGHT
    )
    again = ev.score(res.plan.flat())
    assert again.iteration_time_s <= deadline * TIGHT
    assert again.energy_j == pytest.approx(res.score.energy_j, rel=1e-12)
    assert res.lower_bound_j <= best * TIGHT
    assert again.energy_j <= best * 1.002, (again.energy_j, best)


def test_milp_oracle_reads_each_chunks_costs(gpt3_profile):
    prof = uneven_chunks(gpt3_profile, [1740, 1350, 900])
    graph = PipelineGraph(build_schedule("interleaved", 2, 4, num_chunks=2))
    clocks = unit_clocks(prof, graph)
    for (s, unit), options in zip(graph.nodes, clocks, strict=True):
        ins = "forward" if unit.is_forward else "backward"
        assert options == [(p.freq_mhz, p.time_s, p.energy_j) for p in prof.points(s, ins, unit.chunk)]
    # A profile of whole stages is split evenly over the chunks.
    whole = gpt3_profile.for_pipeline(2).restricted([1740, 1350, 900])
    s, unit = graph.nodes[0]
    assert unit_clocks(whole, graph)[0][0][1] == pytest.approx(whole.time_s(s, "forward", 1740) / 2)
