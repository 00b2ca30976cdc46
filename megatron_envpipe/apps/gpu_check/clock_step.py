"""Step 3 of ``envpipe gpu-check``: how long a clock change takes, three ways.

For raises and lowerings between several clock pairs (max <-> ~60 %, ~60 % <-> ~45 %,
max <-> min, from step 1's supported clocks), each several times while the budget
lasts: (a) the NVML lock call, (b) until NVML reports the new clock, (c) until the SMs
run at it, from a GPU-side timer trace of 0.1 ms spin kernels
(:mod:`megatron_envpipe.apps.gpu_check.clock_change_probe`, :mod:`megatron_envpipe.core.clock_trace`).
Figures: ``nvml_call_s``, ``nvml_report_s``, ``sm_settle_s`` (medians over every change;
``sm_settle_s`` is request -> SMs, the simulated GPU's ``clock_latency_s``), per
direction, and ``pairs``; ``clock-trace.csv`` holds the kernels around each change.

With ``--device cpu`` (CI) the same probe runs against the simulated GPU with the
``realistic`` dynamics preset in virtual time: its figures are that preset's, labelled
simulated. Clocks are locked through the ClockGuard only, reset when the step ends.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from megatron_envpipe.apps.gpu_check.clock_change_probe import (
    CudaKernelTrain,
    KernelTrain,
    ProbeTiming,
    Requester,
    SimKernelTrain,
    ThreadedRequester,
    TracedChange,
    VirtualRequester,
    run_clock_changes,
)
from megatron_envpipe.apps.gpu_check.device import SIMULATED_PROFILE, open_check_device
from megatron_envpipe.apps.gpu_check.step_api import StepContext, StepResult
from megatron_envpipe.core.clock_trace import clock_step, pick_clock_pairs, trace_csv
from megatron_envpipe.core.device_dynamics import load_dynamics
from megatron_envpipe.core.resources import configs_dir
from megatron_envpipe.core.virtual_clock import VirtualClock
from megatron_envpipe.errors import EnvPipeError
from megatron_envpipe.gpu import open_gpu
from megatron_envpipe.gpu.control.safety import ClockGuard
from megatron_envpipe.gpu.devices.base import GpuDevice, GpuError
from megatron_envpipe.gpu.devices.simulated import SimulatedGpu

__all__ = ["run"]

_REPS_GPU = 5       # each pair lowered and raised this often on a GPU, while the budget lasts
_REPS_SIMULATED = 1  # the simulated GPU is deterministic: once is all it says
MARGIN_S = 5.0     # left for the clock reset, the CSV and the child's exit
# The simulated GPU's latency is known to be well under 0.1 s: a shorter watch spares CI's host time.
_SIMULATED_TIMING = ProbeTiming(settle_before_s=0.05, watch_s=0.1)
# Each simulated kernel's fixed cost (an assumed ~1 us, as a kernel's start and its events take):
# the probe measures it and takes it off, as on a GPU.
_SIMULATED_OVERHEAD_S = 1.5e-6


@dataclass(frozen=True)
class _Probe:
    """What the probe runs on: the same function, a real or a simulated device."""

    device: GpuDevice
    train: KernelTrain
    requester: Requester
    supported_mhz: tuple[int, ...]
    step_mhz: int
    reps: int
    timing: ProbeTiming
    timebase: dict[str, Callable]  # clock/sleep (virtual time) or empty (the host's)
    label: str
    source: str


def run(ctx: StepContext) -> StepResult:
    guard = ClockGuard(ctx.state_dir)
    device = None
    try:
        probe = _simulated(guard) if ctx.device == "cpu" else _cuda(ctx, guard)
        device = probe.device
        pairs = pick_clock_pairs(probe.supported_mhz)
        changes, overhead_s, stopped = run_clock_changes(
            probe.device, probe.train, probe.requester, pairs, probe.step_mhz, reps=probe.reps,
            time_left_s=lambda: ctx.left_s(MARGIN_S), timing=probe.timing, **probe.timebase)
    except EnvPipeError as exc:
        return StepResult("failed", reason=str(exc).splitlines()[0] if str(exc) else repr(exc))
    finally:
        guard.close()  # resets the clocks (the runner resets after the step too)
        if device is not None:
            device.close()
    if not changes:
        return StepResult("failed", reason=stopped or "no clock change was traced")
    return _result(changes, pairs, probe.step_mhz, probe.label, simulated=ctx.device == "cpu", source=probe.source,
                   stopped=stopped, overhead_s=overhead_s)


def _simulated(guard: ClockGuard) -> _Probe:
    vc = VirtualClock()
    dynamics = load_dynamics("realistic", configs_dir())
    # The GPU the other steps simulate (device.py), on a clock of our own: the kernel train ticks on it.
    device = open_gpu(f"simulated:{SIMULATED_PROFILE}", dynamics=dynamics, virtual_clock=vc)
    if not isinstance(device, SimulatedGpu):
        raise GpuError(f"simulated:{SIMULATED_PROFILE} opened a {type(device).__name__}, not a simulated GPU")
    supported = device.supported_clocks_mhz()
    return _Probe(device, SimKernelTrain(device, vc, overhead_s=_SIMULATED_OVERHEAD_S),
                  VirtualRequester(guard, device, vc, dynamics.nvml_call_s), supported, clock_step(supported),
                  _REPS_SIMULATED, _SIMULATED_TIMING, {"clock": vc.now, "sleep": vc.sleep},
                  "simulated GPU (realistic dynamics preset)", dynamics.source)


def _cuda(ctx: StepContext, guard: ClockGuard) -> _Probe:
    device = open_check_device(ctx).device  # the NVML device behind ctx.device_index, as every step maps it
    facts = ctx.earlier.get("facts", {})  # step 1's figures, when it ran
    supported = tuple(facts.get("supported_sm_clocks_mhz") or device.supported_clocks_mhz())
    step_mhz = int(facts.get("clock_step_mhz") or clock_step(supported))
    return _Probe(device, CudaKernelTrain(ctx.device_index), ThreadedRequester(guard, device), supported, step_mhz,
                  _REPS_GPU, ProbeTiming(), {}, device.info().label(), "measured")


def _median(values: Sequence[float | None]) -> float | None:
    got = [v for v in values if v is not None]
    return statistics.median(got) if got else None


def _result(changes: list[TracedChange], pairs: Sequence[tuple[int, int]], step_mhz: int, label: str, *,
            simulated: bool, source: str, stopped: str, overhead_s: float) -> StepResult:
    per_pair = []
    for hi, lo in pairs:
        for f_from, f_to in ((hi, lo), (lo, hi)):
            these = [c for c in changes if (c.change.from_mhz, c.change.to_mhz) == (f_from, f_to)]
            if not these:
                continue
            settles = [c.change.settle_s for c in these if c.change.settle_s is not None]
            per_pair.append({
                "from_mhz": f_from, "to_mhz": f_to, "direction": these[0].change.direction, "changes": len(these),
                "reached": sum(c.change.reached for c in these),
                "call_s": _median([c.call_s for c in these]),
                "nvml_report_s": _median([c.nvml_report_s for c in these]),
                "sm_settle_s": _median(settles), "sm_settle_max_s": max(settles) if settles else None,
                "resolution_s": _median([c.change.resolution_s for c in these]),
                "seen_mhz": round(_median([c.change.seen_mhz for c in these]) or 0.0, 1),
                "overshoot_mhz": round(max(c.change.overshoot_mhz for c in these), 1),
            })
    settle = _median([c.change.settle_s for c in changes])
    figures = {
        "simulated": simulated, "device": label, "source": source, "clock_step_mhz": step_mhz, "changes": len(changes),
        "not_reached": sum(not c.change.reached for c in changes),
        "nvml_call_s": _median([c.call_s for c in changes]),
        "nvml_report_s": _median([c.nvml_report_s for c in changes]),
        "sm_settle_s": settle,
        "sm_settle_raise_s": _median([c.change.settle_s for c in changes if c.change.direction == "raise"]),
        "sm_settle_lower_s": _median([c.change.settle_s for c in changes if c.change.direction == "lower"]),
        "resolution_s": _median([c.change.resolution_s for c in changes]),
        "kernel_overhead_s": overhead_s,
        "pairs": per_pair, "stopped_early": stopped,
    }
    csv = trace_csv([(f"{i}:{c.change.from_mhz}->{c.change.to_mhz}", c.change, c.kernels, c.request_s)
                     for i, c in enumerate(changes)])

    def ms(value: float | None) -> str:
        return "n/a" if value is None else f"{1e3 * value:.1f} ms"

    lines = [f"{'SIMULATED: ' if simulated else ''}{len(changes)} clock changes on {label}: NVML call "
             f"{ms(figures['nvml_call_s'])}, NVML reports the clock after {ms(figures['nvml_report_s'])}, "
             f"SMs at it after {ms(settle)} (raise {ms(figures['sm_settle_raise_s'])}, lower "
             f"{ms(figures['sm_settle_lower_s'])}; medians, resolution {ms(figures['resolution_s'])})"]
    if figures["not_reached"]:
        missed = [c.change.detail for c in changes if not c.change.reached]
        lines.append(f"{figures['not_reached']} change(s) never reached the clock: {missed[0]}")
    if stopped:
        lines.append(stopped)
    return StepResult("ok", figures=figures, lines=tuple(lines), files={"clock-trace.csv": csv})
