"""How long a clock change takes, and what it costs: a small value object the planner prices switches with.

A clock change has two delays (Velička et al., arXiv 2502.20075, name them switching and transition
latency):

* ``call_s``: the NVML lock call itself, on the thread that makes it. NVML calls "typically take
  10-20 ms" (Zeus issue #29); our executor makes them on one clock worker thread per process, so the
  GPU keeps computing meanwhile: the call delays *when* the new clock lands, it burns no energy of
  its own.
* ``settle_s``: from the call's return until the SMs run at the new clock. It depends mostly on the
  target clock (Velička et al.); no figure for the GPUs we ship profiles for is in our references,
  so the default is an assumption.

**Switch cost.** During the settle time the GPU runs at neither clock: we assume it does no useful
work and draws the P2P blocking power (what a stalled GPU draws, Perseus's ``P_p2p``), so one change
costs ``P_p2p x settle_s`` joules. (A change that lands late also shifts when the next clock runs:
the executor's lead rule is what keeps that off the critical path, and it is charged there, not here.)
A later step feeds a simulated or measured latency into the same value.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from megatron_envpipe.errors import UsageError

MAX_CLOCK_LATENCY_S = 10.0  # beyond this a figure is a unit mistake (ms given as s)


class ClockLatencyError(UsageError, ValueError):
    """A clock-change latency that cannot be used."""


@dataclass(frozen=True)
class ClockLatency:
    """The two delays of one clock change (seconds) and where the figures come from."""

    call_s: float  # the NVML lock call on the calling thread
    settle_s: float  # call returned -> SMs at the new clock
    source: str

    def __post_init__(self) -> None:
        for name in ("call_s", "settle_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value <= MAX_CLOCK_LATENCY_S:
                raise ClockLatencyError(f"clock latency {name} must be a number of seconds between 0 and "
                                        f"{MAX_CLOCK_LATENCY_S:g}, got {value!r} ({self.source or 'no source'})")
        if not isinstance(self.source, str) or not self.source.strip():
            raise ClockLatencyError("a clock latency needs a source: where its figures come from, or 'assumed'")

    @property
    def request_to_clock_s(self) -> float:
        """From the lock request until the SMs run at the new clock (how early a raise must be asked for)."""
        return self.call_s + self.settle_s

    def switch_cost_j(self, p2p_power_w: float) -> float:
        """Joules one clock change costs: ``p2p_power_w`` for the settle time (module docstring)."""
        if not 0 <= p2p_power_w < math.inf:
            raise ClockLatencyError(f"P2P blocking power must be a finite number >= 0 W, got {p2p_power_w!r}")
        return p2p_power_w * self.settle_s


# Used where the GPU table gives no figure of its own (none of the shipped entries does).
DEFAULT_CLOCK_LATENCY = ClockLatency(
    call_s=0.015,
    settle_s=0.010,
    source="call 15 ms: NVML calls take 10-20 ms (Zeus issue #29); settle 10 ms: assumed (depends on the target "
           "clock, Velicka et al. arXiv 2502.20075; no figure for these GPUs in our references)",
)
