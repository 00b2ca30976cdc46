"""What a GPU-side timer trace says about one clock change (``envpipe gpu-check`` step 3).

The trace is a train of short spin kernels of a fixed cycle count, back to back on one
stream, each bracketed by GPU timestamps: a spin of ``cycles`` SM cycles lasts
``cycles / f`` at SM clock ``f``, so each kernel measures the clock it ran at, every ~0.1 ms.
Given the GPU time the clock was requested (the NVML call's start, mapped from the host's
clock, with its uncertainty), :func:`analyse_trace` finds when the SMs got there: the
first of ``run`` consecutive kernels within one clock step (plus the timer's own noise) of
the target. A change that lands inside a kernel leaves that kernel between the two clocks,
so the landing lies between that kernel's start and the next one's: the resolution is one
kernel, plus the request time's uncertainty. A clock that never arrives is reported as
not reached, with the clock the kernels ran at instead.

Each measured duration also holds a fixed per-kernel cost (the kernel's start and the events
around it, ~1 us: 1 % of a 0.1 ms kernel, more than a clock step at 2 GHz), so it is measured
once (:func:`launch_overhead_s`: kernels of N and 2N cycles interleaved, ``d = N / f + o``)
and taken off every duration before its clock is computed.

Pure Python (no torch): tested on synthetic traces and on traces of the simulated GPU.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from megatron_envpipe.errors import UsageError

__all__ = ["ClockChange", "ClockTraceError", "TraceKernel", "analyse_trace", "clock_step", "launch_overhead_s",
           "pick_clock_pairs", "trace_csv"]

# Kernels needing this many in a row at the target: one lucky kernel (a change landing in a
# kernel's last moments, timer noise) is not a settled clock.
_SETTLED_RUN = 3
# CUDA event timestamps resolve about 0.5 us: a kernel's measured clock carries that much relative noise.
_TIMER_RESOLUTION_S = 1e-6
_CSV_AROUND = 5  # clock-trace.csv keeps this many kernels either side of the request and of the settle


class ClockTraceError(UsageError, ValueError):
    """A trace that cannot be analysed (empty, not covering the request, a kernel of no length)."""


@dataclass(frozen=True)
class TraceKernel:
    """One spin kernel as the GPU ran it: its timestamps (s, any GPU timebase) and its SM cycles."""

    start_s: float
    end_s: float
    cycles: int

    @property
    def duration_s(self) -> float:
        return self.end_s - self.start_s

    @property
    def clock_mhz(self) -> float:
        """The mean SM clock during the kernel, its fixed overhead included."""
        return self.cycles / self.duration_s / 1e6

    def clock_mhz_net(self, overhead_s: float) -> float:
        """The mean SM clock during the kernel, ``overhead_s`` (:func:`launch_overhead_s`) taken off."""
        return self.cycles / (self.duration_s - overhead_s) / 1e6


@dataclass(frozen=True)
class ClockChange:
    """One analysed change from ``from_mhz`` to ``to_mhz`` (times in seconds from the request)."""

    from_mhz: int
    to_mhz: int
    reached: bool
    settle_s: float | None          # request -> first of the settled kernels (None: not reached)
    resolution_s: float             # one kernel around the change + the request time's uncertainty
    before_mhz: float               # median clock of the kernels before the request
    seen_mhz: float                 # median clock of the last kernels (the clock it ended at)
    overshoot_mhz: float            # furthest beyond the target, in the change's direction, after the request
    kernels: int
    max_gap_s: float                # the longest idle gap between kernels (a starved stream if large)
    first_settled: int | None       # index of the first settled kernel
    request_index: int              # index of the kernel running at the request
    overhead_s: float = 0.0         # taken off each kernel's duration (:func:`launch_overhead_s`)
    detail: str = ""

    @property
    def direction(self) -> str:
        return "raise" if self.to_mhz > self.from_mhz else "lower"

    def to_json(self) -> dict[str, object]:
        return {"from_mhz": self.from_mhz, "to_mhz": self.to_mhz, "direction": self.direction,
                "reached": self.reached, "settle_s": self.settle_s, "resolution_s": self.resolution_s,
                "before_mhz": round(self.before_mhz, 1), "seen_mhz": round(self.seen_mhz, 1),
                "overshoot_mhz": round(self.overshoot_mhz, 1), "kernels": self.kernels,
                "max_gap_s": self.max_gap_s, "overhead_s": self.overhead_s, "detail": self.detail}


def analyse_trace(kernels: Sequence[TraceKernel], request_s: float, from_mhz: int, to_mhz: int, step_mhz: int,
                  *, request_uncertainty_s: float = 0.0, overhead_s: float = 0.0, run: int = _SETTLED_RUN,
                  timer_resolution_s: float = _TIMER_RESOLUTION_S) -> ClockChange:
    """Analyse one change (module docstring). ``kernels`` in stream order, ``request_s`` on their timebase."""
    if len(kernels) < run + 1:
        raise ClockTraceError(f"clock trace {from_mhz}->{to_mhz} MHz: {len(kernels)} kernels, need at least "
                              f"{run + 1}: enqueue more kernels around the request")
    for i, k in enumerate(kernels):
        if not (math.isfinite(k.start_s) and math.isfinite(k.end_s) and k.end_s > k.start_s and k.cycles > 0):
            raise ClockTraceError(f"clock trace {from_mhz}->{to_mhz} MHz: kernel {i} has start {k.start_s!r} s, "
                                  f"end {k.end_s!r} s, {k.cycles} cycles: need end > start and cycles > 0")
    if not kernels[0].start_s <= request_s < kernels[-1].end_s:
        raise ClockTraceError(f"clock trace {from_mhz}->{to_mhz} MHz: the request at {request_s:.6f} s is outside "
                              f"the trace ({kernels[0].start_s:.6f}..{kernels[-1].end_s:.6f} s): the stream must "
                              "run before, during and after the request")
    if step_mhz <= 0:
        raise ClockTraceError(f"clock trace: clock step must be > 0 MHz, got {step_mhz}")
    shortest_s = min(k.duration_s for k in kernels)
    if not 0.0 <= overhead_s < shortest_s:
        raise ClockTraceError(f"clock trace {from_mhz}->{to_mhz} MHz: kernel overhead {overhead_s!r} s must be >= 0 "
                              f"and below the shortest kernel ({shortest_s:.3g} s): measure it again")
    clocks = [k.clock_mhz_net(overhead_s) for k in kernels]
    # The kernel running at the request (or the first one after it, across a gap).
    req = next(i for i, k in enumerate(kernels) if k.end_s > request_s)
    before = statistics.median(clocks[max(0, req - 20):req] or clocks[:1])
    tail = clocks[-max(run, min(20, (len(clocks) - req) // 4)):]
    seen = statistics.median(tail)
    duration_s = statistics.median(k.duration_s for k in kernels[req:])
    # One clock step, plus what the timer's resolution does to a kernel's measured clock.
    tol = step_mhz + to_mhz * timer_resolution_s / duration_s
    first = None
    for i in range(req, len(kernels) - run + 1):
        if all(abs(clocks[j] - to_mhz) <= tol for j in range(i, i + run)):
            first = i
            break
    sign = 1.0 if to_mhz >= from_mhz else -1.0
    overshoot = max(0.0, max(sign * (c - to_mhz) for c in clocks[req:]))
    gaps = [b.start_s - a.end_s for a, b in zip(kernels, kernels[1:], strict=False)]
    max_gap = max([0.0, *gaps])
    # A change measured from a clock the SMs had not reached yet says little about this pair.
    note = "" if abs(before - from_mhz) <= tol else f"the SMs ran at {before:.0f} MHz before the request, not " \
                                                    f"{from_mhz} MHz"
    if first is None:
        detail = f"not reached: the SMs ran at {seen:.0f} MHz, not {to_mhz} MHz, " \
                 f"{kernels[-1].end_s - request_s:.3f} s after the request"
        return ClockChange(from_mhz, to_mhz, False, None, duration_s + request_uncertainty_s, before, seen,
                           overshoot, len(kernels), max_gap, None, req, overhead_s,
                           detail="; ".join(x for x in (detail, note) if x))
    # The change landed after the previous kernel's start (it may have run partly at the new clock).
    kernel_before = kernels[first - 1].duration_s if first > 0 else kernels[first].duration_s
    settle = max(0.0, kernels[first].start_s - request_s)
    return ClockChange(from_mhz, to_mhz, True, settle, kernel_before + request_uncertainty_s, before, seen,
                       overshoot, len(kernels), max_gap, first, req, overhead_s, detail=note)


def launch_overhead_s(single: Sequence[TraceKernel], double: Sequence[TraceKernel]) -> tuple[float, float]:
    """``(overhead_s, clock_mhz)`` from kernels of N cycles (``single``) and 2N (``double``),
    interleaved at one clock: ``d1 = N / f + o`` and ``d2 = 2N / f + o`` (medians), so
    ``o = 2 d1 - d2`` (at least 0: noise) and ``f = N / (d2 - d1)``."""
    if len(single) < 3 or len(double) < 3:
        raise ClockTraceError(f"kernel overhead: need at least 3 kernels of each length, got {len(single)} and "
                              f"{len(double)}")
    cycles = {k.cycles for k in single}
    if len(cycles) != 1 or {k.cycles for k in double} != {2 * next(iter(cycles))}:
        raise ClockTraceError("kernel overhead: the single kernels must all have N cycles and the double ones 2N")
    d1 = statistics.median(k.duration_s for k in single)
    d2 = statistics.median(k.duration_s for k in double)
    if not d2 > d1:
        raise ClockTraceError(f"kernel overhead: kernels of twice the cycles did not take longer ({d2:.3g} s vs "
                              f"{d1:.3g} s): is the clock steady?")
    return max(0.0, 2 * d1 - d2), next(iter(cycles)) / (d2 - d1) / 1e6


def pick_clock_pairs(supported_mhz: Sequence[int]) -> list[tuple[int, int]]:
    """Clock pairs to trace, higher clock first: max <-> ~60 %, ~60 % <-> ~45 %, max <-> min
    (the range plans use, and the extremes); duplicates dropped on GPUs with few clocks."""
    clocks = sorted({int(c) for c in supported_mhz if int(c) > 0}, reverse=True)
    if len(clocks) < 2:
        raise ClockTraceError(f"clock changes need at least two supported SM clocks, got {list(supported_mhz)}")
    top, low = clocks[0], clocks[-1]

    def near(fraction: float) -> int:
        return min(clocks, key=lambda c: abs(c - fraction * top))

    pairs: list[tuple[int, int]] = []
    for hi, lo in ((top, near(0.6)), (near(0.6), near(0.45)), (top, low)):
        if hi > lo and (hi, lo) not in pairs:
            pairs.append((hi, lo))
    return pairs or [(top, low)]


def clock_step(supported_mhz: Sequence[int], default: int | None = 15) -> int | None:
    """The most common gap between neighbouring supported clocks (15 MHz on recent GPUs);
    ``default`` when there is no gap (fewer than two clocks)."""
    clocks = sorted({int(c) for c in supported_mhz}, reverse=True)
    gaps = [a - b for a, b in zip(clocks, clocks[1:], strict=False) if a > b]
    return int(statistics.mode(gaps)) if gaps else default


def trace_csv(changes: Sequence[tuple[str, ClockChange, Sequence[TraceKernel], float]]) -> str:
    """clock-trace.csv: per change (label, analysis, kernels, request time), the kernels around the
    request and around the settle (around the trace's end when the clock was never reached)."""
    lines = ["change,from_mhz,to_mhz,kernel,start_ms,duration_us,clock_mhz,settled"]
    for label, change, kernels, request_s in changes:
        req = change.request_index
        around = change.first_settled if change.first_settled is not None else len(kernels) - _CSV_AROUND
        keep = sorted({i for i in (*range(req - _CSV_AROUND, req + _CSV_AROUND),
                                   *range(around - _CSV_AROUND, around + 2 * _CSV_AROUND)) if 0 <= i < len(kernels)})
        for i in keep:
            k = kernels[i]
            settled = change.first_settled is not None and i >= change.first_settled
            lines.append(f"{label},{change.from_mhz},{change.to_mhz},{i},{1e3 * (k.start_s - request_s):.4f},"
                         f"{1e6 * k.duration_s:.2f},{k.clock_mhz_net(change.overhead_s):.1f},{int(settled)}")
    return "\n".join(lines) + "\n"
