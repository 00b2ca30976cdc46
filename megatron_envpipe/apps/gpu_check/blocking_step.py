"""Step 4 of ``envpipe gpu-check``: the power of a GPU waiting as on NCCL P2P, at locked clocks.

A pipeline stage waiting for its neighbour spins in NCCL's P2P kernel at the clock locked for
the wait; the planner prices that wait at the *blocking power*. Here one kernel spins on a device
flag (:class:`~megatron_envpipe.apps.gpu_check.spin_wait.FlagSpin`: Triton if importable, else
``torch.cuda._sleep``; ``spin_kind`` says which) at max, ~75 %, ~50 % and min of the supported
clocks, locked through the ClockGuard, one energy window each with edges on counter updates
(:func:`~megatron_envpipe.apps.gpu_check.energy_window.measure_window`), then once idle with clocks unlocked.

The window length comes from step 2's ``counter_period_s`` and ``read_cost_s`` via
``window_length_s`` for a 0.5 % tolerance, stretched to what the budget allows (at most
``MAX_WINDOW_S``: power settles over seconds as the GPU warms). Without step 2's figures the
period defaults to ``_DEFAULT_COUNTER_PERIOD_S`` (100 ms, A100's), said in ``counter_period_from``.
Figures: ``idle_power_w``, ``blocking_power_w_by_clock`` {"<MHz>": W}, ``blocking_power_w`` (at the
highest clock), ``spin_kind``, per-clock uncertainty and the SM clock read back in each window.

With ``--device cpu`` the same measurement runs on the simulated GPU in virtual time, which draws
its table P2P power whenever no unit runs: the figures recover that power, labelled simulated.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from typing import Any

from megatron_envpipe.apps.gpu_check.device import open_check_device
from megatron_envpipe.apps.gpu_check.energy_window import window_length_s
from megatron_envpipe.apps.gpu_check.spin_wait import FlagSpin, measure_blocking_power, spin_clocks_mhz
from megatron_envpipe.apps.gpu_check.step_api import StepContext, StepResult
from megatron_envpipe.core.device_dynamics import DeviceDynamics
from megatron_envpipe.errors import EnvPipeError
from megatron_envpipe.gpu.control.safety import ClockGuard

__all__ = ["run"]

MARGIN_S = 5.0                  # clock reset, the child's exit
_TOLERANCE = 0.005               # relative power error of one window from its edges
MAX_WINDOW_S = 5.0              # readings settle over seconds (ml.energy): longer says no more here
_DEFAULT_COUNTER_PERIOD_S = 0.1  # when step 2 gave none (A100's ~100 ms)
_WINDOWS = 5                     # four clocks and idle
SIMULATED_DYNAMICS = DeviceDynamics(counter_period_s=0.1, source="gpu-check --device cpu: a 100 ms counter")


def _window_plan_s(counter_period_s: float, read_cost_s: float, left_s: float, windows: int = _WINDOWS) -> float:
    """Each window's body: long enough for ``_TOLERANCE``, as long as the budget allows (per window:
    the body, two counter periods of edges and the settle), at most ``MAX_WINDOW_S``."""
    shortest = window_length_s(counter_period_s, _TOLERANCE, read_cost_s)
    per_window_overhead_s = 2 * counter_period_s + 0.2 + 1.0
    fits = left_s / max(1, windows) - per_window_overhead_s
    return max(shortest, min(MAX_WINDOW_S, fits))


def run(ctx: StepContext) -> StepResult:
    counter = ctx.earlier.get("counter", {})
    period = counter.get("counter_period_s")
    period_from = "step 2 (counter)"
    if not isinstance(period, int | float) or not math.isfinite(period) or period < 0:
        period, period_from = _DEFAULT_COUNTER_PERIOD_S, f"default {_DEFAULT_COUNTER_PERIOD_S:g} s (no step 2 figure)"
    read_cost = counter.get("read_cost_s")
    read_cost = float(read_cost) if isinstance(read_cost, int | float) and math.isfinite(read_cost) else 0.0
    try:
        opened = open_check_device(ctx, SIMULATED_DYNAMICS)
    except EnvPipeError as exc:
        return StepResult("failed", reason=f"cannot open the GPU: {_line(exc)}")
    device = opened.device
    guard = ClockGuard(ctx.state_dir)
    spin_kind, fallback = "simulated", ""
    try:
        if opened.modelled:
            spinning: Any = _idle_between_units
            left = 60.0  # virtual time: as if a whole budget were left
            left_fn = None
        else:
            spin = FlagSpin(ctx.device_index)
            spin_kind, fallback = spin.spin_kind, spin.fallback_reason
            spinning = spin.spinning
            left = ctx.left_s(MARGIN_S)
            left_fn = lambda: ctx.left_s(MARGIN_S)  # noqa: E731 - the budget, read as the windows go
        window_s = _window_plan_s(float(period), read_cost, left)
        clocks = spin_clocks_mhz(device.supported_clocks_mhz())
        result = measure_blocking_power(device, guard, clocks, spinning, counter_period_s=float(period),
                                        window_s=window_s, clock=opened.clock, sleep=opened.sleep, left_s=left_fn)
        early_ends = 0 if opened.modelled else spin.early_ends
    except EnvPipeError as exc:
        return StepResult("failed", reason=_line(exc))
    finally:
        guard.close()  # resets the clocks whatever happened (the runner resets after the step too)
        device.close()
    if not result.blocking_power_w_by_clock and result.idle_power_w is None:
        return StepResult("failed", reason="no window fitted in the time left")
    figures: dict[str, Any] = {
        "gpu": device.info().label(), "simulated": opened.modelled,
        "idle_power_w": _round(result.idle_power_w),
        "blocking_power_w_by_clock": {k: _round(v) for k, v in result.blocking_power_w_by_clock.items()},
        "blocking_power_w": _round(result.blocking_power_w),
        "blocking_uncertainty_w_by_clock": {k: _round(v) for k, v in result.uncertainty_w_by_clock.items()},
        "reached_sm_clock_mhz_by_clock": result.reached_mhz_by_clock,
        "spin_kind": spin_kind, "window_s": _round(window_s),
        "counter_period_s": float(period), "counter_period_from": period_from,
    }
    if fallback:
        figures["spin_fallback_reason"] = fallback
    if early_ends:  # a spin that ended before its window did: those windows hold idle time too
        figures["spin_early_ends"] = early_ends
    missing = [str(f) for f in clocks if str(f) not in result.blocking_power_w_by_clock]
    if missing:
        figures["clocks_not_measured_mhz"] = missing
    return StepResult("ok", figures=figures, lines=_lines(figures))


@contextlib.contextmanager
def _idle_between_units(max_s: float, clock_mhz: int) -> Iterator[None]:
    """The simulated GPU draws its P2P (blocking) power whenever no unit runs: nothing to launch."""
    yield


def _round(value: float | None) -> float | None:
    return None if value is None else float(f"{value:.6g}")


def _lines(figures: dict[str, Any]) -> tuple[str, ...]:
    tag = " (simulated GPU)" if figures["simulated"] else ""
    by_clock = ", ".join(f"{mhz} MHz {w:.1f} W" for mhz, w in figures["blocking_power_w_by_clock"].items())
    idle = figures["idle_power_w"]
    kind = "" if figures["simulated"] else f" ({figures['spin_kind']})"
    return (f"blocking power{tag}{kind}: {by_clock or 'not measured'}",
            f"idle power, clocks unlocked{tag}: {'not measured' if idle is None else f'{idle:.1f} W'}; "
            f"windows of {figures['window_s']:g} s, counter period from {figures['counter_period_from']}")


def _line(exc: BaseException) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__
