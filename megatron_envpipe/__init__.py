"""megatron-envpipe: energy-saving pipeline-parallel training for Megatron-core.

The package tree is the architecture, one layer per folder, each importing
only the layers above it in this list:

- ``core/``      pure Python (stdlib only): schedules, profiles, the pipeline
  graph and timeline, frequency plans, instruction programs, GPU table.
- ``planning/``  pure planners: EnvPipe's plans and online reconfiguration, the
  optimal per-unit clock planner (LP; numpy/HiGHS imported when it runs),
  the MILP reference, the frontier, Perseus compatibility.
- ``gpu/``       the GPU edge: devices (NVML, simulated, none), clock control and
  safety, energy measurement, the start-up clock sweep, its cache.
- ``megatron/``  the torch + Megatron-core edge: the instruction executor,
  ``install()``, version compatibility, the run-time phases, Megatron-LM entry.
- ``apps/``      the ``envpipe`` command, the demo, the tiny GPT example.
- ``testing/``   the gloo harness that runs Megatron pipelines on CPU.

Public API: ``install(config)`` routes Megatron-core's pipeline schedule through
EnvPipe's executor and ``uninstall()`` restores it; ``EnvPipeConfig`` and
``add_envpipe_args`` define the ``--envpipe-*`` flags; every error the package
raises on purpose is an ``EnvPipeError``.
"""

from typing import Any

from megatron_envpipe.config import EnvPipeConfig, add_envpipe_args
from megatron_envpipe.errors import EnvPipeError, UsageError

__version__ = "0.1.0"
__all__ = [
    "EnvPipeConfig",
    "EnvPipeError",
    "UsageError",
    "add_envpipe_args",
    "install",
    "is_installed",
    "uninstall",
]


def __getattr__(name: str) -> Any:
    # install()/uninstall() live in the Megatron edge, which imports torch and
    # megatron-core: loaded on first use so the pure layers stay torch-free.
    if name in ("install", "uninstall", "is_installed"):
        from megatron_envpipe.megatron import patch

        return getattr(patch, name)
    raise AttributeError(f"module 'megatron_envpipe' has no attribute {name!r}")
