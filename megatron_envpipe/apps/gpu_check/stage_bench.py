"""What steps 5 (profile) and 6 (replay) share: the stage, the device, and the figures of earlier steps.

On CUDA the device is the NVML GPU of ``ctx.device_index`` (found by PCI bus id), clocks are locked
through a :class:`ClockGuard` in ``ctx.state_dir`` (state file first, reset on the way out) and
time is the host's. On the CPU (``ctx.device == "cpu"``, CI) the same step code runs a tiny stage
on CPU tensors against a simulated GPU (stage 0 of the shipped A40 profile) on a
:class:`VirtualClock`, with the measured counter period and a clock-dependent blocking power, so
what it measures cannot depend on the host's speed.

A figure an earlier step did not produce falls back to a documented default (``DEFAULTS``), and
the step says which it used.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from megatron_envpipe.apps.gpu_check.energy_window import window_length_s
from megatron_envpipe.apps.gpu_check.replay import interpolated_power
from megatron_envpipe.apps.gpu_check.step_api import StepContext
from megatron_envpipe.core.device_dynamics import DeviceDynamics
from megatron_envpipe.core.gpu_specs import spec_for_profile_source
from megatron_envpipe.core.profile import Profile
from megatron_envpipe.core.resources import shipped_profile
from megatron_envpipe.core.virtual_clock import VirtualClock
from megatron_envpipe.errors import EnvPipeError
from megatron_envpipe.gpu.control.safety import ClockGuard
from megatron_envpipe.gpu.devices.base import GpuDevice
from megatron_envpipe.gpu.devices.nvml import NvmlGpu
from megatron_envpipe.gpu.devices.simulated import SimulatedGpu
from megatron_envpipe.megatron.stage_model import StageSpec

__all__ = ["Bench", "CPU_SPEC", "DEFAULTS", "GPU_SPEC", "StageBenchError", "blocking_by_clock",
           "counter_figures", "open_bench", "window_s"]

# Four Megatron GPT layers of a 1.3B-class model: a forward of a few ms in bf16 on an H100, long
# enough that launch gaps do not dominate, short enough for dozens of units per energy window.
GPU_SPEC = StageSpec(hidden_size=2048, num_heads=16, num_layers=4, seq_length=2048, micro_batch_size=1)
CPU_SPEC = StageSpec(hidden_size=32, num_heads=4, num_layers=1, seq_length=16, micro_batch_size=1)
_SIM_SOURCE = "a40/gpt3-175b"  # the CPU run's simulated GPU: stage 0 of this shipped profile
DEFAULTS = {
    "counter_period_s": 0.1,  # NVML's energy counter on A100/H100 (docs/energy-measurement.md)
    "read_cost_s": 0.0,
    "window_tolerance": 0.01,  # relative counter error one energy window may add
    "reach_tolerance_mhz": 30,  # a clock within this of the request counts as reached (2 x H100's 15 MHz step)
}
MAX_WINDOW_S = 2.0  # a slow counter must not eat the step's budget: fewer, longer windows instead


class StageBenchError(EnvPipeError, RuntimeError):
    """The bench for steps 5/6 could not be set up (no clock lock, no device)."""


def _figure(earlier: Mapping[str, Mapping[str, Any]], step: str, key: str) -> Any:
    value = earlier.get(step, {}).get(key)
    return None if isinstance(value, bool) else value


def counter_figures(ctx: StepContext) -> tuple[float, float, str]:
    """(counter period s, read cost s, where they came from): step 2's, else the defaults."""
    period = _figure(ctx.earlier, "counter", "counter_period_s")
    cost = _figure(ctx.earlier, "counter", "read_cost_s")
    if isinstance(period, int | float) and 0 < period <= 1.0:
        return float(period), float(cost) if isinstance(cost, int | float) and cost >= 0 else 0.0, "step 2"
    return DEFAULTS["counter_period_s"], DEFAULTS["read_cost_s"], "default (step 2 gave no counter period)"


def window_s(period_s: float, read_cost_s: float) -> float:
    """Energy window length for the counter: ``window_length_s`` at ``DEFAULTS['window_tolerance']``."""
    return min(MAX_WINDOW_S, window_length_s(period_s, DEFAULTS["window_tolerance"], read_cost_s))


def blocking_by_clock(ctx: StepContext) -> dict[int, float] | None:
    """Step 4's blocking power per locked clock ({MHz: W}), or None when it did not run."""
    table = _figure(ctx.earlier, "blocking_power", "blocking_power_w_by_clock")
    if not isinstance(table, Mapping):
        return None
    out = {}
    for f, w in table.items():  # a clock step 4 could not measure is None: left out, interpolated over
        try:
            out[int(f)] = float(w)
        except (TypeError, ValueError):
            continue
    return {f: w for f, w in out.items() if math.isfinite(w) and w >= 0} or None


def _sim_blocking_w_at(ctx: StepContext, f_max_mhz: int) -> Callable[[int], float]:
    """The CPU run's simulated GPU's blocking power per clock: step 4's figures when they exist, else
    the A40's table P2P power at the maximum clock falling to 60 % of it at zero MHz (a GPU spinning
    on a flag draws less at a lower clock; the slope only has to be clearly non-zero here)."""
    table = blocking_by_clock(ctx)
    if table is not None:
        return interpolated_power(table)
    spec = spec_for_profile_source(_SIM_SOURCE)
    base_w = spec.p2p_power_w if spec is not None and spec.p2p_power_w else 70.0
    return lambda f: base_w * (0.6 + 0.4 * f / f_max_mhz)


@dataclass
class Bench:
    device: GpuDevice
    guard: ClockGuard
    cuda: bool
    clock: Callable[[], float]
    sleep: Callable[[float], None]
    virtual_clock: VirtualClock | None  # the CPU run's simulated time

    def lock(self, freq_mhz: int) -> None:
        """Lock the SM clock through the guard (a released guard is a failure, not a silent no-op)."""
        if not self.guard.lock(self.device, int(freq_mhz)):
            raise StageBenchError(f"clock lock to {freq_mhz} MHz not made: the clock guard was released "
                                  f"({self.guard.released})")


@contextlib.contextmanager
def open_bench(ctx: StepContext, counter_period_s: float) -> Iterator[Bench]:
    """The device of ``ctx`` with its guard; clocks reset and the device closed on the way out."""
    guard = ClockGuard(ctx.state_dir)
    if ctx.device == "cuda":
        import torch  # CUDA runs only

        torch.cuda.set_device(ctx.device_index)
        device: GpuDevice = NvmlGpu.for_torch_device(ctx.device_index)
        bench = Bench(device, guard, True, time.perf_counter, time.sleep, None)
    else:
        profile = Profile.from_csv(shipped_profile(_SIM_SOURCE))
        vc = VirtualClock()
        dynamics = DeviceDynamics(counter_period_s=counter_period_s,
                                  source="gpu-check on the CPU: the energy counter's measured period")
        device = SimulatedGpu(profile, 0, name=f"Simulated GPU ({_SIM_SOURCE})", clock=vc.now, sleep=vc.sleep,
                              dynamics=dynamics,
                              blocking_power_w_at=_sim_blocking_w_at(ctx, profile.max_frequency()))
        bench = Bench(device, guard, False, vc.now, vc.sleep, vc)
    try:
        yield bench
    finally:
        try:
            guard.close()  # resets the clock it locked; raises (reported as a failed step) if it cannot
        finally:
            device.close()
