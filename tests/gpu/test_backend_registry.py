"""Device backends are found by registration (gpu/devices/registry.py), asked by capability
(core/device_backends.py): a new backend is its own module plus one register_backend call."""

from __future__ import annotations

import pytest
from constant_backend import (  # registers "constant" (tests/gpu is on sys.path)
    CLOCK_MHZ,
    ConstantPowerGpu,
    open_constant,
)

from megatron_envpipe.core.clock_latency import DEFAULT_CLOCK_LATENCY
from megatron_envpipe.core.device_backends import (
    BackendTraits,
    DeviceBackendError,
    backend_traits,
    model_profile,
    named_backend,
)
from megatron_envpipe.core.device_dynamics import EXACT
from megatron_envpipe.core.virtual_clock import VirtualClock
from megatron_envpipe.gpu import open_gpu
from megatron_envpipe.gpu.devices.registry import register_backend
from megatron_envpipe.gpu.startup import StageDevice

PROFILE = "a40/gpt3-175b"


def test_a_backend_in_its_own_module_is_opened_by_its_name():
    gpu = open_gpu("constant:250")
    assert isinstance(gpu, ConstantPowerGpu) and gpu.power_w() == 250.0
    assert gpu.supported_clocks_mhz() == (CLOCK_MHZ,)
    # The pipeline sees it through its capabilities: no control, energy measured, not simulated.
    stage = StageDevice.of(gpu, control=False)
    assert (stage.backend, stage.energy, stage.modelled) == ("constant", True, False)


def test_flag_checks_ask_the_registered_traits():
    from megatron_envpipe.config import EnvPipeConfig, EnvPipeConfigError

    assert named_backend("constant:250") == "constant" and not backend_traits("constant:250").modelled
    EnvPipeConfig(gpu="constant:250").validate()  # a backend name, not an unknown GPU-table key
    with pytest.raises(EnvPipeConfigError, match="simulated GPU"):  # simulator flags need a modelled GPU
        EnvPipeConfig(gpu="constant:250", sim_jitter=0.1).validate()
    with pytest.raises(EnvPipeConfigError):  # an unregistered name is still a table key, and unknown
        EnvPipeConfig(gpu="constantx:250").validate()


def test_builtin_capabilities():
    none = open_gpu("none").capabilities()
    assert (none.can_lock_clocks, none.energy_scope, none.modelled) == (False, "none", False)
    wall = open_gpu(f"simulated:{PROFILE}", time_scale=0.01).capabilities()
    assert (wall.modelled, wall.time_base, wall.energy_scope) == (True, "wall", "model")
    assert wall.clock_latency_s == EXACT.clock_latency_s == 0.0
    virtual = open_gpu(f"simulated:{PROFILE}", virtual_clock=VirtualClock()).capabilities()
    assert virtual.time_base == "virtual"
    # A real GPU's latency is the assumed default (what the planner scores with).
    assert ConstantPowerGpu(1.0).capabilities().clock_latency_s == DEFAULT_CLOCK_LATENCY.request_to_clock_s


def test_spec_traits():
    assert model_profile(f"simulated:{PROFILE}") == PROFILE and model_profile("simulated") == ""
    assert model_profile("a40") is None and model_profile("nvml") is None and model_profile(None) is None
    assert backend_traits("a40") == backend_traits("nvml") == backend_traits(None)  # table keys are NVML GPUs
    assert backend_traits("simulated:x").virtual_time and not backend_traits("auto").virtual_time


def test_a_name_is_registered_once():
    with pytest.raises(DeviceBackendError):
        register_backend(BackendTraits("constant"), open_constant)  # other traits under a taken name
    with pytest.raises(DeviceBackendError):
        register_backend(BackendTraits("constant", can_lock_clocks=False), lambda request: ConstantPowerGpu(1.0))
    with pytest.raises(DeviceBackendError):
        BackendTraits("bad:name")
