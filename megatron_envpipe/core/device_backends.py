"""What a GPU backend can do, asked instead of testing its name (Zeus-style capabilities).

Two levels, both plain data:

* :class:`BackendTraits`: what ``--envpipe-gpu <spec>`` names, known from the spec alone,
  before any device opens (the flag checks of config/ and the demo ask these): is it a
  model of a GPU whose figures are labelled simulated, does the spec name a profile after
  ``:``, can it run on a virtual clock, may it lock clocks at all, what its energy counter covers.
* :class:`DeviceCapabilities`: what an *opened* device can do (``GpuDevice.capabilities()``):
  the same facts plus its time base and its clock-change latency (seconds, as
  :class:`~megatron_envpipe.core.clock_latency.ClockLatency` splits it).

Backends register their traits here (the device layer's ``register_backend`` does it with
the opener); a spec whose name is no registered backend is a GPU-table key, i.e. a real GPU
driven through NVML with that table's clock steps. Pure Python.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from megatron_envpipe.errors import EnvPipeError

__all__ = [
    "BackendTraits", "DeviceBackendError", "DeviceCapabilities", "backend_traits", "model_profile",
    "named_backend", "register_backend_traits",
]

_TimeBase = Literal["wall", "virtual"]
# What the energy counter covers: the whole GPU (real counter), the modelled units, or nothing.
_EnergyScope = Literal["device", "model", "none"]


class DeviceBackendError(EnvPipeError, ValueError):
    """A backend registered twice under one name, or with contradictory traits."""


@dataclass(frozen=True)
class BackendTraits:
    """A device backend as its ``--envpipe-gpu`` name describes it (module docstring)."""

    name: str  # the spec's part before ':'
    modelled: bool = False  # a model of a GPU: its figures are labelled simulated
    takes_profile: bool = False  # the spec is ``name:<profile>``: the model's time/energy profile
    virtual_time: bool = False  # can run on a virtual clock (--envpipe-sim-time virtual)
    can_lock_clocks: bool = True  # may ever lock clocks (permission is proven at start-up)
    energy_scope: _EnergyScope = "device"

    def __post_init__(self) -> None:
        if not self.name or ":" in self.name:
            raise DeviceBackendError(f"a backend name must be non-empty and free of ':', got {self.name!r}")
        if self.takes_profile and not self.modelled:
            raise DeviceBackendError(f"backend {self.name}: only a modelled GPU takes a profile")


@dataclass(frozen=True)
class DeviceCapabilities:
    """What an opened device can do (``GpuDevice.capabilities()``)."""

    modelled: bool  # figures come from a model (label them simulated), not from a GPU
    time_base: _TimeBase  # the clock its unit windows are on: the host's wall clock or a virtual one
    clock_latency_s: float  # lock request -> SMs at the new clock (what the hooks lead raises by)
    clock_call_s: float  # of which the lock call itself (a ClockLatency's call_s)
    can_lock_clocks: bool  # the backend locks clocks at all (whether this process may is proven at start-up)
    energy_scope: _EnergyScope


# NVML is the default for a spec that names no backend (a GPU-table key), so it is known here.
_NVML_TRAITS = BackendTraits("nvml")
_TRAITS: dict[str, BackendTraits] = {}


def register_backend_traits(traits: BackendTraits) -> None:
    """Make ``traits.name`` a backend name of ``--envpipe-gpu`` (idempotent for equal traits)."""
    known = _TRAITS.get(traits.name)
    if known is not None and known != traits:
        raise DeviceBackendError(f"backend {traits.name!r} is registered already, with other traits")
    _TRAITS[traits.name] = traits


def named_backend(spec: str | None) -> str | None:
    """The registered backend ``spec`` names, or None (empty spec, or a GPU-table key)."""
    name = (spec or "").partition(":")[0]
    return name if name in _TRAITS else None


def backend_traits(spec: str | None) -> BackendTraits:
    """The traits of the backend ``spec`` names; a GPU-table key (or nothing) is NVML's."""
    name = named_backend(spec)
    return _TRAITS[name] if name is not None else _NVML_TRAITS


def model_profile(spec: str | None) -> str | None:
    """The profile a modelled backend's spec names (``simulated:<profile>``: the part after ':'),
    ``""`` when it names none; None for a backend that takes no profile."""
    if not backend_traits(spec).takes_profile:
        return None
    return (spec or "").partition(":")[2]


# The built-in backends (the device layer registers their openers under the same names).
for _builtin in (
    BackendTraits("auto"),  # NVML for this rank's CUDA device when there is one, else none
    _NVML_TRAITS,
    BackendTraits("none", can_lock_clocks=False, energy_scope="none"),
    BackendTraits("simulated", modelled=True, takes_profile=True, virtual_time=True, energy_scope="model"),
):
    register_backend_traits(_builtin)
