"""Energy of one window of GPU work, with both edges on the energy counter's own updates.

API (stable; other steps build on it)::

    window_length_s(counter_period_s: float, tolerance: float, read_cost_s: float = 0.0) -> float
    measure_window(device: GpuDevice, body: Callable[[], None], *, counter_period_s: float,
                   clock=time.monotonic, sleep=time.sleep) -> WindowEnergy
    WindowEnergy(energy_j, time_s, uncertainty_j, reads, edge_wait_s, body_s, time_uncertainty_s)

NVML's total-energy counter moves only every ~100 ms (docs/energy-measurement.md): a value
read at an arbitrary moment is the energy at the last update, stale by up to one period, so
``read - body - read`` is off by up to one period's energy at *each* edge, whatever the number
of repetitions. Here each edge is an update itself: :func:`measure_window` polls the counter
until it changes, runs ``body`` (which must return when its work is done, e.g. after
``torch.cuda.synchronize()``), then polls until it changes again. The difference of the two
new values is the exact energy between the two updates (up to the counter's 1 mJ step); the
only uncertainty is *when* each update happened: inside the bracket between the read before
it and the read that saw it (``poll_interval_s`` plus the read's own cost). So a window of
length T measures power within ``bracket / T`` (:func:`window_length_s`), not
``2 * period / T`` as edge reads did.

The window spans the body plus ``edge_wait_s`` (before it: up to one poll; after it: until
the next update, up to one period). Callers that want the body's power keep the GPU in the
same state across the edges (start the load before the window, let ``body`` only wait), or
subtract ``edge_wait_s`` times the power the GPU draws there. ``body`` may be called
repeatedly by the caller, once per window.

Time is the caller's ``clock``/``sleep`` (a VirtualClock's on the simulated GPU).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

from megatron_envpipe.errors import EnvPipeError
from megatron_envpipe.gpu.devices.base import GpuDevice

__all__ = ["EnergyWindowError", "WindowEnergy",
           "measure_window", "poll_interval_s", "window_length_s"]

# NVML reports whole millijoules: one step of quantisation per edge.
_COUNTER_STEP_J = 1e-3
# Polls per counter period while waiting for an update (100 ms period: every 2 ms, light on the driver).
_POLL_DIVISIONS = 50
# No faster than this, whatever the period (NVML calls cost tens of microseconds).
_MIN_POLL_S = 1e-4
# A window spans at least this many updates: within one period the counter is built from power
# samples covering only part of the runtime (Yang et al., SC24), which averages out over several.
_MIN_WINDOW_PERIODS = 4
# An update is waited for this many periods before the counter is declared stalled, and at least
# _MIN_EDGE_TIMEOUT_S: a period measured under load may be short, and a real driver skips an update now and then.
_EDGE_TIMEOUT_PERIODS = 5
_MIN_EDGE_TIMEOUT_S = 0.5


class EnergyWindowError(EnvPipeError, RuntimeError):
    """A window could not be measured (bad arguments, a counter that stalls or goes back)."""


@dataclass(frozen=True)
class WindowEnergy:
    """One window between two counter updates."""

    energy_j: float            # counter difference between the two updates (exact up to _COUNTER_STEP_J each)
    time_s: float              # between the two updates (bracket middles)
    uncertainty_j: float       # bound on |energy_j - energy over a window of exactly time_s| (edge timing + steps)
    reads: int                 # counter reads it took
    edge_wait_s: float         # window time outside body(): before it and after it until the update
    body_s: float = 0.0        # host time body() took
    time_uncertainty_s: float = 0.0  # bound on |time_s - true time between the updates|

    @property
    def power_w(self) -> float:
        """Mean power over the window (0 for an empty window)."""
        return self.energy_j / self.time_s if self.time_s > 0 else 0.0

    @property
    def relative_error(self) -> float:
        """``uncertainty_j / energy_j`` (inf for no energy)."""
        return self.uncertainty_j / self.energy_j if self.energy_j > 0 else math.inf


def _check_period(counter_period_s: float, where: str) -> float:
    if isinstance(counter_period_s, bool) or not isinstance(counter_period_s, int | float) \
            or not math.isfinite(counter_period_s) or counter_period_s < 0:
        raise EnergyWindowError(f"{where}: counter_period_s must be a finite number of seconds >= 0 "
                                f"(0 = a counter exact at every read), got {counter_period_s!r}")
    return float(counter_period_s)


def poll_interval_s(counter_period_s: float) -> float:
    """Seconds between counter reads while waiting for an update (0 for an exact counter)."""
    period = _check_period(counter_period_s, "poll_interval_s")
    return 0.0 if period == 0 else max(_MIN_POLL_S, period / _POLL_DIVISIONS)


def window_length_s(counter_period_s: float, tolerance: float, read_cost_s: float = 0.0) -> float:
    """The shortest window whose measured power is within ``tolerance`` (relative) with aligned edges.

    Each edge's update lies in a bracket of one poll interval plus up to two reads; stamping it at
    the middle errs by at most half that, so two edges err by one bracket: ``T >= bracket / tolerance``.
    At least ``_MIN_WINDOW_PERIODS`` updates long (see there)."""
    period = _check_period(counter_period_s, "window_length_s")
    if isinstance(tolerance, bool) or not isinstance(tolerance, int | float) or not 0 < tolerance < 1:
        raise EnergyWindowError(f"window_length_s: tolerance is relative, a number in (0, 1) such as 0.01 for "
                                f"1 %, got {tolerance!r}")
    if isinstance(read_cost_s, bool) or not isinstance(read_cost_s, int | float) or not math.isfinite(read_cost_s) \
            or read_cost_s < 0:
        raise EnergyWindowError(f"window_length_s: read_cost_s must be a finite number of seconds >= 0 (one "
                                f"counter read), got {read_cost_s!r}")
    bracket_s = poll_interval_s(period) + 2.0 * read_cost_s
    return max(bracket_s / tolerance, _MIN_WINDOW_PERIODS * period)


@dataclass(frozen=True)
class _Edge:
    lo_s: float       # the update happened after this (start of the read before it)
    hi_s: float       # and before this (end of the read that saw it)
    energy_mj: float  # the counter's new value
    reads: int

    @property
    def mid_s(self) -> float:
        return 0.5 * (self.lo_s + self.hi_s)

    @property
    def width_s(self) -> float:
        return self.hi_s - self.lo_s


def _timed_read(device: GpuDevice, clock: Callable[[], float]) -> tuple[float, float, float]:
    before = clock()
    value = float(device.energy_mj())
    return before, value, clock()


def _next_update(device: GpuDevice, clock: Callable[[], float], sleep: Callable[[float], None],
                 poll_s: float, timeout_s: float) -> _Edge:
    """Poll until the counter changes; the change happened between the two reads' outer times."""
    prev_before, base, first_s = _timed_read(device, clock)
    reads = 1
    while True:
        sleep(poll_s)
        before, value, after = _timed_read(device, clock)
        reads += 1
        if value < base:
            raise EnergyWindowError(f"energy counter of {device.info().label()} went back ({base:.0f} -> "
                                    f"{value:.0f} mJ: driver reload?); measure the window again")
        if value != base:
            return _Edge(prev_before, after, value, reads)
        if after - first_s > timeout_s:
            raise EnergyWindowError(
                f"energy counter of {device.info().label()} did not change for {after - first_s:.3g} s "
                f"({reads} reads): it is stalled or the GPU draws no power; check the counter period given "
                f"(waited up to {timeout_s:.3g} s) and that the device has an energy counter")
        prev_before = before


def measure_window(device: GpuDevice, body: Callable[[], None], *, counter_period_s: float,
                   clock: Callable[[], float] = time.monotonic,
                   sleep: Callable[[float], None] = time.sleep) -> WindowEnergy:
    """Run ``body`` once between two counter updates and return the energy between them (module docstring).

    ``counter_period_s`` is the measured update period (step 2's ``counter_period_s``); 0 means a
    counter exact at every read (the edges are plain reads then)."""
    period = _check_period(counter_period_s, "measure_window")
    if period == 0:
        start_before, start_mj, start_after = _timed_read(device, clock)
        body()
        end_before, end_mj, end_after = _timed_read(device, clock)
        time_s = 0.5 * (end_before + end_after) - 0.5 * (start_before + start_after)
        width_s = 0.5 * ((start_after - start_before) + (end_after - end_before))
        return _window(start_mj, end_mj, time_s, width_s, reads=2, edge_wait_s=0.0,
                       body_s=end_before - start_after)
    poll_s = poll_interval_s(period)
    timeout_s = max(_EDGE_TIMEOUT_PERIODS * period, _MIN_EDGE_TIMEOUT_S)
    start = _next_update(device, clock, sleep, poll_s, timeout_s)
    body_begin_s = clock()
    body()
    body_end_s = clock()
    end = _next_update(device, clock, sleep, poll_s, timeout_s)
    edge_wait_s = max(0.0, body_begin_s - start.mid_s) + max(0.0, end.mid_s - body_end_s)
    return _window(start.energy_mj, end.energy_mj, end.mid_s - start.mid_s, 0.5 * (start.width_s + end.width_s),
                   reads=start.reads + end.reads, edge_wait_s=edge_wait_s, body_s=body_end_s - body_begin_s)


def _window(start_mj: float, end_mj: float, time_s: float, time_uncertainty_s: float, *, reads: int,
            edge_wait_s: float, body_s: float) -> WindowEnergy:
    energy_j = (end_mj - start_mj) / 1000.0
    if energy_j < 0:
        raise EnergyWindowError(f"energy counter went back during the window ({start_mj:.0f} -> {end_mj:.0f} mJ: "
                                "driver reload?); measure the window again")
    power_w = energy_j / time_s if time_s > 0 else 0.0
    # The stamps err by up to half a bracket each: that much time at the window's power, plus one step per edge.
    uncertainty_j = power_w * time_uncertainty_s + 2 * _COUNTER_STEP_J
    return WindowEnergy(energy_j=energy_j, time_s=max(0.0, time_s), uncertainty_j=uncertainty_j, reads=reads,
                        edge_wait_s=edge_wait_s, body_s=max(0.0, body_s), time_uncertainty_s=time_uncertainty_s)
