"""First iteration: open this rank's GPU, decide on clock control, agree on the facts.

Runs on every rank of the pipeline at the same point of the first iteration
after ``install()``, so the per-stage descriptions are gathered and combined
identically everywhere (:func:`~megatron_envpipe.gpu.startup.combine_stage_devices`).
The GPU hooks it creates replace the placeholder hooks in the executor state.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from megatron_envpipe.core.device_backends import backend_traits
from megatron_envpipe.core.kinds import plan_kind
from megatron_envpipe.core.virtual_clock import VirtualClock
from megatron_envpipe.errors import OutOfOrderError
from megatron_envpipe.gpu import open_gpu
from megatron_envpipe.gpu.control.clock_proof import cuda_spin_load
from megatron_envpipe.gpu.hooks import GpuHooks
from megatron_envpipe.gpu.startup import DeviceFacts, StageDevice, clock_control, combine_stage_devices
from megatron_envpipe.megatron.device_session import ClockTiming, DeviceSession
from megatron_envpipe.megatron.device_time import DeviceTimeLink
from megatron_envpipe.megatron.groups import StageGroups
from megatron_envpipe.megatron.memory import memory_source
from megatron_envpipe.megatron.state import ExecutorState

__all__ = ["profile_layout_key", "setup_device"]

log = logging.getLogger("megatron_envpipe")

# Megatron config fields that change a stage's work, and so its profile.
_MODEL_FIELDS = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups",
                 "kv_channels", "recompute_granularity", "recompute_method", "num_moe_experts")


def profile_layout_key(model_config: Any, model: Any, groups: StageGroups, send_shape: tuple[int, ...],
                       dtype: torch.dtype) -> dict[str, Any]:
    """What a stage profile depends on besides the GPU: architecture, layout, batch shape."""
    model_key = {name: getattr(model_config, name, None) for name in _MODEL_FIELDS}
    model_key["class"] = type(model).__name__
    return {
        "model": model_key,
        "tensor_parallel": groups.tp_size,
        "pipeline_parallel": groups.num_stages,
        "context_parallel": groups.cp_size,
        "micro_batch_size": send_shape[1],
        "seq_length": send_shape[0],
        "dtype": str(dtype),
    }


def _profile_cache_key(layout_key: dict[str, Any], facts: DeviceFacts) -> dict[str, Any]:
    return {**layout_key, "gpu_name": facts.name, "driver_version": facts.driver_version,
            "clocks": list(facts.clocks_mhz)}


def setup_device(state: ExecutorState, groups: StageGroups, torch_device: torch.device,
                 layout_key: dict[str, Any], num_chunks: int = 1) -> None:
    """Open the GPU (unless hooks were given to ``install()``), attach the pipeline's facts to
    the run-time with the profile cache key, and mark the state's device ready."""
    runtime = state.runtime
    if runtime is None:
        raise OutOfOrderError("EnvPipe executor called before megatron_envpipe.install()")
    cfg = runtime.config
    timing: ClockTiming | None = None
    if state.user_hooks:
        mine = StageDevice.absent()
    else:
        cuda = torch_device.type == "cuda"
        # A simulated GPU in virtual time runs on its own clock, stamped over the pipeline.
        virtual = VirtualClock() if backend_traits(cfg.gpu).virtual_time and cfg.sim_time == "virtual" else None
        device = open_gpu(cfg.gpu or "auto", torch.cuda.current_device() if cuda else None,
                          stage=groups.stage, num_stages=groups.num_stages, time_scale=cfg.sim_time_scale,
                          p2p_power_w=cfg.p2p_power_w, cuda=cuda, num_chunks=num_chunks, jitter=cfg.sim_jitter,
                          unit_scale=cfg.sim_unit_scale,
                          dynamics=cfg.device_dynamics, virtual_clock=virtual)
        # A real GPU idle during the trial lock may park its clock: keep it busy meanwhile.
        caps = device.capabilities()
        load = cuda_spin_load() if cuda and caps.can_lock_clocks and not caps.modelled else None
        decision = clock_control(device, plan_kind(cfg.plan_type).sets_clocks, cfg.on_no_permission, groups.stage,
                                 load=load)
        timing = ClockTiming.of(caps)  # decided once: the hooks lead by it, the planner scores with it
        state.use_hooks(GpuHooks(device, control=decision.control, cuda=cuda, lost=decision.lost,
                                 time_scale=cfg.sim_time_scale if caps.modelled and virtual is None else 1.0,
                                 virtual_clock=virtual, clock_lead=timing.clock_lead(cfg.clock_lead == "on")))
        if virtual is not None:
            state.device_time = DeviceTimeLink.create(virtual, groups.pp_group, num_chunks, cfg.comm_timeout_s)
        mine = StageDevice.of(device, decision.control)
    facts = combine_stage_devices(groups.agree(groups.gather_stages(mine)))
    if mine.control and not facts.control:  # the ranks without control said why, each in its own log
        log.warning("EnvPipe stage %d: another stage cannot lock clocks (or they share no clock): the pipeline "
                    "keeps Megatron's own order, no clock plan, clocks left to the driver", groups.stage)
    key = _profile_cache_key(layout_key, facts)
    if timing is None:  # hooks given to install(): no device of ours, the figures the config implies
        timing = ClockTiming.assumed(facts.modelled, cfg.device_dynamics)
    runtime.attach_device(facts, key, DeviceSession(facts, timing, key))
    runtime.attach_memory(memory_source(groups, torch_device, cfg))
    state.device_ready = True
