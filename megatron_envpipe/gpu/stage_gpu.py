"""Open this rank's GPU from two settings groups and decide on clock control.

It receives the device group (which backend, what to do when clocks may not be locked) and the
simulated GPU's group (time base, noise, unit scale, dynamics), not the whole run config: the
megatron edge (megatron/devices.py) hands over only these groups (issue 38: each layer receives only
the settings it needs). The plan type's ``sets_clocks`` and the P2P power are the plan's. The
device's clock lead is left to the caller, because it depends on the device session's clock timing.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_envpipe.config.groups import DeviceSettings, SimDeviceSettings
from megatron_envpipe.core.device_backends import DeviceCapabilities, backend_traits
from megatron_envpipe.core.virtual_clock import VirtualClock
from megatron_envpipe.gpu import GpuDevice, open_gpu
from megatron_envpipe.gpu.control.clock_proof import cuda_spin_load
from megatron_envpipe.gpu.startup import ClockDecision, clock_control

__all__ = ["StageGpu", "open_stage_gpu"]


@dataclass(frozen=True)
class StageGpu:
    """This rank's opened device, the clock-control decision, and the time base for the hooks."""

    device: GpuDevice
    capabilities: DeviceCapabilities  # asked once, at the opening
    decision: ClockDecision
    virtual_clock: VirtualClock | None  # a simulated GPU in virtual time runs on it (None: wall time)
    hooks_time_scale: float  # clock seconds per device second: a modelled GPU in scaled wall time, else 1


def open_stage_gpu(device: DeviceSettings, sim: SimDeviceSettings, *, sets_clocks: bool,
                   p2p_power_w: float | None, local_rank: int | None, stage: int, num_stages: int,
                   cuda: bool, num_chunks: int = 1) -> StageGpu:
    """Open the device that ``--envpipe-gpu`` names (with the simulated GPU's settings when it is one),
    then decide clock control (see :func:`~megatron_envpipe.gpu.startup.clock_control`)."""
    # A simulated GPU in virtual time runs on its own clock, stamped over the pipeline.
    virtual = VirtualClock() if backend_traits(device.gpu).virtual_time and sim.sim_time == "virtual" else None
    gpu = open_gpu(device.gpu or "auto", local_rank, stage=stage, num_stages=num_stages,
                   time_scale=sim.sim_time_scale, p2p_power_w=p2p_power_w, cuda=cuda, num_chunks=num_chunks,
                   jitter=sim.sim_jitter, unit_scale=sim.sim_unit_scale, dynamics=sim.device_dynamics(),
                   virtual_clock=virtual)
    # A real GPU that is idle during the trial lock may drop its clock, so keep it busy meanwhile.
    caps = gpu.capabilities()
    load = cuda_spin_load() if cuda and caps.can_lock_clocks and not caps.modelled else None
    decision = clock_control(gpu, sets_clocks, device.on_no_permission, stage, load=load)
    return StageGpu(gpu, caps, decision, virtual, sim.sim_time_scale if caps.modelled and virtual is None else 1.0)
