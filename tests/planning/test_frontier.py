"""The time-energy frontier: monotone, feasible, picks plans for a target time; `envpipe frontier`."""

from __future__ import annotations

import csv
import json

import pytest

pytest.importorskip("numpy")

from megatron_envpipe.apps.cli import main  # noqa: E402
from megatron_envpipe.apps.plot import frontier_image  # noqa: E402
from megatron_envpipe.core.gpu_specs import get_gpu_spec  # noqa: E402
from megatron_envpipe.core.timeline import PlanEvaluator  # noqa: E402
from megatron_envpipe.planning.basis import PlannerConfig, PlannerError
from megatron_envpipe.planning.frontier import CSV_COLUMNS, compute_frontier  # noqa: E402
from megatron_envpipe.planning.optimal import InfeasibleDeadline  # noqa: E402
from megatron_envpipe.planning.planner import plan_envpipe  # noqa: E402

A40 = get_gpu_spec("a40")
P2P = A40.p2p_power_w


@pytest.fixture(scope="module")
def gpt3_1f1b(gpt3_profile):
    return compute_frontier(gpt3_profile, 12, PlannerConfig("optimal", "1f1b", "default", gpu=A40), points=8)


@pytest.mark.parametrize("name,scheduling", [("gpt3", "ours"), ("bloom", "1f1b"), ("bloom", "ours")])
def test_frontier_is_monotone_and_feasible(name, scheduling, gpt3_profile, bloom_profile, gpt3_1f1b):
    prof = gpt3_profile if name == "gpt3" else bloom_profile
    fr = compute_frontier(prof, 8, PlannerConfig("optimal", scheduling, "default", gpu=A40), points=6)
    check_frontier(fr, prof)


def check_frontier(fr, prof):
    pts = fr.points
    assert len(pts) >= 3
    # Energy strictly falls as iteration time grows, from the fastest plan up to the valley.
    for a, b in zip(pts, pts[1:]):
        assert b.time_s > a.time_s and b.energy_j < a.energy_j
    assert pts[0].time_s == pytest.approx(fr.fastest_s, rel=1e-6)
    assert pts[-1].time_s <= fr.valley_s * (1 + 1e-9)
    ev = PlanEvaluator(fr.schedule, prof, fr.p2p_power_w)
    for pt in pts:
        sc = ev.score(pt.plan.flat())  # every point is a real plan, scored as everything else
        assert sc.iteration_time_s == pytest.approx(pt.time_s, rel=1e-12)
        assert sc.energy_j == pytest.approx(pt.energy_j, rel=1e-12)
        assert pt.time_s <= pt.deadline_s * (1 + 1e-9)
        assert pt.saving == pytest.approx(1 - pt.energy_j / fr.baseline.energy_j)
        assert pt.slowdown == pytest.approx(pt.time_s / fr.baseline.iteration_time_s - 1)


def test_1f1b_frontier_starts_at_the_zero_slowdown_optimum(gpt3_1f1b, gpt3_profile):
    fr = gpt3_1f1b
    check_frontier(fr, gpt3_profile)
    assert fr.fastest_s == pytest.approx(fr.baseline.iteration_time_s, rel=1e-12)  # 1F1B: f_max is fastest
    zero = plan_envpipe(gpt3_profile, 12, PlannerConfig("optimal", "1f1b", "default", gpu=A40))
    assert fr.points[0].energy_j <= zero.score.energy_j * (1 + 2e-3)
    assert fr.points[-1].saving > fr.points[0].saving + 0.05  # the valley saves much more, later


def test_pick_for_a_target_time(gpt3_1f1b):
    fr = gpt3_1f1b
    base_t = fr.baseline.iteration_time_s
    with pytest.raises(InfeasibleDeadline, match="faster than the fastest plan"):
        fr.pick(0.9 * base_t)
    target = 1.03 * base_t
    pt, e_at, base_at = fr.pick(target)
    assert pt.time_s <= target and pt is max((p for p in fr.points if p.time_s <= target), key=lambda p: p.time_s)
    assert e_at == pytest.approx(pt.energy_j + P2P * 8 * (target - pt.time_s))
    assert base_at == pytest.approx(fr.baseline.energy_j + P2P * 8 * (target - base_t))
    # Far beyond the valley the valley plan is picked; both then block until the target.
    pt2, e2, b2 = fr.pick(2 * base_t)
    assert pt2 is fr.points[-1] and b2 - e2 == pytest.approx(fr.baseline.energy_j - pt2.energy_j + P2P * 8 * (pt2.time_s - base_t))


def test_points_argument_is_checked(gpt3_profile):
    with pytest.raises(PlannerError, match="at least 2 points"):
        compute_frontier(gpt3_profile, 8, PlannerConfig("optimal", "1f1b", "default", gpu=A40), points=1)


def test_csv_and_plot(gpt3_1f1b, tmp_path):
    path = gpt3_1f1b.to_csv(tmp_path / "f.csv")
    rows = list(csv.reader(path.open()))
    assert tuple(rows[0]) == CSV_COLUMNS == ("time_s", "energy_j", "saving", "slowdown")
    assert len(rows) == 1 + len(gpt3_1f1b.points)
    assert float(rows[1][0]) == gpt3_1f1b.points[0].time_s
    png = frontier_image(gpt3_1f1b, "png", target_time_s=1.05 * gpt3_1f1b.baseline.iteration_time_s)
    assert png[:4] == b"\x89PNG" and len(png) > 10_000


def test_cli_frontier(capsys, tmp_path):
    csv_path, png = tmp_path / "out" / "frontier.csv", tmp_path / "out" / "frontier.png"
    argv = ["frontier", "--profile", "a40/bloom-176b", "--microbatches", "12", "--scheduling", "ours",
            "--points", "5", "--target-time", "7.5"]
    assert main(argv + ["--csv", str(csv_path), "--plot", str(png)]) == 0
    out = capsys.readouterr().out
    assert "frontier    " in out and "target 7.5000 s: run the" in out and "peak in-flight activations" in out
    assert csv_path.read_text().startswith("time_s,energy_j,saving,slowdown\n") and png.stat().st_size > 10_000
    assert main(argv + ["--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["scheduling"] == "ours" and len(data["points"]) >= 3
    assert data["target"]["plan_time_s"] <= 7.5 and data["target"]["saving_at_target"] > 0.15
    assert max(data["peak_inflight_activations"]) > 8  # ours holds more activations than 1F1B
    energies = [p["energy_j"] for p in data["points"]]
    assert energies == sorted(energies, reverse=True)
    # A target no plan can meet is a one-line error.
    assert main(["frontier", "--profile", "a40/bloom-176b", "-m", "8", "--points", "3", "--target-time", "1"]) == 2
    err = capsys.readouterr().err
    assert "faster than the fastest plan" in err and err.count("\n") == 1
