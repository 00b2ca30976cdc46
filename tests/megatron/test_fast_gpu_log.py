"""Issue 33, the log on a fast GPU: the saving the run's exit summary reports equals (within 1 point) the
saving measured against a baseline run of the same length, on the tiny GPT (PP = 4) driven by the A40
GPT-3 profile with unit times x0.15 (17/42 ms), realistic dynamics (100 ms counter, 15 ms clock latency,
3 % heat), in virtual time. Before the baseline was measured again at the plan's GPU age the summary
said 12.7 % where the same-length baseline run measured 15.7 %. The same runs check issue 34's acceptance:
measured saving within 1.5 points of the plan's, iteration time within +1 % of the plan's."""

from __future__ import annotations

import re
import statistics

import pytest
from launching import REPO, torchrun

pytestmark = [pytest.mark.dist, pytest.mark.e2e]

ITERS = 40
FLAGS = ["--pipeline-model-parallel-size", 4, "--device", "cpu", "--train-iters", ITERS,
         "--envpipe-gpu", "simulated:a40/gpt3-175b", "--envpipe-sim-unit-scale", 0.15,
         "--envpipe-sim-dynamics", "realistic", "--envpipe-profile-cache", "off"]
LINE = re.compile(r"EnvPipe energy.*\| iteration (\d+) \| ([\d.]+) J over the pipeline in ([\d.]+) s")
PLAN = re.compile(r"EnvPipe plan optimal/.*?predicted energy saving ([\d.]+)%.*?iteration time ([-+][\d.]+)%")
SUMMARY = re.compile(r"EnvPipe summary \(simulated\) \| iterations (\d+)-(\d+) .*\| energy ([-+][\d.]+)%.*$", re.M)


def _energies(log: str) -> dict[int, float]:
    return {int(m.group(1)): float(m.group(2)) for m in LINE.finditer(log)}


def _times(log: str) -> dict[int, float]:
    return {int(m.group(1)): float(m.group(3)) for m in LINE.finditer(log)}


def test_the_logged_saving_is_what_a_same_length_baseline_run_measures(tmp_path):
    pytest.importorskip("megatron.core", reason="the tiny GPT trains with megatron-core")
    script = REPO / "examples" / "train_tiny_gpt.py"
    envpipe = torchrun(["--nproc-per-node", 4, script, *FLAGS, "--envpipe-type", "optimal",
                        "--envpipe-scheduling", "ours"], cwd=tmp_path, log_dir=tmp_path / "envpipe", timeout_s=600,
                       forked=True)
    base = torchrun(["--nproc-per-node", 4, script, *FLAGS, "--envpipe-type", "baseline",
                     "--envpipe-scheduling", "1f1b"], cwd=tmp_path, log_dir=tmp_path / "baseline", timeout_s=600,
                    forked=True)
    summary = SUMMARY.search(envpipe.log)
    assert summary, envpipe.log[-3000:]
    # The stock run measured no profile: it plans its schedule from a stand-in (unit times of 1 s), whose time is
    # no prediction, so its energy lines compare with none (they read "time -97.01% vs the plan's 22.000 s").
    # The EnvPipe run's lines, planned from its start-up profile, do.
    stock_lines = [line for line in base.log.splitlines() if LINE.search(line)]
    assert stock_lines and not any("vs the plan's" in line for line in stock_lines), stock_lines[:2]
    assert any("vs the plan's" in line for line in envpipe.log.splitlines() if LINE.search(line)), envpipe.log[-3000:]
    first, last, logged = int(summary.group(1)), int(summary.group(2)), -float(summary.group(3))
    assert last == ITERS and "measured again up to iteration" in summary.group(0)
    # The same iterations, at the same GPU age, in both runs.
    ran, stock = _energies(envpipe.log), _energies(base.log)
    window = range(first, last + 1)
    measured = 100 * (1 - statistics.fmean(ran[i] for i in window) / statistics.fmean(stock[i] for i in window))
    print(f"\nlogged {logged:.2f} %, measured against a baseline run of the same length {measured:.2f} % "
          f"(iterations {first}-{last})")
    assert abs(logged - measured) < 1.0
    assert measured > 12  # and it is a saving (the plan from the start-up profile predicts ~16 %)
    # Issue 34's acceptance, same runs: measured saving within 1.5 points of the plan's, iteration time
    # within +1 % of the plan's (both against their baselines: the plan's deadline, the baseline run).
    plan = PLAN.search(envpipe.log)
    assert plan, envpipe.log[-3000:]
    time_ran = statistics.fmean(_times(envpipe.log)[i] for i in window)
    time_stock = statistics.fmean(_times(base.log)[i] for i in window)
    assert abs(measured - float(plan.group(1))) <= 1.5
    assert (time_ran / time_stock) / (1 + float(plan.group(2)) / 100) <= 1.01
