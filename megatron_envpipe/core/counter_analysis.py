"""What a trace of energy-counter reads says about the counter (gpu-check step 2). Pure Python.

The probe (:mod:`megatron_envpipe.apps.gpu_check.counter_probe`) reads ``nvmlDeviceGetTotalEnergyConsumption``
back to back, stamping each read's start and end, and now and then the power reading. From those:

* **update period**: each change happened inside the *bracket* between the start of the read
  before it and the end of the read that saw it. Bracket middles are spaced by whole periods
  (a poll much faster than the period sees every update); their median spacing is a first
  estimate, then a least-squares fit of ``middle_k = phase + n_k * period`` (``n_k`` the update
  index, rounded from the first estimate, so a missed update costs nothing) gives the period to
  a fraction of the bracket over a few hundred updates. The spread is that of single-period gaps.
* **step**: the energy per update (J; the counter's granularity is 1 mJ, a step is power x period).
* **read cost**: mean and 99th percentile of one read's duration (what polling costs).
* **agreement**: counter power (energy between the first and last update over the time between
  them) against the mean of the power readings taken at least ``power_average_s`` after the
  phase began (NVML's power is a 1 s average on Ampere and later, Zeus #45: earlier readings
  still average the previous phase).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from megatron_envpipe.errors import EnvPipeError

__all__ = ["CounterAnalysisError", "CounterFigures", "CounterRead", "PowerRead", "analyze_counter",
           "counter_csv"]

# Updates needed before a period is reported (the median of fewer gaps is not a measurement).
_MIN_CHANGES = 5


class CounterAnalysisError(EnvPipeError, ValueError):
    """A counter trace that cannot be analysed (too short, out of order, going back)."""


@dataclass(frozen=True)
class CounterRead:
    """One read of the cumulative counter."""

    start_s: float     # clock before the call
    end_s: float       # clock after it returned
    energy_mj: float   # the counter's value


@dataclass(frozen=True)
class PowerRead:
    """One power reading (NVML: a moving average, see the module docstring)."""

    t_s: float
    power_w: float


@dataclass(frozen=True)
class CounterFigures:
    """Step 2's figures for one phase (idle or under load)."""

    counter_period_s: float          # fitted update period
    counter_period_spread_s: float   # p90 - p10 of single-period gaps between bracket middles
    counter_period_median_s: float   # median gap (the fit's starting point)
    changes: int                     # updates seen
    missed_updates: int              # gaps of two or more periods (reads too slow, or no update)
    counter_step_j: float            # median energy per update
    counter_power_w: float           # energy between first and last update / time between them
    read_cost_s: float               # mean duration of one read
    read_cost_p99_s: float
    reads: int
    span_s: float                    # first read start to last read end
    power_reading_w: float | None    # mean of the steady power readings (None: none taken)
    power_readings: int
    power_agreement: float | None    # power_reading_w / counter_power_w - 1 (None without readings)

    def to_json(self, suffix: str = "") -> dict[str, float | int | None]:
        """The figures with ``suffix`` inserted before each unit (``counter_period_idle_s``)."""
        out: dict[str, float | int | None] = {}
        for key, value in self.__dict__.items():
            for unit in ("_s", "_j", "_w"):
                if suffix and key.endswith(unit):
                    key = f"{key[: -len(unit)]}{suffix}{unit}"
                    break
            else:
                key = f"{key}{suffix}" if suffix else key
            out[key] = value
        return out


def _percentile(sorted_values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile of already sorted values (``q`` in [0, 1])."""
    index = min(len(sorted_values) - 1, max(0, math.ceil(q * len(sorted_values)) - 1))
    return sorted_values[index]


def _check_reads(reads: Sequence[CounterRead], where: str) -> None:
    for i, (a, b) in enumerate(zip(reads, reads[1:]), start=1):
        if not (a.start_s <= a.end_s <= b.start_s <= b.end_s):
            raise CounterAnalysisError(f"{where}: read {i} is out of time order ({a.start_s}..{a.end_s} then "
                                       f"{b.start_s}..{b.end_s}); pass the reads as taken")
        if b.energy_mj < a.energy_mj:
            raise CounterAnalysisError(f"{where}: the counter went back at read {i} ({a.energy_mj:.0f} -> "
                                       f"{b.energy_mj:.0f} mJ: a driver reload?); measure again")


def _fit_period(mids: Sequence[float], first_guess_s: float) -> tuple[float, list[int]]:
    """Least-squares period of update times ``mids`` whose indices are rounded from ``first_guess_s``."""
    indices = [0]
    for a, b in zip(mids, mids[1:]):
        indices.append(indices[-1] + max(1, round((b - a) / first_guess_s)))
    n_mean = statistics.fmean(indices)
    m_mean = statistics.fmean(mids)
    snn = math.fsum((n - n_mean) ** 2 for n in indices)
    snm = math.fsum((n - n_mean) * (m - m_mean) for n, m in zip(indices, mids))
    period = snm / snn if snn > 0 else first_guess_s
    return (period if period > 0 else first_guess_s), indices


def analyze_counter(reads: Sequence[CounterRead], powers: Sequence[PowerRead] = (), *,
                    power_average_s: float = 1.0, where: str = "energy counter") -> CounterFigures:
    """Figures of one phase's reads (module docstring); ``where`` names the phase in errors."""
    reads = list(reads)
    if len(reads) < 2:
        raise CounterAnalysisError(f"{where}: {len(reads)} read(s); need a trace of many reads (poll for longer)")
    _check_reads(reads, where)
    brackets = [(a.start_s, b.end_s, b.energy_mj - a.energy_mj)
                for a, b in zip(reads, reads[1:]) if b.energy_mj != a.energy_mj]
    if len(brackets) < _MIN_CHANGES:
        raise CounterAnalysisError(
            f"{where}: the counter changed {len(brackets)} time(s) in {reads[-1].end_s - reads[0].start_s:.3g} s "
            f"({len(reads)} reads); need {_MIN_CHANGES}: poll for longer, or the GPU draws no power it reports")
    mids = [0.5 * (lo + hi) for lo, hi, _ in brackets]
    gaps = [b - a for a, b in zip(mids, mids[1:])]
    median_gap = statistics.median(gaps)
    if not median_gap > 0:
        raise CounterAnalysisError(f"{where}: updates are not spaced in time (median gap {median_gap}); "
                                   "the clock did not advance between reads")
    period, indices = _fit_period(mids, median_gap)
    steps = [n1 - n0 for n0, n1 in zip(indices, indices[1:])]
    single = sorted(g for g, s in zip(gaps, steps) if s == 1) or sorted(gaps)
    update_span_s = mids[-1] - mids[0]
    energy_j = math.fsum(d for _, _, d in brackets[1:]) / 1000.0
    counter_power_w = energy_j / update_span_s if update_span_s > 0 else 0.0
    costs = sorted(r.end_s - r.start_s for r in reads)
    phase_start = reads[0].start_s
    steady = [p.power_w for p in powers
              if p.t_s >= phase_start + power_average_s and p.t_s <= reads[-1].end_s and math.isfinite(p.power_w)]
    reading = statistics.fmean(steady) if steady else None
    agreement = reading / counter_power_w - 1.0 if reading is not None and counter_power_w > 0 else None
    return CounterFigures(
        counter_period_s=period,
        counter_period_spread_s=_percentile(single, 0.9) - _percentile(single, 0.1),
        counter_period_median_s=median_gap,
        changes=len(brackets),
        missed_updates=sum(1 for s in steps if s > 1),
        counter_step_j=statistics.median(d for _, _, d in brackets) / 1000.0,
        counter_power_w=counter_power_w,
        read_cost_s=statistics.fmean(costs),
        read_cost_p99_s=_percentile(costs, 0.99),
        reads=len(reads),
        span_s=reads[-1].end_s - reads[0].start_s,
        power_reading_w=reading,
        power_readings=len(steady),
        power_agreement=agreement,
    )


def counter_csv(phases: Sequence[tuple[str, Sequence[CounterRead], Sequence[PowerRead]]], *,
                max_rows: int = 4000) -> str:
    """``counter.csv``: per phase, the reads around each change (the brackets, which is all the
    analysis uses) and the power readings, thinned evenly to at most ``max_rows`` rows.
    Columns: ``phase,kind,start_s,end_s,energy_mj,power_w`` (kind ``read`` or ``power``)."""
    rows: list[tuple[str, str, float, float, str, str]] = []
    for phase, reads, powers in phases:
        keep: set[int] = set()
        for i in range(1, len(reads)):
            if reads[i].energy_mj != reads[i - 1].energy_mj:
                keep.update((i - 1, i))
        if reads:
            keep.update((0, len(reads) - 1))
        rows.extend((phase, "read", reads[i].start_s, reads[i].end_s, f"{reads[i].energy_mj:.0f}", "")
                    for i in sorted(keep))
        rows.extend((phase, "power", p.t_s, p.t_s, "", f"{p.power_w:.3f}") for p in powers)
    if max_rows < 1:
        raise CounterAnalysisError(f"counter.csv: max_rows must be >= 1, got {max_rows}")
    if len(rows) > max_rows:
        stride = len(rows) / max_rows
        rows = [rows[int(k * stride)] for k in range(max_rows)]
    origin = min((r[2] for r in rows), default=0.0)
    lines = ["phase,kind,start_s,end_s,energy_mj,power_w"]
    lines += [f"{p},{k},{a - origin:.6f},{b - origin:.6f},{e},{w}" for p, k, a, b, e, w in rows]
    return "\n".join(lines) + "\n"
