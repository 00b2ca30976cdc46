"""Counter analysis (gpu-check step 2) on synthetic traces: a counter that updates every
``period`` at a known phase, read back to back with a known cost; the analysis must recover
the period, the step, the read cost and the power, and say in one line what is wrong with a
trace it cannot use."""

from __future__ import annotations

import math
import random

import pytest

from megatron_envpipe.core.counter_analysis import (
    CounterAnalysisError,
    CounterRead,
    PowerRead,
    analyze_counter,
    counter_csv,
)


def trace(period_s: float = 0.1, phase_s: float = 0.037, power_w: float = 200.0, duration_s: float = 10.0,
          poll_s: float = 0.001, read_cost_s: float = 50e-6, seed: int = 0, skip_every: int = 0,
          offset_s: float = 0.0) -> list[CounterRead]:
    """Reads of a counter that, at each update tick, jumps to the energy integrated so far (whole mJ)."""
    rng = random.Random(seed)
    reads, t, k = [], 0.0, 0
    while t < duration_s:
        cost = read_cost_s * (0.5 + rng.random())
        sample = t + 0.5 * cost  # the instant the driver answered for
        ticks = math.floor((sample - phase_s) / period_s)
        if skip_every:  # a counter that sometimes skips an update: the value holds one period longer
            ticks -= 1 if ticks % skip_every == 0 else 0
        tick_s = phase_s + ticks * period_s
        energy = 0.0 if tick_s < 0 else math.floor(power_w * tick_s * 1000.0)
        reads.append(CounterRead(offset_s + t, offset_s + t + cost, energy))
        t += cost + poll_s * (0.5 + rng.random())
        k += 1
    return reads


@pytest.mark.parametrize("period_s", [0.1, 0.02, 0.5])
@pytest.mark.parametrize("seed", [0, 1])
def test_recovers_period_step_and_power(period_s, seed):
    f = analyze_counter(trace(period_s=period_s, duration_s=max(10.0, 40 * period_s), seed=seed, offset_s=1e4))
    assert f.counter_period_s == pytest.approx(period_s, rel=0.002)
    assert f.counter_period_median_s == pytest.approx(period_s, rel=0.03)
    assert f.counter_step_j == pytest.approx(200.0 * period_s, rel=0.01)
    assert f.counter_power_w == pytest.approx(200.0, rel=0.002)
    assert f.read_cost_s == pytest.approx(50e-6, rel=0.1)
    assert 50e-6 <= f.read_cost_p99_s <= 75e-6
    assert f.missed_updates == 0
    assert f.counter_period_spread_s < 0.005  # brackets ~1 ms wide
    assert f.power_reading_w is None and f.power_agreement is None


def test_skipped_updates_do_not_bend_the_period():
    f = analyze_counter(trace(skip_every=7, duration_s=20.0))
    assert f.missed_updates > 0
    assert f.counter_period_s == pytest.approx(0.1, rel=0.002)
    assert f.counter_power_w == pytest.approx(200.0, rel=0.01)


def test_power_readings_compared_after_their_averaging_window():
    reads = trace(duration_s=6.0)
    # readings average the previous phase for their first second: 80 W then, 210 W after
    powers = [PowerRead(0.05 * i, 80.0 if 0.05 * i < 1.0 else 210.0) for i in range(120)]
    f = analyze_counter(reads, powers, power_average_s=1.0)
    assert f.power_reading_w == pytest.approx(210.0)
    assert f.power_agreement == pytest.approx(210.0 / 200.0 - 1, abs=0.003)
    assert f.power_readings == sum(1 for p in powers if 1.0 <= p.t_s <= reads[-1].end_s)


def test_to_json_puts_the_phase_before_the_unit():
    out = analyze_counter(trace()).to_json("_load")
    assert out["counter_period_load_s"] == pytest.approx(0.1, rel=0.01)
    assert "counter_step_load_j" in out and "counter_power_load_w" in out and "changes_load" in out
    assert all("load" in k for k in out)


@pytest.mark.parametrize("reads, needle", [
    ([], "need a trace"),
    ([CounterRead(0, 0.001, 5)] * 1, "need a trace"),
    (trace(duration_s=0.3), "changed"),
    ([CounterRead(0.0, 0.1, 1.0), CounterRead(0.05, 0.2, 2.0)], "out of time order"),
    ([CounterRead(0.0, 0.1, 5.0), CounterRead(0.2, 0.3, 2.0)], "went back"),
])
def test_unusable_traces_are_one_line(reads, needle):
    with pytest.raises(CounterAnalysisError) as err:
        analyze_counter(reads, where="counter idle")
    assert needle in str(err.value) and "\n" not in str(err.value)
    assert str(err.value).startswith("counter idle")


def test_flat_counter_says_so():
    reads = [CounterRead(0.001 * i, 0.001 * i + 1e-5, 7.0) for i in range(3000)]
    with pytest.raises(CounterAnalysisError, match="changed 0 time"):
        analyze_counter(reads)


def test_counter_csv_keeps_the_brackets_and_stays_small():
    reads = trace(duration_s=30.0)  # ~30000 reads, 300 updates
    powers = [PowerRead(0.05 * i, 200.0) for i in range(600)]
    text = counter_csv([("load", reads, powers)])
    lines = text.splitlines()
    assert lines[0] == "phase,kind,start_s,end_s,energy_mj,power_w"
    assert len(lines) - 1 <= 4000
    kept = [ln for ln in lines[1:] if ",read," in ln]
    assert len(kept) >= 2 * 299  # the read before and the read that saw each change
    # thinning evenly when asked for fewer rows
    assert len(counter_csv([("load", reads, powers)], max_rows=100).splitlines()) == 101
