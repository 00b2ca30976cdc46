"""Execution hooks that drive a GPU: clocks at unit boundaries, energy per iteration.

* ``set_frequency`` queues the clock on the process's one clock worker
  (:class:`~megatron_envpipe.gpu.control.clocks.ClockController`); on CUDA it passes an
  event recorded on the compute stream at the unit boundary, so the worker
  changes the clock when the previous unit's kernels are done and the
  training thread never synchronizes the device.
* ``unit_begin``/``unit_end`` tell the device (the simulated GPU models the
  unit's time and energy from them; real GPUs ignore them).
* With a :class:`~megatron_envpipe.core.clock_lead.ClockLead`, a *raise* is
  requested ahead of its boundary, so that the SMs reach the new clock as the
  unit before it ends instead of ``latency`` into the next one (which is often
  on the critical path); lowerings stay at the boundary (a late lowering costs
  energy, never time). The executor hands over each iteration's units, clocks
  and predicted times (``clock_plan``). CUDA: the request is queued when unit k
  begins, behind an event recorded then plus the lead's offset
  (:class:`~megatron_envpipe.gpu.control.clocks.DelayedEvent`); simulated GPU: made at
  that device time in ``unit_end``. The boundary's own ``set_frequency`` is then
  skipped. Only when clocks change moves: the order and the math never do.
* ``iteration_sizes`` (variable-length micro-batches): each unit's micro-batch size goes to the
  device before the unit (the simulated GPU costs it at that size; real GPUs measure) and tags the
  unit's profiling sample, so the start-up profiler fits the length model from them.
* Every iteration's energy comes from the counter read at its two edges, and
  profiling iterations attribute energy to each unit and P2P wait from the
  background energy monitor's trace (interpolated NVML counter).

Measurement never stops training: an error of energy measurement or clock
control stays in the hooks. An iteration whose energy cannot be known (a
failing, stalled or reset counter) is *unmeasured*: counted by reason, logged
once per reason, and reported with the energy; a failed clock change switches
this GPU to monitor-only (the clock controller logs it once; the clocks are
still reset at exit).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from megatron_envpipe.core.clock_lead import ClockLead
from megatron_envpipe.core.hooks import ExecutionHooks
from megatron_envpipe.core.length_costs import MicrobatchSize
from megatron_envpipe.core.measurement import IterationMeasurement
from megatron_envpipe.core.schedule import Unit
from megatron_envpipe.core.virtual_clock import VirtualClock
from megatron_envpipe.errors import EnvPipeError
from megatron_envpipe.gpu.control.clocks import ClockController, DelayedEvent
from megatron_envpipe.gpu.control.safety import REPAIR_HINT
from megatron_envpipe.gpu.devices.base import GpuDevice, GpuNotSupportedError
from megatron_envpipe.gpu.energy.counter_errors import READ_FAILED, EnergyMonitorError
from megatron_envpipe.gpu.energy.iteration_energy import IterationEnergy
from megatron_envpipe.gpu.energy.iteration_meter import IterationEnergyMeter
from megatron_envpipe.gpu.energy.monitor import EnergyMonitor
from megatron_envpipe.gpu.profiler.sweep import StageSamples, UnitWindow, stage_samples
from megatron_envpipe.gpu.profiler.sweep_lengths import sized_stage_samples

log = logging.getLogger("megatron_envpipe")

# Blocking windows shorter than this are dominated by the energy counter's steps at their edges (the
# monitor stamps each step at its fitted update time, gpu/energy/counter_ticks.py); the P2P power fit ignores them.
MIN_BLOCKING_WINDOW_S = 0.02

# What energy measurement and clock control may raise at the device boundary: our
# own errors (GpuError wraps NVML's), OS errors, and RuntimeError (torch events,
# bindings). They stay in the hooks; anything else is a bug and propagates.
DEVICE_ERRORS = (EnvPipeError, OSError, RuntimeError)


def _unmeasured_reason(exc: BaseException) -> str:
    """A few words for reports: the monitor's reason, else a failed counter read."""
    return exc.reason if isinstance(exc, EnergyMonitorError) else READ_FAILED


@dataclass(frozen=True)
class _StagePlan:
    """This iteration's units of the stage, their clocks and predicted times (clock_plan)."""

    units: tuple[Unit, ...]
    freqs_mhz: tuple[int, ...]
    times_s: tuple[float, ...]


@dataclass(frozen=True)
class EnergyStatus:
    """One GPU's energy measurement after an iteration, as the energy report gathers it."""

    energy: IterationEnergy | None  # this iteration's; None: not measured
    reason: str | None  # why this iteration is not measured
    intervals: int  # iterations bracketed so far
    unmeasured: tuple[tuple[str, int], ...]  # (reason, iterations) so far
    clock_control_lost: str | None = None  # why this GPU is monitor-only


class GpuHooks(ExecutionHooks):
    def __init__(self, device: GpuDevice, *, control: bool, cuda: bool, time_scale: float = 1.0,
                 guard: Any = None, poll_interval_s: float = 0.002, lost: str | None = None,
                 clock_lead: ClockLead | None = None, sleep: Callable[[float], None] = time.sleep,
                 virtual_clock: VirtualClock | None = None) -> None:
        """``lost``: why clock control is off from the start (a start-up lock accepted but not
        reached): the controller falls back to monitor-only at once, logged and reported as
        a loss mid-run would be. ``clock_lead``: request raises ahead of their boundary by its
        latency (None: every change at the boundary); ``sleep``: how the clock worker waits
        out a lead's offset on a real GPU. ``virtual_clock``: the clock a simulated GPU runs on in
        virtual time (megatron/device_time.py): iteration edges, windows and the energy trace use
        it, and the trace is sampled inside its sleeps; ``time_scale`` is then 1."""
        self.device = device
        # A modelled GPU times its units itself, on its own clock (asked once: a capability, not a name).
        self._modelled = device.capabilities().modelled
        self.clock_lead = clock_lead
        self._sleep = sleep
        self._plan: _StagePlan | None = None  # this iteration's, from clock_plan()
        self._next_unit = 0  # index in _plan of the next unit_begin
        self._running: int | None = None  # index in _plan of the unit between unit_begin and unit_end
        self._led_mhz: int | None = None  # a raise already requested for the coming boundary
        self.led = 0  # raises requested ahead of their boundary
        self.cuda = cuda
        self.time_scale = 1.0 if virtual_clock is not None else time_scale
        self.virtual_clock = virtual_clock
        # The executor's clock: windows and monitor agree (the host's, or the device's virtual one).
        self.clock = virtual_clock.now if virtual_clock is not None else time.perf_counter
        self.controller: ClockController | None = None
        if control or lost is not None:
            self.controller = ClockController(device, guard, on_error="monitor")
            if lost is not None:
                self.controller.fall_back(lost)
        self.monitor: EnergyMonitor | None = None
        if device.capabilities().energy_scope != "none":  # a device with an energy counter
            self.monitor = EnergyMonitor(device, poll_interval_s=poll_interval_s, clock=self.clock)
            if virtual_clock is not None:
                self.monitor.start_on(virtual_clock)
            else:
                self.monitor.start()
        self._meter: IterationEnergyMeter | None = None
        self.stage = 0
        self.iteration = 0
        self.last_energy: IterationEnergy | None = None
        self.last_unmeasured: str | None = None  # why the last iteration's energy is unknown
        self.intervals = 0
        self.unmeasured: dict[str, int] = {}
        self._fault: str | None = None  # this iteration's, once known
        self._begun_s = 0.0
        self._ended_s = 0.0  # the last iteration's end, on the executor's clock (its waits are P2P waits)
        self._logged: set[str] = set()
        # The simulated GPU knows each unit's exact (modelled) window; host marks
        # would add scheduling noise on a busy CPU.
        self._device_windows: list[tuple[str, float, float]] = []
        self._sizes: tuple[MicrobatchSize, ...] | None = None  # this iteration's, per micro-batch
        self._unit_sizes: list[MicrobatchSize | None] = []  # each unit's this iteration, in the order begun

    # -- ExecutionHooks --------------------------------------------------------------
    def iteration_begin(self, stage: int, iteration: int) -> None:
        self.stage = stage
        self.iteration = iteration
        self._device_windows = []
        self._sizes = None
        self._unit_sizes = []
        self._plan = None
        self._next_unit = 0
        self._running = None
        self._led_mhz = None
        self._fault = None
        self._begun_s = self.clock()
        if self.monitor is not None:
            if self._meter is None:
                self._meter = IterationEnergyMeter(self.monitor, stage, clock=self.clock)
            self._meter.cancel()  # an iteration the executor abandoned is never ended
            try:
                self._meter.begin(iteration)
            except DEVICE_ERRORS as exc:
                self._fault = self._note(exc)

    def iteration_sizes(self, sizes: Sequence[MicrobatchSize] | None) -> None:
        self._sizes = None if sizes is None else tuple(sizes)

    def _size_of(self, unit: Unit) -> MicrobatchSize | None:
        sizes = self._sizes
        if sizes is None:
            return None
        if not 0 <= unit.microbatch < len(sizes):
            raise ValueError(f"stage {self.stage} iteration {self.iteration}: unit {unit} of micro-batch "
                             f"{unit.microbatch}, but iteration_sizes gave {len(sizes)} sizes (one per micro-batch)")
        return sizes[unit.microbatch]

    def clock_plan(self, units: Sequence[Unit], freqs_mhz: Sequence[int],
                   times_s: Sequence[float] | None) -> None:
        if self.clock_lead is None or times_s is None or self.controller is None:
            return
        if not len(units) == len(freqs_mhz) == len(times_s):
            raise ValueError(f"clock plan of stage {self.stage}: {len(units)} units, {len(freqs_mhz)} clocks and "
                             f"{len(times_s)} times (one of each per unit)")
        self._plan = _StagePlan(tuple(units), tuple(int(f) for f in freqs_mhz), tuple(float(t) for t in times_s))

    def set_frequency(self, freq_mhz: int) -> None:
        controller = self.controller
        if controller is None or controller.monitor_only is not None:
            return
        led, self._led_mhz = self._led_mhz, None
        if led == freq_mhz:
            return  # requested ahead of this boundary already
        try:
            after = None
            if self.cuda:
                import torch  # only CUDA runs get here: this layer imports without torch

                after = torch.cuda.Event()
                after.record()
            controller.request(freq_mhz, after=after)
            if self._modelled:
                # The simulated GPU models the next unit with whatever clock is locked when
                # it begins; a real GPU gets the same order from the event above.
                controller.flush()
        except DEVICE_ERRORS as exc:
            controller.fall_back(exc)

    def unit_begin(self, unit: Unit) -> None:
        self._led_mhz = None  # a lead is for the boundary right after the unit it was made in
        self._running = self._plan_index(unit)
        size = self._size_of(unit)
        self._unit_sizes.append(size)
        if self._sizes is not None:  # without sizes the device is called exactly as before
            self.device.set_unit_size(size, unit.chunk)
        self.device.unit_begin(self.stage, unit.kind)
        if not self._modelled:  # a real GPU: the worker waits for this unit's begin, then the offset
            offset_s = self._lead_offset_s()
            if offset_s is not None:
                self._request_ahead(offset_s * self.time_scale)

    def unit_end(self, unit: Unit) -> None:
        if self._modelled:  # its units' times are its model's, on its own clock
            offset_s = self._lead_offset_s()
            if offset_s is not None:
                # Request at that device time (the device's clock: a VirtualClock keeps it exact).
                self.device.wait_until(self.device.open_unit_begin_s() + offset_s * self.time_scale)
                self._request_ahead(None)
        self._running = None
        self.device.unit_end(self.stage, unit.kind)
        window = self.device.last_unit_window()
        if window is not None:
            self._device_windows.append(window)

    # -- clock lead ----------------------------------------------------------------------
    def _plan_index(self, unit: Unit) -> int | None:
        """``unit``'s index in this iteration's clock plan; a unit out of the plan's order
        (a caller other than the executor) drops the plan: changes at the boundary, as today."""
        plan = self._plan
        if plan is None:
            return None
        k = self._next_unit
        if k >= len(plan.units) or plan.units[k] != unit:
            self._plan = None
            return None
        self._next_unit = k + 1
        return k

    def _lead_offset_s(self) -> float | None:
        """Seconds after the running unit's begin at which to request the next unit's clock
        (a raise with the lead on); None: at the boundary, by ``set_frequency``."""
        plan, k, lead = self._plan, self._running, self.clock_lead
        if plan is None or k is None or lead is None or k + 1 >= len(plan.units):
            return None
        controller = self.controller
        if controller is None or controller.monitor_only is not None:
            return None
        old, new = plan.freqs_mhz[k], plan.freqs_mhz[k + 1]
        if old == new:
            return None
        return lead.request_after_begin_s(old, new, plan.times_s[k])

    def _request_ahead(self, delay_s: float | None) -> None:
        """Request the next unit's clock: a real GPU's worker ``delay_s`` after the running unit's
        kernels begin (CUDA event) or after now; None: now (simulated GPU). The boundary's own
        set_frequency is then skipped."""
        controller = self.controller
        freq = self._plan.freqs_mhz[self._running + 1]
        try:
            if delay_s is None:
                controller.request(freq)
                controller.flush()  # simulated: the lock is made at this device time
            else:
                event = None
                if self.cuda:
                    import torch  # only CUDA runs get here: this layer imports without torch

                    event = torch.cuda.Event()
                    event.record()  # on the compute stream, as the running unit's kernels begin
                controller.request(freq, after=DelayedEvent(event, delay_s, self._sleep))
        except DEVICE_ERRORS as exc:
            controller.fall_back(exc)
            return
        self._led_mhz = freq
        self.led += 1

    def iteration_end(self, measurement: IterationMeasurement | None) -> None:
        self._ended_s = self.clock()
        if self._meter is None or self.monitor is None:
            return
        energy = None
        if self._fault is None:
            try:
                energy = self._meter.end()
            except DEVICE_ERRORS as exc:
                self._fault = self._note(exc)
        else:
            self._meter.cancel()
        self.intervals += 1
        self.last_energy = energy
        self.last_unmeasured = self._fault
        if self._fault is not None:
            self.unmeasured[self._fault] = self.unmeasured.get(self._fault, 0) + 1
        self.monitor.trim(self._begun_s - 1.0)

    def close(self) -> None:
        try:
            if self.controller is not None:
                try:
                    self.controller.close(reset=True)
                except DEVICE_ERRORS as exc:
                    log.error("EnvPipe: resetting the clocks of %s failed: %s; %s",
                              self.device.info().label(), exc, REPAIR_HINT)
        finally:
            if self.monitor is not None:
                self.monitor.stop()
            try:
                self.device.close()
            except DEVICE_ERRORS as exc:
                log.warning("EnvPipe: closing %s failed: %s", self.device.info().label(), exc)

    # -- measurement status -------------------------------------------------------------
    @property
    def clock_control_lost(self) -> str | None:
        """Why this GPU went monitor-only mid-run (None while clocks are under control)."""
        return self.controller.monitor_only if self.controller is not None else None

    def energy_status(self) -> EnergyStatus:
        """This GPU's measurement of the last iteration and so far, for the energy report."""
        return EnergyStatus(self.last_energy, self.last_unmeasured, self.intervals,
                            tuple(sorted(self.unmeasured.items())), self.clock_control_lost)

    def _note(self, exc: BaseException, what: str = "energy of iteration") -> str:
        """Log the first interval of each reason; later ones are counted and reported."""
        reason = _unmeasured_reason(exc)
        if reason not in self._logged:
            self._logged.add(reason)
            log.warning("EnvPipe stage %d: the %s %d is not measured (%s: %s); training goes on, and such "
                        "intervals are counted and reported with the energy", self.stage, what,
                        self.iteration, reason, exc)
        return reason

    # -- profiling -------------------------------------------------------------------
    @property
    def device_windows(self) -> tuple[tuple[str, float, float], ...]:
        """This iteration's unit windows as the device ran them (simulated GPU only)."""
        return tuple(self._device_windows)

    def stage_samples(self, windows: Sequence[tuple[str, float, float]],
                      blocking: Sequence[tuple[float, float]], chunks: Sequence[int] = ()) -> StageSamples | None:
        """Time (device seconds) and energy of each unit and P2P wait of one iteration;
        None when they are not known (energy unmeasured, or the clock was not the swept one).
        ``chunks``: each window's model chunk (interleaved pipeline), which tags its sample."""
        if self.monitor is None:
            raise GpuNotSupportedError("profiling needs a device with an energy counter")
        if self.clock_control_lost is not None or self.last_unmeasured is not None:
            return None
        if len(self._device_windows) == len(windows):
            windows = self._device_windows
            # The GPU blocks (P2P power) in the gaps between its units.
            blocking = [(a[2], b[1]) for a, b in zip(windows, windows[1:]) if b[1] > a[2]]
        options = {"time_scale": self.time_scale, "min_blocking_s": (
            MIN_BLOCKING_WINDOW_S * self.time_scale if self._modelled else MIN_BLOCKING_WINDOW_S),
            "span": (self._begun_s, self._ended_s)}
        units = [UnitWindow(k, a, b) for k, a, b in windows]
        try:
            if self._sizes is None:
                samples = stage_samples(self.monitor, units, blocking, **options)
            else:  # each unit's micro-batch size: a power per size, and the profiler fits the length model
                samples = sized_stage_samples(self.monitor, units, self._unit_sizes, blocking, **options)
        except DEVICE_ERRORS as exc:
            self._note(exc, "profile of iteration")
            return None
        if any(chunks):
            if len(chunks) != len(samples.units):
                raise ValueError(f"{len(chunks)} model chunks for {len(samples.units)} unit windows")
            samples = replace(samples, units=tuple(
                replace(u, chunk=c) for u, c in zip(samples.units, chunks, strict=True)))
        return samples
