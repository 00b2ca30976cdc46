"""The clock-trace analysis (core/clock_trace.py) on synthetic kernel trains: a spin of N cycles
lasts N / f, so a train generated from a known clock-versus-time curve has a known answer."""

from __future__ import annotations

import random

import pytest

from megatron_envpipe.core.clock_trace import (
    ClockTraceError,
    TraceKernel,
    analyse_trace,
    clock_step,
    launch_overhead_s,
    pick_clock_pairs,
    trace_csv,
)

H100_CLOCKS = tuple(range(1980, 209, -15))
KERNEL_S = 1e-4


def train(clock_at, cycles: int, n: int = 10**9, t0: float = 0.0, dt: float = 2e-7, noise: float = 0.0,
          seed: int = 0, until_s: float = float("inf"), overhead_s: float = 0.0) -> list[TraceKernel]:
    """``n`` kernels (or until ``until_s``) back to back from ``t0``: each takes ``overhead_s``, then
    runs until ``cycles`` SM cycles of ``clock_at(t)`` (MHz) have passed (integrated in ``dt``
    steps); ``noise`` jitters the measured end times."""
    rng = random.Random(seed)
    out, t = [], t0
    while len(out) < n and t < until_s:
        start, left = t, float(cycles)
        t += overhead_s
        while True:
            per_step = clock_at(t) * 1e6 * dt
            if per_step >= left:
                t += left / (clock_at(t) * 1e6)
                break
            left -= per_step
            t += dt
        jitter = rng.gauss(0.0, noise) if noise else 0.0
        out.append(TraceKernel(start, t + jitter, cycles))
    return out


def step_at(land_s: float, f0: float, f1: float):
    return lambda t: f0 if t < land_s else f1


def cycles_for(f_mhz: int) -> int:
    return round(KERNEL_S * f_mhz * 1e6)


@pytest.mark.parametrize(("f0", "f1", "latency_s"), [(1980, 1185, 0.015), (1185, 1980, 0.015), (1980, 210, 0.004),
                                                      (885, 1185, 0.0307)])
def test_step_change_is_found_within_one_kernel(f0, f1, latency_s):
    request_s = 0.01
    cycles = cycles_for(max(f0, f1))
    kernels = train(step_at(request_s + latency_s, f0, f1), cycles, until_s=0.06)
    c = analyse_trace(kernels, request_s, f0, f1, 15)
    assert c.reached and c.kernels == len(kernels)
    # The first kernel wholly at the new clock starts after the landing, at most one kernel later.
    assert latency_s - 1e-6 <= c.settle_s <= latency_s + c.resolution_s
    assert c.resolution_s <= cycles / (min(f0, f1) * 1e6) + 1e-9
    assert c.before_mhz == pytest.approx(f0) and c.seen_mhz == pytest.approx(f1)
    assert c.overshoot_mhz == pytest.approx(0.0, abs=1e-6) and c.max_gap_s == pytest.approx(0.0, abs=1e-12)
    assert c.direction == ("raise" if f1 > f0 else "lower")
    assert kernels[c.request_index].start_s <= request_s < kernels[c.request_index].end_s


def test_request_uncertainty_widens_the_resolution():
    kernels = train(step_at(0.025, 1980, 1185), cycles_for(1980), n=400)
    sharp = analyse_trace(kernels, 0.01, 1980, 1185, 15)
    blurred = analyse_trace(kernels, 0.01, 1980, 1185, 15, request_uncertainty_s=2e-4)
    assert blurred.resolution_s == pytest.approx(sharp.resolution_s + 2e-4)
    assert blurred.settle_s == sharp.settle_s


def test_timer_noise_and_a_lone_kernel_at_the_target_do_not_fool_it():
    kernels = train(step_at(0.025, 1980, 1185), cycles_for(1980), n=400, noise=2e-7, seed=3)
    # One kernel early on measures the target clock (a timer glitch): three in a row are needed.
    i = 150
    k = kernels[i]
    kernels[i] = TraceKernel(k.start_s, k.start_s + k.cycles / 1185e6, k.cycles)
    c = analyse_trace(kernels, 0.01, 1980, 1185, 15)
    assert c.reached and 0.015 - 1e-6 <= c.settle_s <= 0.015 + c.resolution_s
    with_one = analyse_trace(kernels, 0.01, 1980, 1185, 15, run=1)
    assert with_one.settle_s < 0.01  # what the run of three protects against


def test_a_clock_that_never_arrives_is_reported_with_the_clock_seen():
    # Raised to 1980, but capped at 1500 (power capping): the SMs stop there.
    kernels = train(step_at(0.02, 1185, 1500), cycles_for(1980), n=400)
    c = analyse_trace(kernels, 0.01, 1185, 1980, 15)
    assert not c.reached and c.settle_s is None and c.first_settled is None
    assert c.seen_mhz == pytest.approx(1500)
    assert "not reached" in c.detail and "1500 MHz" in c.detail and "1980 MHz" in c.detail


def test_a_ramp_settles_when_it_gets_within_a_step_and_overshoot_is_measured():
    def ramp(t: float) -> float:  # lands at 12 ms, overshoots to 2010 MHz at 16 ms, back at 1980 from 20 ms
        if t < 0.012:
            return 1185.0
        if t < 0.016:
            return 1185.0 + (2010.0 - 1185.0) * (t - 0.012) / 0.004
        if t < 0.020:
            return 2010.0 - 30.0 * (t - 0.016) / 0.004
        return 1980.0

    kernels = train(ramp, cycles_for(1980), n=400)
    c = analyse_trace(kernels, 0.002, 1185, 1980, 15)
    assert c.reached
    # Within 15 MHz of 1980 first on the way up (at ~15.9 ms), three kernels before the overshoot's peak.
    assert 0.0135 <= c.settle_s <= 0.0145
    assert 25.0 <= c.overshoot_mhz <= 30.0


def test_gaps_in_the_stream_are_reported():
    kernels = train(lambda t: 1980.0, cycles_for(1980), n=100)
    moved = [TraceKernel(k.start_s + (1e-3 if i >= 50 else 0), k.end_s + (1e-3 if i >= 50 else 0), k.cycles)
             for i, k in enumerate(kernels)]
    c = analyse_trace(moved, 0.002, 1980, 1980, 15)
    assert c.max_gap_s == pytest.approx(1e-3)


@pytest.mark.parametrize(("kernels", "request_s", "needle"), [
    ([TraceKernel(0.0, 1e-4, 1000)] * 2, 0.0, "need at least"),
    (train(lambda t: 1980.0, 198000, 10), 0.5, "outside the trace"),
    (train(lambda t: 1980.0, 198000, 10)[:5] + [TraceKernel(0.1, 0.1, 198000)], 0.0001, "need end > start"),
])
def test_bad_traces_say_what_is_wrong(kernels, request_s, needle):
    with pytest.raises(ClockTraceError, match=needle):
        analyse_trace(kernels, request_s, 1980, 1185, 15)


def test_pairs_span_the_plans_range_and_the_extremes():
    assert pick_clock_pairs(H100_CLOCKS) == [(1980, 1185), (1185, 885), (1980, 210)]
    assert pick_clock_pairs([1000, 500]) == [(1000, 500)]
    with pytest.raises(ClockTraceError, match="at least two"):
        pick_clock_pairs([1000])
    assert clock_step(H100_CLOCKS) == 15
    assert clock_step([1740, 1725, 1710, 1500]) == 15


def test_csv_keeps_the_kernels_around_the_request_and_the_settle():
    kernels = train(step_at(0.025, 1980, 1185), cycles_for(1980), n=400)
    c = analyse_trace(kernels, 0.01, 1980, 1185, 15)
    text = trace_csv([("0:1980->1185", c, kernels, 0.01)])
    rows = [line.split(",") for line in text.splitlines()]
    assert rows[0] == ["change", "from_mhz", "to_mhz", "kernel", "start_ms", "duration_us", "clock_mhz", "settled"]
    indices = [int(r[3]) for r in rows[1:]]
    assert len(rows) - 1 == 25 and c.request_index in indices and c.first_settled in indices
    settled = {int(r[3]): r[7] for r in rows[1:]}
    assert settled[c.first_settled] == "1" and settled[c.first_settled - 1] == "0"
    first = next(r for r in rows[1:] if int(r[3]) == c.first_settled)
    assert float(first[4]) == pytest.approx(1e3 * c.settle_s, abs=1e-3)
    assert float(first[6]) == pytest.approx(1185, abs=15)  # within a step: it may hold the landing


def test_the_kernels_fixed_overhead_is_measured_and_taken_off():
    # 2 us per kernel is 2 % of a 0.1 ms kernel: 40 MHz at 1980 MHz, more than the tolerance.
    kernels = train(step_at(0.025, 1185, 1980), cycles_for(1980), until_s=0.06, overhead_s=2e-6)
    naive = analyse_trace(kernels, 0.01, 1185, 1980, 15)
    assert not naive.reached
    mixed = [k for pair in zip(train(lambda t: 1980.0, 198000, n=20, overhead_s=2e-6),
                               train(lambda t: 1980.0, 396000, n=20, overhead_s=2e-6), strict=True) for k in pair]
    overhead_s, clock_mhz = launch_overhead_s(mixed[0::2], mixed[1::2])
    assert overhead_s == pytest.approx(2e-6, rel=1e-6) and clock_mhz == pytest.approx(1980)
    c = analyse_trace(kernels, 0.01, 1185, 1980, 15, overhead_s=overhead_s)
    assert c.reached and c.overhead_s == overhead_s and c.seen_mhz == pytest.approx(1980)
    assert abs(c.settle_s - 0.015) <= c.resolution_s
    csv_clock = float(trace_csv([("x", c, kernels, 0.01)]).splitlines()[-1].split(",")[6])
    assert csv_clock == pytest.approx(1980, abs=0.1)


@pytest.mark.parametrize(("single", "double", "needle"), [
    (train(lambda t: 1980.0, 198000, n=2), train(lambda t: 1980.0, 396000, n=5), "at least 3"),
    (train(lambda t: 1980.0, 198000, n=5), train(lambda t: 1980.0, 198000, n=5), "2N"),
])
def test_bad_overhead_measures_say_what_is_wrong(single, double, needle):
    with pytest.raises(ClockTraceError, match=needle):
        launch_overhead_s(single, double)


def test_an_overhead_as_long_as_a_kernel_is_refused():
    kernels = train(lambda t: 1980.0, 198000, n=10)
    with pytest.raises(ClockTraceError, match="below the shortest kernel"):
        analyse_trace(kernels, 1e-4, 1980, 1185, 15, overhead_s=1e-4)


def test_a_from_clock_not_reached_before_the_request_is_noted():
    kernels = train(step_at(0.025, 1500, 1185), cycles_for(1980), until_s=0.06)
    c = analyse_trace(kernels, 0.01, 1980, 1185, 15)
    assert c.reached and "1500 MHz before the request, not 1980 MHz" in c.detail
