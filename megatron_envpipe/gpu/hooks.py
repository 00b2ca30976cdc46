"""Execution hooks that drive a GPU: clocks at unit boundaries, energy per iteration.

* ``set_frequency`` queues the clock on the process's one clock worker
  (:class:`~megatron_envpipe.gpu.clocks.ClockController`); on CUDA it passes an
  event recorded on the compute stream at the unit boundary, so the worker
  changes the clock when the previous unit's kernels are done and the
  training thread never synchronizes the device.
* ``unit_begin``/``unit_end`` tell the device (the simulated GPU models the
  unit's time and energy from them; real GPUs ignore them).
* Every iteration's energy comes from the background energy monitor
  (interpolated NVML counter), and profiling iterations attribute energy to
  each unit and P2P wait.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any

from megatron_envpipe.core.hooks import ExecutionHooks
from megatron_envpipe.core.measurement import IterationMeasurement
from megatron_envpipe.core.schedule import Unit
from megatron_envpipe.gpu.base import GpuDevice
from megatron_envpipe.gpu.clocks import ClockController
from megatron_envpipe.gpu.energy import EnergyMonitor, IterationEnergy, IterationEnergyMeter
from megatron_envpipe.gpu.sweep import StageSamples, UnitWindow, stage_samples

log = logging.getLogger("megatron_envpipe")

# Blocking windows shorter than this are dominated by the counter's ~10 ms
# update period at their edges; the P2P power fit ignores them.
MIN_BLOCKING_WINDOW_S = 0.02


class GpuHooks(ExecutionHooks):
    def __init__(self, device: GpuDevice, *, control: bool, cuda: bool, time_scale: float = 1.0,
                 guard: Any = None, poll_interval_s: float = 0.002) -> None:
        self.device = device
        self.cuda = cuda
        self.time_scale = time_scale
        self.clock = time.perf_counter  # the executor's host clock: windows and monitor agree
        self.controller: ClockController | None = None
        if control:
            self.controller = ClockController(device, guard)
        self.monitor: EnergyMonitor | None = None
        if device.backend != "none":
            self.monitor = EnergyMonitor(device, poll_interval_s=poll_interval_s, clock=self.clock).start()
        self._meter: IterationEnergyMeter | None = None
        self.stage = 0
        self.last_energy: IterationEnergy | None = None
        # The simulated GPU knows each unit's exact (modelled) window; host marks
        # would add scheduling noise on a busy CPU.
        self._device_windows: list[tuple[str, float, float]] = []

    # -- ExecutionHooks --------------------------------------------------------------
    def iteration_begin(self, stage: int, iteration: int) -> None:
        self.stage = stage
        self._device_windows = []
        if self.monitor is not None:
            if self._meter is None:
                self._meter = IterationEnergyMeter(self.monitor, stage, clock=self.clock)
            self._meter.begin(iteration)

    def set_frequency(self, freq_mhz: int) -> None:
        if self.controller is None:
            return
        after = None
        if self.cuda:
            import torch  # only CUDA runs get here: this layer imports without torch

            after = torch.cuda.Event()
            after.record()
        self.controller.request(freq_mhz, after=after)
        if self.device.simulated:
            # The simulated GPU models the next unit with whatever clock is locked when
            # it begins; a real GPU gets the same order from the event above.
            self.controller.flush()

    def unit_begin(self, unit: Unit) -> None:
        self.device.unit_begin(self.stage, unit.kind)

    def unit_end(self, unit: Unit) -> None:
        self.device.unit_end(self.stage, unit.kind)
        window = self.device.last_unit_window()
        if window is not None:
            self._device_windows.append(window)

    def iteration_end(self, measurement: IterationMeasurement | None) -> None:
        if self._meter is not None:
            self.last_energy = self._meter.end()
            self.monitor.trim(self.last_energy.start_s - 1.0)

    def close(self) -> None:
        try:
            if self.controller is not None:
                self.controller.close(reset=True)
        finally:
            if self.monitor is not None:
                self.monitor.stop()
            self.device.close()

    # -- profiling -------------------------------------------------------------------
    @property
    def device_windows(self) -> tuple[tuple[str, float, float], ...]:
        """This iteration's unit windows as the device ran them (simulated GPU only)."""
        return tuple(self._device_windows)

    def stage_samples(self, windows: Sequence[tuple[str, float, float]],
                      blocking: Sequence[tuple[float, float]]) -> StageSamples:
        """Time (device seconds) and energy of each unit and P2P wait of one iteration."""
        if self.monitor is None:
            raise RuntimeError("profiling needs a device with an energy counter")
        if len(self._device_windows) == len(windows):
            windows = self._device_windows
            # The GPU blocks (P2P power) in the gaps between its units.
            blocking = [(a[2], b[1]) for a, b in zip(windows, windows[1:]) if b[1] > a[2]]
        return stage_samples(
            self.monitor,
            [UnitWindow(k, a, b) for k, a, b in windows],
            blocking,
            time_scale=self.time_scale,
            min_blocking_s=MIN_BLOCKING_WINDOW_S * self.time_scale if self.device.simulated else MIN_BLOCKING_WINDOW_S,
        )
