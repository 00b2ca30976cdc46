"""Step 1 of ``envpipe gpu-check``: what the GPU is, and whether a clock lock works.

NVML facts (name, driver, UUID, PCI bus id, persistence mode, supported SM clocks at the highest
memory clock, memory clocks, clock-event reasons) and one trial lock through
:func:`~megatron_envpipe.gpu.control.clock_proof.prove_clock_control` (lock through the ClockGuard, read the
SM clock back while a CUDA spin kernel keeps the GPU busy, reset). A refused lock, or one the SMs do
not reach, is reported here within seconds, and the runner skips every step that locks clocks with
this step's words. Also says whether torch has CUDA, which the runner's gating needs (it never loads
torch itself).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from megatron_envpipe.apps.gpu_check.device import open_check_device
from megatron_envpipe.apps.gpu_check.step_api import StepContext, StepResult
from megatron_envpipe.core.clock_trace import clock_step
from megatron_envpipe.gpu.control.clock_proof import cuda_spin_load, prove_clock_control
from megatron_envpipe.gpu.control.safety import ClockGuard
from megatron_envpipe.gpu.devices.base import GpuDevice, GpuError
from megatron_envpipe.gpu.devices.nvml import NvmlGpu
from megatron_envpipe.gpu.devices.nvml_library import nvml_module

__all__ = ["run"]


def _cuda_status(device_index: int) -> tuple[bool, str]:
    """(torch has CUDA and the device, one phrase saying so)."""
    try:
        import torch  # the child's business: the runner never loads torch
    except ImportError:
        return False, "torch is not installed"
    if not torch.cuda.is_available():
        return False, f"torch {torch.__version__} without CUDA (torch.cuda.is_available() is False)"
    if device_index >= torch.cuda.device_count():
        return False, f"CUDA device {device_index} does not exist ({torch.cuda.device_count()} visible)"
    return True, f"torch {torch.__version__}, CUDA {torch.version.cuda}"


def _nvml_extras(device: GpuDevice) -> dict[str, Any]:
    """Persistence mode and memory clocks, straight from NVML (None where the driver does not say)."""
    out: dict[str, Any] = {"persistence_mode": None, "memory_clocks_mhz": None}
    if not isinstance(device, NvmlGpu):
        return out
    m = nvml_module()
    call: Callable[..., Any] | None = getattr(m, "nvmlDeviceGetPersistenceMode", None)
    try:
        if call is not None:
            out["persistence_mode"] = "enabled" if int(call(device.handle)) else "disabled"
    except m.NVMLError:
        pass
    try:
        out["memory_clocks_mhz"] = sorted({int(c) for c in m.nvmlDeviceGetSupportedMemoryClocks(device.handle)},
                                          reverse=True)
    except m.NVMLError:
        pass
    return out


def run(ctx: StepContext) -> StepResult:
    cuda_ok, cuda_detail = (True, "CPU tensors (--device cpu)") if ctx.device == "cpu" else _cuda_status(ctx.device_index)
    opened = open_check_device(ctx)
    device = opened.device
    try:
        info = device.info()
        clocks = device.supported_clocks_mhz()
        figures: dict[str, Any] = {
            "gpu_name": info.name, "driver": info.driver_version, "uuid": info.uuid, "pci_bus_id": info.pci_bus_id,
            "simulated": opened.modelled, **_nvml_extras(device),
            "supported_sm_clocks_mhz": list(clocks), "max_sm_clock_mhz": clocks[0], "min_sm_clock_mhz": clocks[-1],
            "clock_step_mhz": clock_step(clocks, default=None), "cuda_available": cuda_ok, "cuda_detail": cuda_detail,
            "can_set_clocks": device.can_set_clocks(), "permission": device.permission_reason(),
            "clock_event_reasons_before": _list(device.clock_event_reasons()),
        }
        load = None
        if cuda_ok and ctx.device == "cuda":
            import torch  # CUDA is there (_cuda_status said so)

            torch.cuda.set_device(ctx.device_index)
            # Create the CUDA context and load the spin kernel now: done lazily by the first spin, they
            # would eat the proof's whole settle time (one clock read, right at the launch).
            torch.cuda._sleep(1000)
            torch.cuda.synchronize()
            load = cuda_spin_load()
        guard = ClockGuard(ctx.state_dir)
        try:
            proof = prove_clock_control(device, guard, load=load, clock=opened.clock, sleep=opened.sleep)
        except GpuError as exc:  # e.g. an unwritable state folder: the lock was never tried
            figures.update(lock="refused", lock_detail=f"the trial lock could not start: {exc}")
            return StepResult("ok", figures=figures, lines=_lines(figures))
        finally:
            guard.close()
            if load is not None:
                torch.cuda.synchronize()
        figures.update(lock=proof.outcome.value, lock_detail=proof.message, lock_requested_mhz=proof.requested_mhz,
                       lock_readback_mhz=proof.readback_mhz, lock_default_mhz=proof.default_mhz,
                       lock_tolerance_mhz=proof.tolerance_mhz, lock_wait_s=round(proof.wait_s, 6),
                       clock_event_reasons=_list(proof.reasons))
        return StepResult("ok", figures=figures, lines=_lines(figures))
    finally:
        device.close()


def _list(reasons: tuple[str, ...] | None) -> list[str] | None:
    return None if reasons is None else list(reasons)


def _lines(f: dict[str, Any]) -> tuple[str, ...]:
    clocks = f["supported_sm_clocks_mhz"]
    mem = f.get("memory_clocks_mhz")
    persistence = f.get("persistence_mode") or "unknown"
    reasons = f.get("clock_event_reasons")
    lines = [
        f"{f['gpu_name']} ({f['uuid']}, PCI {f['pci_bus_id']}), driver {f['driver']}, persistence mode {persistence}",
        f"SM clocks {clocks[0]}..{clocks[-1]} MHz ({len(clocks)}, step {f['clock_step_mhz']} MHz)"
        + (f"; memory clocks {', '.join(map(str, mem))} MHz" if mem else ""),
        f"lock: {f['lock']}: {f['lock_detail']}",
    ]
    if f["lock"] != "refused":  # a refused lock held nothing to give reasons for
        lines.append("clock-event reasons while locked: "
                     + ("not readable" if reasons is None else ", ".join(reasons) or "none"))
    lines.append(f"CUDA: {f['cuda_detail']}")
    return tuple(lines)
