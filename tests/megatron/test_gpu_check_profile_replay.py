"""gpu-check steps 5 and 6 on the CPU, as CI runs them: a real Megatron-core stage on CPU tensors against the
simulated GPU on virtual time (stepped 100 ms counter, clock-dependent blocking power). Step 5 must write a
profile.csv that is the device's own profile within the uncertainty it reports; step 6 must replay the four
plans from it within its derived tolerance, and a replay at the wrong clocks must be a mismatch.

Load-proof: all device time is virtual, so the host's speed changes nothing below."""

from __future__ import annotations

import time

import pytest

pytest.importorskip("torch", reason="needs torch and megatron-core: pip install -e '.[megatron]' (install.sh does)")
pytest.importorskip("megatron.core", reason="needs torch and megatron-core: pip install -e '.[megatron]' (install.sh does)")

from megatron_envpipe.apps.gpu_check import profile_step, replay_step  # noqa: E402
from megatron_envpipe.apps.gpu_check.stage_bench import _SIM_SOURCE  # noqa: E402
from megatron_envpipe.apps.gpu_check.step_api import StepContext, StepResult  # noqa: E402
from megatron_envpipe.core.profile import Profile  # noqa: E402
from megatron_envpipe.core.resources import shipped_profile  # noqa: E402


def _ctx(tmp_path, limit_s: float, earlier=None) -> StepContext:
    return StepContext(out_dir=tmp_path, device="cpu", device_index=0, limit_s=limit_s,
                       started_monotonic=time.monotonic(), earlier=earlier or {}, state_dir=str(tmp_path / "state"))


@pytest.fixture(scope="module")
def profiled(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu-check")
    result = profile_step.run(_ctx(out, 100.0, {"counter": {"counter_period_s": 0.1, "read_cost_s": 0.0}}))
    StepResult.from_json(result.to_json())  # crosses the process boundary as JSON
    (out / "profile.csv").write_text(result.files["profile.csv"])
    return out, result


def test_profile_step_writes_the_devices_profile(profiled):
    out, result = profiled
    assert result.status == "ok", result.reason
    fig = result.figures
    assert fig["simulated"] is True and fig["counter_period_from"] == "step 2" and fig["not_reached"] == []
    assert len(fig["clocks_mhz"]) == profile_step.MAX_CLOCKS and fig["clocks_mhz"][0] == 1740
    measured = Profile.from_csv(out / "profile.csv")
    truth = Profile.from_csv(shipped_profile(_SIM_SOURCE))
    rel_unc = fig["energy_rel_unc_max"]
    assert 0 < rel_unc < 0.05
    for f in fig["clocks_mhz"]:
        for ins in ("forward", "backward"):
            assert measured.time_s(0, ins, f) == pytest.approx(truth.time_s(0, ins, f), rel=1e-9)
            assert abs(measured.energy_j(0, ins, f) / truth.energy_j(0, ins, f) - 1) <= rel_unc
    assert "profile.csv" in result.files and any("12 of 12 clocks" in line for line in result.lines)


def test_replay_step_matches_and_its_control_does_not(profiled):
    out, profile_result = profiled
    result = replay_step.run(_ctx(out, 90.0, {"profile": profile_result.figures}))
    assert result.status == "ok", result.reason
    fig = result.figures
    assert fig["all_within_tolerance"] is True and fig["control_mismatch_detected"] is True
    assert fig["blocking_power_from"].startswith("step 5")  # no step 4 here: idle per clock, measured
    plans = {(p["plan"], p["replay_clocks"]): p for p in fig["plans"]}
    for name in replay_step._PLANS:
        p = plans[(name, "planned")]
        assert abs(p["error"]) <= p["tolerance"] < 0.05, p
        assert abs(p["measured_saving"] - p["predicted_saving"]) <= p["tolerance"], p
    assert plans[("optimal:ours", "planned")]["predicted_saving"] > 0.05
    assert plans[("optimal:ours", "max")]["error"] > 0.05
    text = result.files["replay.csv"]
    assert text.splitlines()[0].startswith("plan,replay_clocks,stage,predicted_j,measured_j")
    assert len(text.splitlines()) == 1 + 5 * 5


def test_a_replay_at_the_maximum_clock_is_a_mismatch(profiled):
    out, profile_result = profiled
    result = replay_step.run(_ctx(out, 90.0, {"profile": profile_result.figures}), replay_clocks="max")
    fig = result.figures
    assert fig["all_within_tolerance"] is False
    wrong = {p["plan"]: p for p in fig["plans"] if p["replay_clocks"] == "max"}
    for name in ("envelope:ours", "optimal:ours"):  # the plans that lower clocks the most
        assert not wrong[name]["ok"] and wrong[name]["error"] > wrong[name]["tolerance"], wrong[name]


def test_replay_without_a_profile_is_skipped_with_the_reason(tmp_path):
    result = replay_step.run(_ctx(tmp_path, 90.0))
    assert result.status == "skipped" and "profile.csv" in result.reason and "step 5" in result.reason


def test_replay_uses_step_4s_blocking_power_per_clock(profiled):
    out, profile_result = profiled
    # Step 4 measured a steeper blocking power (and could not measure one clock): the simulated GPU waits
    # at it and the prediction charges it, so they still agree; the clock it missed is interpolated over.
    step4 = {"blocking_power_w_by_clock": {"1740": 95.0, "1305": None, "870": 45.0}}
    result = replay_step.run(_ctx(out, 90.0, {"profile": profile_result.figures, "blocking_power": step4}))
    fig = result.figures
    assert result.status == "ok" and fig["blocking_power_from"].startswith("step 4"), result
    assert fig["all_within_tolerance"] is True and fig["control_mismatch_detected"] is True
