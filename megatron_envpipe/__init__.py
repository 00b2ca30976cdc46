"""megatron-envpipe: energy-saving pipeline-parallel training for Megatron-core.

The planning core (schedules, profiles, timeline, planners, instruction
programs) is pure Python and imports no torch; the Megatron and GPU edges are
imported on demand: ``megatron_envpipe.install(config)`` routes Megatron-core's
1F1B schedule through EnvPipe's executor, ``uninstall()`` restores it.
"""

from typing import Any

__version__ = "0.1.0"
__all__ = ["install", "uninstall", "is_installed", "EnvPipeConfig", "add_envpipe_args"]


def __getattr__(name: str) -> Any:
    if name in ("install", "uninstall", "is_installed"):
        from . import patch

        return getattr(patch, name)
    if name in ("EnvPipeConfig", "add_envpipe_args"):
        from . import config

        return getattr(config, name)
    raise AttributeError(f"module 'megatron_envpipe' has no attribute {name!r}")
