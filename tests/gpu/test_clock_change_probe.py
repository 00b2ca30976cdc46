"""The clock-change probe (apps/gpu_check/clock_change_probe.py) and gpu-check step 3 (apps/gpu_check/clock_step.py).

The probe runs unchanged against the simulated GPU on a virtual clock: spin kernels whose
progress follows the device's running clock (SimKernelTrain), lock requests through the
ClockGuard whose call occupies the model's NVML time (VirtualRequester). It must recover the
device's clock latency from the kernels' timestamps alone. The threaded requester (the real
GPU's) is driven by the NVML test double for its bookkeeping and error handling.
"""

from __future__ import annotations

import sys
import time
import types
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from nvml_double import NvmlDouble, node  # noqa: E402

from megatron_envpipe.apps.gpu_check.clock_change_probe import (  # noqa: E402
    CudaKernelTrain,
    ProbeTiming,
    SimKernelTrain,
    ThreadedRequester,
    VirtualRequester,
    _trace_change,
    run_clock_changes,
)
from megatron_envpipe.apps.gpu_check.clock_step import run  # noqa: E402
from megatron_envpipe.apps.gpu_check.step_api import STEP_FILES, StepContext  # noqa: E402
from megatron_envpipe.core.clock_trace import pick_clock_pairs  # noqa: E402
from megatron_envpipe.core.device_dynamics import DeviceDynamics  # noqa: E402
from megatron_envpipe.core.virtual_clock import VirtualClock  # noqa: E402
from megatron_envpipe.gpu.control.safety import ClockGuard  # noqa: E402
from megatron_envpipe.gpu.devices.base import GpuPermissionError  # noqa: E402
from megatron_envpipe.gpu.devices.nvml import NvmlGpu  # noqa: E402
from megatron_envpipe.testing.clock_probe_gpu import simulated_clock_gpu  # noqa: E402


@pytest.fixture
def guard(tmp_path):
    g = ClockGuard(tmp_path / "state", install_handlers=False)
    yield g
    g.close()


def simulated(guard, latency_s: float = 0.015, call_s: float = 0.010, **kw):
    vc = VirtualClock()
    dynamics = DeviceDynamics(clock_latency_s=latency_s, nvml_call_s=call_s, source="test")
    gpu = simulated_clock_gpu(vc, dynamics, **kw)
    return vc, gpu, SimKernelTrain(gpu, vc), VirtualRequester(guard, gpu, vc, call_s)


# Shorter than the step's (virtual time costs host time in ticks); still longer than any latency here.
QUICK = ProbeTiming(settle_before_s=0.02, watch_s=0.06)


@pytest.mark.parametrize(("latency_s", "call_s", "all_pairs"), [(0.015, 0.010, True), (0.004, 0.002, False),
                                                                 (0.040, 0.015, False)])
def test_the_probe_recovers_the_simulated_latency_from_the_kernels(guard, latency_s, call_s, all_pairs):
    vc, gpu, train, requester = simulated(guard, latency_s, call_s)
    pairs = pick_clock_pairs(gpu.supported_clocks_mhz()) if all_pairs else [(1980, 1185)]
    changes, overhead_s, stopped = run_clock_changes(gpu, train, requester, pairs, 15, reps=1, time_left_s=lambda: 60.0,
                                         clock=vc.now, sleep=vc.sleep, timing=QUICK)
    assert stopped == "" and len(changes) == 2 * len(pairs)
    for c in changes:
        ch = c.change
        assert ch.reached, ch.detail
        assert ch.resolution_s < 1.2e-3  # one kernel (0.1 ms at the pair's higher clock) + the request's placing
        assert abs(ch.settle_s - latency_s) <= ch.resolution_s, (ch.from_mhz, ch.to_mhz, ch.settle_s)
        assert ch.before_mhz == pytest.approx(ch.from_mhz) and ch.seen_mhz == pytest.approx(ch.to_mhz)
        assert c.call_s == pytest.approx(call_s)
        # NVML's report is polled every 50 us of host time.
        assert latency_s - 1e-9 <= c.nvml_report_s <= latency_s + 1e-4
        assert c.request_uncertainty_s <= 1e-4
    # The kernels' timebase is the train's own: the request was placed on it, not on the host's clock.
    assert changes[0].request_s > 1000.0
    assert gpu.locked_clock_mhz() == pairs[-1][0]  # left at the last change's target (the guard resets)


def test_a_kernel_overhead_is_measured_and_the_latency_still_recovered(guard):
    vc, gpu, _, requester = simulated(guard)
    train = SimKernelTrain(gpu, vc, overhead_s=2e-6)
    changes, overhead_s, _ = run_clock_changes(gpu, train, requester, [(1980, 1185)], 15, reps=1,
                                               time_left_s=lambda: 60.0, clock=vc.now, sleep=vc.sleep, timing=QUICK)
    assert overhead_s == pytest.approx(2e-6, abs=1e-7)
    for c in changes:
        assert c.change.reached and abs(c.change.settle_s - 0.015) <= c.change.resolution_s
        assert c.change.seen_mhz == pytest.approx(c.change.to_mhz, abs=1.0)


def test_kernels_at_the_lower_clock_last_longer_and_the_stream_never_starves(guard):
    vc, gpu, train, requester = simulated(guard)
    c = _trace_change(gpu, train, requester, 1980, 1185, 15, clock=vc.now, sleep=vc.sleep, timing=QUICK)
    before = c.kernels[c.change.request_index - 1]
    after = c.kernels[-1]
    assert before.duration_s == pytest.approx(1e-4) and after.duration_s == pytest.approx(1e-4 * 1980 / 1185)
    assert c.change.max_gap_s == pytest.approx(0.0, abs=1e-12)
    assert c.kernels[-1].end_s - c.request_s >= QUICK.watch_s


def test_a_capped_clock_is_reported_not_reached(guard):
    # The driver accepts the lock but holds the SMs at or below 1500 MHz (power capping).
    vc, gpu, train, requester = simulated(guard, sm_clock_range_mhz=(210, 1500))
    c = _trace_change(gpu, train, requester, 1185, 1980, 15, clock=vc.now, sleep=vc.sleep, timing=QUICK)
    assert not c.change.reached and c.change.settle_s is None
    assert c.change.seen_mhz == pytest.approx(1500)
    assert c.nvml_report_s is None  # NVML reports 1500 MHz too


def test_the_budget_stops_the_probe_between_changes(guard):
    vc, gpu, train, requester = simulated(guard)
    # Each change takes ~0.1 s of (virtual) wall time: 0.15 s left does not cover two more.
    left = iter([30.0, 30.0, 30.0, 0.15])  # the first before the kernels' overhead is measured
    changes, overhead_s, stopped = run_clock_changes(gpu, train, requester, [(1980, 1185), (1185, 885)], 15, reps=3,
                                         time_left_s=lambda: next(left), clock=vc.now, sleep=vc.sleep,
                                         timing=QUICK, wall=vc.now)
    assert len(changes) == 2 and [(c.change.from_mhz, c.change.to_mhz) for c in changes] == [(1980, 1185),
                                                                                             (1185, 1980)]
    assert stopped.startswith("stopped after 2 changes (rep 1 of 3)")


# -- the threaded requester (the real GPU's), against the NVML double ----------------------

@pytest.fixture
def nvml_gpu(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    opened = []

    def install(permission: bool = True) -> tuple[NvmlDouble, NvmlGpu]:
        double = NvmlDouble(node(1), permission=permission)
        monkeypatch.setitem(sys.modules, "pynvml", double.module())
        gpu = NvmlGpu.for_nvml_index(0)
        opened.append(gpu)
        return double, gpu

    yield install
    for gpu in opened:
        gpu.close()


def wait(requester, limit_s: float = 5.0) -> None:
    t0 = time.monotonic()
    while not requester.done():
        assert time.monotonic() - t0 < limit_s
        time.sleep(0.001)


def test_threaded_requests_lock_through_the_guard_and_time_the_call(nvml_gpu, guard):
    double, gpu = nvml_gpu()
    ticks = iter(range(100))
    requester = ThreadedRequester(guard, gpu, clock=lambda: float(next(ticks)))
    requester.request(1050)
    wait(requester)
    assert requester.started_s == 0.0 and requester.call_s == 1.0  # two reads of the injected clock
    assert double.gpus[0].locked == [1050, 1050] and guard.state_path(gpu) is not None
    guard.reset(gpu)
    assert double.gpus[0].locked is None


def test_a_refused_lock_is_raised_on_the_probing_thread(nvml_gpu, guard):
    _, gpu = nvml_gpu(permission=False)
    requester = ThreadedRequester(guard, gpu)
    requester.request(1050)
    with pytest.raises(GpuPermissionError):
        wait(requester)


# -- the CUDA kernel train's bookkeeping, on a stand-in for torch.cuda ----------------------

def fake_torch(clock_hz: float):
    """A stream that runs each _sleep(cycles) in cycles / clock_hz, stamping events in order;
    an event counts as done once ``done_upto`` says so."""
    gpu = types.SimpleNamespace(now_s=7.0, done_upto=0, events=0, calls=[])

    class Event:
        def __init__(self, enable_timing: bool = False) -> None:
            assert enable_timing
            self.at_s, self.n = None, None

        def record(self) -> None:
            self.at_s, self.n = gpu.now_s, gpu.events
            gpu.events += 1

        def query(self) -> bool:
            return self.n is not None and self.n < gpu.done_upto

        def elapsed_time(self, other: "Event") -> float:
            return (other.at_s - self.at_s) * 1e3  # ms, as torch

    def sleep_kernel(cycles: int) -> None:
        gpu.now_s += cycles / clock_hz

    cuda = types.SimpleNamespace(Event=Event, _sleep=sleep_kernel, set_device=lambda i: gpu.calls.append(("dev", i)),
                                 synchronize=lambda: gpu.calls.append("sync"))
    return types.SimpleNamespace(cuda=cuda), gpu


def test_cuda_train_times_kernels_from_its_first_event(monkeypatch):
    torch, gpu = fake_torch(1.5e9)
    monkeypatch.setitem(sys.modules, "torch", torch)
    train = CudaKernelTrain(2)
    assert gpu.calls[:2] == [("dev", 2), "sync"]  # warmed up before any trace
    for cycles in (150_000, 300_000, 150_000):
        train.launch(cycles)
    gpu.done_upto = 4  # events 0..3 done: the first kernel's end (event 1) and the second's start (2) and end (3)
    assert train.completed() == 2
    kernels = train.finish()
    assert [k.cycles for k in kernels] == [150_000, 300_000, 150_000]
    assert kernels[0].start_s == 0.0
    assert [round(k.duration_s * 1e6, 6) for k in kernels] == [100.0, 200.0, 100.0]
    assert [round(k.clock_mhz, 6) for k in kernels] == [1500.0] * 3
    train.start_trace()
    assert train.completed() == 0


# -- step 3 ---------------------------------------------------------------------------------

def context(tmp_path, limit_s: float = 60.0) -> StepContext:
    return StepContext(out_dir=tmp_path, device="cpu", device_index=0, limit_s=limit_s,
                       started_monotonic=time.monotonic(), state_dir=str(tmp_path / "state"))


def test_step_on_cpu_measures_the_realistic_preset_and_writes_its_trace(tmp_path):
    result = run(context(tmp_path))
    assert result.status == "ok", result.reason
    f = result.figures
    assert f["simulated"] is True and f["changes"] == 6 and f["not_reached"] == 0
    assert f["kernel_overhead_s"] == pytest.approx(1.5e-6, abs=1e-7)  # the simulated kernels' fixed cost
    # configs/realistic-gpu.toml: 15 ms request -> SMs, 10 ms of it the call.
    assert f["nvml_call_s"] == pytest.approx(0.010)
    assert abs(f["sm_settle_s"] - 0.015) <= f["resolution_s"] and f["resolution_s"] < 1e-3
    assert abs(f["sm_settle_raise_s"] - 0.015) <= f["resolution_s"]
    assert abs(f["sm_settle_lower_s"] - 0.015) <= f["resolution_s"]
    # The shipped A40 stage the other steps simulate: 1740..855 MHz.
    assert [(p["from_mhz"], p["to_mhz"]) for p in f["pairs"]] == [(1740, 1050), (1050, 1740), (1050, 855),
                                                                  (855, 1050), (1740, 855), (855, 1740)]
    assert set(result.files) == set(STEP_FILES["clock_changes"])
    assert result.files["clock-trace.csv"].startswith("change,from_mhz,to_mhz,kernel,")
    assert result.lines[0].startswith("SIMULATED: 6 clock changes")
    assert {p.name for p in tmp_path.iterdir()} <= {"state"}  # the step writes no file itself


def test_step_without_time_left_fails_with_the_reason(tmp_path):
    result = run(context(tmp_path, limit_s=1.0))
    assert result.status == "failed" and result.reason.startswith("stopped before the first change")
