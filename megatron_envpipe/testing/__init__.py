"""Test support: run Megatron-core pipeline training on CPU ranks over gloo.

``run_pipeline`` drives a tiny deterministic GPT through one training
iteration per requested run, with Megatron's 1F1B or a replacement schedule,
and returns every rank's losses and gradients for bitwise comparison, with the
identity of the schedule function that ran on each rank. Importing this
package imports torch but not megatron; ranks import megatron themselves.
"""

from megatron_envpipe.testing.harness import (
    MEGATRON_1F1B,
    PipelineRun,
    ScheduleFn,
    ScheduleIdentity,
    StageResult,
    compare_results,
    identify,
    megatron_1f1b,
    run_pipeline,
    run_schedule,
)
from megatron_envpipe.testing.tiny_gpt import TinyGPTSpec

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
