"""What can go wrong with an energy counter: the energy monitor's errors and their few-word reasons.

Split from gpu/energy/monitor.py: reports and the executor's hooks name a reason (``exc.reason``) without the monitor.
"""

from __future__ import annotations

from megatron_envpipe.errors import EnvPipeError

__all__ = [
    "CounterReadError", "CounterStalledError", "CounterWentBackError", "EnergyMonitorError", "READ_FAILED",
    "STALLED", "WENT_BACK",
]


STALLED = "counter stalled"


WENT_BACK = "counter went backwards"


READ_FAILED = "counter read failed"


class EnergyMonitorError(EnvPipeError, RuntimeError):
    """A window the trace cannot answer; ``reason`` says why in a few words (for reports)."""

    reason = "energy trace incomplete"


class CounterStalledError(EnergyMonitorError):
    """The counter stood still while the GPU drew power."""

    reason = STALLED


class CounterWentBackError(EnergyMonitorError):
    """The counter went back (driver reload, wrap): the energy around the jump is unknown."""

    reason = WENT_BACK


class CounterReadError(EnergyMonitorError):
    """Reading the counter failed."""

    reason = READ_FAILED
