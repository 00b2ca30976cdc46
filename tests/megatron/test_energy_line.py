"""The training log's energy line states the plan's own figures: measured time against the plan's, saving against the planned one."""

from __future__ import annotations

from megatron_envpipe.core.energy_report import EnergyReport


def test_line_compares_time_and_saving_with_the_plan():
    report = EnergyReport(iteration=12, time_s=3.838, energy_j=900.0, stage_power_w=(60.0, 70.0),
                          predicted_baseline_j=1000.0, simulated=True, planned_time_s=3.80, planned_saving=0.105)
    line = report.line()
    # No measured baseline: the predicted one, and the line says so.
    assert "saving 10.00% (planned 10.50%) vs the predicted baseline's 1000.0 J (baseline: predicted)" in line
    assert "time +1.00% vs the plan's 3.800 s" in line
    assert line.startswith("EnvPipe energy (simulated) | iteration 12 |")


def test_line_without_a_plan_says_no_plan_figures():
    line = EnergyReport(3, 2.0, 500.0, (50.0,), None, False).line()
    assert "saving" not in line and "vs the plan" not in line and "(simulated)" not in line
