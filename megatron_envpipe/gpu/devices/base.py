"""One small interface over a GPU's clocks and energy counter (Zeus-style).

Backends: ``nvml`` (real GPUs, through ``nvidia-ml-py``), ``simulated`` (a
GPU model driven by a time/energy profile, so the whole profile -> plan ->
execute -> measure loop runs on CPU; its numbers are labelled simulated), and
``none`` (monitors nothing, changes nothing). Pure Python; backends import
their own dependencies.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar

from megatron_envpipe.core.clock_latency import DEFAULT_CLOCK_LATENCY
from megatron_envpipe.core.device_backends import DeviceCapabilities
from megatron_envpipe.core.length_costs import MicrobatchSize
from megatron_envpipe.errors import EnvPipeError


class GpuError(EnvPipeError, RuntimeError):
    """A GPU operation failed; the message says what and, where possible, how to fix it."""


class GpuPermissionError(GpuError):
    """Locking clocks needs root or CAP_SYS_ADMIN."""


class GpuNotSupportedError(GpuError):
    """The device or driver does not support the operation (e.g. energy counter before Volta)."""


PERMISSION_HINT = (
    "locking GPU clocks needs root or the CAP_SYS_ADMIN capability: run the job as root, "
    "start the container with --cap-add SYS_ADMIN, or ask your admin; to train without "
    "changing clocks (measuring energy only) pass --envpipe-on-no-permission monitor"
)


@dataclass(frozen=True)
class GpuInfo:
    name: str
    uuid: str
    pci_bus_id: str
    driver_version: str
    backend: str
    simulated: bool = False

    def label(self) -> str:
        return f"{self.name} ({self.uuid}{', simulated' if self.simulated else ''})"


class GpuDevice(ABC):
    """The GPU this process trains on."""

    backend: ClassVar[str]

    @abstractmethod
    def info(self) -> GpuInfo: ...

    def capabilities(self) -> DeviceCapabilities:
        """What this device can do, asked instead of testing its backend's name. The default is a
        real GPU's: host wall time, the assumed clock latency, may lock clocks, a device-wide counter."""
        return DeviceCapabilities(modelled=False, time_base="wall",
                                  clock_latency_s=DEFAULT_CLOCK_LATENCY.request_to_clock_s,
                                  clock_call_s=DEFAULT_CLOCK_LATENCY.call_s, can_lock_clocks=True,
                                  energy_scope="device")

    @abstractmethod
    def supported_clocks_mhz(self) -> tuple[int, ...]:
        """Supported SM clocks at the highest memory clock, fastest first."""

    @abstractmethod
    def can_set_clocks(self) -> bool:
        """Whether :meth:`set_locked_clocks` will be permitted (checked without changing anything)."""

    def permission_reason(self) -> str:
        """Why :meth:`can_set_clocks` says what it says, as one phrase for error messages
        (e.g. the missing capability); empty when the backend has nothing to add."""
        return ""

    @abstractmethod
    def set_locked_clocks(self, freq_mhz: int) -> None:
        """Lock the SM clock to ``freq_mhz`` (min = max). Raises GpuPermissionError."""

    @abstractmethod
    def reset_locked_clocks(self) -> None:
        """Undo any lock: the driver's default clock management again."""

    @abstractmethod
    def locked_clock_mhz(self) -> int | None:
        """The clock this object last locked, or None when unlocked."""

    def current_sm_clock_mhz(self) -> int | None:
        """The clock the SMs run at now (NVML's ``NVML_CLOCK_SM``), which a lock may not reach
        (power or thermal capping, a driver that ignores it); None when the backend cannot tell."""
        return None

    def clock_event_reasons(self) -> tuple[str, ...] | None:
        """Why the SM clock is held where it is now (NVML's clock-event, formerly throttle,
        reasons, e.g. ``sw_power_cap``); ``()`` for none, None when the backend cannot tell."""
        return None

    @abstractmethod
    def energy_mj(self) -> float:
        """Cumulative energy counter in millijoules (monotonic; NVML updates it about every 100 ms on A100)."""

    @abstractmethod
    def power_w(self) -> float:
        """Current power draw in watts."""

    def unit_begin(self, stage: int, kind: str) -> None:
        """A forward (``F``) or backward (``B``) unit starts. Real GPUs ignore this;
        the simulated GPU uses it to model the unit's time and energy."""

    def set_unit_size(self, size: MicrobatchSize | None, chunk: int = 0) -> None:
        """The next unit's micro-batch size (variable lengths; None: the profile's reference size) and
        model chunk. Real GPUs ignore it (they measure); the simulated GPU costs the unit at that size."""

    def unit_end(self, stage: int, kind: str) -> None:
        """The unit's compute was issued (host side)."""

    def last_unit_window(self) -> tuple[str, float, float] | None:
        """``(kind, start_s, end_s)`` of the last finished unit as the device itself ran it,
        on the executor's host clock; None when the device cannot tell (real GPUs: the
        executor's own marks are used) or before the first unit."""
        return None

    def close(self) -> None:
        """Release the device handle (does not reset clocks: the clock guard does)."""
