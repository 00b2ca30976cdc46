"""The built-in device backends, one registration each: ``auto``, ``nvml`` (and GPU-table keys),
``none`` and ``simulated:<profile>``. A new backend registers the same way from its own module
(docs/design.md, "Where does a new GPU backend go").
"""

from __future__ import annotations

import time

from megatron_envpipe.core.device_backends import backend_traits
from megatron_envpipe.core.gpu_specs import spec_for_profile_source
from megatron_envpipe.core.profile import Profile
from megatron_envpipe.core.resources import shipped_profile
from megatron_envpipe.gpu.devices.base import GpuDevice, GpuNotSupportedError
from megatron_envpipe.gpu.devices.none import NoGpu
from megatron_envpipe.gpu.devices.nvml import NvmlGpu
from megatron_envpipe.gpu.devices.registry import DeviceRequest, register_backend
from megatron_envpipe.gpu.devices.sim_lengths import simulated_length_model
from megatron_envpipe.gpu.devices.simulated import SimulatedGpu

__all__: list[str] = []  # importing the module registers the backends


def _open_none(request: DeviceRequest) -> GpuDevice:
    return NoGpu()


def _open_nvml(request: DeviceRequest) -> GpuDevice:
    """NVML for this rank's CUDA device (``nvml`` or a GPU-table key): fails when there is none."""
    return NvmlGpu.for_torch_device(request.local_rank)


def _open_auto(request: DeviceRequest) -> GpuDevice:
    """NVML where this rank drives a CUDA device NVML can control, else no GPU control."""
    if not request.cuda:  # a CPU run gets no GPU control rather than some other process's GPU
        return NoGpu("no GPU control: this rank runs on the CPU")
    try:
        return NvmlGpu.for_torch_device(request.local_rank)
    except GpuNotSupportedError as exc:  # no driver, no nvidia-ml-py, or a MIG slice
        return NoGpu(f"no GPU control: {exc}")


def _open_simulated(request: DeviceRequest) -> GpuDevice:
    """A GPU model for ``request.stage`` of the profile the spec names (see ``open_gpu``)."""
    source = request.spec.partition(":")[2]
    unit_scale = request.unit_scale
    profile = Profile.from_csv(shipped_profile(source))
    if unit_scale != 1.0:  # a faster (or slower) GPU: same powers, shorter units
        profile = profile.scaled(unit_scale, unit_scale, names=("unit scale", "unit scale"))
    # Sized units (variable-length micro-batches) scale rows by it; fitted before for_pipeline drops samples.
    length_model = simulated_length_model(profile, source, request.num_stages)
    if request.num_stages is not None:
        profile = profile.for_pipeline(request.num_stages)
    if request.num_chunks > 1:  # Megatron's interleaved pipeline: a unit is one of V equal model chunks
        profile = profile.for_chunks(request.num_chunks)
    p2p_power_w = request.p2p_power_w
    if p2p_power_w is None:  # a custom profile names no GPU of the table: no blocking power
        table_spec = spec_for_profile_source(source)
        p2p_power_w = table_spec.p2p_power_w if table_spec else 0.0
    # perf_counter: the executor's and the energy monitor's clock (or the device's virtual one).
    virtual_clock = request.virtual_clock
    timebase = {"clock": time.perf_counter} if virtual_clock is None else {
        "clock": virtual_clock.now, "sleep": virtual_clock.sleep, "time_scale": 1.0}
    return SimulatedGpu(profile, request.stage, **{"time_scale": request.time_scale, **timebase},
                        p2p_power_w=p2p_power_w,
                        name=f"Simulated GPU ({source}{f', unit times x{unit_scale:g}' if unit_scale != 1 else ''})",
                        jitter=request.jitter, dynamics=request.dynamics, length_model=length_model)


for _name, _opener in (("auto", _open_auto), ("nvml", _open_nvml), ("none", _open_none),
                       ("simulated", _open_simulated)):
    register_backend(backend_traits(_name), _opener)
