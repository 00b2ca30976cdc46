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
