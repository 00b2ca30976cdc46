"""The device a gpu-check step measures: the real GPU (NVML) or, with ``--device cpu``, a simulated one.

``open_check_device(ctx)`` gives the step its :class:`GpuDevice` and the clock/sleep to time it with:
on CUDA the GPU behind ``ctx.device_index`` (mapped to NVML by the PCI bus id torch reports) and
``time.monotonic``/``time.sleep``; on CPU the simulated GPU of the shipped A40 profile on a virtual
clock, so a CI run of a step takes no wall time for what it models.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from megatron_envpipe.apps.gpu_check.step_api import StepContext
from megatron_envpipe.core.device_dynamics import EXACT, DeviceDynamics
from megatron_envpipe.core.virtual_clock import VirtualClock
from megatron_envpipe.gpu import open_gpu
from megatron_envpipe.gpu.devices.base import GpuDevice
from megatron_envpipe.gpu.devices.nvml import NvmlGpu

__all__ = ["CheckDevice", "SIMULATED_PROFILE", "open_check_device"]

SIMULATED_PROFILE = "a40/gpt3-175b"  # what --device cpu simulates: a shipped, measured A40 stage


@dataclass(frozen=True)
class CheckDevice:
    device: GpuDevice
    clock: Callable[[], float]
    sleep: Callable[[float], None]
    modelled: bool  # a model of a GPU (its capabilities say so): figures labelled simulated


def open_check_device(ctx: StepContext, dynamics: DeviceDynamics = EXACT) -> CheckDevice:
    """The step's device (close it when done; a ClockGuard resets its clocks, the runner does too)."""
    if ctx.device == "cpu":
        vc = VirtualClock()
        gpu = open_gpu(f"simulated:{SIMULATED_PROFILE}", dynamics=dynamics, virtual_clock=vc)
        return CheckDevice(gpu, vc.now, vc.sleep, True)
    return CheckDevice(NvmlGpu.for_torch_device(ctx.device_index), time.monotonic, time.sleep, False)
