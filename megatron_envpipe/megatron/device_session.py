"""The device facts of a training run, decided once: the pipeline's agreed facts and the clock latency.

The clock latency (lock request -> SMs at the new clock, and of it the lock call) is used twice: the
GPU hooks request raises that far ahead of their boundary
(:class:`~megatron_envpipe.core.clock_lead.ClockLead`), and the planner scores every plan with the same
figures (``clock_latency_s``, ``clock_call_s``). :func:`~megatron_envpipe.megatron.devices.setup_device`
reads them once from the opened device (``GpuDevice.capabilities()``: a simulated GPU's dynamics, a real
GPU's assumed default) into a :class:`DeviceSession`, and hands the one session to the hooks
(:meth:`ClockTiming.clock_lead`) and to the phase machine's planner (:meth:`DeviceSession.planner_timing`).
Without an opened device (offline: tests and replays that attach facts by hand) :meth:`ClockTiming.assumed`
takes the same figures from the configuration.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from megatron_envpipe.core.clock_latency import DEFAULT_CLOCK_LATENCY
from megatron_envpipe.core.clock_lead import ClockLead
from megatron_envpipe.core.device_backends import DeviceCapabilities
from megatron_envpipe.core.device_dynamics import DeviceDynamics
from megatron_envpipe.gpu.startup import DeviceFacts

__all__ = ["ClockTiming", "DeviceSession"]


@dataclass(frozen=True)
class ClockTiming:
    """How long a clock change of this stage's device takes (seconds): the one figure hooks and planner use."""

    clock_latency_s: float  # lock request -> SMs at the new clock
    clock_call_s: float  # of which the lock call itself

    @classmethod
    def of(cls, caps: DeviceCapabilities) -> "ClockTiming":
        """The opened device's (``GpuDevice.capabilities()``)."""
        return cls(caps.clock_latency_s, caps.clock_call_s)

    @classmethod
    def assumed(cls, modelled: bool, dynamics: DeviceDynamics) -> "ClockTiming":
        """Without an opened device: a modelled GPU's ``dynamics``, a real GPU's default latency."""
        if modelled:
            return cls(dynamics.clock_latency_s, dynamics.nvml_call_s)
        return cls(DEFAULT_CLOCK_LATENCY.request_to_clock_s, DEFAULT_CLOCK_LATENCY.call_s)

    def clock_lead(self, enabled: bool) -> ClockLead | None:
        """The hooks' clock lead (``--envpipe-clock-lead on|off``); None (every change at its boundary) when
        there is no latency to lead."""
        if self.clock_latency_s <= 0.0:
            return None
        return ClockLead(latency_s=self.clock_latency_s, enabled=enabled)


@dataclass(frozen=True)
class DeviceSession:
    """What a run knows about its pipeline's GPUs from the first iteration on (module docstring)."""

    facts: DeviceFacts  # agreed by every stage
    timing: ClockTiming  # this stage's device's clock changes, as its hooks lead them
    cache_key: Mapping[str, Any] | None = None  # the profile cache's key (layout and device)

    def planner_timing(self, clock_lead: bool) -> dict[str, Any]:
        """The planner's clock-timing settings: the latency the hooks lead raises by, with clock control only."""
        if not self.facts.control:
            return {}
        return {"clock_latency_s": self.timing.clock_latency_s, "clock_call_s": self.timing.clock_call_s,
                "clock_lead": clock_lead}
