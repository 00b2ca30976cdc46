"""The ranges of every numeric flag, one table for the ``envpipe`` command and the ``--envpipe-*`` training flags.

A flag and its twin (``--target-time`` and ``--envpipe-target-time``) read the same
entry, so they accept the same numbers. Upper bounds: beyond them a value is a typo
or a unit mistake, or a size this large would only exhaust memory or time (the
shipped profiles and Megatron runs sit far below); ``why`` says which. Every value
must be finite: nan fails every comparison, so ``not low <= x <= high`` refuses it.

The planner's own limits (``planning.basis._MAX_TIMING_MARGIN``, ``_MAX_VIRTUAL_STAGES``,
``planning.switching._MAX_SWITCH_COST_J``) sit in a later layer: a test keeps them equal.
Pure Python.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from megatron_envpipe.core.gpu_specs import MAX_CLOCK_MHZ, MAX_P2P_POWER_W
from megatron_envpipe.core.jitter import MAX_JITTER


@dataclass(frozen=True)
class FlagRange:
    """A number's kind ("int" or "float") and range ``[low, high]`` (open at ``low``/``high`` with
    ``low_open``/``high_open``)."""

    kind: str
    low: float
    high: float
    unit: str = ""
    why: str = ""  # why the upper bound
    low_open: bool = False
    high_open: bool = False

    def holds(self, value: Any) -> bool:
        return self.problem(value) is None

    def problem(self, value: Any) -> str | None:
        """Why ``value`` is not a number of this kind in range (``must be ...``), or None."""
        unit = f" {self.unit}" if self.unit else ""
        in_unit = f" ({self.unit})" if self.unit else ""
        if isinstance(value, bool) or not isinstance(value, int | float) or self.kind == "int" and not isinstance(
                value, int):
            return f"must be a {'whole number' if self.kind == 'int' else 'number'}{in_unit}"
        # An int is compared as it is (exactly, without converting): math.isfinite(10**400) overflows.
        if isinstance(value, float) and not math.isfinite(value):
            return f"must be a finite number{in_unit}"
        if self.low_open and not value > self.low:
            return f"must be > {self.low:g}{unit}"
        if not self.low_open and not value >= self.low:
            return f"must be >= {self.low:g}{unit}"
        if self.high_open and not value < self.high:
            return f"must be < {self.high:g}{unit} ({self.why})" if self.why else f"must be < {self.high:g}{unit}"
        if not value <= self.high:
            return f"must be at most {self.high:g}{unit} ({self.why})" if self.why else f"must be at most {self.high:g}{unit}"
        return None

    def describe(self) -> str:
        """``>= 1 and <= 100 MHz``: the range as an argparse message says it."""
        low = f"> {self.low:g}" if self.low_open else f">= {self.low:g}"
        high = f"< {self.high:g}" if self.high_open else f"<= {self.high:g}"
        return f"{low} and {high}{f' {self.unit}' if self.unit else ''}"


_TYPO = "a larger value is a typo or a unit mistake"
_ITERATIONS = "iterations"

# key -> range. The flags that read each entry: CLI / training (-- none).
RANGES: dict[str, FlagRange] = {
    # --p2p-power / --envpipe-p2p-power; also the GPU table's p2p_power_w
    "p2p_power_w": FlagRange("float", 0.0, MAX_P2P_POWER_W, "W", "above any GPU's board power"),
    # --p2p-latency / --
    "p2p_latency_s": FlagRange("float", 0.0, 3_600.0, "s", "an hour per message is a unit mistake"),
    # --time-scale, --energy-scale / --
    "profile_scale": FlagRange("float", 0.0, 1e6, "", _TYPO, low_open=True),
    # --microbatches / Megatron's own
    "microbatches": FlagRange("int", 1, 10_000, "micro-batches", "the planner's time and memory grow with it"),
    # --stages / --pipeline-model-parallel-size (Megatron's)
    "stages": FlagRange("int", 1, 1_000, "stages", "the planner's time and memory grow with it"),
    # frontier --points / --
    "points": FlagRange("int", 2, 1_000, "plans", "one LP per point"),
    # --freq, --reconfig-step / --envpipe-reconfig-step, --envpipe-profile-step
    "clock_mhz": FlagRange("int", 1, MAX_CLOCK_MHZ, "MHz", "above any GPU's clock"),
    # --max-slowdown / --envpipe-max-slowdown: a fraction; 5 meaning 5 % is the usual mistake
    "max_slowdown": FlagRange("float", 0.0, 1.0, "", "a fraction: 0.05 = 5 %, 1 = twice the baseline's time"),
    # --target-time / --envpipe-target-time
    "target_time_s": FlagRange("float", 0.0, 1e6, "s", "over 11 days per iteration", low_open=True),
    # --switch-cost-j / --envpipe-switch-cost-j (= planning.switching._MAX_SWITCH_COST_J)
    "switch_cost_j": FlagRange("float", 0.0, 1e6, "J", "a megajoule per clock change keeps every clock"),
    # --max-clock-changes / --envpipe-max-clock-changes
    "max_clock_changes": FlagRange("int", 1, 10**6, "changes per iteration", "more than any iteration has units"),
    # --timing-margin / --envpipe-timing-margin (= planning.basis._MAX_TIMING_MARGIN)
    "timing_margin": FlagRange("float", 0.0, 0.5, "", "beyond half a unit's time no clock would change"),
    # --virtual-stages / --virtual-pipeline-model-parallel-size (= planning.basis._MAX_VIRTUAL_STAGES)
    "virtual_stages": FlagRange("int", 1, 64, "model chunks per rank", "Megatron needs a layer per chunk"),
    # --max-inflight / --envpipe-max-inflight, each entry
    "max_inflight": FlagRange("int", 1, 10**6, "micro-batch activations", "more than any iteration's micro-batches"),
    # programs --prefetch / --envpipe-prefetch
    "prefetch": FlagRange("int", 1, 10_000, "receives", "more than any iteration's micro-batches"),
    # -- / --envpipe-comm-timeout (a timedelta: 1e14 s overflows it)
    "comm_timeout_s": FlagRange("float", 0.0, 1e6, "seconds", "over 11 days for one transfer", low_open=True),
    # -- / --envpipe-finish-limit
    "finish_limit": FlagRange("int", 0, 10**6, _ITERATIONS, _TYPO),
    # -- / --envpipe-threshold-scale (x the last stage's smallest receive wait)
    "threshold_scale": FlagRange("float", 0.0, 1_000.0, "", "beyond it no wait is critical", low_open=True),
    # -- / --envpipe-measure-iterations
    "measure_iterations": FlagRange("int", 1, 1_000, _ITERATIONS, "each one is a training iteration"),
    # -- / --envpipe-profile-iterations (per clock)
    "profile_iterations": FlagRange("int", 1, 100, _ITERATIONS, "per clock, times every clock of the GPU"),
    # -- / --envpipe-reconfig-window
    "reconfig_window": FlagRange("int", 1, 100, _ITERATIONS, "a step would wait that many iterations"),
    # -- / --envpipe-straggler-window
    "straggler_window": FlagRange("int", 1, 100, _ITERATIONS, "a straggler would go unnoticed that long"),
    # -- / --envpipe-log-interval
    "log_interval": FlagRange("int", 1, 10**6, _ITERATIONS, _TYPO),
    # -- / --envpipe-baseline-iterations (0: the predicted baseline)
    "baseline_iterations": FlagRange("int", 0, 1_000, _ITERATIONS, "each one runs at the maximum clock"),
    # -- / --envpipe-sim-time-scale (wall seconds per simulated second; below 1/1000 the host's own
    # milliseconds become seconds of simulated time: energies of 1e302 J at 1e-300)
    "sim_time_scale": FlagRange("float", 0.001, 10.0, "", "slower than the GPU it simulates", low_open=True),
    # -- / --envpipe-sim-unit-scale (unit times and energies x this)
    "sim_unit_scale": FlagRange("float", 0.01, 10.0, "", "a GPU 100x faster or 10x slower than the profile's"),
    # -- / --envpipe-sim-jitter
    "sim_jitter": FlagRange("float", 0.0, MAX_JITTER, "", "with 3-sigma clipping every unit keeps time > 0"),
    # -- / --envpipe-sim-clock-latency-ms, --envpipe-sim-counter-period-ms, --envpipe-sim-thermal-drift
    # (= core.device_dynamics' MAX_LATENCY_S, _MAX_COUNTER_PERIOD_S, _MAX_THERMAL_DRIFT; a test keeps them equal)
    "sim_clock_latency_ms": FlagRange("float", 0.0, 1000.0, "ms", "a second per clock change: ms given as s?"),
    "sim_counter_period_ms": FlagRange("float", 0.0, 5000.0, "ms", "no GPU's counter is that slow"),
    "sim_thermal_drift": FlagRange("float", 0.0, 0.5, "", "a fraction: 0.03 = 3 %"),
    # -- / --envpipe-straggler-threshold: the slowest pipeline's lead that starts following
    "straggler_threshold": FlagRange("float", 0.0, 1.0, "", "a fraction: 0.02 = 2 %", low_open=True, high_open=True),
    # -- / --envpipe-sim-straggler R:FACTOR: a unit takes FACTOR times longer (4: a GPU at a quarter of its speed)
    "straggler_factor": FlagRange("float", 1.0, 4.0, "", "a GPU throttled below a quarter of its speed"),
    # -- / --envpipe-sim-memory GIB_FREE,MIB_PER_MICROBATCH (core.memory.MemoryModel)
    "sim_free_gib": FlagRange("float", 0.0, 1e6, "GiB", "a pebibyte: a unit mistake"),
    "sim_mib_per_microbatch": FlagRange("float", 0.0, 1e6, "MiB", "a terabyte per micro-batch: a unit mistake",
                                        low_open=True),
}
