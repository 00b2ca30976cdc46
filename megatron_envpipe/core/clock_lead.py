"""The clock-lead rule: when to request a clock change so that it lands where the plan wants it.

A lock request takes ``latency_s`` (request -> SMs at the new clock, ``DeviceDynamics.clock_latency_s``)
to land; until then the SMs keep the old clock. Asked for at the unit boundary:

* a *lowering* lands ``latency_s`` into the next unit, which runs that long at the higher clock: a
  little energy, no time lost. It stays at the boundary (asking earlier would slow the unit before).
* a *raise* lands ``latency_s`` into the next unit, which runs that long too slowly: on the critical
  path that delays the iteration. With the rule on, a raise is requested ``latency_s`` (+ ``margin_s``)
  before the previous unit's predicted end, so it lands on time; the previous unit's tail then runs at
  the higher clock (a little energy, a little time saved).

Pure Python: the executor's hooks (gpu/hooks.py), the latency-aware prediction
(core/clock_transitions.py) and the measured simulation (testing/pipeline_sim.py) all ask this one rule.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from megatron_envpipe.errors import UsageError

__all__ = ["ClockLead", "ClockLeadError"]

_MAX_LEAD_S = 1.0  # beyond this a latency or margin is a unit mistake (ms given as s), not a GPU


class ClockLeadError(UsageError, ValueError):
    """A clock-lead setting or query that cannot be used."""


def _check_seconds(name: str, value: object, high: float) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) \
            or not 0.0 <= value <= high:
        raise ClockLeadError(f"clock lead: {name} must be a number of seconds in [0, {high:g}], got {value!r} "
                             "(give milliseconds as e.g. 0.015)")
    return float(value)


@dataclass(frozen=True)
class ClockLead:
    """When to request each clock change (module docstring)."""

    latency_s: float  # expected lock request -> SMs at the new clock
    enabled: bool = True  # False: every change requested at the unit boundary (today's behaviour)
    margin_s: float = 0.0  # raise this much earlier still (absorbs unit-time noise)

    def __post_init__(self) -> None:
        object.__setattr__(self, "latency_s", _check_seconds("latency_s", self.latency_s, _MAX_LEAD_S))
        object.__setattr__(self, "margin_s", _check_seconds("margin_s", self.margin_s, _MAX_LEAD_S))
        if not isinstance(self.enabled, bool):
            raise ClockLeadError(f"clock lead: enabled must be True or False, got {self.enabled!r}")

    def request_after_begin_s(self, old_mhz: int, new_mhz: int, previous_unit_s: float) -> float | None:
        """seconds after the previous unit's BEGIN at which to request the change: a raise with the rule on:
        max(0, previous_unit_s - latency_s - margin_s); None: at the boundary (lowerings; rule off)."""
        for name, mhz in (("old_mhz", old_mhz), ("new_mhz", new_mhz)):
            if isinstance(mhz, bool) or not isinstance(mhz, int) or mhz <= 0:
                raise ClockLeadError(f"clock lead: {name} must be a positive whole number of MHz, got {mhz!r}")
        if isinstance(previous_unit_s, bool) or not isinstance(previous_unit_s, int | float) \
                or not math.isfinite(previous_unit_s) or previous_unit_s < 0:
            raise ClockLeadError(f"clock lead: previous_unit_s must be a finite number of seconds >= 0, "
                                 f"got {previous_unit_s!r}")
        if not self.enabled or new_mhz <= old_mhz:
            return None
        return max(0.0, float(previous_unit_s) - self.latency_s - self.margin_s)
