"""Reading the energy counter back to back, idle and under load (gpu-check step 2).

:func:`poll_counter` reads ``GpuDevice.energy_mj`` every ``poll_s`` for ``duration_s``,
stamping each read's start and end on ``clock``, and reads ``GpuDevice.power_w`` every
``power_every_s``; ``feed()`` (optional) is called between reads to keep a load queued.
:class:`MatmulLoad` is that load on CUDA: bf16 matmuls on a side stream, a few batches in
flight, so the host never blocks on a full launch queue while it polls; :class:`SimulatedUnitLoad`
is the same on the simulated GPU (CI). The trace goes to
:func:`megatron_envpipe.core.counter_analysis.analyze_counter`.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from typing import Any

from megatron_envpipe.core.counter_analysis import CounterRead, PowerRead
from megatron_envpipe.errors import EnvPipeError
from megatron_envpipe.gpu.devices.base import GpuDevice, GpuError
from megatron_envpipe.gpu.devices.simulated import SimulatedGpu

__all__ = ["CounterProbeError", "MatmulLoad", "POLL_S", "SimulatedUnitLoad", "poll_counter"]

# Fast enough that each update of a ~100 ms counter lands in a ~1 ms bracket, light enough for the driver.
POLL_S = 0.001
_POWER_EVERY_S = 0.05


class CounterProbeError(EnvPipeError, RuntimeError):
    """The counter could not be polled (bad arguments, a read that fails)."""


def poll_counter(device: GpuDevice, duration_s: float, *, poll_s: float = POLL_S,
                 power_every_s: float = _POWER_EVERY_S, feed: Callable[[], None] | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], None] = time.sleep) -> tuple[list[CounterRead], list[PowerRead]]:
    """Counter reads and power readings for ``duration_s`` seconds (module docstring)."""
    for name, value in (("duration_s", duration_s), ("poll_s", poll_s), ("power_every_s", power_every_s)):
        if isinstance(value, bool) or not isinstance(value, int | float) or not value >= 0 or value == float("inf"):
            raise CounterProbeError(f"poll_counter: {name} must be a finite number of seconds >= 0, got {value!r}")
    reads: list[CounterRead] = []
    powers: list[PowerRead] = []
    start = clock()
    next_power = start
    label = device.info().label()
    while True:
        if feed is not None:
            feed()
        before = clock()
        try:
            value = float(device.energy_mj())
        except GpuError as exc:
            raise CounterProbeError(f"energy counter of {label}: read {len(reads) + 1} failed ({exc})") from None
        after = clock()
        reads.append(CounterRead(before, after, value))
        if after >= next_power:
            try:
                powers.append(PowerRead(after, float(device.power_w())))
            except GpuError:
                pass  # power readings are only compared with the counter: a missing one thins them
            next_power = after + power_every_s
        if after - start >= duration_s:
            return reads, powers
        if poll_s > 0:
            sleep(poll_s)


class MatmulLoad:
    """A steady CUDA load for polling under load: square bf16 matmuls on a side stream.

    ``feed()`` tops the stream up to ``in_flight`` batches (events say which finished) and
    returns at once; ``stop()`` waits for the queued work. CUDA only (imports torch on use)."""

    def __init__(self, device_index: int, *, size: int = 4096, batch: int = 32, in_flight: int = 3) -> None:
        import torch  # CUDA runs only: this layer imports without torch

        self._torch: Any = torch
        self._device = torch.device("cuda", device_index)
        self._stream = torch.cuda.Stream(device=self._device)
        with torch.cuda.device(self._device):
            self._a = torch.randn(size, size, device=self._device, dtype=torch.bfloat16)
            self._b = torch.randn(size, size, device=self._device, dtype=torch.bfloat16)
            self._c = torch.empty(size, size, device=self._device, dtype=torch.bfloat16)
            # The side stream (non-blocking) must not read the operands before randn has written them.
            self._stream.wait_stream(torch.cuda.current_stream(self._device))
        self._batch = batch
        self._in_flight = in_flight
        self._events: deque[Any] = deque()
        self.batches = 0

    def feed(self) -> None:
        while self._events and self._events[0].query():
            self._events.popleft()
        torch = self._torch
        while len(self._events) < self._in_flight:
            with torch.cuda.stream(self._stream):
                for _ in range(self._batch):
                    torch.matmul(self._a, self._b, out=self._c)
                event = torch.cuda.Event()
                event.record(self._stream)
            self._events.append(event)
            self.batches += 1

    def stop(self) -> None:
        self._stream.synchronize()
        self._events.clear()


class SimulatedUnitLoad:
    """The load on a simulated GPU: back-to-back backward units of ``stage``, driven from ``feed()``
    on the GPU's own (virtual) clock, so polling and load share one thread as on CUDA."""

    def __init__(self, gpu: SimulatedGpu, stage: int | None = None) -> None:
        self._gpu = gpu
        self._stage = gpu.stage if stage is None else stage
        self._clock = gpu.timebase[0]
        self._end_s: float | None = None
        self.units = 0

    def feed(self) -> None:
        now = self._clock()
        if self._end_s is not None and now < self._end_s:
            return
        if self._end_s is not None:
            self._gpu.unit_end(self._stage, "B")  # its modelled time has passed: returns at once
        self._gpu.unit_begin(self._stage, "B")
        self._end_s = now + self._gpu.unit_time_s("B") * self._gpu.time_scale
        self.units += 1

    def stop(self) -> None:
        if self._end_s is not None:
            self._gpu.unit_end(self._stage, "B")
            self._end_s = None
