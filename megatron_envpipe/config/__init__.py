"""EnvPipe's run-time settings (:mod:`.settings`), by group (:mod:`.groups`), and the ``--envpipe-*`` flags
(:mod:`.flags`).

``add_envpipe_args(parser)`` adds the flags to any argparse parser (Megatron's
included); ``EnvPipeConfig.from_args(args)`` turns them into a validated config;
``validate_with_megatron_args(args)`` adds what needs Megatron's flags; ``config.group(ProfilerSettings)``
is one group of it (plan, schedule, device, profiler, simulated GPU, stragglers, reporting, transport).
``fraction`` is the argparse type of fraction flags (``0.05``, ``5%``). Pure Python.
"""

from __future__ import annotations

from megatron_envpipe.config.flags import add_envpipe_args
from megatron_envpipe.config.groups import (
    DeviceSettings,
    PlanSettings,
    ProfilerSettings,
    ReportSettings,
    ScheduleSettings,
    SimDeviceSettings,
    StragglerSettings,
    TransportSettings,
)
from megatron_envpipe.config.profiles import load_profile
from megatron_envpipe.config.settings import EnvPipeConfig
from megatron_envpipe.flag_types import (
    EnvPipeConfigError,
    fraction,
    int_list,
    max_inflight_arg,
    memory_model_arg,
    num_microbatches_of,
    virtual_stages_of,
)

__all__ = ["DeviceSettings", "EnvPipeConfig", "EnvPipeConfigError", "PlanSettings", "ProfilerSettings",
           "ReportSettings", "ScheduleSettings", "SimDeviceSettings", "StragglerSettings", "TransportSettings",
           "add_envpipe_args", "fraction", "int_list", "load_profile", "max_inflight_arg", "memory_model_arg",
           "num_microbatches_of", "virtual_stages_of"]
