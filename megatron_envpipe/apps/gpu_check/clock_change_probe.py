"""Clock changes measured three ways: the NVML call, NVML's report, the SMs themselves.

For one change from ``f_from`` to ``f_to`` (:func:`_trace_change`), while a train of short
spin kernels keeps the GPU busy (:class:`KernelTrain`: enqueued ahead, so the stream never
starves while the host waits on NVML):

(a) ``call_s``: the lock call's own duration on the host (it runs on a thread of its own,
    as the clock worker's does in training, while this thread keeps the stream fed);
(b) ``nvml_report_s``: request -> NVML's current SM clock within one step of the target
    (polled from this thread every ``poll_s``);
(c) ``settle_s``: request -> the SMs at the target, from the kernels' own timestamps
    (:func:`megatron_envpipe.core.clock_trace.analyse_trace`), each kernel's fixed overhead
    (measured once by :func:`_measure_overhead`) taken off.

The request's time on the GPU's timebase comes from the kernels too: every time this thread
sees a kernel finished (host clock ``h``), the kernel's end ``e`` (GPU timestamp) bounds the
offset between the clocks, ``offset <= h - e``; the smallest of many such bounds before the
request is the offset (the host saw that kernel end within one poll), and its disagreement
with the smallest bound after the request, or the poll interval if larger, is the request
time's uncertainty.

The same :func:`_trace_change` runs on a real GPU (:class:`CudaKernelTrain`,
:class:`ThreadedRequester`) and on the simulated GPU in virtual time
(:class:`SimKernelTrain`, :class:`VirtualRequester`): that is how it is tested on CPU.
Locks go through the :class:`~megatron_envpipe.gpu.control.safety.ClockGuard` only.
Pure Python: :class:`CudaKernelTrain` imports torch when created.
"""

from __future__ import annotations

import math
import statistics
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from megatron_envpipe.core.clock_trace import ClockChange, TraceKernel, analyse_trace, launch_overhead_s
from megatron_envpipe.core.virtual_clock import VirtualClock
from megatron_envpipe.gpu.control.safety import ClockGuard
from megatron_envpipe.gpu.devices.base import GpuDevice, GpuError
from megatron_envpipe.gpu.devices.simulated import SimulatedGpu

__all__ = ["CudaKernelTrain", "KernelTrain", "ProbeTiming", "Requester", "SimKernelTrain", "ThreadedRequester",
           "TracedChange", "VirtualRequester", "run_clock_changes"]

# An NVML lock call that has not returned by then is hung (they take 10-20 ms: Zeus #29).
_CALL_TIMEOUT_S = 5.0
_MIN_BEFORE = 20  # kernels finished before the request, at least: they place it on the GPU's timeline


@dataclass(frozen=True)
class ProbeTiming:
    """How one change is traced (seconds)."""

    kernel_s: float = 1e-4        # a kernel's length at the pair's higher clock: the trace's resolution
    ahead_s: float = 0.02         # GPU work kept queued ahead of the host (covers the host's hiccups)
    settle_before_s: float = 0.1  # at f_from before the request: the previous change must have landed
    watch_s: float = 0.2          # traced after the request (longer than any settle we expect)
    poll_s: float = 5e-5          # the host's poll interval (kernel completions, NVML's clock)

    @property
    def change_s(self) -> float:
        """Host time one change takes, about."""
        return self.settle_before_s + self.watch_s + self.ahead_s


class KernelTrain(Protocol):
    """Spin kernels of a fixed cycle count, back to back on one stream, with GPU timestamps."""

    def start_trace(self) -> None: ...            # forget the previous trace
    def launch(self, cycles: int) -> None: ...     # enqueue one kernel (never waits for the GPU)
    def completed(self) -> int: ...                # how many of this trace's kernels have finished
    def finish(self) -> list[TraceKernel]: ...     # wait for all; their timestamps (s, the train's timebase)


class Requester(Protocol):
    """Makes one lock request without blocking the caller."""

    def request(self, freq_mhz: int) -> None: ...
    def done(self) -> bool: ...                    # the call has returned (raises its error, if any)
    @property
    def call_s(self) -> float | None: ...          # the call's duration, once done
    @property
    def started_s(self) -> float | None: ...       # the host time the call began (the request), once done


@dataclass(frozen=True)
class TracedChange:
    change: ClockChange
    kernels: tuple[TraceKernel, ...]
    request_s: float                # the request on the kernels' timebase
    request_uncertainty_s: float
    call_s: float | None            # (a)
    nvml_report_s: float | None     # (b) None: NVML never reported the target while watched

    def to_json(self) -> dict[str, object]:
        return {**self.change.to_json(), "call_s": self.call_s, "nvml_report_s": self.nvml_report_s,
                "request_uncertainty_s": self.request_uncertainty_s}


# -- the probe ---------------------------------------------------------------------------

def _trace_change(device: GpuDevice, train: KernelTrain, requester: Requester, f_from: int, f_to: int,
                 step_mhz: int, *, clock: Callable[[], float] = time.perf_counter,
                 sleep: Callable[[float], None] = time.sleep, timing: ProbeTiming = ProbeTiming(),
                 overhead_s: float = 0.0) -> TracedChange:
    """Trace one change (module docstring); the clock is left locked at ``f_to``."""
    _wait_done(requester, f_from, clock, sleep, timing.poll_s)
    requester.request(f_from)
    _wait_done(requester, f_from, clock, sleep, timing.poll_s)
    cycles = _cycles(timing, f_from, f_to)
    ahead = max(4, math.ceil(timing.ahead_s / timing.kernel_s))
    train.start_trace()
    launched = 0
    seen: list[tuple[float, int]] = []  # (host time, kernels finished by then) whenever that count grew
    polls: list[float] = []
    done_count = 0

    def feed() -> None:
        nonlocal launched, done_count
        n = train.completed()
        now = clock()
        if n > done_count:
            seen.append((now, n))
            done_count = n
        while launched - n < ahead:
            train.launch(cycles)
            launched += 1
        polls.append(now)

    t0 = clock()
    while clock() - t0 < timing.settle_before_s or done_count < _MIN_BEFORE:  # kernels place the request
        if clock() - t0 > _CALL_TIMEOUT_S:
            raise GpuError(f"{device.info().label()}: no spin kernel finished within {_CALL_TIMEOUT_S:g} s")
        feed()
        sleep(timing.poll_s)
    asked_s = clock()
    requester.request(f_to)
    reported_at_s: float | None = None
    call_done = False
    while True:
        feed()
        now = clock()
        if reported_at_s is None:
            reported = device.current_sm_clock_mhz()
            if reported is not None and abs(reported - f_to) <= step_mhz:
                reported_at_s = now
        call_done = call_done or requester.done()
        if call_done and now - asked_s >= timing.watch_s:
            break
        if not call_done and now - asked_s > _CALL_TIMEOUT_S:
            raise GpuError(f"{device.info().label()}: the clock lock to {f_to} MHz did not return within "
                           f"{_CALL_TIMEOUT_S:g} s (a hung driver?); reset with `envpipe reset-clocks`")
        sleep(timing.poll_s)
    kernels = train.finish()
    # The request is the call's start (on its thread), not when this thread asked for it.
    request_host_s = requester.started_s if requester.started_s is not None else asked_s
    report_s = None if reported_at_s is None else max(0.0, reported_at_s - request_host_s)
    request_s, uncertainty_s = _map_request(seen, kernels, request_host_s, polls)
    change = analyse_trace(kernels, request_s, f_from, f_to, step_mhz, request_uncertainty_s=uncertainty_s,
                           overhead_s=overhead_s)
    return TracedChange(change, tuple(kernels), request_s, uncertainty_s, requester.call_s, report_s)


def run_clock_changes(device: GpuDevice, train: KernelTrain, requester: Requester,
                      pairs: Sequence[tuple[int, int]], step_mhz: int, *, reps: int, time_left_s: Callable[[], float],
                      clock: Callable[[], float] = time.perf_counter, sleep: Callable[[float], None] = time.sleep,
                      timing: ProbeTiming = ProbeTiming(), wall: Callable[[], float] = time.monotonic,
                      ) -> tuple[list[TracedChange], float, str]:
    """Lower then raise each pair ``reps`` times (every pair once before any twice), while
    ``time_left_s()`` covers two more changes at the slowest rate seen; returns the changes, the
    kernels' fixed overhead (measured first, at the first pair's higher clock) and, if it stopped
    early, why."""
    out: list[TracedChange] = []
    slowest_s = timing.change_s
    left_s = time_left_s()
    if left_s < 3 * slowest_s:  # the overhead's measure and two changes
        return out, 0.0, f"stopped before the first change: {left_s:.1f} s left, a change takes {slowest_s:.1f} s"
    requester.request(pairs[0][0])
    _wait_done(requester, pairs[0][0], clock, sleep, timing.poll_s)
    overhead_s = _measure_overhead(train, _cycles(timing, *pairs[0]), timing)
    for rep in range(reps):
        for hi, lo in pairs:
            for f_from, f_to in ((hi, lo), (lo, hi)):
                left_s = time_left_s()
                if left_s < 2 * slowest_s:
                    return out, overhead_s, (f"stopped after {len(out)} changes (rep {rep + 1} of {reps}): "
                                             f"{left_s:.1f} s left, a change takes up to {slowest_s:.1f} s")
                w0 = wall()
                out.append(_trace_change(device, train, requester, f_from, f_to, step_mhz, clock=clock,
                                        sleep=sleep, timing=timing, overhead_s=overhead_s))
                slowest_s = max(slowest_s, wall() - w0)
    return out, overhead_s, ""


def _measure_overhead(train: KernelTrain, cycles: int, timing: ProbeTiming = ProbeTiming(),
                     pairs: int = 100) -> float:
    """Each kernel's fixed cost (s), at the clock running now: ``settle_before_s`` of kernels to
    let it settle, then ``pairs`` kernels of ``cycles`` and of twice that, interleaved
    (:func:`~megatron_envpipe.core.clock_trace.launch_overhead_s`)."""
    train.start_trace()
    warm = math.ceil(timing.settle_before_s / timing.kernel_s)
    for _ in range(warm):
        train.launch(cycles)
    for _ in range(pairs):
        train.launch(cycles)
        train.launch(2 * cycles)
    kernels = train.finish()[warm:]
    return launch_overhead_s(kernels[0::2], kernels[1::2])[0]


def _cycles(timing: ProbeTiming, f_from: int, f_to: int) -> int:
    """A kernel of ``timing.kernel_s`` at the pair's higher clock."""
    return max(1, round(timing.kernel_s * max(f_from, f_to) * 1e6))


def _wait_done(requester: Requester, freq_mhz: int, clock: Callable[[], float],
               sleep: Callable[[float], None], poll_s: float) -> None:
    t0 = clock()
    while not requester.done():
        if clock() - t0 > _CALL_TIMEOUT_S:
            raise GpuError(f"the clock lock to {freq_mhz} MHz did not return within {_CALL_TIMEOUT_S:g} s "
                           "(a hung driver?); reset with `envpipe reset-clocks`")
        sleep(poll_s)


def _map_request(seen: Sequence[tuple[float, int]], kernels: Sequence[TraceKernel], request_host_s: float,
                 polls: Sequence[float]) -> tuple[float, float]:
    """The request's time on the kernels' timebase, and its uncertainty (module docstring)."""
    before = [h - kernels[n - 1].end_s for h, n in seen if h < request_host_s]
    after = [h - kernels[n - 1].end_s for h, n in seen if h >= request_host_s]
    if not before:
        raise GpuError("clock trace: no kernel finished before the request, so the request cannot be placed on "
                       "the GPU's timeline (raise ProbeTiming.settle_before_s)")
    offset_s = min(before)
    gaps = [b - a for a, b in zip(polls, polls[1:], strict=False)]
    poll_s = statistics.median(gaps) if gaps else 0.0
    drift_s = abs(min(after) - offset_s) if after else 0.0
    return request_host_s - offset_s, max(poll_s, drift_s)


# -- real GPU ----------------------------------------------------------------------------

class ThreadedRequester:
    """Each request on a thread of its own (this thread keeps feeding the stream), through the guard."""

    def __init__(self, guard: ClockGuard, device: GpuDevice, clock: Callable[[], float] = time.perf_counter) -> None:
        self.guard = guard
        self.device = device
        self._clock = clock
        self._thread: threading.Thread | None = None
        self._call_s: float | None = None
        self._started_s: float | None = None
        self._error: BaseException | None = None

    def request(self, freq_mhz: int) -> None:
        if self._thread is not None and self._thread.is_alive():
            raise GpuError("clock trace: a lock request is still running")
        self._call_s, self._started_s, self._error = None, None, None

        def call() -> None:
            t0 = self._started_s = self._clock()
            try:
                if not self.guard.lock(self.device, freq_mhz):
                    raise GpuError(f"clock lock to {freq_mhz} MHz refused: the clock guard was released "
                                   f"({self.guard.released})")
            except BaseException as exc:  # re-raised by done() on the probing thread
                self._error = exc
            self._call_s = self._clock() - t0

        self._thread = threading.Thread(target=call, name="envpipe-clock-trace", daemon=True)
        self._thread.start()

    def done(self) -> bool:
        if self._thread is not None and self._thread.is_alive():
            return False
        if self._error is not None:
            raise self._error
        return True

    @property
    def call_s(self) -> float | None:
        return self._call_s

    @property
    def started_s(self) -> float | None:
        return self._started_s


class CudaKernelTrain:
    """``torch.cuda._sleep(cycles)`` kernels (a spin of that many SM cycles) between CUDA events."""

    def __init__(self, device_index: int) -> None:
        import torch  # CUDA runs only: this module imports without torch

        self._torch = torch
        torch.cuda.set_device(device_index)
        torch.cuda._sleep(1000)  # the context and the kernel load now, not inside a trace
        torch.cuda.synchronize()
        self.start_trace()

    def start_trace(self) -> None:
        self._starts: list = []
        self._ends: list = []
        self._cycles: list[int] = []
        self._done = 0

    def launch(self, cycles: int) -> None:
        start = self._torch.cuda.Event(enable_timing=True)
        end = self._torch.cuda.Event(enable_timing=True)
        start.record()
        self._torch.cuda._sleep(int(cycles))
        end.record()
        self._starts.append(start)
        self._ends.append(end)
        self._cycles.append(int(cycles))

    def completed(self) -> int:
        while self._done < len(self._ends) and self._ends[self._done].query():
            self._done += 1
        return self._done

    def finish(self) -> list[TraceKernel]:
        self._torch.cuda.synchronize()
        base = self._starts[0]  # elapsed_time is in ms, ~0.5 us resolution
        return [TraceKernel(base.elapsed_time(s) / 1e3, base.elapsed_time(e) / 1e3, c)
                for s, e, c in zip(self._starts, self._ends, self._cycles, strict=True)]


# -- simulated GPU, virtual time ---------------------------------------------------------

class VirtualRequester:
    """A request to the simulated GPU through the guard; the call occupies ``call_s`` of virtual
    time (the device models the call itself, on a worker the caller does not wait for)."""

    def __init__(self, guard: ClockGuard, device: SimulatedGpu, vc: VirtualClock, call_s: float) -> None:
        self.guard, self.device, self.vc, self._model_call_s = guard, device, vc, call_s
        self._done_at = -math.inf
        self._call_s: float | None = None
        self._started_s: float | None = None

    def request(self, freq_mhz: int) -> None:
        if not self.guard.lock(self.device, freq_mhz):
            raise GpuError(f"clock lock to {freq_mhz} MHz refused: the clock guard was released")
        self._started_s = self.vc.now()
        self._done_at = self._started_s + self._model_call_s
        self._call_s = None

    def done(self) -> bool:
        if self.vc.now() < self._done_at:
            return False
        self._call_s = self._model_call_s
        return True

    @property
    def call_s(self) -> float | None:
        return self._call_s

    @property
    def started_s(self) -> float | None:
        return self._started_s


class SimKernelTrain:
    """Spin kernels on a simulated GPU in virtual time: every ``tick_s`` the running kernel
    advances by the SM clock the device runs at then (a landing is seen within one tick);
    timestamps are on a timebase of its own (``gpu_offset_s`` from the virtual clock's),
    as CUDA events are, so the probe's mapping of the request is exercised; each kernel also
    takes a fixed ``overhead_s`` (a real kernel's start and events) before its cycles."""

    def __init__(self, device: SimulatedGpu, vc: VirtualClock, tick_s: float = 1e-5,
                 gpu_offset_s: float = -1234.5, overhead_s: float = 0.0) -> None:
        self.device, self.vc, self.tick_s, self.gpu_offset_s = device, vc, tick_s, gpu_offset_s
        self.overhead_s = overhead_s
        self._last_s = vc.now()
        self._queue: deque[list[float]] = deque()  # [ready_s, cycles left, start_s, cycles, overhead left]
        self._done: list[TraceKernel] = []
        vc.every(tick_s, self._tick)

    def start_trace(self) -> None:
        self._tick()
        self._queue.clear()
        self._done = []

    def launch(self, cycles: int) -> None:
        self._queue.append([self.vc.now(), float(cycles), math.nan, int(cycles), self.overhead_s])

    def completed(self) -> int:
        return len(self._done)

    def finish(self) -> list[TraceKernel]:
        while self._queue:
            self.vc.sleep(self.tick_s)
        return list(self._done)

    def _tick(self) -> None:
        now = self.vc.now()
        hz = self.device.current_sm_clock_mhz() * 1e6
        t = self._last_s
        while self._queue and t < now:
            kernel = self._queue[0]
            t = max(t, kernel[0])  # idle until it was launched
            if t >= now:
                break
            if math.isnan(kernel[2]):
                kernel[2] = t
            if kernel[4] > 0:  # the fixed part first
                spent_s = min(kernel[4], now - t)
                kernel[4] -= spent_s
                t += spent_s
                continue
            need_s = kernel[1] / hz
            if t + need_s <= now:
                t += need_s
                self._queue.popleft()
                self._done.append(TraceKernel(kernel[2] - self.gpu_offset_s, t - self.gpu_offset_s, kernel[3]))
            else:
                kernel[1] -= (now - t) * hz
                t = now
        self._last_s = now
