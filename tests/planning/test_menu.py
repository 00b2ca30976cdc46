"""Issue 36: the menu of time and energy, and a deadline taken from 1F1B (CLI and training flags).

The menu's rows must be what `envpipe plan` prints for each row run by hand (same flags, same code), on the
shipped A40 profiles; here M = 16 for both (the full grid, M = 16/24/48/96, is `python3 bench/menu.py --check`,
about 3 minutes). The interleaved row at 1F1B's time must save at least what a hand-computed --max-slowdown
gives. Bad combinations are one-line errors, exit 2 (CLI) or EnvPipeConfigError at start-up (training).
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import pytest

from megatron_envpipe.apps.cli import main
from megatron_envpipe.config import EnvPipeConfig
from megatron_envpipe.config.flags import add_envpipe_args
from megatron_envpipe.core.gpu_specs import get_gpu_spec
from megatron_envpipe.core.profile import Profile
from megatron_envpipe.core.resources import shipped_profile
from megatron_envpipe.flag_types import EnvPipeConfigError
from megatron_envpipe.megatron.runtime import EnvPipeRuntime
from megatron_envpipe.planning.basis import PlannerConfig, PlannerError
from megatron_envpipe.planning.deadline import _whole_stages, deadline_from_1f1b, one_f_one_b_reference
from megatron_envpipe.planning.menu import build_menu


def run(argv: list[str], capsys) -> tuple[int, str, str]:
    capsys.readouterr()
    try:
        code = main(argv)
    except SystemExit as exc:  # argparse's own errors: exit 2, one line (parser._EnvpipeArgumentParser)
        code = exc.code
    out, err = capsys.readouterr()
    return code, out, err


def plan_json(capsys, profile: str, m: int, flags: str) -> dict:
    code, out, err = run(["plan", "--profile", profile, "-m", str(m), "--json", *flags.split()], capsys)
    assert code == 0, err
    return json.loads(out)


@pytest.mark.parametrize("name", ["gpt3-175b", "bloom-176b"])
def test_menu_rows_equal_envpipe_plan_run_by_hand(name: str, capsys) -> None:
    profile, m = f"a40/{name}", 16
    code, out, err = run(["menu", "--profile", profile, "-m", str(m), "--json"], capsys)
    assert code == 0, err
    menu = json.loads(out)
    rows = {(r["schedule"], r["deadline"]): r for r in menu["rows"]}
    assert list(rows) == [("1F1B at f_max", "f_max"), ("1f1b", "1F1B's time"), ("ours", "1F1B's time"),
                          ("interleaved V=2", "1F1B's time"), ("interleaved V=2", "own fastest")]
    base = plan_json(capsys, profile, m, rows[("1F1B at f_max", "f_max")]["plan_flags"])["baseline"]
    e_1f1b = base["energy_j"]
    assert menu["reference"]["iteration_time_s"] == base["iteration_time_s"] and menu["reference"]["energy_j"] == e_1f1b
    for (schedule, _), row in list(rows.items())[1:]:
        by_hand = plan_json(capsys, profile, m, row["plan_flags"])
        plan = by_hand["plan"]
        assert row["iteration_time_s"] == plan["iteration_time_s"], schedule
        assert row["energy_j"] == plan["energy_j"], schedule
        assert row["saving_vs_1f1b_at_f_max"] == pytest.approx(1 - plan["energy_j"] / e_1f1b, abs=1e-12)
        v = by_hand["baseline"]["virtual_stages"]
        assert row["peak_inflight_activations"] == [n / v for n in plan["peak_inflight_activations"]]
        assert plan["iteration_time_s"] <= base["iteration_time_s"] * (1 + 1e-9)  # never slower than 1F1B
        if "deadline_from" in by_hand:
            assert by_hand["deadline_from"]["energy_saving_vs_1f1b"] == row["saving_vs_1f1b_at_f_max"]
            assert by_hand["deadline_from"]["deadline_s"] == base["iteration_time_s"]
    at_1f1b = rows[("interleaved V=2", "1F1B's time")]
    own = rows[("interleaved V=2", "own fastest")]
    # The slack 1F1B's time gives interleaved is worth energy: more saving than at its own fastest time.
    assert at_1f1b["saving_vs_1f1b_at_f_max"] > own["saving_vs_1f1b_at_f_max"] > 0
    assert at_1f1b["peak_vs_1f1b"] == pytest.approx(23 / 2 / 8)  # 11.5 micro-batches on stage 0 vs 1F1B's 8


def test_interleaved_at_1f1b_time_saves_at_least_the_hand_computed_max_slowdown(capsys) -> None:
    profile, m, v = "a40/gpt3-175b", 24, "--scheduling interleaved --virtual-stages 2"
    t_1f1b = plan_json(capsys, profile, m, "--type baseline --scheduling 1f1b")["baseline"]
    t_int = plan_json(capsys, profile, m, f"--type baseline {v}")["baseline"]["iteration_time_s"]
    slowdown = t_1f1b["iteration_time_s"] / t_int - 1
    menu = plan_json(capsys, profile, m, f"--type optimal {v} --deadline-from 1f1b")
    assert menu["deadline_from"]["max_slowdown"] == slowdown
    for digits in (4, 6):  # typed by hand, rounded down so as not to run past 1F1B's time: a tighter deadline
        typed = math.floor(slowdown * 10**digits) / 10**digits
        hand = plan_json(capsys, profile, m, f"--type optimal {v} --max-slowdown {typed}")
        # LP + rounding is not monotone in the deadline to the last digit (bench/menu.py --check: GPT-3 M = 48
        # rounded down saves 0.0025 points more): at least as much, to 0.01 % of the energy.
        assert menu["plan"]["energy_j"] <= hand["plan"]["energy_j"] * (1 + 1e-4), digits
    exact = plan_json(capsys, profile, m, f"--type optimal {v} --max-slowdown {slowdown!r}")
    assert exact["plan"]["energy_j"] == menu["plan"]["energy_j"]


def test_deadline_from_1f1b_plans_ours_and_1f1b_to_their_own_baseline() -> None:
    profile = Profile.from_csv(shipped_profile("a40/bloom-176b"))
    gpu = get_gpu_spec("a40")
    for scheduling in ("1f1b", "ours"):
        d = deadline_from_1f1b(profile, 16, PlannerConfig("optimal", scheduling, "default", gpu=gpu))
        assert d.config.max_slowdown == 0 and d.own_fastest_s == d.deadline_s
    d = deadline_from_1f1b(profile, 16, PlannerConfig("optimal", "interleaved", "default", gpu=gpu, virtual_stages=2))
    assert d.own_fastest_s < d.deadline_s
    assert d.own_fastest_s * (1 + d.config.max_slowdown) == pytest.approx(d.deadline_s, rel=1e-15)


def test_a_profile_with_model_chunks_predicts_1f1b_from_its_chunks_summed() -> None:
    whole = Profile.from_csv(shipped_profile("a40/gpt3-175b"))
    chunked = whole.for_chunks(2)
    summed = _whole_stages(chunked)
    assert summed.num_chunks == 1
    cfg = PlannerConfig("optimal", "interleaved", "default", gpu=get_gpu_spec("a40"), virtual_stages=2)
    a, b = one_f_one_b_reference(whole, 16, cfg), one_f_one_b_reference(chunked, 16, cfg)
    assert a.iteration_time_s == pytest.approx(b.iteration_time_s, rel=1e-12)
    assert a.energy_j == pytest.approx(b.energy_j, rel=1e-12)


def test_menu_budget_ours_within_it_and_interleaved_must_fit() -> None:
    profile = Profile.from_csv(shipped_profile("a40/gpt3-175b"))
    cfg = PlannerConfig("optimal", "ours", "default", gpu=get_gpu_spec("a40"), max_inflight=12)
    menu = build_menu(profile, 16, cfg, schedules=("ours", "interleaved"))
    ours = next(r for r in menu.rows if r.schedule == "ours")
    assert max(ours.peak_inflight) <= 12
    with pytest.raises(PlannerError, match=r"interleaved V=2 holds 11.5 micro-batch activations on stage 0 .* "
                                           r"give at least 12,11,10,9,8,7,6,5"):
        build_menu(profile, 16, PlannerConfig("optimal", "ours", "default", gpu=get_gpu_spec("a40"),
                                              max_inflight=11))
    # Where Megatron cannot interleave M, the row is left out and the menu says why.
    short = build_menu(profile, 12, PlannerConfig("optimal", "ours", "default", gpu=get_gpu_spec("a40")))
    assert [r.schedule for r in short.rows] == ["1F1B at f_max", "1f1b", "ours"]
    assert "interleaved V=2 left out" in short.notes[0] and "M=12" in short.notes[0]


@pytest.mark.parametrize("argv, message", [
    (["plan", "--deadline-from", "1f1b"], "needs --type optimal"),
    (["plan", "--deadline-from", "1f1b", "--type", "optimal", "--max-slowdown", "0.05"], "both set the deadline"),
    (["plan", "--deadline-from", "1f1b", "--compat", "perseus"], "--compat perseus"),
    (["plan", "--deadline-from", "ours", "--type", "optimal"], "invalid choice"),
    (["plan", "--type", "optimal", "--scheduling", "interleaved", "--virtual-stages", "2", "--deadline-from", "1f1b",
      "--max-inflight", "10"], "holds 11.5 micro-batch activations on stage 0"),
    (["plan", "--type", "optimal", "--scheduling", "interleaved", "--virtual-stages", "2", "--max-inflight", "10"],
     "--max-inflight 10 budgets the extra warm-up of --scheduling ours"),  # no deadline: still refused
    (["plan", "--type", "optimal", "--scheduling", "interleaved", "--virtual-stages", "2", "--deadline-from", "1f1b",
      "--p2p-latency", "1"], "cannot run in 1F1B's time"),
    (["menu", "--max-inflight", "10"], "holds 11.5 micro-batch activations on stage 0"),
    (["menu", "--schedules", "1f1b,zero"], "expected some of 1f1b,ours,interleaved"),
    (["menu", "--schedules", "1f1b,ours,1f1b"], "1f1b given twice in '1f1b,ours,1f1b': name each schedule once"),
])
def test_bad_combinations_are_one_line_errors(argv: list[str], message: str, capsys) -> None:
    code, out, err = run([*argv[:1], "--profile", "a40/gpt3-175b", "-m", "16", *argv[1:]], capsys)
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and message in err and "Traceback" not in err, err


# -- training: --envpipe-deadline-from 1f1b -----------------------------------------------------------------------
def training(*flags: str) -> EnvPipeConfig:
    parser = add_envpipe_args(argparse.ArgumentParser())
    return EnvPipeConfig.from_args(parser.parse_args(list(flags)))


MEGATRON = argparse.Namespace(pipeline_model_parallel_size=8, num_microbatches=16,
                              virtual_pipeline_model_parallel_size=2)
INTERLEAVED = ("--envpipe-type", "optimal", "--envpipe-scheduling", "interleaved", "--envpipe-deadline-from", "1f1b")


@pytest.mark.parametrize("flags, message", [
    (("--envpipe-deadline-from", "1f1b"), "needs --envpipe-type optimal"),
    (("--envpipe-type", "optimal", "--envpipe-deadline-from", "1f1b", "--envpipe-target-time", "9"),
     "both set the optimal plan's deadline"),
    (("--envpipe-type", "optimal", "--envpipe-deadline-from", "1f1b", "--envpipe-max-slowdown", "0.1"),
     "both set the optimal plan's deadline"),
    (("--envpipe-type", "optimal", "--envpipe-deadline-from", "1f1b", "--envpipe-per-iteration-plans"),
     "drop one of them"),
    (("--envpipe-type", "optimal", "--envpipe-scheduling", "interleaved", "--envpipe-max-inflight", "12"),
     "budgets the extra warm-up"),  # without the deadline a budget does nothing to interleaved: refused as before
])
def test_training_flag_refuses_bad_combinations(flags: tuple[str, ...], message: str) -> None:
    with pytest.raises(EnvPipeConfigError, match=message):
        training(*flags)


def test_training_checks_the_interleaved_budget_at_start_up() -> None:
    with pytest.raises(EnvPipeConfigError, match=r"--envpipe-max-inflight 11: interleaved V=2 holds 11.5"):
        training(*INTERLEAVED, "--envpipe-max-inflight", "11").validate_with_megatron_args(MEGATRON)
    ok = training(*INTERLEAVED, "--envpipe-max-inflight", "12").validate_with_megatron_args(MEGATRON)
    assert ok.planner_config().max_inflight is None  # a check, never a planner budget for interleaved
    with pytest.raises(EnvPipeConfigError, match="--no-envpipe-per-iteration-plans"):
        training(*INTERLEAVED).validate_with_megatron_args(argparse.Namespace(**vars(MEGATRON),
                                                                              variable_seq_lengths=True))


def test_runtime_plans_the_menu_row_at_1f1b_time() -> None:
    """Training's plan is the menu's row (same profile, P2P power, no margin or switch cost), with 1F1B's time
    predicted at start-up and the plan's saving against it kept for the log."""
    cfg = training(*INTERLEAVED, "--envpipe-profile", "a40/gpt3-175b", "--envpipe-timing-margin", "0",
                   "--envpipe-gpu", "a40")
    rt = EnvPipeRuntime(cfg)
    it = rt.prepare(8, 16, num_chunks=2)
    assert it.plan is not None and it.schedule.num_chunks == 2
    menu = build_menu(Profile.from_csv(shipped_profile("a40/gpt3-175b")), 16,
                      PlannerConfig("optimal", "ours", "default", gpu=get_gpu_spec("a40"), switch_cost_j=0.0),
                      schedules=("interleaved",))
    row = next(r for r in menu.rows if r.deadline == "1F1B's time")
    assert rt.deadline is not None and rt.deadline.deadline_s == menu.reference.iteration_time_s
    assert rt.last_result.energy_j == row.energy_j and rt.last_result.score.iteration_time_s == row.iteration_time_s
    assert rt.last_result.deadline_s == pytest.approx(menu.reference.iteration_time_s, rel=1e-15)


@pytest.fixture(scope="module")
def printed_menus() -> dict[str, tuple[int, str, str]]:
    """Command -> (exit code, stdout, stderr) of `envpipe menu`, run once for the docs that show it."""
    return {}


@pytest.mark.parametrize("doc", ["README.md", "docs/menu.md"])
def test_the_menu_the_docs_show_is_what_envpipe_menu_prints_now(doc: str, capsys, printed_menus) -> None:
    text = (Path(__file__).resolve().parents[2] / doc).read_text()
    command = "envpipe menu --profile a40/gpt3-175b --microbatches 16\n"
    shown = text.split(command, 1)[1].split("```text\n", 1)[1].split("```", 1)[0].splitlines()
    if command not in printed_menus:
        printed_menus[command] = run(command.split()[1:], capsys)
    code, out, err = printed_menus[command]
    assert code == 0, err
    assert len(shown) == 6 and all(line in out.splitlines() for line in shown), out
