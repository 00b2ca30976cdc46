"""bench/gpu_stage_replay.py on the simulated GPU: a real Megatron stage profiled, planned for 4 stages,
replayed stage by stage; the replay's energy must match the plans' prediction, and a replay at the wrong
clocks must be reported as a mismatch.

Load-proof by construction: the bench runs the simulated GPU on simulated time (a VirtualClock), so the
real kernels take no device time and a busy host cannot make a unit late or charge it idle power. That is
why the bounds below are rounding-tight: any difference is a bug, not host load."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

from megatron_envpipe.core.profile import Profile
from megatron_envpipe.core.resources import shipped_profile
from megatron_envpipe.errors import UsageError

BENCH = Path(__file__).resolve().parents[2] / "bench" / "gpu_stage_replay.py"
TINY = ["--hidden", "32", "--heads", "4", "--layers", "1", "--seq", "16", "--micro-batch", "1",
        "--stages", "4", "--microbatches", "8", "--sim-unit-ms", "8", "--idle-s", "0.2"]


def _load_bench():
    spec = importlib.util.spec_from_file_location("envpipe_bench_gpu_stage_replay", BENCH)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


bench = _load_bench()


def test_replay_matches_prediction_on_the_simulated_gpu(tmp_path):
    out_path = tmp_path / "replay.json"
    out = bench.main(TINY + ["--out", str(out_path)])
    assert out["simulated"] is True
    rows = {r["plan"]: r for r in out["results"]}
    assert set(rows) == set(bench.PLANS)
    for name, row in rows.items():
        # Exact up to float rounding (~1e-15 measured): simulated time has no host noise to tolerate.
        assert abs(row["error"]) <= 1e-9, (name, row)
        assert abs(row["baseline_error"]) <= 1e-9, (name, row)
        assert row["ok"], name
        assert abs(row["measured_saving"] - row["predicted_saving"]) <= 1e-9, (name, row)
        # The replay held the plan's time exactly; a replay at the lowest clocks is 2.8 % late (below).
        assert row["late_s"] <= 1e-9 * row["predicted_time_s"], (name, row)
    # Not a vacuous match: the plans do lower clocks, so the replay switched clocks and saved energy.
    assert rows["optimal:ours"]["predicted_saving"] > 0.05
    assert rows["envelope:ours"]["measured_saving"] > 0.05
    # The measured profile is the simulated GPU's own (stage 0 of the shipped A40 profile) at the swept clocks.
    measured = Profile.from_csv_text(out["profile_csv"])
    source = Profile.from_csv(shipped_profile("a40/gpt3-175b"))
    assert measured.num_stages == 4
    for f in measured.frequencies(0, "forward"):
        for ins in ("forward", "backward"):
            assert measured.time_s(3, ins, f) == pytest.approx(source.time_s(0, ins, f), rel=1e-9)
            assert measured.energy_j(3, ins, f) == pytest.approx(source.energy_j(0, ins, f), rel=1e-9)
    assert json.loads(out_path.read_text())["results"] == out["results"]


@pytest.mark.parametrize("clocks", ["max", "min"])
def test_replay_at_wrong_clocks_is_a_mismatch(clocks):
    out = bench.main(TINY + ["--plans", "optimal:ours", "--replay-clocks", clocks])
    (row,) = out["results"]
    assert abs(row["baseline_error"]) <= 1e-9  # the baseline replay is still right
    assert not row["ok"]
    if clocks == "max":  # f_max everywhere: more energy than the low-clock plan predicts (+19 %), on time
        assert row["error"] > 0.05 and row["late_s"] <= 1e-9 * row["predicted_time_s"]
    else:  # f_min everywhere: less energy (-12 %) but late (2.8 %): the late bound above is not vacuous
        assert row["error"] < -0.05 and row["late_s"] > 0.01 * row["predicted_time_s"]


@pytest.mark.parametrize("argv", [["--stages", "1"], ["--tolerance", "nan"], ["--plans", "optimal:zb"],
                                  ["--sim-unit-ms", "inf"], ["--hidden", "30", "--heads", "4"]])
def test_bad_inputs_are_usage_errors(argv):
    with pytest.raises(UsageError):
        bench.main(argv)
