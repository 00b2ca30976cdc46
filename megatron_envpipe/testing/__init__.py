"""Test support: run Megatron-core pipeline training on CPU ranks over gloo.

``run_pipeline`` drives a tiny deterministic GPT through one training
iteration per requested run, with Megatron's 1F1B or a replacement schedule,
and returns every rank's losses and gradients for bitwise comparison, with the
identity of the schedule function that ran on each rank. Those names load on
first use (PEP 562), so the pure test helpers here (``milp``: the exact MILP
reference planner, ``synthetic``: deeper profiles from the shipped ones) import
without torch; the harness imports torch but not megatron; ranks import megatron
themselves.

Other test support lives in modules of its own: ``forked_ranks`` (a torchrun stand-in that forks
the ranks of a launch from one interpreter that imported torch and megatron-core once),
``switch_bound`` (a lower bound on energy that counts clock changes, for bench/switch_bound.py),
``noisy_run``, ``graph_choosing``, ``clock_probe_gpu`` and ``microbatch_sizes`` (helpers only tests
and benches use).
"""

import importlib
from typing import Any

# Public name -> the module that defines it (imported on first access).
_LAZY = {name: "harness" for name in (
    "MEGATRON_1F1B", "PipelineRun", "ScheduleFn", "ScheduleIdentity", "StageResult", "compare_results",
    "identify", "megatron_1f1b", "run_pipeline", "run_schedule")} | {"TinyGPTSpec": "tiny_gpt"}


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)


__all__ = [
    "MEGATRON_1F1B",
    "PipelineRun",
    "ScheduleFn",
    "ScheduleIdentity",
    "StageResult",
    "TinyGPTSpec",
    "compare_results",
    "identify",
    "megatron_1f1b",
    "run_pipeline",
    "run_schedule",
]
