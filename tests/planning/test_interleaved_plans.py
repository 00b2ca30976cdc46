"""Planning Megatron's interleaved pipeline (issue 14, item 3): baseline, optimal and envelope plans,
the switching pass on chunk-level plans, the CLI and the training flags."""

from __future__ import annotations

import argparse
import json

import pytest

pytest.importorskip("numpy")
pytest.importorskip("megatron_envpipe.core.interleaved", reason="needs the interleaved schedule (issue 14, core)")

from megatron_envpipe.apps.cli import main  # noqa: E402
from megatron_envpipe.config import EnvPipeConfig, EnvPipeConfigError, add_envpipe_args, virtual_stages_of  # noqa: E402
from megatron_envpipe.core.gpu_specs import get_gpu_spec  # noqa: E402
from megatron_envpipe.core.kinds import build_schedule  # noqa: E402
from megatron_envpipe.core.plan import FrequencyPlan  # noqa: E402
from megatron_envpipe.core.timeline import PlanEvaluator  # noqa: E402
from megatron_envpipe.planning.basis import PlannerConfig, PlannerError  # noqa: E402
from megatron_envpipe.planning.frontier import compute_frontier  # noqa: E402
from megatron_envpipe.planning.planner import plan_envpipe  # noqa: E402

A40 = get_gpu_spec("a40")
P2P = A40.p2p_power_w
TIGHT = 1 + 1e-9


def interleaved(plan_type="optimal", v=2, **kw):
    return PlannerConfig(plan_type, "interleaved", "default" if plan_type == "optimal" else "balanced", gpu=A40,
                         virtual_stages=v, **kw)


def test_baseline_is_the_same_interleaved_schedule_at_fmax(gpt3_profile):
    res = plan_envpipe(gpt3_profile, 16, interleaved(switch_cost_j=0.0))
    schedule = build_schedule("interleaved", 8, 16, num_chunks=2)
    assert res.baseline_plan.schedule.orders == schedule.orders
    assert set(res.baseline_plan.flat()) == {1740}
    chunked = gpt3_profile.for_chunks(2)
    expected = PlanEvaluator(schedule, chunked, P2P).score([1740] * len(res.baseline_plan.flat()))
    assert res.baseline == expected
    # interleaving shortens 1F1B's bubble at f_max: a faster baseline than 1F1B's
    one_f = plan_envpipe(gpt3_profile, 16, PlannerConfig("baseline", "1f1b", "default", gpu=A40)).baseline
    assert res.baseline.iteration_time_s < one_f.iteration_time_s - 1.0
    # the plan runs the same order: clocks only
    assert res.schedule.orders == schedule.orders and res.config.baseline_name == "interleaved V=2 at f_max"


@pytest.mark.parametrize("v, m", [(2, 8), (2, 24), (4, 16)])
def test_optimal_plans_meet_the_interleaved_deadline(v, m, bloom_profile):
    res = plan_envpipe(bloom_profile, m, interleaved(v=v, switch_cost_j=0.0))
    assert res.score.iteration_time_s <= res.baseline.iteration_time_s * TIGHT and res.slowdown <= 1e-9
    assert res.lower_bound_j <= res.score.energy_j * TIGHT and res.energy_saving > 0.05
    ev = PlanEvaluator(res.schedule, bloom_profile.for_chunks(v), P2P)
    assert ev.score(res.plan.flat()) == res.score  # scored as anything else
    assert set(res.plan.flat()) <= set(res.candidates_mhz)


def test_acceptance_command(capsys):
    """The issue's acceptance: >= 16.5 % at zero slowdown against interleaved at f_max (timing: the bench)."""
    argv = ["plan", "--profile", "a40/gpt3-175b", "--microbatches", "16", "--scheduling", "interleaved",
            "--virtual-stages", "2", "--type", "optimal", "--json"]
    assert main(argv) == 0
    data = json.loads(capsys.readouterr().out)
    # The figure is the switch-free saving (its prototype charged no clock change); what the plan is
    # worth counts the changes it keeps at the default cost (tests/planning/test_switch_accounting.py).
    plan, base = data["plan"], data["baseline"]
    assert 1 - plan["simulated_energy_j"] / base["energy_j"] >= 0.165 and data["slowdown"] <= 1e-9
    assert data["energy_saving"] == pytest.approx(1 - plan["energy_j"] / base["energy_j"], rel=1e-12)
    assert plan["energy_j"] == pytest.approx(plan["simulated_energy_j"] + plan["switch_energy_j"], rel=1e-12)
    assert data["baseline"]["name"] == "interleaved V=2 at f_max"
    assert data["baseline"]["scheduling"] == "interleaved" and data["baseline"]["virtual_stages"] == 2
    units = {u for row in data["plan"]["frequencies"] for u, _ in row}
    assert "F0v1" in units and "B15v1" in units and len(units) == 2 * 16 * 2
    # the default switch cost ran and its effect is reported next to the saving
    sw = data["clock_switching"]
    assert sw["switch_cost_j"] == pytest.approx(0.010 * P2P)
    assert data["clock_changes_per_rank_per_iteration"] == sw["clock_changes_after"]
    assert sum(sw["clock_changes_after"]) < sum(sw["clock_changes_before"])


def test_envelope_plans_interleaved(gpt3_profile):
    res = plan_envpipe(gpt3_profile, 16, interleaved("envelope"))
    assert res.energy_saving > 0.03 and res.slowdown <= 0.01
    assert res.converged and res.schedule.orders == res.baseline_plan.schedule.orders


def test_switch_cost_cuts_chunk_level_clock_changes(gpt3_profile):
    free = plan_envpipe(gpt3_profile, 16, interleaved(switch_cost_j=0.0))
    cut = plan_envpipe(gpt3_profile, 16, interleaved(switch_cost_j=2.0))
    before, after = sum(free.plan.clock_changes()), sum(cut.plan.clock_changes())
    assert after < 0.8 * before
    given_up = cut.score.energy_j - free.score.energy_j
    assert given_up < 2.0 * (before - after)
    assert cut.score.iteration_time_s <= cut.baseline.iteration_time_s * TIGHT


def test_frontier_of_the_interleaved_schedule(gpt3_profile):
    fr = compute_frontier(gpt3_profile, 16, interleaved(), points=4)
    base = plan_envpipe(gpt3_profile, 16, interleaved("baseline")).baseline
    assert fr.baseline == base and fr.schedule.num_chunks == 2
    energies = [pt.energy_j for pt in fr.points]
    assert energies == sorted(energies, reverse=True) and fr.points[0].time_s <= base.iteration_time_s * TIGHT


def test_cli_schedule_simulate_programs_frontier(capsys, tmp_path):
    assert main(["schedule", "--stages", "4", "--microbatches", "8", "--scheduling", "interleaved",
                 "--virtual-stages", "2"]) == 0
    out = capsys.readouterr().out
    assert "F0v1" in out and "B7v1" in out
    assert main(["programs", "--stages", "4", "--microbatches", "8", "--scheduling", "interleaved",
                 "--virtual-stages", "2"]) == 0
    assert "deadlock-free" in capsys.readouterr().out
    plan_path = tmp_path / "plan.json"
    assert main(["plan", "--profile", "a40/bloom-176b", "-m", "16", "--scheduling", "interleaved",
                 "--virtual-stages", "2", "--type", "optimal", "--out", str(plan_path)]) == 0
    text = capsys.readouterr().out
    assert "(interleaved V=2 at f_max)" in text and "clock changes per rank per iteration" in text
    saved = json.loads(plan_path.read_text())
    assert main(["simulate", "--profile", "a40/bloom-176b", "--plan", str(plan_path), "--json"]) == 0
    sim = json.loads(capsys.readouterr().out)
    assert sim["energy_j"] == pytest.approx(saved["plan"]["simulated_energy_j"], rel=1e-12)  # no switch cost
    assert main(["simulate", "--profile", "a40/bloom-176b", "-m", "16", "--scheduling", "interleaved",
                 "--virtual-stages", "2", "--json"]) == 0
    sim = json.loads(capsys.readouterr().out)
    assert sim["energy_j"] == pytest.approx(saved["baseline"]["energy_j"], rel=1e-12)
    assert main(["frontier", "--profile", "a40/gpt3-175b", "-m", "16", "--scheduling", "interleaved",
                 "--virtual-stages", "2", "--points", "3", "--json"]) == 0
    assert len(json.loads(capsys.readouterr().out)["points"]) >= 2


@pytest.mark.parametrize("argv, needle", [
    (["--scheduling", "interleaved"], "needs --virtual-stages V >= 2"),
    (["--scheduling", "interleaved", "--virtual-stages", "1"], "needs --virtual-stages V >= 2"),
    (["--scheduling", "ours", "--virtual-stages", "2"], "--virtual-stages 2 needs --scheduling interleaved"),
    (["--scheduling", "1f1b", "--virtual-stages", "4"], "--virtual-stages 4 needs --scheduling interleaved"),
    (["--scheduling", "interleaved", "--virtual-stages", "2", "--extra-warmup", "1,1,1,1,1,1,1,0"],
     "--extra-warmup"),
    (["--scheduling", "interleaved", "--virtual-stages", "2", "--max-inflight", "12"], "--max-inflight"),
    (["--scheduling", "interleaved", "--virtual-stages", "0"], "--virtual-stages"),
    (["--scheduling", "interleaved", "--virtual-stages", "100"], "--virtual-stages"),
    (["--scheduling", "interleaved", "--virtual-stages", "2", "--switch-cost-j", "nan"], "--switch-cost-j"),
    (["--scheduling", "interleaved", "--virtual-stages", "2", "--max-clock-changes", "0"], "--max-clock-changes"),
])
def test_impossible_combinations_are_one_line_errors(argv, needle, capsys):
    try:
        code = main(["plan", "--profile", "a40/gpt3-175b", "-m", "16"] + argv)
    except SystemExit as exc:  # argparse's own range checks
        code = exc.code
    err = capsys.readouterr().err
    assert code == 2 and needle in err and len(err.strip().splitlines()) == 1, err


def test_planner_config_refuses_what_interleaved_cannot_do():
    for kw, needle in ((dict(virtual_stages=1), "V >= 2"), (dict(extra_warmup=(1,) * 8), "--extra-warmup"),
                       (dict(max_inflight=12), "--max-inflight"), (dict(comm="paired"), "--comm paired")):
        with pytest.raises(PlannerError, match=needle):
            PlannerConfig("optimal", "interleaved", **{"virtual_stages": 2, **kw}).validate()
    with pytest.raises(PlannerError, match="group size"):
        PlannerConfig("optimal", "1f1b", microbatch_group_size=8).validate()


# -- training flags ---------------------------------------------------------------------------------------
def megatron_args(**kw):
    base = dict(pipeline_model_parallel_size=4, num_microbatches=8, virtual_pipeline_model_parallel_size=None,
                num_layers_per_virtual_pipeline_stage=None, num_layers=16)
    base.update(kw)
    return argparse.Namespace(**base)


def test_training_flags_take_v_from_megatron():
    parser = add_envpipe_args(argparse.ArgumentParser())
    cfg = EnvPipeConfig.from_args(parser.parse_args(["--envpipe-scheduling", "interleaved", "--envpipe-type",
                                                     "optimal", "--envpipe-switch-cost-j", "0.5"]))
    assert cfg.scheduling == "interleaved" and cfg.switch_cost_j == 0.5
    assert virtual_stages_of(megatron_args(virtual_pipeline_model_parallel_size=2)) == 2
    assert virtual_stages_of(megatron_args(num_layers_per_virtual_pipeline_stage=2)) == 2  # 16 / (4 x 2)
    assert virtual_stages_of(megatron_args()) == 1
    cfg.validate_with_megatron_args(megatron_args(virtual_pipeline_model_parallel_size=2))
    pcfg = cfg.planner_config(A40, virtual_stages=2)
    assert pcfg.validate().virtual_stages == 2 and pcfg.switch_cost_j == 0.5


@pytest.mark.parametrize("cfg, args, needle", [
    (dict(scheduling="interleaved"), dict(), "needs model chunks"),
    (dict(scheduling="ours", plan_type="envelope"), dict(virtual_pipeline_model_parallel_size=2),
     "add --envpipe-scheduling interleaved"),
    (dict(scheduling="1f1b", plan_type="optimal"), dict(num_layers_per_virtual_pipeline_stage=2),
     "add --envpipe-scheduling interleaved"),
    (dict(scheduling="interleaved"), dict(num_layers_per_virtual_pipeline_stage=3), "whole virtual stages"),
    (dict(scheduling="interleaved", max_inflight=12), dict(virtual_pipeline_model_parallel_size=2),
     "--envpipe-max-inflight"),
    (dict(scheduling="interleaved", extra_warmup=(1, 1, 1, 0)), dict(virtual_pipeline_model_parallel_size=2),
     "--envpipe-extra-warmup"),
    (dict(scheduling="ours", switch_cost_j=-1.0), dict(), "--envpipe-switch-cost-j"),
    (dict(scheduling="ours", max_clock_changes=0), dict(), "--envpipe-max-clock-changes"),
])
def test_training_refuses_impossible_combinations_at_start_up(cfg, args, needle):
    with pytest.raises(EnvPipeConfigError, match=needle.replace("-", r"\-")):
        EnvPipeConfig(**cfg).validate_with_megatron_args(megatron_args(**args))


def test_stock_megatron_with_a_virtual_pipeline_is_still_allowed():
    EnvPipeConfig().validate_with_megatron_args(megatron_args(virtual_pipeline_model_parallel_size=2))


def test_plan_file_of_an_interleaved_plan_round_trips(gpt3_profile):
    res = plan_envpipe(gpt3_profile, 8, interleaved())
    again = FrequencyPlan.from_dict(res.plan.to_dict())
    assert again.schedule.orders == res.schedule.orders and again.freqs_mhz == res.plan.freqs_mhz
