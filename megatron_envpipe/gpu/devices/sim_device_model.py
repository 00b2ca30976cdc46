"""The simulated GPU's bookkeeping under device dynamics: units across clock changes, heat, history.

:class:`UnitRun` is a running unit as *work*: a clock change that lands while it runs
leaves the fraction of work still to do, which then runs at the new clock's time and
power (several changes: several segments). :class:`EnergyModel` integrates power over
wall time in the profile's joules, with the heat factor of
:meth:`~megatron_envpipe.core.device_dynamics.DeviceDynamics.power_factor` in closed
form. :class:`PowerHistory` keeps the few marks (every change of power) that averaged
power readings and a stepped energy counter need to read energy at a past time.
Pure Python; the device holds its own lock around all of it.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

from megatron_envpipe.core.device_dynamics import DeviceDynamics
from megatron_envpipe.gpu.devices.base import GpuError

__all__ = ["EnergyMark", "EnergyModel", "PowerHistory", "UnitRun", "check_clock_range", "last_tick_wall_s",
           "running_clock_mhz"]


@dataclass
class UnitRun:
    """An open unit: its current segment runs at ``freq_mhz`` from ``seg_begin_wall_s`` with
    ``work_left`` of the unit's work (1.0 = all) still to do then."""

    kind: str
    instruction: str
    begin_wall_s: float
    jitter_factor: float  # the unit's seeded time factor; every segment keeps it
    freq_mhz: int
    power_w: float  # the profile's power at freq_mhz (before heat)
    full_wall_s: float  # wall seconds the whole unit would take at freq_mhz
    seg_begin_wall_s: float = math.nan
    work_left: float = 1.0

    def __post_init__(self) -> None:
        if math.isnan(self.seg_begin_wall_s):
            self.seg_begin_wall_s = self.begin_wall_s

    @property
    def end_wall_s(self) -> float:
        """When the modelled compute finishes if the clock does not change again."""
        return self.seg_begin_wall_s + self.work_left * self.full_wall_s

    def switch(self, at_wall_s: float, freq_mhz: int, power_w: float, full_wall_s: float) -> bool:
        """The SMs run at ``freq_mhz`` from ``at_wall_s``: the work left continues there.
        False (nothing changes) when the unit's compute had already finished."""
        if not at_wall_s < self.end_wall_s:
            return False
        done = max(0.0, at_wall_s - self.seg_begin_wall_s) / self.full_wall_s
        self.work_left = max(0.0, self.work_left - done)
        self.seg_begin_wall_s = max(at_wall_s, self.seg_begin_wall_s)
        self.freq_mhz, self.power_w, self.full_wall_s = freq_mhz, power_w, full_wall_s
        return True


@dataclass(frozen=True)
class EnergyModel:
    """Energy of constant (profile) power over wall time, in the profile's millijoules, heat included."""

    dynamics: DeviceDynamics
    time_scale: float  # wall seconds per simulated second
    t0_wall_s: float  # when the device was created: the heat clock's zero
    p2p_power_w: float

    def factor_at(self, wall_s: float) -> float:
        """Power relative to the profile's at ``wall_s`` (1.0 without heat drift)."""
        return self.dynamics.power_factor((wall_s - self.t0_wall_s) / self.time_scale)

    def segment_mj(self, power_w: float, a_wall_s: float, b_wall_s: float) -> float:
        """``power_w`` (profile) from ``a`` to ``b`` wall seconds."""
        d = self.dynamics.thermal_drift
        if d == 0.0:
            return power_w * (b_wall_s - a_wall_s) / self.time_scale * 1000.0  # exactly as without dynamics
        tau = self.dynamics.thermal_tau_s
        sa = max(0.0, a_wall_s - self.t0_wall_s) / self.time_scale
        span = (b_wall_s - a_wall_s) / self.time_scale
        # Integral of 1 - d exp(-s/tau) over [sa, sa + span], with expm1 for short spans.
        cold = -d * tau * math.exp(-sa / tau) * -math.expm1(-span / tau)
        return power_w * (span + cold) * 1000.0

    def energy_after(self, energy_mj: float, a_wall_s: float, b_wall_s: float, unit_power_w: float | None,
                     unit_end_wall_s: float, idle_power_w: float | None = None) -> float:
        """``energy_mj`` at ``a`` plus, up to ``b``, a unit's power until its end (if one runs) and P2P
        blocking power after (summed in this order: without dynamics, bit for bit the same as before)."""
        energy = energy_mj
        t = a_wall_s
        if unit_power_w is not None and t < unit_end_wall_s:
            busy_end = min(b_wall_s, unit_end_wall_s)
            energy += self.segment_mj(unit_power_w, t, busy_end)
            t = busy_end
        idle_w = self.p2p_power_w if idle_power_w is None else idle_power_w  # clock-dependent blocking power
        energy += self.segment_mj(idle_w, t, max(t, b_wall_s))
        return energy


@dataclass(frozen=True)
class EnergyMark:
    """The energy at a change of power, and what runs from there on."""

    wall_s: float
    energy_mj: float
    unit_power_w: float | None  # None: no unit open
    unit_end_wall_s: float
    idle_power_w: float | None = None  # blocking power from here on (None: the model's p2p_power_w)


class PowerHistory:
    """Marks of the last ``keep_wall_s`` (and the one before), to read energy at a past time."""

    def __init__(self, keep_wall_s: float, first: EnergyMark) -> None:
        self.keep_wall_s = keep_wall_s
        self._marks: deque[EnergyMark] = deque([first])

    def mark(self, mark: EnergyMark) -> None:
        marks = self._marks
        if marks and marks[-1].wall_s == mark.wall_s:
            marks.pop()  # two changes at one instant: the later state holds from there
        marks.append(mark)
        horizon = mark.wall_s - self.keep_wall_s
        while len(marks) > 1 and marks[1].wall_s <= horizon:
            marks.popleft()

    def energy_at(self, wall_s: float, model: EnergyModel) -> float:
        """Energy at ``wall_s`` (not before the oldest mark kept: the device's start or the horizon)."""
        mark = self._marks[0]
        for m in reversed(self._marks):
            if m.wall_s <= wall_s:
                mark = m
                break
        wall_s = max(wall_s, mark.wall_s)
        return model.energy_after(mark.energy_mj, mark.wall_s, wall_s, mark.unit_power_w, mark.unit_end_wall_s,
                                  mark.idle_power_w)


def last_tick_wall_s(now_wall_s: float, t0_wall_s: float, phase_s: float, period_s: float,
                     time_scale: float) -> float | None:
    """The last update tick of a counter ticking every ``period_s`` simulated seconds from
    ``phase_s`` after ``t0``, at or before ``now`` (None before the first tick)."""
    n = math.floor(((now_wall_s - t0_wall_s) / time_scale - phase_s) / period_s)
    if n < 0:
        return None
    return min(now_wall_s, t0_wall_s + (phase_s + n * period_s) * time_scale)


def check_clock_range(limits: tuple[int, int] | None, clocks_mhz: tuple[int, ...]) -> tuple[int, int] | None:
    """The simulated GPU's ``sm_clock_range_mhz`` (where power or heat caps hold its SMs; None: no cap),
    checked against its profiled clocks (fastest first)."""
    if limits is None:
        return None
    lo, hi = (int(x) for x in limits)
    inside = [c for c in clocks_mhz if lo <= c <= hi]
    if not 0 < lo <= hi or not inside:
        raise GpuError(f"simulated GPU: sm_clock_range_mhz must be (low, high) MHz with 0 < low <= high around "
                       f"a profiled clock ({clocks_mhz[-1]}..{clocks_mhz[0]} MHz), got {limits}")
    return lo, hi


def running_clock_mhz(wanted_mhz: int, clocks_mhz: tuple[int, ...], limits: tuple[int, int] | None) -> int:
    """The profiled clock the SMs run at when ``wanted_mhz`` is asked for (exact without a range)."""
    if limits is None:
        return wanted_mhz
    lo, hi = limits
    held = min(max(wanted_mhz, lo), hi)
    return min((c for c in clocks_mhz if lo <= c <= hi), key=lambda c: (abs(c - held), -c))
