"""A stage's forward and backward time and energy across SM clocks, measured in counter-aligned windows.

``envpipe gpu-check`` step 5. For each clock (locked through the caller's ``lock``, i.e. a
:class:`~megatron_envpipe.gpu.control.safety.ClockGuard`) three kinds of energy window
(:func:`megatron_envpipe.apps.gpu_check.energy_window.measure_window`, both edges on counter updates):
an idle window (the GPU synchronised and waiting at the locked clock), ``repeats`` windows of
forwards and ``repeats`` windows of forward + backward pairs, each long enough for the counter
(``window_s``, from :func:`~megatron_envpipe.apps.gpu_check.energy_window.window_length_s`). A window's
edges hold the GPU idle (``edge_wait_s``): that much idle energy is taken off before dividing
by the units; backward = pair - forward. One activation is alive at a time.

Per clock the SM clock is read (NVML ``current_sm_clock_mhz``) after every unit is issued: the
median is the clock reached, max - min its spread. A clock whose median is off by more than
``reach_tolerance_mhz`` was NOT reached (a cap, a refused minimum, a lock lost): its rows are
kept out of the profile and reported, instead of being written under a clock they never ran
at (the silent failure of the old ``bench/gpu_stage_replay.py``).

Uncertainties per row (relative, half the range over the repeats combined in quadrature with
the counter's own bound and a 10 % bound on the idle energy taken off), written as extra CSV
columns that :meth:`Profile.from_csv` ignores. Time runs on the caller's ``clock``/``sleep``
(a :class:`~megatron_envpipe.core.virtual_clock.VirtualClock`'s on the simulated GPU).
"""

from __future__ import annotations

import csv
import io
import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from megatron_envpipe.apps.gpu_check.energy_window import WindowEnergy, measure_window
from megatron_envpipe.apps.gpu_check.replay import StageKernels
from megatron_envpipe.core.measurement_columns import MEASUREMENT_COLUMNS
from megatron_envpipe.core.profile import REQUIRED_COLUMNS, Profile
from megatron_envpipe.core.schedule import Unit
from megatron_envpipe.errors import EnvPipeError
from megatron_envpipe.gpu.devices.base import GpuDevice

__all__ = ["ClockRow", "Measured", "ProfileRunError", "StageProfile", "identical_stages",
           "measure_stage_profile", "pick_clocks"]

_IDLE_POWER_REL_UNC = 0.10  # bound on the idle power at the window edges (it is measured once per clock)


class ProfileRunError(EnvPipeError, RuntimeError):
    """The stage profile could not be measured (bad arguments, non-positive unit energy)."""


@dataclass(frozen=True)
class Measured:
    """One instruction at one clock: per unit, with relative uncertainties."""

    time_s: float
    energy_j: float
    time_rel_unc: float
    energy_rel_unc: float


@dataclass(frozen=True)
class ClockRow:
    freq_mhz: int                # the clock requested
    reached_mhz: int | None      # median SM clock read during the windows (None: the device reports none)
    reached_spread_mhz: int      # max - min of those readings
    reached: bool                # within reach_tolerance_mhz of the request: only then in the profile
    forward: Measured
    backward: Measured
    idle_power_w: float          # the GPU synchronised and idle at this clock (the windows' edges)
    units_per_window: int


@dataclass(frozen=True)
class StageProfile:
    rows: tuple[ClockRow, ...]   # in the order measured (max clock first)
    window_s: float              # the window length asked for
    repeats: int

    @property
    def reached_rows(self) -> tuple[ClockRow, ...]:
        return tuple(r for r in self.rows if r.reached)

    @property
    def not_reached(self) -> tuple[ClockRow, ...]:
        return tuple(r for r in self.rows if not r.reached)

    def to_csv_text(self) -> str:
        """Perseus CSV of stage 0 (reached clocks only) plus the measurement columns."""
        out = io.StringIO()
        writer = csv.writer(out, lineterminator="\n")
        writer.writerow(REQUIRED_COLUMNS + MEASUREMENT_COLUMNS)
        for r in self.reached_rows:
            for name, m in (("forward", r.forward), ("backward", r.backward)):
                writer.writerow([0, name, r.freq_mhz, repr(m.time_s), repr(m.energy_j),
                                 "" if r.reached_mhz is None else r.reached_mhz, r.reached_spread_mhz,
                                 f"{m.time_rel_unc:.6g}", f"{m.energy_rel_unc:.6g}"])
        return out.getvalue()


def pick_clocks(supported_mhz: Sequence[int], count: int, floor_mhz: int | None = None) -> tuple[int, ...]:
    """``count`` supported clocks evenly spread from the maximum (always first) down to ``floor_mhz``
    (default: half the maximum; lower clocks only stretch a stage for little energy)."""
    clocks = sorted({int(c) for c in supported_mhz}, reverse=True)
    if not clocks or count < 1:
        raise ProfileRunError(f"profile: need supported clocks and a count >= 1, got {len(clocks)} clocks, "
                              f"count {count}")
    floor = clocks[0] // 2 if floor_mhz is None else int(floor_mhz)
    usable = [c for c in clocks if c >= floor] or clocks[:1]
    if count >= len(usable):
        return tuple(usable)
    if count == 1:
        return (usable[0],)
    picks = [usable[round(i * (len(usable) - 1) / (count - 1))] for i in range(count)]
    return tuple(dict.fromkeys(picks))


def identical_stages(profile: Profile, num_stages: int) -> Profile:
    """``num_stages`` copies of stage 0: the P identical stages one GPU replays in turn."""
    points = {(s, ins): profile.points(0, ins) for s in range(num_stages) for ins in ("forward", "backward")}
    return Profile(points, source=f"{profile.source} (stage 0 x {num_stages})")


def _half_range_rel(values: Sequence[float]) -> float:
    mean = statistics.fmean(values)
    return 0.5 * (max(values) - min(values)) / mean if mean > 0 and len(values) > 1 else 0.0


def _run_units(device: GpuDevice, kernels: StageKernels, units: Sequence[Unit], reads: list[int]) -> None:
    for unit in units:
        device.unit_begin(0, unit.kind)  # the simulated GPU charges the unit here; NVML ignores it
        kernels.run(unit)
        device.unit_end(0, unit.kind)
        mhz = device.current_sm_clock_mhz()  # issued, still running on a real GPU: the clock it runs at
        if mhz is not None:
            reads.append(int(mhz))
    kernels.sync()


def _units_body(device: GpuDevice, kernels: StageKernels, units: list[Unit], reads: list[int]) -> Callable[[], None]:
    return lambda: _run_units(device, kernels, units, reads)


def _unit_energy(w: WindowEnergy, units: int, idle: WindowEnergy) -> tuple[float, float, float]:
    """(time per unit, energy per unit, absolute energy uncertainty of the window): the window's idle
    edges are taken off at the idle power measured at the same clock."""
    edge_j = idle.power_w * w.edge_wait_s
    unc = w.uncertainty_j + (_IDLE_POWER_REL_UNC + idle.relative_error) * edge_j
    return w.body_s / units, (w.energy_j - edge_j) / units, unc


def measure_stage_profile(device: GpuDevice, kernels: StageKernels, clocks_mhz: Sequence[int],
                          lock: Callable[[int], None], *, counter_period_s: float, window_s: float,
                          repeats: int = 2, reach_tolerance_mhz: int = 30,
                          clock: Callable[[], float] = time.perf_counter,
                          sleep: Callable[[float], None] = time.sleep,
                          progress: Callable[[str], None] = lambda line: None) -> StageProfile:
    """Measure every clock in ``clocks_mhz`` (module docstring); ``lock(f)`` locks the SM clock."""
    if repeats < 1 or not clocks_mhz:
        raise ProfileRunError(f"profile: need >= 1 repeat and >= 1 clock, got {repeats} and {list(clocks_mhz)}")
    if not (math.isfinite(window_s) and window_s > 0):
        raise ProfileRunError(f"profile: window length must be a finite number of seconds > 0, got {window_s}")

    def window(body: Callable[[], None]) -> WindowEnergy:
        return measure_window(device, body, counter_period_s=counter_period_s, clock=clock, sleep=sleep)

    rows = []
    for f in clocks_mhz:
        lock(int(f))
        kernels.reset()
        reads: list[int] = []
        # Warm-up at the new clock, timed: sizes the windows (and lets the clock settle).
        t0 = clock()
        _run_units(device, kernels, [Unit("F", 0), Unit("B", 0)], [])
        pair_s = max(clock() - t0, 1e-6)
        n = max(1, math.ceil(window_s / pair_s))
        idle = window(lambda: sleep(window_s))
        idle_w = idle.power_w

        fwd, pair = [], []
        for _ in range(repeats):
            fwd.append(_unit_energy(window(_units_body(device, kernels, [Unit("F", 0)] * (2 * n), reads)), 2 * n,
                                    idle))
            pair.append(_unit_energy(window(_units_body(device, kernels, [Unit("F", 0), Unit("B", 0)] * n, reads)),
                                     n, idle))
        kernels.reset()
        tf = statistics.fmean(x[0] for x in fwd)
        ef = statistics.fmean(x[1] for x in fwd)
        tp = statistics.fmean(x[0] for x in pair)
        ep = statistics.fmean(x[1] for x in pair)
        tb, eb = tp - tf, ep - ef
        if not (tf > 0 and tb > 0 and ef > 0 and eb > 0):
            raise ProfileRunError(f"profile at {f} MHz: non-positive time or energy (F {tf:.3g} s {ef:.3g} J, "
                                  f"B {tb:.3g} s {eb:.3g} J): windows too short for the counter")
        # Counter bound per unit (mean over the repeats' windows), and the repeats' spread.
        ef_unc = statistics.fmean(x[2] for x in fwd) / (2 * n) / ef
        ep_unc = statistics.fmean(x[2] for x in pair) / n / ep
        f_e = math.hypot(_half_range_rel([x[1] for x in fwd]), ef_unc)
        p_e = math.hypot(_half_range_rel([x[1] for x in pair]), ep_unc)
        f_t = _half_range_rel([x[0] for x in fwd])
        p_t = _half_range_rel([x[0] for x in pair])
        forward = Measured(tf, ef, f_t, f_e)
        # backward = pair - forward: absolute uncertainties add in quadrature.
        backward = Measured(tb, eb, math.hypot(p_t * tp, f_t * tf) / tb, math.hypot(p_e * ep, f_e * ef) / eb)
        reached_mhz = int(statistics.median(reads)) if reads else None
        spread = max(reads) - min(reads) if reads else 0
        reached = reached_mhz is not None and abs(reached_mhz - int(f)) <= reach_tolerance_mhz
        rows.append(ClockRow(int(f), reached_mhz, spread, reached, forward, backward, idle_w, n))
        progress(f"{f} MHz: reached {reached_mhz} MHz (spread {spread}), F {1e3 * tf:.3f} ms {ef:.4g} J, "
                 f"B {1e3 * tb:.3f} ms {eb:.4g} J, idle {idle_w:.1f} W{'' if reached else '  NOT REACHED'}")
    return StageProfile(tuple(rows), float(window_s), int(repeats))

