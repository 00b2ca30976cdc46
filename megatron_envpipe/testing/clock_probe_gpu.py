"""A simulated GPU for the clock-change probe's tests: only its clocks matter."""

from __future__ import annotations

from collections.abc import Sequence

from megatron_envpipe.core.device_dynamics import DeviceDynamics
from megatron_envpipe.core.profile import Profile, ProfilePoint
from megatron_envpipe.core.virtual_clock import VirtualClock
from megatron_envpipe.gpu.devices.simulated import SimulatedGpu

__all__ = ["simulated_clock_gpu"]


def simulated_clock_gpu(vc: VirtualClock, dynamics: DeviceDynamics,
                        clocks_mhz: Sequence[int] = tuple(range(1980, 209, -15)),
                        sm_clock_range_mhz: tuple[int, int] | None = None) -> SimulatedGpu:
    """A simulated GPU with these SM clocks (H100-like by default) and ``dynamics``, on ``vc``:
    only its clocks matter here (its units' times and powers are placeholders)."""
    top = max(clocks_mhz)
    points = [ProfilePoint(int(f), 1e-3 * top / f, 0.3 * top / f) for f in sorted(clocks_mhz, reverse=True)]
    profile = Profile({(0, "forward"): points, (0, "backward"): points}, source="<clock-change probe>")
    return SimulatedGpu(profile, 0, clock=vc.now, sleep=vc.sleep, dynamics=dynamics,
                        sm_clock_range_mhz=sm_clock_range_mhz, name="Simulated GPU (clock-change probe)")
