"""GPU devices: clocks and energy through NVML, a simulated GPU, or none.

``open_gpu(spec, local_rank, stage=...)`` picks the backend the way
``--envpipe-gpu`` names it: ``auto`` (NVML for this rank's CUDA device when
there is one, else none), ``nvml``, ``none``, ``simulated:<profile>`` (a GPU
model on CPU driven by a Perseus-format profile; its numbers are labelled
simulated), or a GPU-table key (NVML, with that table's steps and P2P power).
"""

from __future__ import annotations

import time

from megatron_envpipe.core.device_dynamics import EXACT, DeviceDynamics
from megatron_envpipe.core.gpu_specs import spec_for_profile_source
from megatron_envpipe.core.profile import Profile
from megatron_envpipe.core.resources import shipped_profile
from megatron_envpipe.core.virtual_clock import VirtualClock
from megatron_envpipe.gpu.base import (
    PERMISSION_HINT,
    GpuDevice,
    GpuError,
    GpuInfo,
    GpuNotSupportedError,
    GpuPermissionError,
)
from megatron_envpipe.gpu.none import NoGpu
from megatron_envpipe.gpu.nvml import NvmlGpu
from megatron_envpipe.gpu.sim_lengths import simulated_length_model
from megatron_envpipe.gpu.simulated import SimulatedGpu

__all__ = [
    "PERMISSION_HINT",
    "GpuDevice",
    "GpuError",
    "GpuInfo",
    "GpuNotSupportedError",
    "GpuPermissionError",
    "open_gpu",
]


def open_gpu(
    spec: str = "auto",
    local_rank: int | None = None,
    *,
    stage: int = 0,
    num_stages: int | None = None,
    time_scale: float = 1.0,
    p2p_power_w: float | None = None,
    cuda: bool = True,
    num_chunks: int = 1,
    jitter: float = 0.0,
    dynamics: DeviceDynamics = EXACT,
    virtual_clock: VirtualClock | None = None,
    unit_scale: float = 1.0,
) -> GpuDevice:
    """The device this rank trains on, per ``--envpipe-gpu``.

    ``cuda`` says whether the rank actually drives a CUDA device (a CPU run
    under ``auto`` gets no GPU control rather than some other process's GPU).
    For ``simulated:<profile>``, ``stage``/``num_stages`` choose the profile rows
    (a longer profile emulates a shorter pipeline: first P-1 stages and the last), and
    ``num_chunks`` V > 1 makes each unit one of V equal model chunks (1/V of a stage's row),
    ``jitter`` adds seeded unit-time noise (a fraction of the unit's time), and ``dynamics`` how the
    simulated GPU departs from an ideal one (clock latency, stepped counter, heat); with ``virtual_clock``
    the simulated GPU runs on it (virtual time: ``time_scale`` is 1, nothing sleeps for real), else on
    ``time.perf_counter`` scaled by ``time_scale``. Units of a given micro-batch size (``set_unit_size``)
    scale its rows by :func:`~megatron_envpipe.gpu.sim_lengths.simulated_length_model`. ``unit_scale``
    multiplies every unit's time and energy (power unchanged): a faster GPU than the profile's, named so.
    """
    spec = spec or "auto"
    if spec == "none":
        return NoGpu()
    if spec.startswith("simulated"):
        source = spec.partition(":")[2]
        profile = Profile.from_csv(shipped_profile(source))
        if unit_scale != 1.0:  # a faster (or slower) GPU: same powers, shorter units
            profile = profile.scaled(unit_scale, unit_scale, names=("unit scale", "unit scale"))
        # Sized units (variable-length micro-batches) scale rows by it; fitted before for_pipeline drops samples.
        length_model = simulated_length_model(profile, source, num_stages)
        if num_stages is not None:
            profile = profile.for_pipeline(num_stages)
        if num_chunks > 1:  # Megatron's interleaved pipeline: a unit is one of V equal model chunks
            profile = profile.for_chunks(num_chunks)
        if p2p_power_w is None:  # a custom profile names no GPU of the table: no blocking power
            table_spec = spec_for_profile_source(source)
            p2p_power_w = table_spec.p2p_power_w if table_spec else 0.0
        # perf_counter: the executor's and the energy monitor's clock (or the device's virtual one).
        timebase = {"clock": time.perf_counter} if virtual_clock is None else {
            "clock": virtual_clock.now, "sleep": virtual_clock.sleep, "time_scale": 1.0}
        return SimulatedGpu(profile, stage, **{"time_scale": time_scale, **timebase}, p2p_power_w=p2p_power_w,
                            name=f"Simulated GPU ({source}{f', unit times x{unit_scale:g}' if unit_scale != 1 else ''})",
                            jitter=jitter,
                            dynamics=dynamics, length_model=length_model)
    if spec == "auto" and not cuda:
        return NoGpu("no GPU control: this rank runs on the CPU")
    try:
        return NvmlGpu.for_torch_device(local_rank)
    except GpuNotSupportedError as exc:  # no driver, no nvidia-ml-py, or a MIG slice
        if spec == "auto":
            return NoGpu(f"no GPU control: {exc}")
        raise
