"""A simulated GPU for one pipeline stage, driven by a time/energy profile.

The model: a forward/backward unit at clock ``f`` takes ``profile.time_s(stage,
instr, f)`` simulated seconds and draws ``E_unit(f) / t_unit(f)`` watts; outside
units the GPU draws the P2P blocking power (Perseus's model, perseus.md §3).
With ``jitter`` each unit's time is multiplied by a seeded noise factor
(:class:`~megatron_envpipe.core.jitter.UnitJitter`), as on a real GPU.

Time is made real: :meth:`SimulatedGpu.unit_end` sleeps until the unit has
lasted ``t_unit(f) * time_scale`` wall seconds since :meth:`unit_begin`, so the
CPU run *experiences* the clock (waits, critical paths and wall-clock timings
reflect it). Energy is integrated in simulated seconds (wall / ``time_scale``),
so a unit's measured energy comes out in the profile's joules. Every number it
reports is labelled simulated.

Clock control is exact by default: every lock is accepted and the SMs run at the
locked clock. Two settings make it behave as real GPUs sometimes do (see
docs/gpu-probe.md, "Clock control proven by trying"): ``lock_refusal`` refuses
every lock with :class:`GpuPermissionError` although :meth:`can_set_clocks` says
yes (a VM or cloud image, even for root), and ``sm_clock_range_mhz`` accepts a
lock but holds the SMs inside that range (power or thermal capping above; a
minimum the driver does not enforce below, open-gpu-kernel-modules #1314), which
:meth:`current_sm_clock_mhz` shows and the units run at.
"""

from __future__ import annotations

import hashlib
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from megatron_envpipe.core.jitter import JitterError, UnitJitter
from megatron_envpipe.core.profile import Profile, ProfileError, instruction_of
from megatron_envpipe.gpu.base import GpuDevice, GpuError, GpuInfo, GpuPermissionError

# Below _SPIN_S of remaining wall time, unit_end stops sleeping (OS sleeps
# overshoot by ~0.1 ms, several percent of a unit at small time scales) and
# yields with sleep(0), which lets the energy poller run; the last _BUSY_S it
# busy-waits, because one sleep(0) itself takes ~50 us.
_SPIN_S = 0.0005
_BUSY_S = 0.0001


@dataclass(frozen=True)
class _OpenUnit:
    kind: str
    begin_wall_s: float
    end_wall_s: float  # when the modelled compute finishes
    power_w: float


class SimulatedGpu(GpuDevice):
    """A GPU model for ``stage`` of ``profile`` (see the module docstring)."""

    backend = "simulated"
    simulated = True

    def __init__(
        self,
        profile: Profile,
        stage: int,
        time_scale: float = 1.0,
        p2p_power_w: float = 0.0,
        name: str | None = None,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
        jitter: float = 0.0,
        seed: int | str = 0,
        lock_refusal: str | None = None,
        sm_clock_range_mhz: tuple[int, int] | None = None,
    ) -> None:
        if not 0 <= stage < profile.num_stages:
            raise GpuError(f"simulated GPU: stage {stage} is not in the profile (stages 0..{profile.num_stages - 1})")
        if not time_scale > 0:
            raise GpuError(
                f"simulated GPU: time_scale must be > 0 (wall seconds per simulated second), got {time_scale}"
            )
        if p2p_power_w < 0:
            raise GpuError(f"simulated GPU: p2p_power_w must be >= 0, got {p2p_power_w}")
        try:
            # Seeded per stage: every rank draws its own reproducible noise.
            self._jitter = UnitJitter(jitter, f"{seed}|stage{stage}")
        except JitterError as exc:
            raise GpuError(f"simulated GPU: {exc}") from None
        self.profile = profile
        self.stage = stage
        self.time_scale = float(time_scale)
        self.p2p_power_w = float(p2p_power_w)
        label = name or "Simulated GPU"
        # Always visibly simulated, whatever name the caller chose.
        self._name = label if label.lower().startswith("simulated") else f"Simulated {label}"
        self._clock = clock
        self._sleep = sleep
        # An injected sleep is trusted to be exact (fake clocks); only the real one spins.
        self._spin_s = _SPIN_S if sleep is time.sleep else 0.0
        fwd = set(profile.frequencies(stage, "forward"))
        bwd = set(profile.frequencies(stage, "backward"))
        clocks = tuple(sorted(fwd & bwd, reverse=True))
        if not clocks:
            raise GpuError(
                f"simulated GPU: stage {stage} of {profile.source} has no clock with both forward and backward rows"
            )
        self._clocks = clocks
        self.lock_refusal = lock_refusal
        self.sm_clock_range_mhz = self._check_range(sm_clock_range_mhz)
        self._lock = threading.Lock()
        self._locked: int | None = None
        self._model_clock = self._running_clock(clocks[0])  # unlocked: the driver boosts to the maximum
        self._energy_mj = 0.0  # integrated up to _ref_wall_s
        self._ref_wall_s = clock()
        self._unit: _OpenUnit | None = None
        self._last_window: tuple[str, float, float] | None = None
        self.overrun_units = 0  # units whose host work took longer than the model
        digest = hashlib.sha1(f"{profile.source}|{stage}".encode()).hexdigest()[:12]
        self._info = GpuInfo(
            name=self._name,
            uuid=f"SIM-{digest}-stage{stage}",
            pci_bus_id="simulated",
            driver_version="simulated",
            backend=self.backend,
            simulated=True,
        )

    # -- GpuDevice -----------------------------------------------------------------------
    def info(self) -> GpuInfo:
        return self._info

    def supported_clocks_mhz(self) -> tuple[int, ...]:
        return self._clocks

    def can_set_clocks(self) -> bool:
        return True

    def set_locked_clocks(self, freq_mhz: int) -> None:
        freq_mhz = int(freq_mhz)
        if freq_mhz not in self._clocks:
            raise GpuError(
                f"{self._name}: {freq_mhz} MHz is not a profiled clock of stage {self.stage} "
                f"({len(self._clocks)} clocks, {self._clocks[-1]}..{self._clocks[0]} MHz)"
            )
        if self.lock_refusal is not None:
            raise GpuPermissionError(f"{self._name}: clock lock refused ({self.lock_refusal})")
        with self._lock:
            # A unit already running keeps the clock it started with.
            self._locked = freq_mhz
            self._model_clock = self._running_clock(freq_mhz)

    def reset_locked_clocks(self) -> None:
        with self._lock:
            self._locked = None
            self._model_clock = self._running_clock(self._clocks[0])

    def locked_clock_mhz(self) -> int | None:
        return self._locked

    def current_sm_clock_mhz(self) -> int | None:
        return self._model_clock

    def clock_event_reasons(self) -> tuple[str, ...] | None:
        wanted = self._locked if self._locked is not None else self._clocks[0]
        reasons = ("user_defined_clocks",) if self._locked is not None else ()
        # Only a cap is reported: a minimum the driver does not hold leaves no reason (#1314).
        return reasons + (("sw_power_cap",) if self._model_clock < wanted else ())

    def energy_mj(self) -> float:
        with self._lock:
            return self._energy_at(self._clock())

    def power_w(self) -> float:
        with self._lock:
            return self._power_at(self._clock())

    def unit_begin(self, stage: int, kind: str) -> None:
        self._check_stage(stage)
        instr = instruction_of(kind)
        with self._lock:
            if self._unit is not None:
                raise GpuError(
                    f"{self._name}: unit {kind} begins while {self._unit.kind} is still open "
                    "(every unit_begin needs its unit_end first)"
                )
            try:
                point = self.profile.point(self.stage, instr, self._model_clock)
            except ProfileError as exc:
                raise GpuError(f"{self._name}: {exc}") from None
            now = self._clock()
            self._advance(now)
            # Jitter stretches or shrinks the unit at the profile's power: its energy scales with it.
            duration_wall_s = point.time_s * self._jitter.factor() * self.time_scale
            self._unit = _OpenUnit(kind, now, now + duration_wall_s, point.power_w)

    def unit_end(self, stage: int, kind: str) -> None:
        """Sleep until the unit has taken its modelled time (longer host work is not shortened)."""
        self._check_stage(stage)
        with self._lock:
            unit = self._unit
            if unit is None or unit.kind != kind:
                open_ = unit.kind if unit else "none"
                raise GpuError(f"{self._name}: unit_end({kind!r}) without a matching unit_begin (open: {open_})")
        if self._clock() > unit.end_wall_s:
            # The host's own work outlasted the model: this unit's wall time no longer
            # reflects the clock (raise time_scale if this is common).
            self.overrun_units += 1
        self._sleep_until(unit.end_wall_s)
        with self._lock:
            self._advance(self._clock())
            self._unit = None
            self._last_window = (unit.kind, unit.begin_wall_s, unit.end_wall_s)

    # -- model ---------------------------------------------------------------------------
    def last_unit_window(self) -> tuple[str, float, float] | None:
        """``(kind, start_s, end_s)`` of the last finished unit as the device ran it (clock
        time of its modelled compute): the simulated counterpart of CUDA events around
        the unit, free of host scheduling delays. None before the first unit."""
        return self._last_window

    @property
    def timebase(self) -> tuple[Callable[[], float], Callable[[float], None]]:
        """``(clock, sleep)`` the device runs on: a caller timing or waiting for its units uses
        the same (a :class:`~megatron_envpipe.core.virtual_clock.VirtualClock`'s keeps a replay
        in simulated time, out of reach of host load)."""
        return self._clock, self._sleep

    @property
    def model_clock_mhz(self) -> int:
        """The clock the next unit runs at (the locked clock, or the maximum when unlocked,
        held inside ``sm_clock_range_mhz`` when one is set)."""
        return self._model_clock

    def unit_time_s(self, kind: str) -> float:
        """Simulated seconds a ``kind`` unit takes at the current model clock."""
        return self.profile.time_s(self.stage, instruction_of(kind), self._model_clock)

    def _power_at(self, wall_s: float) -> float:
        unit = self._unit
        if unit is not None and unit.begin_wall_s <= wall_s < unit.end_wall_s:
            return unit.power_w
        return self.p2p_power_w

    def _energy_at(self, wall_s: float) -> float:
        """Energy (mJ) at ``wall_s`` >= the reference time; pure, so readers never mutate state."""
        wall_s = max(wall_s, self._ref_wall_s)  # a clock read racing _advance never goes back
        energy = self._energy_mj
        t = self._ref_wall_s
        unit = self._unit
        if unit is not None and t < unit.end_wall_s:
            busy_end = min(wall_s, unit.end_wall_s)
            energy += unit.power_w * (busy_end - t) / self.time_scale * 1000.0
            t = busy_end
        energy += self.p2p_power_w * (wall_s - t) / self.time_scale * 1000.0
        return energy

    def _advance(self, wall_s: float) -> None:
        if wall_s > self._ref_wall_s:
            self._energy_mj = self._energy_at(wall_s)
            self._ref_wall_s = wall_s

    def _sleep_until(self, target_wall_s: float) -> None:
        remaining = target_wall_s - self._clock()
        if self._spin_s == 0.0:
            if remaining > 0:
                self._sleep(remaining)  # injected sleeps are exact: once is enough
            return
        while remaining > 0:
            if remaining > self._spin_s:
                self._sleep(remaining - self._spin_s)
            elif remaining > _BUSY_S:
                self._sleep(0)  # yields the GIL to the energy poller
            # else: busy-wait the last few microseconds (sleep(0) alone costs ~50 us)
            remaining = target_wall_s - self._clock()

    def _check_range(self, limits: tuple[int, int] | None) -> tuple[int, int] | None:
        if limits is None:
            return None
        lo, hi = (int(x) for x in limits)
        inside = [c for c in self._clocks if lo <= c <= hi]
        if not 0 < lo <= hi or not inside:
            raise GpuError(f"simulated GPU: sm_clock_range_mhz must be (low, high) MHz with 0 < low <= high around "
                           f"a profiled clock ({self._clocks[-1]}..{self._clocks[0]} MHz), got {limits}")
        return lo, hi

    def _running_clock(self, wanted_mhz: int) -> int:
        """The profiled clock the SMs run at when ``wanted_mhz`` is asked for (exact without a range)."""
        if self.sm_clock_range_mhz is None:
            return wanted_mhz
        lo, hi = self.sm_clock_range_mhz
        held = min(max(wanted_mhz, lo), hi)
        return min((c for c in self._clocks if lo <= c <= hi), key=lambda c: (abs(c - held), -c))

    def _check_stage(self, stage: int) -> None:
        if stage != self.stage:
            raise GpuError(f"{self._name}: models stage {self.stage}, got a unit of stage {stage}")

    def __repr__(self) -> str:
        return f"SimulatedGpu(stage={self.stage}, clock={self._model_clock} MHz, time_scale={self.time_scale:g})"
