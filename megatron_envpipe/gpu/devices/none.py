"""The ``none`` backend: monitors nothing and changes nothing.

For CPU runs, for GPUs NVML cannot drive (MIG slices, other vendors) and for
jobs that must not touch clocks. Decisions:

* :meth:`NoGpu.can_set_clocks` is False, so anything that plans to lock clocks
  (the executor's GPU hooks, the start-up profiler) can see up front that it
  cannot, and say so once, instead of failing mid-run.
* :meth:`NoGpu.set_locked_clocks` is a silent no-op that records nothing:
  :meth:`locked_clock_mhz` stays None, so callers never believe a clock is
  locked, and no clock guard state file is ever written for this backend.
* The energy counter reads 0.0 and power 0.0 W: "no measurement", never a
  made-up number (energy reports must check ``backend == "none"``).
"""

from __future__ import annotations

import dataclasses

from megatron_envpipe.core.device_backends import DeviceCapabilities
from megatron_envpipe.gpu.devices.base import GpuDevice, GpuInfo

__all__ = ["NoGpu"]


class NoGpu(GpuDevice):
    backend = "none"

    def __init__(self, label: str = "no GPU") -> None:
        self._label = label

    def info(self) -> GpuInfo:
        return GpuInfo(name=self._label, uuid="none", pci_bus_id="", driver_version="", backend=self.backend)

    def capabilities(self) -> DeviceCapabilities:
        return dataclasses.replace(super().capabilities(), can_lock_clocks=False, energy_scope="none")

    def supported_clocks_mhz(self) -> tuple[int, ...]:
        return ()

    def can_set_clocks(self) -> bool:
        return False

    def set_locked_clocks(self, freq_mhz: int) -> None:
        """Does nothing (see the module docstring)."""

    def reset_locked_clocks(self) -> None:
        """Does nothing."""

    def locked_clock_mhz(self) -> int | None:
        return None

    def energy_mj(self) -> float:
        return 0.0

    def power_w(self) -> float:
        return 0.0

    def __repr__(self) -> str:
        return f"NoGpu({self._label!r})"
