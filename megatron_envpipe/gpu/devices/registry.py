"""The device backends ``--envpipe-gpu`` can name, each registered once with its opener.

A backend is one :func:`register_backend` call (its :class:`~megatron_envpipe.core.device_backends.BackendTraits`
and a function that opens it for a rank) in its own module; :func:`~megatron_envpipe.gpu.open_gpu`
looks the spec's name up here instead of testing names. A spec naming no backend is a GPU-table
key: the ``nvml`` backend's opener handles it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from megatron_envpipe.core.device_backends import (
    BackendTraits,
    DeviceBackendError,
    named_backend,
    register_backend_traits,
)
from megatron_envpipe.core.device_dynamics import EXACT, DeviceDynamics
from megatron_envpipe.core.virtual_clock import VirtualClock
from megatron_envpipe.gpu.devices.base import GpuDevice

__all__ = ["DeviceRequest", "opener_for", "register_backend"]


@dataclass(frozen=True)
class DeviceRequest:
    """Everything :func:`~megatron_envpipe.gpu.open_gpu` was asked for; a backend reads what it needs."""

    spec: str
    local_rank: int | None = None
    stage: int = 0
    num_stages: int | None = None
    time_scale: float = 1.0
    p2p_power_w: float | None = None
    cuda: bool = True
    num_chunks: int = 1
    jitter: float = 0.0
    dynamics: DeviceDynamics = EXACT
    virtual_clock: VirtualClock | None = None
    unit_scale: float = 1.0


_Opener = Callable[[DeviceRequest], GpuDevice]
_OPENERS: dict[str, _Opener] = {}


def register_backend(traits: BackendTraits, opener: _Opener) -> None:
    """Make ``traits.name`` (and ``traits.name:<argument>``) openable by ``--envpipe-gpu``."""
    if traits.name in _OPENERS and _OPENERS[traits.name] is not opener:
        raise DeviceBackendError(f"device backend {traits.name!r} is registered already")
    register_backend_traits(traits)
    _OPENERS[traits.name] = opener


def opener_for(spec: str) -> _Opener:
    """The opener of the backend ``spec`` names; a GPU-table key is opened by ``nvml``'s."""
    return _OPENERS[named_backend(spec) or "nvml"]
