"""The eight steps of ``envpipe gpu-check``, in order, with their hard limits and needs.

The limits add up to the planned total printed at the start (at most 8 minutes: a lent GPU is
typically a short loan, and the check must leave time for nothing else to go wrong). Each step
module is imported only in its child process (``child.py``), so this list stays import-light.
"""

from __future__ import annotations

from megatron_envpipe.apps.gpu_check.step_api import Step

__all__ = ["STEPS"]

_MAX_TOTAL_S = 480.0  # the issue's "under 8 minutes", for the sum of the steps' hard limits
_NEEDS = frozenset({"gpu", "cuda", "clock_control", "megatron"})

_PKG = "megatron_envpipe.apps.gpu_check"


def _step(number: int, name: str, title: str, planned_s: float, needs: set[str], module: str) -> Step:
    return Step(number, name, title, planned_s, frozenset(needs), f"{_PKG}.{module}:run")


STEPS: tuple[Step, ...] = (
    _step(1, "facts", "GPU, driver, clocks; does a clock lock work (lock, read back, reset)", 20,
          {"gpu"}, "facts_step"),
    _step(2, "counter", "energy counter: update period, step, read cost, agreement with power", 40,
          {"gpu"}, "counter_step"),
    _step(3, "clock_changes", "clock changes: NVML call, NVML report, SMs at the new clock", 60,
          {"gpu", "cuda", "clock_control"}, "clock_step"),
    _step(4, "blocking_power", "power of a GPU spinning on a flag at locked clocks, and idle", 45,
          {"gpu", "cuda", "clock_control"}, "blocking_step"),
    _step(5, "profile", "a Megatron-core transformer stage across clocks (profile.csv)", 100,
          {"gpu", "cuda", "clock_control", "megatron"}, "profile_step"),
    _step(6, "replay", "plans replayed from that profile: predicted vs measured energy and time", 90,
          {"gpu", "cuda", "clock_control", "megatron"}, "replay_step"),
    _step(7, "executor", "the tiny GPT as 4 stages sharing the GPU, losses vs stock Megatron", 90,
          {"gpu", "cuda", "megatron"}, "executor_step"),
    _step(8, "preset", "a simulated-GPU preset from these measurements (calibrated-gpu.toml)", 10,
          {"gpu"}, "preset_step"),
)


def _planned_total_s(steps: tuple[Step, ...] | list[Step] = STEPS) -> float:
    return float(sum(s.planned_s for s in steps))


def _check(steps: tuple[Step, ...]) -> None:
    """Import-time guard: the plan the issue promises (numbers in order, names unique, known needs, <= 8 min)."""
    if [s.number for s in steps] != list(range(1, len(steps) + 1)) or len({s.name for s in steps}) != len(steps):
        raise AssertionError("gpu-check steps must be numbered 1..N in order with unique names")
    unknown = set().union(*(s.needs for s in steps)) - _NEEDS
    if unknown:
        raise AssertionError(f"gpu-check steps need unknown things: {sorted(unknown)}")
    if _planned_total_s(steps) > _MAX_TOTAL_S:
        raise AssertionError(f"gpu-check steps plan {_planned_total_s(steps):g} s, more than {_MAX_TOTAL_S:g} s")


_check(STEPS)
