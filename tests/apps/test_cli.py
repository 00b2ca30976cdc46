"""The envpipe command line, run in-process through main()."""

from __future__ import annotations

import json

import pytest

from megatron_envpipe.apps.cli import main

ACCEPT = ["plan", "--profile", "a40/gpt3-175b", "--microbatches", "12", "--type", "envelope",
          "--scheduling", "1f1b", "--reconfig", "balanced", "--gpu", "a40"]


def run(capsys, argv):
    code = main(argv)
    out = capsys.readouterr()
    return code, out.out, out.err


def test_plan_json_has_the_documented_keys(capsys):
    code, out, _ = run(capsys, ACCEPT + ["--json"])
    assert code == 0
    data = json.loads(out)
    for key in ("iteration_time_s", "energy_j"):
        assert data["baseline"][key] > 0 and data["plan"][key] > 0
    assert 0.05 < data["energy_saving"] < 0.5
    assert abs(data["slowdown"]) < 0.01
    assert data["planner_seconds"] < 5
    assert len(data["plan"]["frequencies"]) == 8
    assert data["plan"]["frequencies"][7][0] == ["F0", 1740]


def test_plan_text_out_show_and_simulate(capsys, tmp_path):
    plan_path = tmp_path / "plan.json"
    png = tmp_path / "t.png"
    code, out, _ = run(capsys, ACCEPT + ["--scheduling", "ours", "--out", str(plan_path), "--plot", str(png)])
    assert code == 0
    assert "energy saving" in out and "Stage 7 | [F0 1740" in out
    assert png.stat().st_size > 10_000 and png.read_bytes()[:4] == b"\x89PNG"
    code, shown, _ = run(capsys, ["show", str(plan_path)])
    assert code == 0 and "Stage 0 |" in shown and "saving" in shown
    saved = json.loads(plan_path.read_text())
    code, sim, _ = run(capsys, ["simulate", "--profile", "a40/gpt3-175b", "--gpu", "a40", "--plan", str(plan_path), "--json"])
    assert code == 0
    # Re-simulating the saved plan gives the planner's own numbers.
    assert json.loads(sim)["energy_j"] == pytest.approx(saved["plan"]["energy_j"], rel=1e-12)
    assert json.loads(sim)["iteration_time_s"] == pytest.approx(saved["plan"]["iteration_time_s"], rel=1e-12)


def test_schedule_and_gpus(capsys):
    code, out, _ = run(capsys, ["schedule", "--stages", "4", "--microbatches", "8", "--scheduling", "ours",
                                "--extra-warmup", "4,3,1,0"])
    assert code == 0 and "S1: F0 F1 F2 F3 F4 F5 B0 F6 B1 F7" in out and "[8, 6, 3, 1]" in out
    code, out, _ = run(capsys, ["gpus"])
    assert code == 0 and "a40" in out and "70.38" in out


@pytest.mark.parametrize(
    "argv,needle",
    [
        (["plan", "--profile", "missing.csv", "-m", "4"], "no profile 'missing.csv'"),
        (ACCEPT + ["--stages", "4"], "does not match the profile's 8 stages"),
        (ACCEPT + ["--gpu", "b9000"], "unknown GPU 'b9000'"),
        (ACCEPT + ["--compat", "perseus", "--scheduling", "ours"], "--compat perseus reproduces"),
        (["show", "/nonexistent/plan.json"], "cannot read plan"),
    ],
)
def test_errors_are_one_line_with_exit_2(capsys, argv, needle):
    code, _, err = run(capsys, argv)
    assert code == 2
    assert needle in err and err.count("\n") == 1


def test_corrupt_profile_named_in_error(capsys, tmp_path):
    bad = tmp_path / "bad.csv"
    bad.write_text("stage,instruction,frequency,time,energy\n0,forward,1410,x,1\n")
    code, _, err = run(capsys, ["plan", "--profile", str(bad), "-m", "4"])
    assert code == 2 and f"{bad}:2: time 'x' is not a number" in err


def test_compare_plans_example_runs():
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[2] / "examples" / "compare_plans.py"
    out = subprocess.run([sys.executable, str(script), "--microbatches", "8"], capture_output=True, text=True, check=True)
    from megatron_envpipe.core.vocabulary import PLAN_TYPES, RECONFIG_POLICIES

    assert out.stdout.count("\n") == 2 + len(PLAN_TYPES) * 2 * len(RECONFIG_POLICIES)
    assert "envelope ours  balanced" in out.stdout


def test_plan_reports_and_limits_clock_changes(capsys):
    base = ["plan", "--profile", "a40/gpt3-175b", "-m", "12", "--type", "optimal", "--scheduling", "ours"]
    code, out, _ = run(capsys, base + ["--switch-cost-j", "0", "--json"])
    free = json.loads(out)
    assert code == 0 and free["clock_switching"] is None  # 0: the pass is off
    assert free["clock_changes_per_rank_per_iteration"] == free["plan"]["clock_changes_per_stage"]
    code, out, _ = run(capsys, base + ["--max-clock-changes", "5", "--json"])
    capped = json.loads(out)
    assert code == 0 and max(capped["clock_changes_per_rank_per_iteration"]) <= 5
    sw = capped["clock_switching"]
    # With changes charged the warm-up candidate is judged after the pass (issue 34), so "before" is that
    # candidate's switch-free count: one per rank, never below what the pass kept, above the cap somewhere.
    before, after = sw["clock_changes_before"], capped["clock_changes_per_rank_per_iteration"]
    assert len(before) == len(after) == len(free["clock_changes_per_rank_per_iteration"])
    assert all(b >= a for b, a in zip(before, after)) and max(before) > 5, (before, after)
    assert sw["switch_cost_j"] == pytest.approx(0.7038)  # optimal's default: 10 ms x 70.38 W
    assert capped["plan"]["iteration_time_s"] <= free["plan"]["iteration_time_s"] * (1 + 1e-9)
    assert capped["energy_saving"] == pytest.approx(1 - capped["plan"]["energy_j"] / capped["baseline"]["energy_j"])
    code, out, _ = run(capsys, base + ["--max-clock-changes", "5"])
    assert code == 0 and "clock changes per rank per iteration [" in out and "before the switching pass" in out
    # EnvPipe's own plan types: reported, not changed, unless asked
    code, out, _ = run(capsys, ACCEPT + ["--json"])
    assert json.loads(out)["clock_switching"] is None


@pytest.mark.parametrize("argv, needle", [
    (["--switch-cost-j", "-1"], "--switch-cost-j"),
    (["--switch-cost-j", "inf"], "--switch-cost-j"),
    (["--max-clock-changes", "0"], "--max-clock-changes"),
    (["--compat", "perseus", "--scheduling", "1f1b", "--max-clock-changes", "3"], "--compat perseus has no"),
])
def test_switching_flag_errors(capsys, argv, needle):
    try:
        code = main(["plan", "--profile", "a40/gpt3-175b", "-m", "12"] + argv)
    except SystemExit as exc:  # argparse's own range checks
        code = exc.code
    err = capsys.readouterr().err
    assert code == 2 and needle in err and len(err.strip().splitlines()) == 1, err
