"""Step 5: a real profile. A Megatron-core transformer stage across SM clocks, written as profile.csv.

The stage (``stage_bench.GPU_SPEC``: 4 GPT layers, bf16) is measured at clocks spread from the
maximum (always first) down to half of it, as many as fit the step's time, by
:func:`megatron_envpipe.apps.gpu_check.stage_profile.measure_stage_profile`: counter-aligned energy windows
sized from step 2's counter period, repeated for an uncertainty, the clock actually reached per
row. A clock not reached is left out of profile.csv and named in the figures; the maximum not
reached fails the step (the clocks are not under control). See docs/gpu-probe.md.
"""

from __future__ import annotations

from typing import Any

from megatron_envpipe.apps.gpu_check.stage_bench import (
    CPU_SPEC,
    DEFAULTS,
    GPU_SPEC,
    counter_figures,
    open_bench,
    window_s,
)
from megatron_envpipe.apps.gpu_check.stage_profile import StageProfile, measure_stage_profile, pick_clocks
from megatron_envpipe.apps.gpu_check.step_api import StepContext, StepResult
from megatron_envpipe.core.profile import Profile
from megatron_envpipe.megatron.stage_model import open_stage, parameter_count

__all__ = ["MAX_CLOCKS", "run"]

MAX_CLOCKS = 12  # enough for the planner's envelope; more only costs the GPU's time
_MIN_CLOCKS = 2   # the maximum and one lower clock, or nothing to plan with
_REPEATS = 2      # windows per instruction and clock: the spread between them is the row's uncertainty
MARGIN_S = 8.0   # left for writing the result and the runner's clock reset


def _reach_tolerance_mhz(ctx: StepContext) -> int:
    step = ctx.earlier.get("facts", {}).get("clock_step_mhz")
    return max(DEFAULTS["reach_tolerance_mhz"], 2 * int(step)) if isinstance(step, int) and step > 0 \
        else DEFAULTS["reach_tolerance_mhz"]


def _supported(ctx: StepContext, device_clocks: tuple[int, ...]) -> tuple[int, ...]:
    listed = ctx.earlier.get("facts", {}).get("supported_sm_clocks_mhz")
    if isinstance(listed, list) and listed and all(isinstance(c, int) for c in listed):
        usable = tuple(c for c in listed if c in set(device_clocks)) if ctx.device == "cpu" else tuple(listed)
        if usable:
            return usable
    return device_clocks


def _figures_of(result: StageProfile, extra: dict[str, Any]) -> dict[str, Any]:
    rows = result.reached_rows
    return {
        **extra,
        "clocks_mhz": [r.freq_mhz for r in rows],
        "not_reached": [{"freq_mhz": r.freq_mhz, "reached_mhz": r.reached_mhz} for r in result.not_reached],
        "reached_spread_mhz_max": max((r.reached_spread_mhz for r in rows), default=None),
        "forward_time_s_at_max": rows[0].forward.time_s if rows else None,
        "backward_time_s_at_max": rows[0].backward.time_s if rows else None,
        "energy_rel_unc_max": max((max(r.forward.energy_rel_unc, r.backward.energy_rel_unc) for r in rows),
                                  default=None),
        "time_rel_unc_max": max((max(r.forward.time_rel_unc, r.backward.time_rel_unc) for r in rows), default=None),
        "idle_power_w_by_clock": {str(r.freq_mhz): r.idle_power_w for r in result.rows},
        "window_s": result.window_s,
        "repeats": result.repeats,
    }


def run(ctx: StepContext) -> StepResult:
    period_s, read_cost_s, period_from = counter_figures(ctx)
    win_s = window_s(period_s, read_cost_s)
    spec = GPU_SPEC if ctx.device == "cuda" else CPU_SPEC
    lines: list[str] = []
    with open_bench(ctx, period_s) as bench:
        with open_stage(spec, f"cuda:{ctx.device_index}" if bench.cuda else "cpu") as stage:
            supported = _supported(ctx, bench.device.supported_clocks_mhz())
            # Per clock: the warm-up pair, an idle window and 2 x _REPEATS unit windows, each up to one
            # counter period longer than asked (the edges wait for updates).
            per_clock_s = (1 + 2 * _REPEATS) * (win_s + 1.5 * period_s) + 0.5
            fit = int(ctx.left_s(MARGIN_S) // per_clock_s) if not bench.virtual_clock else MAX_CLOCKS
            count = min(MAX_CLOCKS, fit)
            if count < _MIN_CLOCKS:
                return StepResult("failed", f"no time left to profile {_MIN_CLOCKS} clocks ({ctx.left_s():.0f} s left "
                                            f"after building the stage, {per_clock_s:.1f} s per clock)")
            clocks = pick_clocks(supported, count)
            result = measure_stage_profile(bench.device, stage, clocks, bench.lock, counter_period_s=period_s,
                                           window_s=win_s, repeats=_REPEATS,
                                           reach_tolerance_mhz=_reach_tolerance_mhz(ctx), clock=bench.clock,
                                           sleep=bench.sleep, progress=print)
            params = parameter_count(stage)
    text = result.to_csv_text()
    rows = result.reached_rows
    Profile.from_csv_text(text, source="profile.csv")  # what the planner will read, read back
    extra = {"counter_period_s": period_s, "counter_period_from": period_from, "parameters": params,
             "stage": {"hidden_size": spec.hidden_size, "num_heads": spec.num_heads, "num_layers": spec.num_layers,
                       "seq_length": spec.seq_length, "micro_batch_size": spec.micro_batch_size},
             "simulated": bench.device.capabilities().modelled}
    figures = _figures_of(result, extra)
    f_max = clocks[0]
    lines.append(f"{len(rows)} of {len(clocks)} clocks profiled ({clocks[-1]}..{f_max} MHz), windows {win_s:.2f} s "
                 f"x {_REPEATS} (counter period {1e3 * period_s:.0f} ms, {period_from})")
    if rows:
        r = rows[0]
        lines.append(f"at {r.freq_mhz} MHz: forward {1e3 * r.forward.time_s:.2f} ms {r.forward.energy_j:.3g} J, "
                     f"backward {1e3 * r.backward.time_s:.2f} ms {r.backward.energy_j:.3g} J; energy uncertainty "
                     f"<= {100 * figures['energy_rel_unc_max']:.2f} %")
    if result.not_reached:
        missed = ", ".join(f"{r.freq_mhz} (ran at {r.reached_mhz})" for r in result.not_reached)
        lines.append(f"NOT REACHED, left out of profile.csv: {missed} MHz")
    files = {"profile.csv": text} if rows else {}
    if not rows or rows[0].freq_mhz != f_max:
        return StepResult("failed", f"the maximum clock {f_max} MHz was not reached: clocks are not under control",
                          figures=figures, lines=tuple(lines), files=files)
    if len(rows) < _MIN_CLOCKS:
        return StepResult("failed", f"only {len(rows)} clock(s) reached: nothing to plan with",
                          figures=figures, lines=tuple(lines), files=files)
    return StepResult("ok", figures=figures, lines=tuple(lines), files=files)
