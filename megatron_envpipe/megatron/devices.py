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

from megatron_envpipe.config.groups import (
    DeviceSettings,
    PlanSettings,
    ScheduleSettings,
    SimDeviceSettings,
    TransportSettings,
)
from megatron_envpipe.core.kinds import plan_kind
from megatron_envpipe.errors import OutOfOrderError
from megatron_envpipe.gpu.hooks import GpuHooks
from megatron_envpipe.gpu.stage_gpu import open_stage_gpu
from megatron_envpipe.gpu.startup import DeviceFacts, StageDevice, combine_stage_devices
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
    cfg = runtime.config  # each part below receives only its settings groups
    dev, sim = cfg.group(DeviceSettings), cfg.group(SimDeviceSettings)
    timing: ClockTiming | None = None
    device_time: DeviceTimeLink | None = None
    if state.user_hooks:
        mine = StageDevice.absent()
    else:
        cuda = torch_device.type == "cuda"
        plan = cfg.group(PlanSettings)
        opened = open_stage_gpu(dev, sim, sets_clocks=plan_kind(plan.plan_type).sets_clocks,
                                p2p_power_w=plan.p2p_power_w, local_rank=torch.cuda.current_device() if cuda else None,
                                stage=groups.stage, num_stages=groups.num_stages, cuda=cuda, num_chunks=num_chunks)
        device, decision, virtual = opened.device, opened.decision, opened.virtual_clock
        timing = ClockTiming.of(opened.capabilities)  # decided once: the hooks lead by it, the planner scores with it
        state.use_hooks(GpuHooks(device, control=decision.control, cuda=cuda, lost=decision.lost,
                                 time_scale=opened.hooks_time_scale, virtual_clock=virtual,
                                 clock_lead=timing.clock_lead(dev.clock_lead == "on")))
        if virtual is not None:
            device_time = DeviceTimeLink.create(virtual, groups.pp_group, num_chunks, cfg.group(TransportSettings))
        mine = StageDevice.of(device, decision.control)
    facts = combine_stage_devices(groups.agree(groups.gather_stages(mine)))
    if mine.control and not facts.control:  # the ranks without control said why, each in its own log
        log.warning("EnvPipe stage %d: another stage cannot lock clocks (or they share no clock): the pipeline "
                    "keeps Megatron's own order, no clock plan, clocks left to the driver", groups.stage)
    key = _profile_cache_key(layout_key, facts)
    if timing is None:  # hooks given to install(): no device of ours, the figures the config implies
        timing = ClockTiming.assumed(facts.modelled, sim.device_dynamics())
    runtime.attach_device(facts, key, DeviceSession(facts, timing, key))
    runtime.attach_memory(memory_source(groups, torch_device, cfg.group(ScheduleSettings)))
    state.device_set_up(device_time)
