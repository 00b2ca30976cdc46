"""gpu-check steps 2 (energy counter) and 4 (blocking power) with ``--device cpu``: the same code as
on a GPU, against the simulated GPU in virtual time, must give back what the simulation was built
with (a 100 ms counter, the table's P2P power); the blocking measurement locks each clock through
the guard for its window only, and sizes its windows from step 2's figures."""

from __future__ import annotations

import contextlib
import json
import time

import pytest

from megatron_envpipe.apps.gpu_check import blocking_step, counter_step
from megatron_envpipe.apps.gpu_check.energy_window import window_length_s
from megatron_envpipe.apps.gpu_check.spin_wait import measure_blocking_power, spin_clocks_mhz
from megatron_envpipe.apps.gpu_check.step_api import STEP_FILES, StepContext, StepResult
from megatron_envpipe.core.device_dynamics import DeviceDynamics
from megatron_envpipe.core.gpu_specs import spec_for_profile_source
from megatron_envpipe.core.profile import Profile, ProfilePoint
from megatron_envpipe.core.virtual_clock import VirtualClock
from megatron_envpipe.gpu.control.safety import ClockGuard
from megatron_envpipe.gpu.devices.simulated import SimulatedGpu

A40_P2P_W = spec_for_profile_source("a40/gpt3-175b").p2p_power_w


def ctx(tmp_path, earlier=None, limit_s=45.0) -> StepContext:
    return StepContext(tmp_path / "out", "cpu", 0, limit_s, time.monotonic(), earlier=earlier or {},
                       state_dir=str(tmp_path / "state"))


def roundtrip(result: StepResult) -> StepResult:
    return StepResult.from_json(json.loads(json.dumps(result.to_json())))


def test_counter_step_on_cpu_recovers_the_simulated_counter(tmp_path):
    r = roundtrip(counter_step.run(ctx(tmp_path)))
    assert r.status == "ok", r.reason
    f = r.figures
    assert f["simulated"] is True
    assert f["counter_period_s"] == pytest.approx(0.1, rel=0.02)
    assert f["counter_period_idle_s"] == pytest.approx(0.1, rel=0.02)
    assert f["idle_power_w"] == pytest.approx(A40_P2P_W, rel=0.01)
    assert f["load_power_w"] > 2 * f["idle_power_w"]
    assert f["counter_step_j"] == pytest.approx(f["load_power_w"] * 0.1, rel=0.05)
    assert f["power_agreement"] == pytest.approx(0.0, abs=0.02)
    assert f["read_cost_s"] == 0.0
    assert set(r.files) == set(STEP_FILES["counter"])
    rows = r.files["counter.csv"].splitlines()
    assert rows[0].startswith("phase,kind,") and 10 < len(rows) <= 4001
    assert any(",idle," in x or x.startswith("idle,") for x in rows) and any(x.startswith("load,") for x in rows)
    assert r.lines and all("simulated" in x or "read cost" in x for x in r.lines)


def test_blocking_step_on_cpu_recovers_the_table_p2p_power(tmp_path):
    r = roundtrip(blocking_step.run(ctx(tmp_path)))
    assert r.status == "ok", r.reason
    f = r.figures
    assert len(f["blocking_power_w_by_clock"]) == 4
    for mhz, watts in f["blocking_power_w_by_clock"].items():
        assert watts == pytest.approx(A40_P2P_W, rel=0.005), mhz
        assert f["reached_sm_clock_mhz_by_clock"][mhz] == int(mhz)
    assert f["blocking_power_w"] == f["blocking_power_w_by_clock"][max(f["blocking_power_w_by_clock"], key=int)]
    assert f["idle_power_w"] == pytest.approx(A40_P2P_W, rel=0.005)
    assert f["spin_kind"] == "simulated"
    assert f["counter_period_from"].startswith("default")
    assert r.files == {}


def test_blocking_step_takes_the_period_from_step_2(tmp_path):
    r = blocking_step.run(ctx(tmp_path, earlier={"counter": {"counter_period_s": 0.05, "read_cost_s": 0.0}}))
    assert r.status == "ok", r.reason
    assert r.figures["counter_period_s"] == 0.05 and r.figures["counter_period_from"] == "step 2 (counter)"
    # a failed step 2 (figures None) falls back to the default, said so
    r = blocking_step.run(ctx(tmp_path, earlier={"counter": {"counter_period_s": None}}))
    assert r.status == "ok" and r.figures["counter_period_from"].startswith("default")


def test_window_plan_fits_tolerance_and_budget():
    shortest = window_length_s(0.1, blocking_step._TOLERANCE, 1e-4)
    assert blocking_step._window_plan_s(0.1, 1e-4, left_s=5.0) == pytest.approx(shortest)
    assert blocking_step._window_plan_s(0.1, 1e-4, left_s=1000.0) == blocking_step.MAX_WINDOW_S
    mid = blocking_step._window_plan_s(0.1, 1e-4, left_s=20.0)
    assert shortest < mid < blocking_step.MAX_WINDOW_S


def test_spin_clocks_are_max_three_quarters_half_min():
    h100 = list(range(1980, 195, -15))
    assert spin_clocks_mhz(h100) == (1980, 1485, 990, 210)
    assert spin_clocks_mhz([1410]) == (1410,)
    assert spin_clocks_mhz([]) == ()


BLOCK_W = 91.0


def sim(seed: int) -> tuple[SimulatedGpu, VirtualClock]:
    pts = {(0, ins): [ProfilePoint(f, 0.1, 0.1 * 250.0) for f in (1500, 1200, 900, 600)]
           for ins in ("forward", "backward")}
    vc = VirtualClock(start_s=5.0)
    gpu = SimulatedGpu(Profile(pts, source="<block>"), 0, p2p_power_w=BLOCK_W, clock=vc.now, sleep=vc.sleep,
                       dynamics=DeviceDynamics(counter_period_s=0.1, source="test"), seed=seed)
    return gpu, vc


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_blocking_measurement_locks_each_clock_for_its_window_only(tmp_path, seed):
    gpu, vc = sim(seed)
    seen: list[int | None] = []

    @contextlib.contextmanager
    def spinning(max_s, clock_mhz):
        seen.append(gpu.locked_clock_mhz())  # locked before the spin starts
        assert max_s > 0.5
        yield

    with ClockGuard(tmp_path / "state", install_handlers=False) as guard:
        out = measure_blocking_power(gpu, guard, (1500, 1200, 900, 600), spinning, counter_period_s=0.1,
                                     window_s=0.5, clock=vc.now, sleep=vc.sleep)
        assert gpu.locked_clock_mhz() is None  # reset after every window
    assert seen == [1500, 1200, 900, 600]
    assert set(out.blocking_power_w_by_clock) == {"1500", "1200", "900", "600"}
    for mhz, watts in out.blocking_power_w_by_clock.items():
        assert watts == pytest.approx(BLOCK_W, rel=0.005)
        assert abs(watts - BLOCK_W) <= out.uncertainty_w_by_clock[mhz] + 1e-9
    assert out.idle_power_w == pytest.approx(BLOCK_W, rel=0.005)
    assert out.blocking_power_w == out.blocking_power_w_by_clock["1500"]
    assert len(out.windows) == 5 and all(w.time_s >= 0.5 for w in out.windows)


def test_blocking_measurement_stops_when_out_of_time(tmp_path):
    gpu, vc = sim(0)
    left = iter([100.0, 100.0, 0.0, 0.0, 0.0, 0.0])
    with ClockGuard(tmp_path / "state", install_handlers=False) as guard:
        out = measure_blocking_power(gpu, guard, (1500, 1200, 900), lambda *a: contextlib.nullcontext(),
                                     counter_period_s=0.1, window_s=0.5, clock=vc.now, sleep=vc.sleep,
                                     left_s=lambda: next(left))
    assert list(out.blocking_power_w_by_clock) == ["1500", "1200"]
    assert out.idle_power_w is None
