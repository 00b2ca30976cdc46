"""Measurement never stops training, end to end: the tiny GPT on 4 CPU ranks with the
simulated GPU, a fault injected on every stage, trains to the end with the losses of
stock Megatron (bit for bit, trained first in the same ranks: --stock-reference-iters) and an
energy report that names what was not measured.

The faults come from tests/gpu/fault_double.py, wrapped around the GPU each rank's
executor opens (a launcher patches ``megatron_envpipe.gpu.stage_gpu.open_gpu``
before training; ``$ENVPIPE_TEST_FAULTS`` says which stage gets what, counted in
units, 16 per iteration: 8 micro-batches x F and B).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

pytest.importorskip("torch", reason="needs torch and megatron-core: pip install -e '.[megatron]' (install.sh does)")
pytest.importorskip("megatron.core", reason="needs torch and megatron-core: pip install -e '.[megatron]' (install.sh does)")

from launching import child_env, torchrun  # noqa: E402

pytestmark = [pytest.mark.dist, pytest.mark.e2e]  # tiny-GPT trainings under torchrun (test tiers: docs/testing.md)
REPO = Path(__file__).resolve().parents[2]
NPROC = 4
ITERS = 12  # 1 warm-up + 4 swept clocks (+1 repeated), then planned iterations (room to recover)
UNITS = 16  # per iteration and stage
MEGATRON_1F1B = "megatron.core.pipeline_parallel.schedules.forward_backward_pipelining_without_interleaving"
LAUNCHER = """\
import sys
sys.path.insert(0, {tests_gpu!r})
import fault_double
fault_double.install_from_env()
from megatron_envpipe.apps.train_tiny_gpt import main
sys.exit(main())
"""
FAULTS = [
    # Profiling iteration 2 (1440 MHz) on stage 1: its samples are missing, the clock is repeated.
    # (Seconds of the simulated GPU's virtual clock, tests/gpu/fault_double.py: an iteration lasts ~4.4 s
    # there, 16 units of the A40 profile's times, whatever the host's speed.)
    {"stage": 1, "fault": "stall", "unit": 2 * UNITS + 4, "seconds": 2.0},
    # A driver reload inside iteration 7 on stage 2.
    {"stage": 2, "fault": "back", "unit": 7 * UNITS + 3},
    # Reads fail from iteration 8's last unit on stage 3 (1-based) on, for about two thirds of an iteration:
    # its end read fails.
    {"stage": 3, "fault": "read_fail", "unit": 8 * UNITS, "seconds": 3.0},
    # Stage 0 loses CAP_SYS_ADMIN after 7 clock locks (the start-up trial lock, then 4 while
    # profiling): monitor-only.
    {"stage": 0, "fault": "lock_fail", "after": 7},
]


def _run(tmp_path: Path, name: str, flags: list[str], faults: list[dict] | None = None) -> tuple[dict, str]:
    script = REPO / "examples" / "train_tiny_gpt.py"
    extra: dict[str, str] = {}
    if faults is not None:
        script = tmp_path / "faulty_train_tiny_gpt.py"
        script.write_text(LAUNCHER.format(tests_gpu=str(REPO / "tests" / "gpu")))
        extra["ENVPIPE_TEST_FAULTS"] = json.dumps(faults)
    out = tmp_path / f"{name}.json"
    # Forked ranks (tests/launching.py): the faults and what the ranks report are tested, not the launch.
    # The preload imports the example's module, not the executor: the launcher's patch of the GPU the
    # executor opens still comes first (the fault messages asserted below show it took).
    result = torchrun(["--nproc-per-node", NPROC, script, "--pipeline-model-parallel-size", NPROC, "--device", "cpu",
                       "--train-iters", ITERS, "--cache-dir", tmp_path / "cache", "--losses-out", out, *flags],
                      cwd=REPO, log_dir=tmp_path / f"{name}-log", timeout_s=400, env=child_env(**extra), forked=True)
    return json.loads(out.read_text()), result.log


def test_faults_on_every_stage_never_stop_training(tmp_path: Path) -> None:
    flags = ["--envpipe-type", "envelope", "--envpipe-scheduling", "ours", "--envpipe-reconfig", "balanced",
             "--envpipe-gpu", "simulated:a40/gpt3-175b",
             "--envpipe-profile-step", "300", "--envpipe-profile-iterations", "1",
             "--envpipe-profile-cache", "off", "--envpipe-log-interval", "1"]
    faulty, log = _run(tmp_path, "faulty", [*flags, "--stock-reference-iters", str(ITERS)], FAULTS)
    # Same math: the faults change what is measured and which clocks run, never the losses. The reference is
    # stock Megatron trained first in the same ranks, before EnvPipe (and its faulty GPU) was installed;
    # that it equals a never-installed process's run is tests/apps/test_example_tiny_gpt.py's to prove.
    stock = faulty["stock_reference"]
    assert all(rank == {"functions": [MEGATRON_1F1B], "envpipe_installed": False, "executor_imported": False}
               for rank in stock["schedule"]) and len(stock["schedule"]) == NPROC
    assert len(faulty["losses"]) == ITERS
    assert [x.hex() for x in faulty["losses"]] == [x.hex() for x in stock["losses"]]

    energy = [line for line in log.splitlines() if "EnvPipe energy (simulated) | iteration" in line]
    assert len(energy) == ITERS, log[-6000:]
    by_iteration = {int(re.search(r"\| iteration (\d+) \|", line).group(1)): line for line in energy}
    # Each fault's interval is named with its stage and reason (iterations are 1-based here).
    assert "not measured on stage 1 (counter stalled)" in by_iteration[3]
    assert re.search(r"not measured on stage .*2 \(counter went backwards\)", by_iteration[8])
    assert re.search(r"not measured on stage .*3 \(counter read failed\)", by_iteration[8])
    assert "J over the pipeline" in by_iteration[1]
    # The monitor recovers: once the read failures end (3 simulated seconds), some iteration after them is
    # measured on every stage again.
    assert any("J over the pipeline" in by_iteration[i] for i in range(10, ITERS + 1)), energy[-3:]
    # ...and every line carries the running count, by reason, and who lost clock control.
    last = by_iteration[ITERS]
    counts = re.search(r"(\d+) of (\d+) intervals unmeasured \(([^)]*)\)", last)
    assert counts and int(counts.group(2)) == ITERS * NPROC, last
    reasons = dict(part.split(": ") for part in counts.group(3).split(", "))
    assert set(reasons) == {"counter stalled", "counter went backwards", "counter read failed"}, last
    assert reasons["counter went backwards"] == "1" and int(counts.group(1)) == sum(map(int, reasons.values()))
    assert "clock control lost on stage 0 (NVML_ERROR_NO_PERMISSION" in last and "monitor-only" in last
    # One warning per stage and kind, not one per interval.
    assert log.count("continuing monitor-only") == 1
    assert log.count("is not measured (counter stalled") == 1
    # The profiler repeated the clock whose samples were missing (the stall may reach into
    # the next iteration too) and still measured every clock.
    assert re.search(r"start-up profiler: 4/4 clocks .* [12] iteration\(s\) unmeasured", log), log[-6000:]
