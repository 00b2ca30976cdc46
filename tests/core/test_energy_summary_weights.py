"""The exit summary over log windows of different lengths weights each window by its iterations."""

from __future__ import annotations

import pytest

from megatron_envpipe.core.energy_report import Baseline, EnergyReport, summary_line


def window(last: int, iterations: int, energy_j: float, time_s: float) -> EnergyReport:
    return EnergyReport(iteration=last, time_s=time_s, energy_j=energy_j, stage_power_w=(60.0, 70.0),
                        predicted_baseline_j=1000.0, simulated=True, iterations=iterations)


def test_windows_of_different_lengths_are_weighted_by_their_iterations():
    # 2 iterations at 1000 J / 5 s, then 8 at 800 J / 4 s: per iteration 840 J in 4.2 s
    # (an unweighted mean of the windows would say 900 J in 4.5 s).
    reports = [window(2, 2, 1000.0, 5.0), window(10, 8, 800.0, 4.0)]
    line = summary_line(reports, Baseline(1000.0, 4.0, 2, 1740), simulated=True, num_gpus=2)
    assert line.startswith("EnvPipe summary (simulated) | iterations 1-10 (10 iterations): 840.0 J over the "
                           "pipeline in 4.200 s per iteration")
    assert "energy -16.00%, time +5.00% vs the measured baseline" in line
    # kWh at the weighted pace: 160 J saved per 4.2 s iteration.
    kwh = 160.0 / 4.2 * 86400 / 3.6e6
    assert f"at this pace {kwh:.3f} kWh saved per day over 2 GPUs" in line
    assert kwh == pytest.approx(0.914, abs=1e-3)


def test_the_order_of_the_windows_does_not_change_the_means():
    a, b = window(3, 3, 900.0, 3.0), window(4, 1, 500.0, 7.0)  # 800 J, 4.0 s per iteration
    for reports in ([a, b], [b, a]):
        line = summary_line(reports, None, simulated=False, num_gpus=1)
        assert "(4 iterations): 800.0 J over the pipeline in 4.000 s per iteration" in line
