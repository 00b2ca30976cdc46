"""Start-up profiler: sweep decisions, attribution, the profile cache, and the acceptance
test: profiling simulated GPUs reproduces the profile that drives them within 2 %."""

from __future__ import annotations

import json
import time

import pytest

from megatron_envpipe.core.profile import Profile, ProfilePoint
from megatron_envpipe.core.resources import shipped_profile
from megatron_envpipe.gpu.devices.simulated import SimulatedGpu
from megatron_envpipe.gpu.energy.monitor import EnergyMonitor
from megatron_envpipe.gpu.profiler.profile_cache import ProfileCache, ProfileKey, ProfileMeta, _key_digest
from megatron_envpipe.gpu.profiler.sweep import (
    BlockingSample,
    ClockSweep,
    ProfileRow,
    StageSamples,
    UnitSample,
    blocking_power_w,
    robust_mean,
    stage_samples,
    sweep_candidates,
)
from megatron_envpipe.testing.profiler_runs import a40_three_stages, profile_on_simulated_gpus, relative_errors

A40_P2P_W = 70.38


# -- candidates and statistics ---------------------------------------------------------
def test_sweep_candidates_start_at_the_true_maximum():
    a40 = range(1740, 209, -15)
    cands = sweep_candidates(a40, 90)
    assert cands[:4] == (1740, 1650, 1560, 1470) and cands[-1] == 210 and len(cands) == 18
    assert sweep_candidates(a40, 90, min_mhz=855)[-1] == 930
    # A100: 1410 is not a multiple of 90, and it is still the first clock (EnvPipe swept from 1350).
    assert sweep_candidates(range(1410, 209, -15), 90)[:2] == (1410, 1320)
    # V100's 7.5 MHz ladder is off any integer grid: snap to the nearest supported clock.
    v100 = [int(1530 - 7.5 * k) for k in range(186)]
    got = sweep_candidates(v100, 90, min_mhz=800)
    assert got[0] == 1530 and all(f in v100 for f in got) and got[-1] >= 800
    assert all(abs((a - b) - 90) <= 8 for a, b in zip(got, got[1:]))
    assert sweep_candidates([1000], 90) == (1000,)
    with pytest.raises(ValueError):
        sweep_candidates([], 90)
    with pytest.raises(ValueError):
        sweep_candidates([1000], 0)


def test_robust_mean_drops_the_odd_unit_out():
    assert robust_mean([1.0, 1.0, 1.0, 1.0, 9.0]) == 1.0  # e.g. the backward that all-reduces
    assert robust_mean([2.0, 4.0]) == 3.0
    assert robust_mean([5.0]) == 5.0
    with pytest.raises(ValueError):
        robust_mean([])


# -- the sweep, fed exact samples ------------------------------------------------------
VALLEY_CLOCKS = (1800, 1650, 1500, 1350, 1200, 1050, 900, 750)
_TIME_X = (1.00, 1.08, 1.18, 1.30, 1.45, 1.62, 1.85, 2.10)
_ENERGY_X = (1.00, 0.90, 0.82, 0.76, 0.80, 0.90, 1.02, 1.15)


def valley_profile(num_stages: int = 2) -> Profile:
    """A clear energy valley at 1350 MHz (also after subtracting P2P power x time)."""
    pts = {}
    for s in range(num_stages):
        for ins, t, e in (("forward", 0.05, 15.0), ("backward", 0.10, 29.0)):
            t, e = t * (1 + 0.2 * s), e * (1 + 0.2 * s)
            pts[(s, ins)] = [ProfilePoint(f, t * tx, e * ex) for f, tx, ex in zip(VALLEY_CLOCKS, _TIME_X, _ENERGY_X)]
    return Profile(pts, source="<valley>")


def exact_samples(prof: Profile, freq: int, microbatches: int = 3) -> list[StageSamples]:
    kinds = (("F", "forward"), ("B", "backward"))
    return [
        StageSamples.of(
            [(k, prof.time_s(s, i, freq), prof.energy_j(s, i, freq)) for _ in range(microbatches) for k, i in kinds],
            [(0.2, 0.2 * A40_P2P_W)],
        )
        for s in range(prof.num_stages)
    ]


def run_exact(prof: Profile, sweep: ClockSweep) -> list[int]:
    clocks = []
    while not sweep.done:
        f = sweep.next_clock()
        clocks.append(f)
        sweep.record(f, exact_samples(prof, f))
    return clocks


def test_sweep_order_warmup_rows_and_early_stop_below_the_valley():
    prof = valley_profile()
    sweep = ClockSweep(VALLEY_CLOCKS, iterations_per_clock=2, warmup_iterations=1, stop_after_rising=3)
    clocks = run_exact(prof, sweep)
    # Warm-up at the maximum, two iterations there (they agree: every stage is steady), then one per
    # clock, highest first, in lockstep.
    assert clocks == [1800, 1800, 1800, 1650, 1500, 1350, 1200, 1050, 900]
    assert sweep.steady == (True, True) and not sweep.unsteady_events
    assert [r.iterations for r in sweep.results] == [2, 1, 1, 1, 1, 1, 1]
    assert sweep.done and sweep.stopped_early and sweep.next_clock() is None
    assert sweep.valley_clock_mhz() == 1350
    assert sweep.measured_clocks_mhz() == (1800, 1650, 1500, 1350, 1200, 1050, 900)  # 3 below the valley, not 750
    assert "below the energy valley" in sweep.stop_reason and "1350 MHz" in sweep.stop_reason
    assert sweep.iterations_used == 9 < sweep.envpipe_iterations() / 3 == 16
    # Without the adaptive rule: two iterations at every clock, as before.
    fixed = ClockSweep(VALLEY_CLOCKS, iterations_per_clock=2, adaptive=False)
    assert run_exact(prof, fixed) == [1800, 1800, 1800, 1650, 1650, 1500, 1500, 1350, 1350, 1200, 1200, 1050,
                                      1050, 900, 900]
    assert fixed.measured_clocks_mhz() == sweep.measured_clocks_mhz() and fixed.iterations_used == 15
    for row in sweep.rows():
        assert row.time_s == pytest.approx(prof.time_s(row.stage, row.instruction, row.freq_mhz))
        assert row.energy_j == pytest.approx(prof.energy_j(row.stage, row.instruction, row.freq_mhz))
    assert sweep.rows()[0] == ProfileRow(0, "forward", 1800, pytest.approx(0.05), pytest.approx(15.0))
    assert sweep.p2p_power_w() == pytest.approx(A40_P2P_W)
    assert "9 iterations (EnvPipe: 48, 19 %)" in sweep.summary()
    again = sweep.profile()
    assert again.common_frequencies() == sweep.measured_clocks_mhz()
    with pytest.raises(RuntimeError, match="done"):
        sweep.record(900, exact_samples(prof, 900))


def test_no_early_stop_without_a_clear_valley_and_when_disabled():
    prof = valley_profile()
    full = ClockSweep(VALLEY_CLOCKS, stop_after_rising=0)
    run_exact(prof, full)
    assert not full.stopped_early and full.measured_clocks_mhz() == VALLEY_CLOCKS
    assert full.stop_reason == "swept all 8 candidate clocks"
    # The metric creeps up just below f_max before falling (A40 GPT-3 at 15 MHz steps): no stop there.
    a40 = Profile.from_csv(shipped_profile("a40/gpt3-175b"))
    sweep = ClockSweep(sweep_candidates(a40.common_frequencies(), 15), iterations_per_clock=1, p2p_power_w=A40_P2P_W)
    run_exact(a40, sweep)
    assert sweep.measured_clocks_mhz()[-1] == 855
    metrics = sweep.metrics_j()
    # A bare "rose 3 times in a row" rule would have stopped near the top, above every valley.
    naive = next(i for i in range(3, len(metrics)) if all(metrics[i - k] > metrics[i - k - 1] for k in range(3)))
    assert sweep.measured_clocks_mhz()[naive] >= 1600 and min(metrics[: naive + 1]) == metrics[0]


def test_p2p_aware_stop_keeps_the_clocks_the_planner_wants():
    """Raw F+B energy bottoms out above the clock that minimises E - P_p2p t (what the
    planner uses); stopping on raw energy would cut that clock off."""
    a40 = Profile.from_csv(shipped_profile("a40/gpt3-175b"))
    cands = sweep_candidates(a40.common_frequencies(), 15)
    raw = ClockSweep(cands, iterations_per_clock=1, p2p_aware=False)
    run_exact(a40, raw)
    aware = ClockSweep(cands, iterations_per_clock=1, p2p_power_w=A40_P2P_W)
    run_exact(a40, aware)
    assert raw.stopped_early and raw.measured_clocks_mhz()[-1] == 900 and raw.valley_clock_mhz() == 945
    assert aware.valley_clock_mhz() == 870 and 870 not in raw.measured_clocks_mhz()
    # Measured P2P power (the blocking windows) gives the same decisions as the given one.
    measured = ClockSweep(cands, iterations_per_clock=1)
    run_exact(a40, measured)
    assert measured.measured_clocks_mhz() == aware.measured_clocks_mhz()


def test_record_checks_what_it_is_given():
    prof = valley_profile()
    sweep = ClockSweep(VALLEY_CLOCKS[:3], warmup_iterations=0)
    with pytest.raises(ValueError, match="asked for 1800"):
        sweep.record(1650, exact_samples(prof, 1650))
    with pytest.raises(ValueError, match="unknown unit kind"):
        sweep.record(1800, [StageSamples.of([("X", 1.0, 1.0)])])
    with pytest.raises(ValueError, match="invalid unit sample"):
        sweep.record(1800, [StageSamples.of([("F", 0.0, 1.0)])])
    sweep.record(1800, exact_samples(prof, 1800))
    with pytest.raises(ValueError, match="1 stages, earlier iterations had 2"):
        sweep.record(1800, exact_samples(prof, 1800)[:1])
    only_f = ClockSweep((1000,), iterations_per_clock=1, warmup_iterations=0)
    with pytest.raises(ValueError, match="no backward samples for stage 0"):
        only_f.record(1000, [([("F", 0.1, 1.0)], [])])  # plain (units, blocking) tuples are accepted
    with pytest.raises(ValueError, match="fastest first"):
        ClockSweep((900, 1000))
    with pytest.raises(ValueError):
        ClockSweep(())


def test_blocking_power_removes_the_per_window_edge_bias():
    # Every window carries the same extra 0.5 J from its edges; the slope ignores it.
    windows = [BlockingSample(t, 70.0 * t + 0.5) for t in (0.05, 0.1, 0.2, 0.4)]
    assert blocking_power_w(windows) == pytest.approx(70.0)
    # Equal lengths: no slope to fit, total energy over total time.
    same = [BlockingSample(0.1, 7.5)] * 3
    assert blocking_power_w(same) == pytest.approx(75.0)
    assert blocking_power_w([]) is None


# -- attribution on a simulated GPU with a fake clock ----------------------------------
class FakeTime:
    """Fake clock whose sleeps tick in 1 ms steps, polling the monitors on the way."""

    def __init__(self) -> None:
        self.now = 0.0
        self.monitors: list[EnergyMonitor] = []

    def clock(self) -> float:
        return self.now

    def sleep(self, dt: float) -> None:
        end = self.now + dt
        while self.now < end:
            self.now = min(end, self.now + 0.001)
            for m in self.monitors:
                m.sample()


@pytest.mark.parametrize("method,rel", [("regress", 1e-6), ("interpolate", 0.05)])
def test_stage_samples_on_a_fake_clock(method, rel):
    prof = valley_profile(1)
    ft = FakeTime()
    gpu = SimulatedGpu(prof, 0, time_scale=0.1, p2p_power_w=A40_P2P_W, clock=ft.clock, sleep=ft.sleep)
    mon = EnergyMonitor(gpu, poll_interval_s=0.001, clock=ft.clock)
    ft.monitors.append(mon)
    mon.sample()
    ft.sleep(0.004)
    units, blocking = [], []
    for m in range(3):
        for kind in "FB":
            if kind == "B":
                w0 = ft.now
                ft.sleep(0.002 * (m + 1))
                blocking.append((w0, ft.now))
            t0 = ft.now
            gpu.unit_begin(0, kind)
            gpu.unit_end(0, kind)
            units.append((kind, t0, ft.now))
    ft.sleep(0.003)
    got = stage_samples(mon, units, blocking, time_scale=0.1, method=method)
    assert len(got.units) == len(units) == 6
    for u in got.units:
        ins = "forward" if u.kind == "F" else "backward"
        assert u.time_s == pytest.approx(prof.time_s(0, ins, 1800))
        assert u.energy_j == pytest.approx(prof.energy_j(0, ins, 1800), rel=rel)
    assert blocking_power_w(got.blocking) == pytest.approx(A40_P2P_W, rel=max(rel, 1e-6) * 4)
    with pytest.raises(ValueError, match="method"):
        stage_samples(mon, units, method="guess")


def test_stage_samples_falls_back_to_interpolation_when_powers_are_inseparable():
    prof = valley_profile(1)
    ft = FakeTime()
    gpu = SimulatedGpu(prof, 0, p2p_power_w=A40_P2P_W, clock=ft.clock, sleep=ft.sleep)
    mon = EnergyMonitor(gpu, clock=ft.clock)
    mon.sample()
    units = []
    for kind in "FB":
        t0 = ft.now
        gpu.unit_begin(0, kind)
        gpu.unit_end(0, kind)
        units.append((kind, t0, ft.now))
    mon.sample()  # two samples for three unknowns (F, B, the rest)
    got = stage_samples(mon, units)
    interpolated = stage_samples(mon, units, method="interpolate")
    assert [u.energy_j for u in got.units] == pytest.approx([u.energy_j for u in interpolated.units])
    with pytest.raises(ValueError, match="overlap"):  # a caller's bug is not hidden by the fallback
        stage_samples(mon, units, blocking=[(units[0][1], units[0][2])])


# -- the acceptance test ---------------------------------------------------------------
def test_acceptance_profiler_reproduces_the_driving_profile(tmp_path):
    """Device-side unit windows (as CUDA events give on GPUs): the time and energy the
    profiler reports are exactly what the simulated GPUs did, whatever the host load: the GPUs
    and pollers run on a virtual clock, so a loaded host cannot make a clock need a repeat."""
    prof = a40_three_stages()
    cands = prof.common_frequencies()
    assert cands == (1740, 1560, 1380, 1200, 1020, 855)
    sweep = ClockSweep(cands, iterations_per_clock=2, warmup_iterations=1, stop_after_rising=3)
    t0 = time.monotonic()
    profile_on_simulated_gpus(prof, sweep, p2p_power_w=A40_P2P_W, time_scale=0.02, microbatches=4,
                              virtual_time=True)
    wall = time.monotonic() - t0
    rows = sweep.rows()
    assert len(rows) == 3 * 2 * len(cands)  # every (stage, instruction, clock)
    worst_t, worst_e = relative_errors(prof, rows)
    print(f"\n[acceptance] {sweep.summary()}\n[acceptance] device timing: max relative error time "
              f"{100 * worst_t:.3f} %, energy {100 * worst_e:.3f} %, P2P {sweep.p2p_power_w():.2f} W "
              f"(true {A40_P2P_W}), {wall:.1f} s wall")
    assert worst_t < 0.02 and worst_e < 0.02
    assert sweep.p2p_power_w() == pytest.approx(A40_P2P_W, rel=0.02)
    # Warm-up, two agreeing iterations at the maximum, then one per clock.
    assert sweep.iterations_used == 1 + 1 + len(cands) < 6 * len(cands) / 3
    assert [r.iterations for r in sweep.results] == [2] + [1] * (len(cands) - 1)
    # The measured profile goes through the cache and back unchanged.
    cache = ProfileCache(tmp_path)
    key = {"model": "a40-3-stage test", "pp": 3}
    meta = ProfileMeta(sweep.iterations_used, sweep.p2p_power_w(), sweep.measured_clocks_mhz(), sweep.stop_reason)
    cache.store(key, sweep.profile(), meta)
    again = cache.load(key)
    for r in rows:
        assert again.time_s(r.stage, r.instruction, r.freq_mhz) == r.time_s


# The host's own time around a unit (clock read to unit_begin, unit_end to clock read): ~3 us each side
# on a quiet machine, ~0.3 % of the shortest unit here (2.25 ms at time_scale 0.02).
HOST_OVERHEAD_S = 3e-6


def test_acceptance_with_host_timestamps():
    """Host clock around unit_begin/unit_end (what a CPU run measures without device timestamps): within
    2 %. On a virtual clock, with the host's own overhead around each unit modelled (HOST_OVERHEAD_S each
    side), so neither the outcome nor the figures depend on the host's speed or load (on the wall clock a
    busy host inflates unit times without bound, and the test passed, skipped or failed with the load)."""
    prof = a40_three_stages()
    sweep = ClockSweep(prof.common_frequencies())
    delays: dict[tuple[int, str, int], list[float]] = {}
    profile_on_simulated_gpus(prof, sweep, p2p_power_w=A40_P2P_W, time_scale=0.02, microbatches=4,
                              timing="host", virtual_time=True, host_delays=delays, host_overhead_s=HOST_OVERHEAD_S)
    worst_t, worst_e = relative_errors(prof, sweep.rows())
    print(f"\n[acceptance] host timing (virtual time, {1e6 * HOST_OVERHEAD_S:.0f} us host overhead per unit side): "
          f"max relative error time {100 * worst_t:.3f} %, energy {100 * worst_e:.3f} %")
    # The host windows really are the host's: each exactly the device's unit plus the overhead on both sides.
    assert delays and all(delay_s == pytest.approx(2 * HOST_OVERHEAD_S * windows, rel=1e-6)
                          for delay_s, windows in delays.values())
    assert worst_t < 0.02 and worst_e < 0.02
    # ... and they are what was measured: the overhead shows in the rows (device timing would be exact).
    assert worst_t > 0.5 * 2 * HOST_OVERHEAD_S / (0.02 * 0.1125)


def test_acceptance_early_stop_below_a_clear_valley():
    """The early stop and its iteration count on simulated time: on the wall clock a host stall could cost a
    clock a second measurement (10 iterations instead of 9 on a loaded CI run). Host timing itself is what
    test_acceptance_with_host_timestamps checks."""
    prof = valley_profile(2)
    sweep = ClockSweep(VALLEY_CLOCKS)  # P2P power measured, not given
    profile_on_simulated_gpus(prof, sweep, p2p_power_w=A40_P2P_W, time_scale=0.02, microbatches=3,
                              virtual_time=True)
    assert sweep.stopped_early and sweep.valley_clock_mhz() == 1350
    assert sweep.measured_clocks_mhz()[-1] == 900  # three clocks below the valley; 750 never run
    assert sweep.iterations_used == 9  # warm-up, 2 at 1800 MHz, 1 at each of the 6 clocks down to 900
    worst_t, worst_e = relative_errors(prof, sweep.rows())
    assert worst_t < 1e-9 and worst_e < 1e-9


# -- the profile cache -----------------------------------------------------------------
def gpt_key(**over) -> ProfileKey:
    base = dict(model={"layers": 24, "hidden": 2048, "heads": 16, "vocab": 50304}, tensor_parallel=1,
                pipeline_parallel=4, micro_batch_size=2, seq_length=1024, dtype="bf16",
                gpu_name="NVIDIA A40", driver_version="550.54.15")
    base.update(over)
    return ProfileKey(**base)


def test_cache_key_is_stable_and_sensitive():
    a = gpt_key()
    b = gpt_key(model={"vocab": 50304, "heads": 16, "hidden": 2048, "layers": 24})  # dict order
    assert _key_digest(a) == _key_digest(b)
    for change in ({"pipeline_parallel": 8}, {"micro_batch_size": 4}, {"driver_version": "555.42"},
                   {"gpu_name": "NVIDIA A100-SXM4-40GB"}, {"model": {"layers": 25}}, {"extra": {"recompute": True}}):
        assert _key_digest(gpt_key(**change)) != _key_digest(a), change
    assert _key_digest({"b": 1, "a": [1, 2]}) == _key_digest({"a": [1, 2], "b": 1})
    with pytest.raises(ValueError, match="not plain JSON"):
        _key_digest({"a": object()})


def test_cache_store_lookup_describe(tmp_path, monkeypatch):
    prof = valley_profile()
    cache = ProfileCache(tmp_path / "c")
    key = gpt_key()
    assert cache.lookup(key) is None and cache.load(key) is None
    assert cache.describe(key).startswith("profile cache miss")
    path = cache.store(key, prof, ProfileMeta(iterations_used=15, p2p_power_w=70.4, clocks_mhz=(1800, 900)))
    assert cache.lookup(key) == path and path.suffix == ".csv"
    assert cache.load(key).points(1, "backward") == prof.points(1, "backward")
    sidecar = json.loads(path.with_suffix(".json").read_text())
    assert sidecar["key"]["driver_version"] == "550.54.15" and sidecar["key"]["format"] == 1
    assert sidecar["meta"]["iterations_used"] == 15 and sidecar["meta"]["created_utc"]
    text = cache.describe(key)
    assert text.startswith("profile cache hit") and "15 iterations" in text and "70.4 W" in text
    assert not [p for p in path.parent.iterdir() if p.name.startswith(".")], "temp files left behind"
    assert cache.lookup(gpt_key(driver_version="555.42")) is None
    # A sidecar naming another key (edited, or a collision) or a corrupt CSV is a miss, not a crash.
    path.write_text("stage,instruction\nbroken")
    assert cache.lookup(key) == path and cache.load(key) is None
    sidecar["key"]["seq_length"] = 4096
    path.with_suffix(".json").write_text(json.dumps(sidecar))
    assert cache.lookup(key) is None
    path.with_suffix(".json").write_text("{not json")
    assert cache.lookup(key) is None
    # Root: $MEGATRON_ENVPIPE_CACHE, else ~/.cache/megatron-envpipe/profiles.
    monkeypatch.setenv("MEGATRON_ENVPIPE_CACHE", str(tmp_path / "env"))
    assert ProfileCache().root == tmp_path / "env"
    monkeypatch.delenv("MEGATRON_ENVPIPE_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert ProfileCache().root == tmp_path / "xdg" / "megatron-envpipe" / "profiles"


def test_model_chunks_get_their_own_rows_and_the_profile_round_trips(tmp_path):
    """Interleaved pipeline: samples tagged with their model chunk give one row per chunk (chunks differ:
    chunk 1 of the last stage carries the LM head), and the profile keeps them through its CSV."""
    whole = valley_profile()
    heavy = {(s, c): 1.0 + 0.3 * c * (s == whole.num_stages - 1) + 0.1 * c for s in range(2) for c in range(2)}
    truth = Profile({(s, ins, c): [ProfilePoint(p.freq_mhz, p.time_s / 2 * heavy[s, c], p.energy_j / 2 * heavy[s, c])
                                   for p in whole.points(s, ins)]
                     for s in range(whole.num_stages) for ins in ("forward", "backward") for c in range(2)},
                    source="<chunked truth>")
    sweep = ClockSweep(VALLEY_CLOCKS, iterations_per_clock=2, warmup_iterations=1, stop_after_rising=3)
    while not sweep.done:
        f = sweep.next_clock()
        sweep.record(f, [StageSamples.of(
            [UnitSample(k, truth.time_s(s, i, f, c), truth.energy_j(s, i, f, c), c)
             for _ in range(3) for c in (0, 1) for k, i in (("F", "forward"), ("B", "backward"))],
            [(0.2, 0.2 * A40_P2P_W)]) for s in range(truth.num_stages)])
    got = sweep.profile()
    assert got.num_chunks == 2
    for f in sweep.measured_clocks_mhz():
        for s in range(2):
            for c in range(2):
                for ins in ("forward", "backward"):
                    assert got.time_s(s, ins, f, c) == pytest.approx(truth.time_s(s, ins, f, c))
                    assert got.energy_j(s, ins, f, c) == pytest.approx(truth.energy_j(s, ins, f, c))
    # The chunks' rows add up to the stage's, so the valley is the whole stage's.
    assert sweep.valley_clock_mhz() == 1350
    path = tmp_path / "chunked.csv"
    got.to_csv(path)
    assert "chunk" in path.read_text().splitlines()[0]
    again = Profile.from_csv(path)
    assert again.num_chunks == 2 and again.energy_j(1, "backward", 1800, 1) == got.energy_j(1, "backward", 1800, 1)
