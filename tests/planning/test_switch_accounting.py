"""Honest switch accounting: a plan's energy and saving count the clock changes it keeps, the same way in the
planner, `envpipe plan --json` and its text, the frontier and the training log; the LP gap is quoted once."""

from __future__ import annotations

import dataclasses
import json
import logging
import re

import pytest

pytest.importorskip("numpy")

from megatron_envpipe.apps.cli import main  # noqa: E402
from megatron_envpipe.config import EnvPipeConfig  # noqa: E402
from megatron_envpipe.core.clock_latency import DEFAULT_CLOCK_LATENCY, ClockLatency, ClockLatencyError  # noqa: E402
from megatron_envpipe.core.gpu_specs import GpuSpecError, get_gpu_spec, load_gpu_table  # noqa: E402
from megatron_envpipe.core.kinds import build_schedule  # noqa: E402
from megatron_envpipe.core.plan import FrequencyPlan  # noqa: E402
from megatron_envpipe.core.profile import Profile, ProfilePoint  # noqa: E402
from megatron_envpipe.core.timeline import PlanEvaluator  # noqa: E402
from megatron_envpipe.megatron.runtime import EnvPipeRuntime  # noqa: E402
from megatron_envpipe.planning.basis import PlannerConfig  # noqa: E402
from megatron_envpipe.planning.frontier import compute_frontier  # noqa: E402
from megatron_envpipe.planning.planner import plan_envpipe  # noqa: E402
from megatron_envpipe.planning.switching import (  # noqa: E402
    DEFAULT_SWITCH_LATENCY_S,
    reduce_clock_changes,
    steady_clock_changes,
)

A40 = get_gpu_spec("a40")
P2P = A40.p2p_power_w
DEFAULT_COST = DEFAULT_CLOCK_LATENCY.settle_s * P2P  # 0.7038 J


def changes_of(plan):
    """Counted here, not by the package: per rank, clock changes of a repeating iteration (wrap included)."""
    out = []
    for row in plan.freqs_mhz:
        out.append(sum(1 for i in range(len(row)) if row[i] != row[(i + 1) % len(row)]))
    return out


def recomputed(plan, profile, cost, p2p=P2P, graph=None):
    """Energy of ``plan`` from scratch: simulated unit + idle energy + cost x clock changes."""
    ev = PlanEvaluator(plan.schedule, profile, p2p, graph=graph)
    score = ev.score(plan.flat())
    return score.energy_j + cost * sum(changes_of(plan)), score


def expected_saving(result, profile, cost):
    energy, _ = recomputed(result.plan, profile, cost, graph=result.timeline.graph)
    base, _ = recomputed(result.baseline_plan, profile, cost)
    return 1 - energy / base, energy, base


@pytest.fixture(scope="module")
def optimal_default(gpt3_profile):
    """Optimal 1F1B plan with the default switch cost: the pass runs and keeps changes that are charged."""
    return plan_envpipe(gpt3_profile, 16, PlannerConfig("optimal", "1f1b", "default", gpu=A40, switch_cost_j=None))


# -- what a change is worth ---------------------------------------------------------------
def test_default_switch_cost_comes_from_the_latency_model():
    assert DEFAULT_SWITCH_LATENCY_S == DEFAULT_CLOCK_LATENCY.settle_s
    assert A40.clock_latency == DEFAULT_CLOCK_LATENCY  # no GPU-specific figure in the table
    cfg = PlannerConfig("optimal", "1f1b", "default", gpu=A40, switch_cost_j=None)
    assert cfg.effective_switch_cost_j == pytest.approx(DEFAULT_COST)
    slow = ClockLatency(call_s=0.02, settle_s=0.05, source="assumed")
    assert slow.switch_cost_j(P2P) == pytest.approx(0.05 * P2P) and slow.request_to_clock_s == pytest.approx(0.07)
    # a GPU's own latency moves its default cost
    gpu = dataclasses.replace(A40, clock_latency=slow)
    assert dataclasses.replace(cfg, gpu=gpu).effective_switch_cost_j == pytest.approx(0.05 * P2P)
    # EnvPipe's own types are charged only when a cost is given
    assert PlannerConfig("envelope", gpu=A40, switch_cost_j=None).effective_switch_cost_j == 0.0
    assert PlannerConfig("envelope", gpu=A40, switch_cost_j=0.5).effective_switch_cost_j == 0.5


@pytest.mark.parametrize("kw", [dict(call_s=-0.001), dict(settle_s=float("nan")), dict(settle_s=11.0),
                                dict(call_s=True), dict(source=" ")])
def test_bad_latency_is_refused(kw):
    args = {"call_s": 0.01, "settle_s": 0.01, "source": "assumed", **kw}
    with pytest.raises(ClockLatencyError):
        ClockLatency(**args)


GPU_ENTRY = """[g]
nvml_names = ["G"]
max_clock_mhz = 1500
min_clock_mhz = 300
clock_step_mhz = 15
profile_step_mhz = 90
reconfig_step_mhz = 30
p2p_power_w = 80.0
sources = ["test"]
"""


def test_gpu_table_gives_a_gpu_its_latency(tmp_path):
    path = tmp_path / "gpus.toml"
    path.write_text(GPU_ENTRY + 'clock_call_ms = 12\nclock_settle_ms = 4.5\nclock_latency_source = "measured"\n')
    spec = load_gpu_table(path)["g"]
    assert spec.clock_latency == ClockLatency(0.012, 0.0045, "measured")
    cfg = PlannerConfig("optimal", gpu=spec, switch_cost_j=None)
    assert cfg.effective_switch_cost_j == pytest.approx(0.0045 * 80.0)
    plain = tmp_path / "plain.toml"  # (tables are cached by path)
    plain.write_text(GPU_ENTRY)
    assert load_gpu_table(plain)["g"].clock_latency == DEFAULT_CLOCK_LATENCY


@pytest.mark.parametrize("extra, words", [
    ("clock_settle_ms = 5\n", "needs all of clock_call_ms, clock_settle_ms, clock_latency_source"),
    ('clock_call_ms = 5\nclock_settle_ms = -1\nclock_latency_source = "x"\n', "clock_settle_ms = -1 must be"),
    ('clock_call_ms = "5"\nclock_settle_ms = 1\nclock_latency_source = "x"\n', "clock_call_ms = '5' must be"),
    ("clock_call_ms = 5\nclock_settle_ms = 1\nclock_latency_source = \"\"\n", "clock_latency_source must say"),
    ("clock_call_ms = 5\nclock_settle_ms = nan\nclock_latency_source = \"x\"\n", "clock_settle_ms = nan must be"),
])
def test_bad_latency_in_the_gpu_table_names_the_key(tmp_path, extra, words):
    path = tmp_path / "gpus.toml"
    path.write_text(GPU_ENTRY + extra)
    with pytest.raises(GpuSpecError) as err:
        load_gpu_table(path)
    assert words in str(err.value) and "[g]" in str(err.value) and "\n" not in str(err.value)


def test_changes_are_those_of_a_repeating_iteration():
    schedule = build_schedule("1f1b", 2, 2)
    n = [len(order) for order in schedule.orders]
    assert steady_clock_changes(FrequencyPlan.constant(schedule, [1500, 1400])) == (0, 0)
    # 1500 1400 1400 1500: the change back into the next iteration's first unit is free (same clock)
    rows = ((1500, 1400, 1400, 1500), (1400,) * n[1])
    assert steady_clock_changes(FrequencyPlan(schedule, rows)) == (2, 0)
    rows = ((1500, 1400, 1400, 1400), (1400,) * (n[1] - 1) + (1500,))
    assert steady_clock_changes(FrequencyPlan(schedule, rows)) == (2, 2)  # last -> next first counts


# -- the planner -------------------------------------------------------------------------
def test_planner_saving_counts_the_changes_kept(optimal_default, gpt3_profile):
    res = optimal_default
    assert res.switch_cost_j == pytest.approx(DEFAULT_COST)
    saving, energy, base = expected_saving(res, gpt3_profile, DEFAULT_COST)
    assert sum(changes_of(res.plan)) > 50  # changes are kept, and charged
    assert res.energy_j == pytest.approx(energy, rel=1e-12) and res.baseline_energy_j == pytest.approx(base)
    assert res.energy_saving == pytest.approx(saving, rel=1e-12)
    assert res.energy_saving < 1 - res.score.energy_j / res.baseline.energy_j  # not the switch-free figure
    sw = res.details["clock_switching"]
    assert sw["charged_clock_changes_after"] == changes_of(res.plan)
    assert sw["switch_energy_saved_j"] == pytest.approx(
        DEFAULT_COST * (sum(sw["charged_clock_changes_before"]) - sum(sw["charged_clock_changes_after"])))


def test_envpipe_types_are_charged_when_a_cost_is_given(gpt3_profile):
    free = plan_envpipe(gpt3_profile, 12, PlannerConfig("envelope", "ours", "balanced", gpu=A40))
    assert free.switch_energy_j == 0 and free.energy_saving == pytest.approx(1 - free.score.energy_j /
                                                                                free.baseline.energy_j)
    paid = plan_envpipe(gpt3_profile, 12, PlannerConfig("envelope", "ours", "balanced", gpu=A40, switch_cost_j=0.5))
    saving, _, _ = expected_saving(paid, gpt3_profile, 0.5)
    assert sum(changes_of(paid.plan)) > 0 and paid.energy_saving == pytest.approx(saving, rel=1e-12)


def test_more_changes_are_worth_exactly_their_cost_less():
    """Two clocks with the same time and energy: plans that differ only in their changes differ in worth by
    exactly cost x changes, and the pass merges every change away."""
    points = {}
    for s in range(2):
        points[(s, "forward")] = [ProfilePoint(1500, 1.0, 100.0), ProfilePoint(1400, 1.0, 100.0)]
        points[(s, "backward")] = [ProfilePoint(1500, 2.0, 200.0), ProfilePoint(1400, 2.0, 200.0)]
    profile = Profile(points, source="<twin clocks>")
    cfg = PlannerConfig("envelope", "1f1b", "default", p2p_power_w=50.0, switch_cost_j=3.0, max_clock_changes=100)
    res = plan_envpipe(profile, 4, cfg)
    schedule = res.schedule
    zigzag = FrequencyPlan(schedule, tuple(tuple(1500 if i % 2 else 1400 for i in range(len(o)))
                                           for o in schedule.orders))
    ev = PlanEvaluator(schedule, profile, 50.0)
    one = dataclasses.replace(res, plan=FrequencyPlan.constant(schedule, [1400, 1400]))
    many = dataclasses.replace(res, plan=zigzag, score=ev.score(zigzag.flat()))
    assert many.score.energy_j == pytest.approx(one.score.energy_j, rel=1e-12)
    k = sum(changes_of(zigzag))
    assert k == 2 * 8 and sum(changes_of(one.plan)) == 0
    assert many.energy_j - one.energy_j == pytest.approx(3.0 * k, rel=1e-12)
    assert one.energy_saving - many.energy_saving == pytest.approx(3.0 * k / res.baseline_energy_j, rel=1e-9)
    # the pass removes every change that costs more than it saves
    sw = reduce_clock_changes(zigzag, ev, None, 3.0)
    assert sum(sw.charged_after) == 0 and sw.summary()["switch_energy_saved_j"] == pytest.approx(3.0 * k)


# -- the LP gap, quoted once ----------------------------------------------------------------
def within(stop_reason):
    return float(re.search(r"within ([\d.]+) % of the LP lower bound", stop_reason).group(1))


@pytest.mark.parametrize("kw", [dict(switch_cost_j=None), dict(switch_cost_j=2.0, max_clock_changes=12),
                                dict(switch_cost_j=2.0, target="1.1"), dict(switch_cost_j=None, timing_margin=0.02)])
def test_stop_reason_quotes_the_gap_after_the_pass(kw, gpt3_profile):
    kw = dict(kw)
    target = kw.pop("target", None)
    cfg = PlannerConfig("optimal", "ours", "default", gpu=A40, **kw)
    if target:
        base = plan_envpipe(gpt3_profile, 12, dataclasses.replace(cfg, switch_cost_j=0.0)).baseline
        cfg = dataclasses.replace(cfg, target_time_s=float(target) * base.iteration_time_s)
    res = plan_envpipe(gpt3_profile, 12, cfg)
    d = res.details
    assert d["clock_switching"]["merges"] > 0  # the pass changed the plan after plan_optimal quoted a gap
    assert within(res.stop_reason) == pytest.approx(100 * d["gap_to_lp_bound"], abs=0.005)
    assert "clock changes counted" in res.stop_reason
    if target:
        energy = res.energy_j + P2P * 8 * (res.deadline_s - res.score.iteration_time_s)
        assert d["energy_at_deadline_j"] == pytest.approx(energy, rel=1e-12)
        assert d["gap_to_lp_bound"] == pytest.approx(energy / res.lower_bound_j - 1, rel=1e-12)
    elif not res.config.timing_margin:
        assert d["gap_to_lp_bound"] == pytest.approx(res.energy_j / res.lower_bound_j - 1, rel=1e-12)
    assert d["switch_energy_j"] == pytest.approx(res.switch_energy_j)


# -- envpipe plan --json and its text --------------------------------------------------------
def test_plan_json_and_text_count_the_changes(capsys, optimal_default, gpt3_profile):
    argv = ["plan", "--profile", "a40/gpt3-175b", "-m", "16", "--type", "optimal", "--scheduling", "1f1b"]
    assert main(argv + ["--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    plan, base = data["plan"], data["baseline"]
    energy, score = recomputed(FrequencyPlan.from_dict({"schedule": "1f1b", "num_stages": 8, "num_microbatches": 16,
                                                        "extra_warmup": [0] * 8, "stages": plan["frequencies"]}),
                               gpt3_profile, data["switch_cost_j"])
    assert data["switch_cost_j"] == pytest.approx(DEFAULT_COST)
    assert plan["energy_j"] == pytest.approx(energy, rel=1e-12)
    assert plan["simulated_energy_j"] == pytest.approx(score.energy_j, rel=1e-12)
    assert plan["switch_energy_j"] == pytest.approx(DEFAULT_COST * sum(plan["charged_clock_changes_per_stage"]))
    assert plan["energy_j"] == pytest.approx(plan["simulated_energy_j"] + plan["switch_energy_j"], rel=1e-12)
    assert base["switch_energy_j"] == 0
    assert data["energy_saving"] == pytest.approx(1 - plan["energy_j"] / base["energy_j"], rel=1e-12)
    assert data["energy_saving"] == pytest.approx(optimal_default.energy_saving, rel=1e-12)
    assert within(data["stop_reason"]) == pytest.approx(100 * data["optimal"]["gap_to_lp_bound"], abs=0.005)
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert f"energy saving {100 * data['energy_saving']:.2f} %" in out
    assert re.search(rf"^plan .* {plan['energy_j']:.1f} J   \(of which clock changes {plan['switch_energy_j']:.1f} J\)",
                     out, re.M)


# -- the frontier ---------------------------------------------------------------------------
def test_frontier_rows_count_the_changes_they_keep(gpt3_profile, capsys):
    cfg = PlannerConfig("optimal", "1f1b", "default", gpu=A40, switch_cost_j=1.5)
    fr = compute_frontier(gpt3_profile, 8, cfg, points=4)
    assert any(sum(changes_of(pt.plan)) for pt in fr.points)
    for pt in fr.points:
        energy, score = recomputed(pt.plan, gpt3_profile, 1.5)
        assert pt.energy_j == pytest.approx(energy, rel=1e-12) and score.iteration_time_s == pytest.approx(pt.time_s)
        assert pt.switch_energy_j == pytest.approx(1.5 * sum(changes_of(pt.plan)))
        assert pt.saving == pytest.approx(1 - energy / fr.baseline.energy_j, rel=1e-12)
    # the CLI: the same cost as 'envpipe plan --type optimal' by default, and as given
    argv = ["frontier", "--profile", "a40/gpt3-175b", "-m", "8", "--scheduling", "1f1b", "--points", "3", "--json"]
    assert main(argv + ["--switch-cost-j", "1.5"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["switch_cost_j"] == 1.5
    for row in data["points"]:
        assert row["saving"] == pytest.approx(1 - row["energy_j"] / data["baseline"]["energy_j"], rel=1e-12)
        assert row["switch_energy_j"] > 0
    assert main(argv) == 0
    assert json.loads(capsys.readouterr().out)["switch_cost_j"] == pytest.approx(DEFAULT_COST)


# -- the training log -------------------------------------------------------------------------
def test_training_log_line_gives_the_saving_with_changes(caplog, gpt3_profile):
    rt = EnvPipeRuntime(EnvPipeConfig(plan_type="optimal", scheduling="1f1b", reconfig="default",
                                      profile="a40/gpt3-175b", gpu="a40", switch_cost_j=0.7))
    with caplog.at_level(logging.INFO, logger="megatron_envpipe"):
        rt.prepare(8, 16)
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("EnvPipe plan optimal"))
    res = rt.last_result
    saving, energy, _ = expected_saving(res, gpt3_profile, 0.7)
    logged = re.search(r"predicted energy saving ([\d.]+)% \((\d+) clock changes per iteration x 0\.7 J = ([\d.]+) J",
                       line)
    assert logged, line
    assert float(logged.group(1)) == pytest.approx(100 * saving, abs=0.005)
    assert int(logged.group(2)) == sum(changes_of(res.plan)) > 0
    assert float(logged.group(3)) == pytest.approx(energy - res.score.energy_j, abs=0.05)
    assert f"within {100 * res.details['gap_to_lp_bound']:.2f} %" in line
    # and the measured-saving report compares with the same baseline energy
    assert res.baseline_energy_j == pytest.approx(res.baseline.energy_j)  # f_max everywhere: no change
    # without a cost the line is the switch-free saving, as before
    assert "clock changes per iteration" not in dataclasses.replace(
        res, config=dataclasses.replace(res.config, switch_cost_j=0.0)).saving_text()
