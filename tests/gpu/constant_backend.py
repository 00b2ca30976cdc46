"""A whole device backend in one module: the worked example of docs/design.md ("Where does a new GPU
backend go"). ``constant:<watts>`` is a pretend vendor's GPU that draws a constant power at one clock:
a subclass of GpuDevice, what it can do (its capabilities), and one register_backend call."""

from __future__ import annotations

import dataclasses
import time

from megatron_envpipe.core.device_backends import BackendTraits, DeviceCapabilities
from megatron_envpipe.gpu.devices.base import GpuDevice, GpuInfo
from megatron_envpipe.gpu.devices.registry import DeviceRequest, register_backend

CLOCK_MHZ = 1000


class ConstantPowerGpu(GpuDevice):
    backend = "constant"

    def __init__(self, power_w: float) -> None:
        self._power_w = power_w
        self._t0_s = time.monotonic()

    def info(self) -> GpuInfo:
        return GpuInfo(name=f"Constant {self._power_w:g} W", uuid="constant-0", pci_bus_id="", driver_version="",
                       backend=self.backend)

    def capabilities(self) -> DeviceCapabilities:  # a real-looking GPU whose clocks cannot be changed
        return dataclasses.replace(super().capabilities(), can_lock_clocks=False)

    def supported_clocks_mhz(self) -> tuple[int, ...]:
        return (CLOCK_MHZ,)

    def can_set_clocks(self) -> bool:
        return False

    def set_locked_clocks(self, freq_mhz: int) -> None:
        """Never called: can_set_clocks() is False."""

    def reset_locked_clocks(self) -> None:
        """Nothing to reset."""

    def locked_clock_mhz(self) -> int | None:
        return None

    def energy_mj(self) -> float:
        return (time.monotonic() - self._t0_s) * self._power_w * 1000.0

    def power_w(self) -> float:
        return self._power_w


def open_constant(request: DeviceRequest) -> GpuDevice:
    return ConstantPowerGpu(float(request.spec.partition(":")[2] or 100.0))


register_backend(BackendTraits("constant", can_lock_clocks=False), open_constant)
