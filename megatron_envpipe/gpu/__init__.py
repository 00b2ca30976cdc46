"""GPU devices: clocks and energy through NVML, a simulated GPU, or none.

``open_gpu(spec, local_rank, stage=...)`` picks the backend the way
``--envpipe-gpu`` names it: ``auto`` (NVML for this rank's CUDA device when
there is one, else none), ``nvml``, ``none``, ``simulated:<profile>`` (a GPU
model on CPU driven by a Perseus-format profile; its numbers are labelled
simulated), or a GPU-table key (NVML, with that table's steps and P2P power).
"""

from __future__ import annotations

from megatron_envpipe.core.device_dynamics import EXACT, DeviceDynamics
from megatron_envpipe.core.virtual_clock import VirtualClock
from megatron_envpipe.gpu.devices import backends  # noqa: F401  (importing it registers the built-in backends)
from megatron_envpipe.gpu.devices.base import (
    PERMISSION_HINT,
    GpuDevice,
    GpuError,
    GpuInfo,
    GpuNotSupportedError,
    GpuPermissionError,
)
from megatron_envpipe.gpu.devices.registry import DeviceRequest, opener_for

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
    """The device this rank trains on, per ``--envpipe-gpu``: the opener registered for the spec's
    backend name (:mod:`~megatron_envpipe.gpu.devices.registry`; built-ins in :mod:`~megatron_envpipe.gpu.devices.backends`).

    ``cuda`` says whether the rank actually drives a CUDA device (a CPU run
    under ``auto`` gets no GPU control rather than some other process's GPU).
    For ``simulated:<profile>``, ``stage``/``num_stages`` choose the profile rows
    (a longer profile emulates a shorter pipeline: first P-1 stages and the last), and
    ``num_chunks`` V > 1 makes each unit one of V equal model chunks (1/V of a stage's row),
    ``jitter`` adds seeded unit-time noise (a fraction of the unit's time), and ``dynamics`` how the
    simulated GPU departs from an ideal one (clock latency, stepped counter, heat); with ``virtual_clock``
    the simulated GPU runs on it (virtual time: ``time_scale`` is 1, nothing sleeps for real), else on
    ``time.perf_counter`` scaled by ``time_scale``. Units of a given micro-batch size (``set_unit_size``)
    scale its rows by :func:`~megatron_envpipe.gpu.devices.sim_lengths.simulated_length_model`. ``unit_scale``
    multiplies every unit's time and energy (power unchanged): a faster GPU than the profile's, named so.
    """
    spec = spec or "auto"
    request = DeviceRequest(spec, local_rank, stage=stage, num_stages=num_stages, time_scale=time_scale,
                            p2p_power_w=p2p_power_w, cuda=cuda, num_chunks=num_chunks, jitter=jitter,
                            dynamics=dynamics, virtual_clock=virtual_clock, unit_scale=unit_scale)
    return opener_for(spec)(request)
