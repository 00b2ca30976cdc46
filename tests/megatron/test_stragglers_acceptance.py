"""Issue 24 acceptance, shortened: the tiny GPT on DP = 2 x PP = 2 with replica 1 15 % slower.

Replica 0 follows replica 1's pace within the first windows after planning; its measured energy per
iteration is >= 5 % lower than the same run with --no-envpipe-follow-stragglers, at the same iteration
time (within 1 %, simulated time: the straggler sets it either way); the losses equal stock Megatron's in
never-installed processes (--no-envpipe). A 2-stage profile is given so that no start-up sweep runs (the
full 40-iteration command in the issue sweeps first; same result, see the report).
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

from megatron_envpipe.core.profile import Profile
from megatron_envpipe.core.resources import shipped_profile

REPO = Path(__file__).resolve().parents[2]
ITERATIONS = 14
LINE = re.compile(r"EnvPipe energy \(simulated\) \| iteration (\d+) \| ([\d.]+) J over the pipeline in ([\d.]+) s")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _train(tmp_path: Path, name: str, *flags: str) -> tuple[str, list[float]]:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(
        [str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])]))
    losses = tmp_path / f"{name}.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4", "--master-addr", "127.0.0.1",
           "--master-port", str(_free_port()), str(REPO / "examples" / "train_tiny_gpt.py"),
           "--pipeline-model-parallel-size", "2", "--device", "cpu", "--train-iters", str(ITERATIONS),
           "--cache-dir", str(tmp_path / "cache"), "--losses-out", str(losses), *flags]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=400)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-6000:]
    return log, json.loads(losses.read_text())["losses"]


def _replica(log: str, replica: int) -> dict[int, tuple[float, float]]:
    """Iteration -> (J over the pipeline, s) of one replica's energy lines."""
    out = {}
    for line in log.splitlines():
        m = LINE.search(line)
        if m and line.rstrip().split(" | following")[0].endswith(f"| replica {replica}"):
            out[int(m.group(1))] = (float(m.group(2)), float(m.group(3)))
    return out


def test_replica_zero_follows_the_straggler_and_saves_energy_at_the_same_pace(tmp_path: Path):
    profile = tmp_path / "a40-2.csv"
    Profile.from_csv(shipped_profile("a40/gpt3-175b")).for_pipeline(2).to_csv(profile)
    envpipe = ["--envpipe-type", "optimal", "--envpipe-scheduling", "ours", "--envpipe-gpu",
               "simulated:a40/gpt3-175b", "--envpipe-profile", str(profile), "--envpipe-sim-straggler", "1:1.15"]
    follow_log, follow_losses = _train(tmp_path, "follow", *envpipe)
    wait_log, wait_losses = _train(tmp_path, "wait", *envpipe, "--no-envpipe-follow-stragglers")
    _, stock_losses = _train(tmp_path, "stock", "--no-envpipe")
    assert follow_losses == stock_losses and wait_losses == stock_losses  # bit for bit

    follows = [line for line in follow_log.splitlines() if "| replica 0 | following replica 1's pace" in line]
    assert follows, follow_log[-4000:]
    first = int(LINE.search(follows[0]).group(1))
    # Planned from iteration 3 (2 baseline iterations); windows of 3: decided at the second window's end.
    assert first <= 9, follows[0]
    assert "following replica 1" not in wait_log and "| replica 1 | following" not in follow_log

    fast, waiting, slow = _replica(follow_log, 0), _replica(wait_log, 0), _replica(follow_log, 1)
    last = range(first + 1, ITERATIONS + 1)
    energy = sum(fast[i][0] for i in last) / len(last)
    energy_waiting = sum(waiting[i][0] for i in last) / len(last)
    assert energy <= 0.95 * energy_waiting, (energy, energy_waiting)
    for i in last:
        assert abs(fast[i][1] / waiting[i][1] - 1) <= 0.01, (i, fast[i], waiting[i])
        assert abs(fast[i][1] / slow[i][1] - 1) <= 1e-9  # one pace: the straggler's
    # The figure README.md and docs/stragglers.md quote is this run's (simulated: the same on every host).
    saved = f"{100 * (1 - energy / energy_waiting):.1f} % less energy per iteration"
    stale = [doc for doc in ("README.md", "docs/stragglers.md") if saved not in " ".join((REPO / doc).read_text().split())]
    assert not stale, f"{stale} should quote what this run measures: {saved!r}"
