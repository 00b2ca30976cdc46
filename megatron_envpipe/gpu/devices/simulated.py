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

``dynamics`` (:class:`~megatron_envpipe.core.device_dynamics.DeviceDynamics`, default
:data:`~megatron_envpipe.core.device_dynamics.EXACT`: all of the above, unchanged) makes it
depart from the ideal GPU as real ones do, in simulated seconds (x ``time_scale`` for
wall): a lock request is issued when the previous call returned (``nvml_call_s`` each)
and the SMs reach the clock ``clock_latency_s`` after it is issued, the caller not
waiting (the clock worker thread absorbs the call); a unit running then continues its
remaining work at the new clock's time and power. The energy counter moves only at
update ticks every ``counter_period_s`` (phase seeded per stage); power readings are
averages over ``power_average_s``; every power is scaled by the heat factor
``power_factor(seconds since the device was created)`` (unit times do not drift); a
``blocking_power_w`` in the dynamics (measured by ``envpipe gpu-check``) replaces ``p2p_power_w``.
:meth:`SimulatedGpu.true_energy_mj` is the exact integral, the ground truth a real GPU
does not have.

Variable-length micro-batches (issue 25): with a ``length_model``
(:class:`~megatron_envpipe.core.length_costs.LengthCostModel`), a unit announced by
:meth:`SimulatedGpu.set_unit_size` takes the profile row at the running clock scaled by the
model's factors for its size (time x the time factor; energy x the energy factor, so power x
their ratio); a unit without a size is the profile's row, exactly as before. See docs/simulated-gpu.md.
"""

from __future__ import annotations

import hashlib
import math
import random
import threading
import time
from collections import deque
from collections.abc import Callable

from megatron_envpipe.core.device_backends import DeviceCapabilities
from megatron_envpipe.core.device_dynamics import EXACT, DeviceDynamics
from megatron_envpipe.core.jitter import JitterError, UnitJitter
from megatron_envpipe.core.length_costs import LengthCostError, LengthCostModel, MicrobatchSize
from megatron_envpipe.core.profile import Profile, ProfileError, instruction_of
from megatron_envpipe.core.virtual_clock import VirtualClock
from megatron_envpipe.gpu.devices.base import GpuDevice, GpuError, GpuInfo, GpuPermissionError
from megatron_envpipe.gpu.devices.sim_device_model import (
    EnergyMark,
    EnergyModel,
    PowerHistory,
    UnitRun,
    check_clock_range,
    last_tick_wall_s,
    running_clock_mhz,
)

# Below _SPIN_S of remaining wall time, unit_end stops sleeping (OS sleeps
# overshoot by ~0.1 ms, several percent of a unit at small time scales) and
# yields with sleep(0), which lets the energy poller run; the last _BUSY_S it
# busy-waits, because one sleep(0) itself takes ~50 us.
_SPIN_S = 0.0005
_BUSY_S = 0.0001


class SimulatedGpu(GpuDevice):
    """A GPU model for ``stage`` of ``profile`` (see the module docstring)."""

    backend = "simulated"

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
        dynamics: DeviceDynamics = EXACT,
        blocking_power_w_at: Callable[[int], float] | None = None,
        length_model: LengthCostModel | None = None,
    ) -> None:
        if not 0 <= stage < profile.num_stages:
            raise GpuError(f"simulated GPU: stage {stage} is not in the profile (stages 0..{profile.num_stages - 1})")
        if not time_scale > 0:
            raise GpuError(
                f"simulated GPU: time_scale must be > 0 (wall seconds per simulated second), got {time_scale}"
            )
        if p2p_power_w < 0:
            raise GpuError(f"simulated GPU: p2p_power_w must be >= 0, got {p2p_power_w}")
        if not isinstance(dynamics, DeviceDynamics):
            raise GpuError(f"simulated GPU: dynamics must be a DeviceDynamics (EXACT, or load_dynamics('realistic', "
                           f"configs_dir()) from megatron_envpipe.core.device_dynamics), got {dynamics!r}")
        try:
            # Seeded per stage: every rank draws its own reproducible noise.
            self._jitter = UnitJitter(jitter, f"{seed}|stage{stage}")
        except JitterError as exc:
            raise GpuError(f"simulated GPU: {exc}") from None
        if length_model is not None and not isinstance(length_model, LengthCostModel):
            raise GpuError(f"simulated GPU: length_model must be a LengthCostModel (core/length_costs.py), "
                           f"got {length_model!r}")
        self.profile = profile
        self.stage = stage
        # Scales a unit's row to its micro-batch's size (None: every unit at the profile's size).
        self.length_model = length_model
        self._next_size: tuple[MicrobatchSize, int] | None = None  # set_unit_size's, for the next unit
        self._unit_size: tuple[MicrobatchSize, int] | None = None  # the open unit's
        self.time_scale = float(time_scale)
        # A measured blocking power (gpu-check step 4, in the dynamics preset) replaces the table's P2P power.
        self.p2p_power_w = float(p2p_power_w if dynamics.blocking_power_w is None else dynamics.blocking_power_w)
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
        self.sm_clock_range_mhz = check_clock_range(sm_clock_range_mhz, self._clocks)
        self.dynamics = dynamics
        # Blocking (P2P wait) power at the SMs' clock: a GPU spinning on a flag draws more at a
        # higher clock (gpu-check step 4). None: p2p_power_w at every clock, as before.
        self._blocking_at = blocking_power_w_at
        self._lock = threading.Lock()
        self._locked: int | None = None
        self._model_clock = self._running_clock(clocks[0])  # unlocked: the driver boosts to the maximum
        self._idle_power_w = self._blocking_power_w(self._model_clock)
        self._energy_mj = 0.0  # integrated up to _ref_wall_s
        self._ref_wall_s = clock()
        self._t0_wall_s = self._ref_wall_s
        self._model = EnergyModel(dynamics, self.time_scale, self._t0_wall_s, self.p2p_power_w)
        # Clock changes requested but not yet reached by the SMs: (wall time they land, running clock).
        self._pending: deque[tuple[float, int]] = deque()
        self._driver_busy_until_wall_s = self._ref_wall_s  # the clock worker's NVML call returns then
        # The counter's update ticks: every counter_period_s from a per-stage seeded phase.
        self._counter_phase_s = random.Random(f"{seed}|stage{stage}|counter").random() * dynamics.counter_period_s
        keep_s = max(dynamics.counter_period_s, dynamics.power_average_s) * self.time_scale
        self._history = PowerHistory(keep_s, EnergyMark(self._ref_wall_s, 0.0, None, self._ref_wall_s,
                                                        self._idle_power_w)) \
            if keep_s > 0 else None
        self._unit: UnitRun | None = None
        self._last_window: tuple[str, float, float] | None = None
        self.overrun_units = 0  # units whose host work took longer than the model
        # A straggler (--envpipe-sim-straggler): every unit from now on takes this many times longer at the
        # profile's power (a throttled or slower GPU), so its energy grows by the same factor.
        self.slowdown = 1.0
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

    def capabilities(self) -> DeviceCapabilities:
        """A model: its own clock (virtual when it runs on one), its dynamics' clock latency."""
        virtual = isinstance(getattr(self._clock, "__self__", None), VirtualClock)
        return DeviceCapabilities(modelled=True, time_base="virtual" if virtual else "wall",
                                  clock_latency_s=self.dynamics.clock_latency_s,
                                  clock_call_s=self.dynamics.nvml_call_s, can_lock_clocks=True,
                                  energy_scope="model")

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
            self._locked = freq_mhz  # NVML reports the setting at once, whatever the SMs run at
            self._request_clock(self._running_clock(freq_mhz))

    def reset_locked_clocks(self) -> None:
        with self._lock:
            self._locked = None
            self._request_clock(self._running_clock(self._clocks[0]))

    def locked_clock_mhz(self) -> int | None:
        return self._locked

    def current_sm_clock_mhz(self) -> int | None:
        return self.model_clock_mhz

    def clock_event_reasons(self) -> tuple[str, ...] | None:
        wanted = self._locked if self._locked is not None else self._clocks[0]
        reasons = ("user_defined_clocks",) if self._locked is not None else ()
        # Only a cap is reported: a minimum the driver does not hold leaves no reason (#1314),
        # nor does a change still on its way to the SMs.
        return reasons + (("sw_power_cap",) if self._running_clock(wanted) < wanted else ())

    def energy_mj(self) -> float:
        """The counter: exact at every read, or (``counter_period_s`` > 0) the energy at its last update tick."""
        with self._lock:
            now = self._clock()
            if not self._pending and self.dynamics.counter_period_s == 0.0:
                return self._energy_at(now)  # exact: no state to move (today's path)
            self._advance(now)
            if self.dynamics.counter_period_s == 0.0:
                return self._energy_at(now)
            tick = last_tick_wall_s(max(now, self._ref_wall_s), self._t0_wall_s, self._counter_phase_s,
                                    self.dynamics.counter_period_s, self.time_scale)
            return 0.0 if tick is None else self._energy_at_past(tick)

    def true_energy_mj(self) -> float:
        """The exact energy integral now (mJ), whatever the counter shows: the ground truth that
        benches and tests compare measurements with (a real GPU has none)."""
        with self._lock:
            now = self._clock()
            self._advance(now)
            return self._energy_at(now)

    def power_w(self) -> float:
        """Power now, or (``power_average_s`` > 0) its average over that window (within the device's life)."""
        with self._lock:
            now = self._clock()
            if self._pending:
                self._advance(now)
            window_s = self.dynamics.power_average_s * self.time_scale
            start = max(self._t0_wall_s, now - window_s)
            if window_s == 0.0 or not now > start:
                return self._power_at(now)
            energy_mj = self._energy_at(now) - self._energy_at_past(start)
            return energy_mj / 1000.0 / ((now - start) / self.time_scale)

    def set_unit_size(self, size: MicrobatchSize | None, chunk: int = 0) -> None:
        """The next unit's micro-batch size (None: the profile's own row) and model chunk."""
        if size is not None and not isinstance(size, MicrobatchSize):
            raise GpuError(f"{self._name}: a unit's size must be a MicrobatchSize, got {size!r}")
        if size is not None and self.length_model is None:
            raise GpuError(f"{self._name}: a unit of {size} but this simulated GPU has no length model: give "
                           f"SimulatedGpu(length_model=...) (default_length_model_for(source), or one fitted "
                           f"from a profile measured at >= 2 sizes)")
        with self._lock:
            self._next_size = None if size is None else (size, int(chunk))

    def unit_begin(self, stage: int, kind: str) -> None:
        self._check_stage(stage)
        instr = instruction_of(kind)
        with self._lock:
            if self._unit is not None:
                raise GpuError(
                    f"{self._name}: unit {kind} begins while {self._unit.kind} is still open "
                    "(every unit_begin needs its unit_end first)"
                )
            now = self._clock()
            self._advance(now)  # a clock change that has landed by now: this unit starts at it
            self._unit_size, self._next_size = self._next_size, None  # a size is for one unit
            time_s, power_w = self._row(instr, self._model_clock)
            # Jitter stretches or shrinks the unit at the profile's power: its energy scales with it.
            factor = self._jitter.factor() * self.slowdown
            duration_wall_s = time_s * factor * self.time_scale
            self._unit = UnitRun(kind, instr, now, factor, self._model_clock, power_w, duration_wall_s)
            self._mark()

    def _row(self, instr: str, freq_mhz: int) -> tuple[float, float]:
        """(time s, power W) of the open unit at ``freq_mhz``: the profile's row, scaled to the unit's size."""
        try:
            point = self.profile.point(self.stage, instr, freq_mhz)
        except ProfileError as exc:
            raise GpuError(f"{self._name}: {exc}") from None
        if self._unit_size is None:
            return point.time_s, point.power_w  # the profile's row itself (bit for bit as before sizes)
        size, chunk = self._unit_size
        try:
            time_factor, energy_factor = self.length_model.factors(self.stage, chunk, instr, freq_mhz, size)
        except LengthCostError as exc:
            raise GpuError(f"{self._name}: {exc}") from None
        return point.time_s * time_factor, point.power_w * energy_factor / time_factor

    def unit_end(self, stage: int, kind: str) -> None:
        """Sleep until the unit has taken its modelled time (longer host work is not shortened)."""
        self._check_stage(stage)
        with self._lock:
            unit = self._unit
            if unit is None or unit.kind != kind:
                open_ = unit.kind if unit else "none"
                raise GpuError(f"{self._name}: unit_end({kind!r}) without a matching unit_begin (open: {open_})")
            if self._pending:
                self._advance(self._clock())
            overran = self._clock() > unit.end_wall_s
        if overran:
            # The host's own work outlasted the model: this unit's wall time no longer
            # reflects the clock (raise time_scale if this is common).
            self.overrun_units += 1
        while True:
            # Sleep to the end, or first to a clock change landing before it (which moves the end).
            with self._lock:
                change_s = self._pending[0][0] if self._pending else math.inf
                target = min(change_s, unit.end_wall_s)
            self._sleep_until(target)
            with self._lock:
                if target < unit.end_wall_s:
                    self._advance(max(self._clock(), target))
                    continue
                if not (self._pending and self._pending[0][0] < unit.end_wall_s):
                    break  # no change requested meanwhile (another thread) that lands before the end
        with self._lock:
            self._advance(self._clock())
            self._unit = None
            self._unit_size = None
            self._last_window = (unit.kind, unit.begin_wall_s, unit.end_wall_s)
            self._mark()

    def wait_until(self, wall_s: float) -> None:
        """Sleep on the device's timebase until ``wall_s`` (at once if it has passed); a unit may
        be open: the clock-lead rule requests a change from inside a unit this way."""
        if not math.isfinite(wall_s):
            raise GpuError(f"{self._name}: wait_until needs a finite time on the device's clock, got {wall_s}")
        self._sleep_until(wall_s)

    def open_unit_begin_s(self) -> float | None:
        """Wall time (the device's clock) the open unit began; None between units."""
        unit = self._unit
        return None if unit is None else unit.begin_wall_s

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
        """The clock the SMs run at now: the next unit's (the locked clock, or the maximum when
        unlocked, held inside ``sm_clock_range_mhz`` when one is set), once a change has landed."""
        with self._lock:
            if self._pending:
                self._advance(self._clock())
            return self._model_clock

    def unit_time_s(self, kind: str, freq_mhz: int | None = None) -> float:
        """Simulated seconds a ``kind`` unit takes at ``freq_mhz`` (default: the model clock now), per the profile."""
        freq = self.model_clock_mhz if freq_mhz is None else int(freq_mhz)
        try:
            return self.profile.time_s(self.stage, instruction_of(kind), freq)
        except ProfileError as exc:
            raise GpuError(f"{self._name}: {exc}") from None

    def _request_clock(self, running_mhz: int) -> None:
        """A lock or reset request now (lock held): issued when the driver is free, landing the latency later."""
        if self.dynamics.clock_latency_s == 0.0:
            if self._blocking_at is not None:
                self._integrate_to(self._clock())  # the blocking power so far was the old clock's
            self._model_clock = running_mhz  # at once; a unit already running keeps its clock (as before)
            self._set_idle_power(running_mhz)
            return
        now = self._clock()
        self._advance(now)
        issued = max(now, self._driver_busy_until_wall_s)  # queued requests serialise on the worker
        self._driver_busy_until_wall_s = issued + self.dynamics.nvml_call_s * self.time_scale
        self._pending.append((issued + self.dynamics.clock_latency_s * self.time_scale, running_mhz))

    def _power_at(self, wall_s: float) -> float:
        unit = self._unit
        power = self._idle_power_w
        if unit is not None and unit.begin_wall_s <= wall_s < unit.end_wall_s:
            power = unit.power_w
        return power * self._model.factor_at(wall_s)

    def _energy_at(self, wall_s: float) -> float:
        """Energy (mJ) at ``wall_s`` >= the reference time, with no clock change landing in
        between (``_advance`` applies those); pure, so readers never mutate state."""
        wall_s = max(wall_s, self._ref_wall_s)  # a clock read racing _advance never goes back
        unit = self._unit
        if unit is None:
            return self._model.energy_after(self._energy_mj, self._ref_wall_s, wall_s, None, 0.0, self._idle_power_w)
        return self._model.energy_after(self._energy_mj, self._ref_wall_s, wall_s, unit.power_w, unit.end_wall_s,
                                        self._idle_power_w)

    def _energy_at_past(self, wall_s: float) -> float:
        """Energy at a time up to the history's horizon back (the stepped counter, averaged power)."""
        if wall_s >= self._ref_wall_s or self._history is None:
            return self._energy_at(wall_s)
        return self._history.energy_at(wall_s, self._model)

    def _advance(self, wall_s: float) -> None:
        """Integrate to ``wall_s``, landing the clock changes due by then in order (lock held)."""
        while self._pending and self._pending[0][0] <= wall_s:
            at, running_mhz = self._pending.popleft()
            at = max(at, self._ref_wall_s)
            self._integrate_to(at)
            self._model_clock = running_mhz
            self._set_idle_power(running_mhz)
            unit = self._unit
            if unit is not None:
                time_s, power_w = self._row(unit.instruction, running_mhz)
                full_wall_s = time_s * unit.jitter_factor * self.time_scale
                if unit.switch(at, running_mhz, power_w, full_wall_s):
                    self._mark()
        self._integrate_to(wall_s)

    def _integrate_to(self, wall_s: float) -> None:
        if wall_s > self._ref_wall_s:
            self._energy_mj = self._energy_at(wall_s)
            self._ref_wall_s = wall_s

    def _mark(self) -> None:
        """Power changes at the reference time: remembered for reads of the past (lock held)."""
        if self._history is None:
            return
        unit = self._unit
        if unit is None:
            mark = EnergyMark(self._ref_wall_s, self._energy_mj, None, self._ref_wall_s, self._idle_power_w)
        else:
            mark = EnergyMark(self._ref_wall_s, self._energy_mj, unit.power_w, unit.end_wall_s, self._idle_power_w)
        self._history.mark(mark)

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

    def _running_clock(self, wanted_mhz: int) -> int:
        return running_clock_mhz(wanted_mhz, self._clocks, self.sm_clock_range_mhz)

    def _blocking_power_w(self, freq_mhz: int) -> float:
        if self._blocking_at is None:
            return self.p2p_power_w
        power_w = float(self._blocking_at(freq_mhz))
        if not (math.isfinite(power_w) and power_w >= 0):
            raise GpuError(f"{self._name}: blocking power at {freq_mhz} MHz must be a finite number of W >= 0, "
                           f"got {power_w}")
        return power_w

    def _set_idle_power(self, freq_mhz: int) -> None:
        """The clock changed at the reference time (lock held): so does the blocking power."""
        if self._blocking_at is not None:
            self._idle_power_w = self._blocking_power_w(freq_mhz)
            self._mark()

    def _check_stage(self, stage: int) -> None:
        if stage != self.stage:
            raise GpuError(f"{self._name}: models stage {self.stage}, got a unit of stage {stage}")

    def __repr__(self) -> str:
        return f"SimulatedGpu(stage={self.stage}, clock={self._model_clock} MHz, time_scale={self.time_scale:g})"
