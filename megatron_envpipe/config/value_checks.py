"""Each ``--envpipe-*`` setting's value checked alone: numbers (kind, finite, range), the activation budget,
the straggler flags. Run by ``EnvPipeConfig.validate`` before whether a flag can act is checked; one
:class:`EnvPipeConfigError` line per problem, naming the flag and what to give. Pure Python.
"""

from __future__ import annotations

from typing import Any

from megatron_envpipe.core.flag_ranges import RANGES
from megatron_envpipe.core.memory import AUTO, MemoryModel, show_budget
from megatron_envpipe.flag_types import (
    OPTIONAL_NUMBERS,
    TRAINING_NUMBERS,
    EnvPipeConfigError,
    SimStraggler,
    show,
)

__all__ = ["check_max_inflight", "check_numbers", "check_stragglers"]


def check_numbers(config: Any) -> None:
    """Each numeric flag: the right kind of number, finite, in its range (core.flag_ranges; nan, inf never pass)."""
    if isinstance(config.max_slowdown, int | float) and 1 < config.max_slowdown < float("inf"):
        x = show(config.max_slowdown)
        raise EnvPipeConfigError(
            f"--envpipe-max-slowdown {x} allows iterations up to {100 * config.max_slowdown:.0f}% slower than the "
            f"baseline (at most 1 = 100%): it is a fraction, 0.05 = 5%; for {x}% give "
            f"{show(config.max_slowdown / 100)} or {x}%"
        )
    for name, (flag, limits, example) in TRAINING_NUMBERS.items():
        value = getattr(config, name)
        if value is None and name in OPTIONAL_NUMBERS:
            continue
        problem = limits.problem(value)
        if problem:
            raise EnvPipeConfigError(f"{flag} {show(value)}: {problem}; give e.g. {flag} {example}")


def check_max_inflight(config: Any) -> None:
    """``--envpipe-max-inflight``: auto, none, a whole number >= 1, or one per stage; the memory model's numbers."""
    flag, value = "--envpipe-max-inflight", config.max_inflight
    example = "give e.g. auto, none, 8 or 4,3,2,2"
    if value is None or value == AUTO:
        pass
    elif isinstance(value, tuple):
        if not value:
            raise EnvPipeConfigError(f"{flag} is empty: give one budget per pipeline stage, e.g. 4,3,2,2, or auto")
        for s, b in enumerate(value):
            problem = RANGES["max_inflight"].problem(b)
            if problem:
                raise EnvPipeConfigError(f"{flag} {show_budget(value)}: stage {s}'s entry {show(b)} {problem}; "
                                         f"{example}")
    elif isinstance(value, str):
        raise EnvPipeConfigError(f"{flag} {value!r}: {example}")
    else:
        problem = RANGES["max_inflight"].problem(value)
        if problem:
            raise EnvPipeConfigError(f"{flag} {show(value)}: {problem}; {example}")
    model = config.sim_memory
    if model is not None:
        problem = model.problem() if isinstance(model, MemoryModel) else "not a memory model"
        if problem:
            raise EnvPipeConfigError(f"--envpipe-sim-memory: {problem}; give GIB_FREE,MIB_PER_MICROBATCH, "
                                     "e.g. 2,256")


def check_stragglers(config: Any) -> None:
    """``--envpipe-straggler-threshold`` a fraction in (0, 1); ``--envpipe-sim-straggler`` well formed, on a
    simulated GPU (the replica's range is checked against the data-parallel size where it is known)."""
    t = config.straggler_threshold
    if RANGES["straggler_threshold"].problem(t):  # core.flag_ranges: a fraction in (0, 1)
        raise EnvPipeConfigError(f"--envpipe-straggler-threshold {show(t)}: must be a fraction in (0, 1), the "
                                 "slowest pipeline's lead that starts following; give e.g. 0.02 or 2%")
    sim = config.sim_straggler
    if sim is None:
        return
    problem = sim.problem() if isinstance(sim, SimStraggler) else "not REPLICA:FACTOR[@ITER]"
    if problem:
        raise EnvPipeConfigError(f"--envpipe-sim-straggler {sim}: {problem}; give e.g. 1:1.15 or 1:1.2@10")
