"""The simulated GPU: profile-driven unit times (slept for real) and energy counter."""

from __future__ import annotations

import random
import threading
import time

import pytest

from megatron_envpipe.core.profile import Profile, ProfilePoint
from megatron_envpipe.gpu.devices.base import GpuDevice, GpuError
from megatron_envpipe.gpu.devices.simulated import SimulatedGpu

P2P_W = 70.0


def small_profile() -> Profile:
    """Two stages, three clocks; forward 300 W / backward 290 W at the top clock."""
    pts = {}
    for s in range(2):
        for ins, t, e in (("forward", 0.10, 30.0), ("backward", 0.20, 58.0)):
            pts[(s, ins)] = [
                ProfilePoint(1500, t * (1 + 0.1 * s), e),
                ProfilePoint(1200, t * 1.2 * (1 + 0.1 * s), e * 0.85),
                ProfilePoint(900, t * 1.6 * (1 + 0.1 * s), e * 0.9),
            ]
    return Profile(pts, source="<small>")


class FakeTime:
    """A clock that only moves when someone sleeps or advances it."""

    def __init__(self, start: float = 100.0) -> None:
        self.now = start
        self.sleeps: list[float] = []

    def clock(self) -> float:
        return self.now

    def sleep(self, dt: float) -> None:
        self.sleeps.append(dt)
        self.now += max(dt, 0.0)

    def advance(self, dt: float) -> None:
        self.now += dt


def fake_gpu(scale: float = 0.5, stage: int = 0) -> tuple[SimulatedGpu, FakeTime]:
    ft = FakeTime()
    gpu = SimulatedGpu(small_profile(), stage, time_scale=scale, p2p_power_w=P2P_W, clock=ft.clock, sleep=ft.sleep)
    return gpu, ft


def test_device_interface_and_labels():
    gpu, _ = fake_gpu()
    assert isinstance(gpu, GpuDevice)
    assert gpu.backend == "simulated" and gpu.capabilities().modelled
    info = gpu.info()
    assert info.simulated and info.backend == "simulated"
    assert info.name.startswith("Simulated") and "simulated" in info.label()
    assert gpu.supported_clocks_mhz() == (1500, 1200, 900)
    assert gpu.can_set_clocks()
    assert gpu.locked_clock_mhz() is None
    named = SimulatedGpu(small_profile(), 1, name="A40")
    assert named.info().name == "Simulated A40"
    assert SimulatedGpu(small_profile(), 1, name="Simulated A40").info().name == "Simulated A40"
    assert named.info().uuid != gpu.info().uuid  # one per stage


def test_unit_takes_scaled_profile_time_with_fake_clock():
    gpu, ft = fake_gpu(scale=0.5)
    t0 = ft.now
    gpu.unit_begin(0, "F")
    ft.advance(0.01)  # host work shorter than the model: the device sleeps the rest
    gpu.unit_end(0, "F")
    assert ft.now - t0 == pytest.approx(0.10 * 0.5)
    assert ft.sleeps[-1] == pytest.approx(0.05 - 0.01)
    assert gpu.overrun_units == 0
    # Host work longer than the model: no sleep, the unit is not shortened, and it is counted.
    n = len(ft.sleeps)
    gpu.unit_begin(0, "B")
    ft.advance(0.5)
    gpu.unit_end(0, "B")
    assert len(ft.sleeps) == n
    assert gpu.overrun_units == 1


def test_last_unit_window_is_the_modelled_compute():
    gpu, ft = fake_gpu(scale=0.5)
    assert gpu.last_unit_window() is None
    t0 = ft.now
    gpu.unit_begin(0, "B")
    ft.advance(0.3)  # the host returns late; the device finished at t0 + 0.1
    gpu.unit_end(0, "B")
    assert gpu.last_unit_window() == ("B", t0, pytest.approx(t0 + 0.20 * 0.5))


def test_energy_integrates_profile_power_and_p2p():
    gpu, ft = fake_gpu(scale=0.5)
    prof = small_profile()
    e0 = gpu.energy_mj()
    ft.advance(0.25)  # idle 0.25 wall s = 0.5 simulated s at P2P power
    assert gpu.energy_mj() - e0 == pytest.approx(P2P_W * 0.5 * 1000)
    assert gpu.power_w() == P2P_W
    for kind, ins in (("F", "forward"), ("B", "backward")):
        a = gpu.energy_mj()
        gpu.unit_begin(0, kind)
        assert gpu.power_w() == pytest.approx(prof.point(0, ins, 1500).power_w)
        gpu.unit_end(0, kind)
        assert (gpu.energy_mj() - a) / 1000 == pytest.approx(prof.energy_j(0, ins, 1500))


def test_energy_is_continuous_within_a_unit_and_host_lag_is_idle():
    gpu, ft = fake_gpu(scale=1.0)
    a = gpu.energy_mj()
    gpu.unit_begin(0, "F")
    ft.advance(0.05)  # half of the 0.10 s forward
    assert (gpu.energy_mj() - a) / 1000 == pytest.approx(15.0)
    ft.advance(0.05 + 0.2)  # the model finished; the host calls unit_end 0.2 s late
    assert gpu.power_w() == P2P_W
    gpu.unit_end(0, "F")
    assert (gpu.energy_mj() - a) / 1000 == pytest.approx(30.0 + P2P_W * 0.2)


def test_clock_lock_changes_the_model():
    gpu, ft = fake_gpu(scale=1.0)
    prof = small_profile()
    gpu.set_locked_clocks(900)
    assert gpu.locked_clock_mhz() == 900 and gpu.model_clock_mhz == 900
    assert gpu.unit_time_s("B") == pytest.approx(prof.time_s(0, "backward", 900))
    t0, e0 = ft.now, gpu.energy_mj()
    gpu.unit_begin(0, "B")
    gpu.set_locked_clocks(1500)  # a running unit keeps its clock
    gpu.unit_end(0, "B")
    assert ft.now - t0 == pytest.approx(prof.time_s(0, "backward", 900))
    assert (gpu.energy_mj() - e0) / 1000 == pytest.approx(prof.energy_j(0, "backward", 900))
    gpu.reset_locked_clocks()
    assert gpu.locked_clock_mhz() is None and gpu.model_clock_mhz == 1500
    with pytest.raises(GpuError, match="1000 MHz is not a profiled clock"):
        gpu.set_locked_clocks(1000)


def test_misuse_is_an_error():
    gpu, _ = fake_gpu()
    with pytest.raises(GpuError, match="without a matching unit_begin"):
        gpu.unit_end(0, "F")
    with pytest.raises(GpuError, match="models stage 0"):
        gpu.unit_begin(1, "F")
    gpu.unit_begin(0, "F")
    with pytest.raises(GpuError, match="still open"):
        gpu.unit_begin(0, "B")
    with pytest.raises(GpuError, match="without a matching"):
        gpu.unit_end(0, "B")
    gpu.unit_end(0, "F")
    with pytest.raises(Exception, match="unknown unit kind"):
        gpu.unit_begin(0, "W")
    with pytest.raises(GpuError, match="stage 5"):
        SimulatedGpu(small_profile(), 5)
    with pytest.raises(GpuError, match="time_scale"):
        SimulatedGpu(small_profile(), 0, time_scale=0)


def test_counter_is_monotonic_over_random_operations():
    gpu, ft = fake_gpu(scale=0.3)
    rng = random.Random(7)
    last = gpu.energy_mj()
    for _ in range(300):
        op = rng.random()
        if op < 0.3:
            gpu.set_locked_clocks(rng.choice(gpu.supported_clocks_mhz()))
        kind = rng.choice("FB")
        gpu.unit_begin(0, kind)
        for _ in range(rng.randrange(3)):
            ft.advance(rng.random() * 0.02)
            now = gpu.energy_mj()
            assert now >= last
            last = now
        gpu.unit_end(0, kind)
        ft.advance(rng.random() * 0.01)
        now = gpu.energy_mj()
        assert now >= last
        last = now


def test_real_time_at_small_scale():
    prof = small_profile()
    scale = 0.02
    gpu = SimulatedGpu(prof, 1, time_scale=scale, p2p_power_w=P2P_W)
    for freq in (1500, 900):
        gpu.set_locked_clocks(freq)
        for kind, ins in (("F", "forward"), ("B", "backward")):
            target = prof.time_s(1, ins, freq) * scale
            t0 = time.monotonic()
            gpu.unit_begin(1, kind)
            gpu.unit_end(1, kind)
            took = time.monotonic() - t0
            # Never shorter than the model; longer only by host delays (load-dependent).
            assert took >= target, (freq, kind, took, target)
            k, start, end = gpu.last_unit_window()
            assert k == kind and end - start == pytest.approx(target) and start >= t0


def test_polling_thread_reads_consistently_while_units_run():
    prof = small_profile()
    scale = 0.02
    gpu = SimulatedGpu(prof, 0, time_scale=scale, p2p_power_w=P2P_W)
    reads: list[float] = []
    stop = threading.Event()
    errors: list[BaseException] = []

    def poll() -> None:
        try:
            while not stop.is_set():
                reads.append(gpu.energy_mj())
                gpu.power_w()
                time.sleep(0.0002)
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    start_e = gpu.energy_mj()
    t_start = time.monotonic()
    thread = threading.Thread(target=poll)
    thread.start()
    busy_s = unit_j = 0.0
    for i in range(20):
        freq = gpu.supported_clocks_mhz()[i % 3]
        gpu.set_locked_clocks(freq)
        for kind, ins in (("F", "forward"), ("B", "backward")):
            gpu.unit_begin(0, kind)
            gpu.unit_end(0, kind)
            busy_s += prof.time_s(0, ins, freq)
            unit_j += prof.energy_j(0, ins, freq)
    end_e = gpu.energy_mj()
    t_end = time.monotonic()
    stop.set()
    thread.join()
    assert not errors
    assert len(reads) > 50
    assert all(b >= a for a, b in zip(reads, reads[1:])), "counter went backwards under concurrent reads"
    # Everything outside the modelled units is P2P power, in simulated seconds.
    idle_s = (t_end - t_start) / scale - busy_s
    expected_j = unit_j + P2P_W * idle_s
    assert (end_e - start_e) / 1000 == pytest.approx(expected_j, rel=0.01)


def test_jitter_stretches_units_reproducibly_at_the_profile_power():
    """--envpipe-sim-jitter: every unit's time times a seeded factor; energy follows at the unit's power."""

    def run(jitter: float, seed: int = 0, stage: int = 0) -> list[tuple[float, float]]:
        ft = FakeTime()
        gpu = SimulatedGpu(small_profile(), stage, time_scale=0.5, p2p_power_w=P2P_W, clock=ft.clock,
                           sleep=ft.sleep, jitter=jitter, seed=seed)
        out = []
        for _ in range(200):
            t0, e0 = ft.now, gpu.energy_mj()
            gpu.unit_begin(stage, "F")
            gpu.unit_end(stage, "F")
            out.append((ft.now - t0, gpu.energy_mj() - e0))
        return out

    exact = run(0.0)
    assert {round(t, 12) for t, _ in exact} == {round(0.10 * 0.5, 12)}
    noisy = run(0.05)
    assert noisy == run(0.05)  # same seed and stage: the same run
    assert noisy != run(0.05, seed=1) and noisy != run(0.05, stage=1)
    times = [t / (0.10 * 0.5) for t, _ in noisy]
    assert min(times) < 0.97 and max(times) > 1.03 and all(0.85 - 1e-9 <= x <= 1.15 + 1e-9 for x in times)
    # Power unchanged (300 W at the top clock): energy scales with the stretched time, in simulated seconds.
    for t, e in noisy:
        assert e / 1000 == pytest.approx(300.0 * t / 0.5, rel=1e-9)
    with pytest.raises(GpuError, match="jitter must be a fraction between 0 and 0.25"):
        SimulatedGpu(small_profile(), 0, jitter=0.3)
