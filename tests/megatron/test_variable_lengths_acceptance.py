"""Issue 25 acceptance, shortened: the tiny GPT on PP = 4 with --variable-seq-lengths, --envpipe-type optimal,
scheduling ours, on the simulated A40 (GPT-3 profile), plans every iteration's clocks for its micro-batches'
sizes in the background and logs them with their predicted saving; its losses equal stock Megatron's bit for
bit (trained first in the same ranks, before EnvPipe is installed: --stock-reference-iters; that this reference is
what a never-installed process computes is tests/apps/test_example_tiny_gpt.py's to prove). A 4-stage profile is given so that no
start-up sweep runs (the issue's 20-iteration command sweeps first: measured in the report).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from launching import torchrun

from megatron_envpipe.core.profile import Profile
from megatron_envpipe.core.resources import shipped_profile

REPO = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.dist, pytest.mark.e2e]  # whole tiny-GPT trainings under torchrun
ITERATIONS = 7  # 2 baseline iterations, the start-up plan's first iteration, then 4 per-iteration plans
PLAN_LINE = re.compile(r"EnvPipe per-iteration plans \| iteration (\d+) \| (\d+) plan\(s\): predicted [\d.]+ s, "
                       r"[\d.]+ J/iter vs stock at f_max for those sizes [\d.]+ s, [\d.]+ J/iter: saving ([\d.]+) %")


def _train(tmp_path: Path, name: str, *flags: str) -> tuple[str, dict]:
    losses = tmp_path / f"{name}.json"
    log = torchrun(["--nproc-per-node", 4, REPO / "examples" / "train_tiny_gpt.py", "--pipeline-model-parallel-size", 4,
                    "--device", "cpu", "--variable-seq-lengths", "--train-iters", ITERATIONS, "--log-interval", 2,
                    "--cache-dir", tmp_path / "cache", "--losses-out", losses, *flags],
                   cwd=tmp_path, log_dir=tmp_path / f"{name}-ranks", timeout_s=400, forked=True).log
    return log, json.loads(losses.read_text())


def test_per_iteration_plans_train_with_stock_losses_and_log_their_saving(tmp_path: Path):
    profile = tmp_path / "gpt3-175b-p4.csv"
    Profile.from_csv(shipped_profile("a40/gpt3-175b")).for_pipeline(4).to_csv(profile)
    log, run = _train(tmp_path, "envpipe", "--envpipe-type", "optimal", "--envpipe-scheduling", "ours",
                      "--envpipe-gpu", "simulated:a40/gpt3-175b", "--envpipe-profile", str(profile),
                      "--envpipe-profile-cache", "off", "--stock-reference-iters", str(ITERATIONS))
    stock = run["stock_reference"]
    assert run["losses"] == stock["losses"] and run["tokens"] == stock["tokens"]  # bit for bit
    assert len(stock["losses"]) == ITERATIONS and all(
        rank == {"functions": ["megatron.core.pipeline_parallel.schedules.forward_backward_pipelining_without_interleaving"],
                 "envpipe_installed": False, "executor_imported": False} for rank in stock["schedule"])
    assert all(f == ["megatron_envpipe.megatron.executor.envpipe_forward_backward"]
               for f in (rank["functions"] for rank in run["schedule"]))

    assert "EnvPipe per-iteration plans on: length model default length model (gpt3-175b" in log, log[-4000:]
    assert "sizes scaled x 16: a full micro-batch (2 x 64 tokens) has the 2048 tokens" in log
    lines = [PLAN_LINE.search(line) for line in log.splitlines() if "EnvPipe per-iteration plans |" in line]
    assert [m.group(1) for m in lines if m] == ["4", "6"], log[-4000:]  # every log interval under the plan
    assert all(0 < float(m.group(3)) < 60 for m in lines if m)  # a saving vs stock at f_max, same sizes
    summary = [line for line in log.splitlines() if "EnvPipe per-iteration plans | run |" in line]
    assert len(summary) == 1 and re.search(r"\| run \| \d+ plan\(s\): .* saving [\d.]+ %", summary[0]), log[-3000:]

    plans = run["envpipe_run"]["per_iteration_plans"]
    assert plans["off_reason"] is None and plans["started"]
    # Iteration 3 runs the start-up plan (nothing planned yet); 4..7 each ran their own plan, or (a plan
    # late on a loaded host) the previous one, counted: every iteration is accounted for.
    assert plans["planned"] + plans["fallbacks"] + plans["unknown"] == ITERATIONS - 3, plans
    assert plans["planned"] >= 1 and plans["unknown"] == 0, plans
    assert 0 < plans["energy_j"] < plans["baseline_energy_j"], plans
    # The energy line of a window run wholly under per-iteration plans is held to their figures (iterations
    # 5-6, unless a plan was late on a loaded host); the mixed window 3-4 keeps the start-up plan's.
    energy = {int(m.group(1)): line for line in log.splitlines()
              if (m := re.search(r"EnvPipe energy \(simulated\) \| iterations? (?:\d+-)?(\d+) \|", line))}
    assert "vs the plan's" in energy[4] and "per-iteration" not in energy[4], energy
    if plans["fallbacks"] == 0:
        assert "vs the per-iteration plans'" in energy[6] and "predicted for the same micro-batch sizes" in energy[6] \
            and "measured baseline" not in energy[6], energy
    else:
        print(f"a per-iteration plan was late ({plans}): the window 5-6 check is skipped")
