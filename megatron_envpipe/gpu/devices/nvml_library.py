"""The NVML library under the NVML backend: loading it (one shared init, reference-counted), calling it with
its errors mapped to ours, and the facts read straight off it (clock-event reasons, lock permission).

Split from gpu/devices/nvml.py, which builds the device (NvmlGpu) on top of it.
"""

from __future__ import annotations

import importlib
import os
import re
import threading
from types import ModuleType
from typing import Any

from megatron_envpipe.gpu.devices.base import (
    PERMISSION_HINT,
    GpuError,
    GpuNotSupportedError,
    GpuPermissionError,
)

__all__ = [
    "MIG_REFUSAL", "clock_permission", "decode_clock_event_reasons", "nvml_acquire", "nvml_call", "nvml_module",
    "nvml_release", "nvml_text",
]


MIG_REFUSAL = (
    "NVML cannot set clocks or read the energy of a MIG slice (clocks belong to the whole GPU and "
    "are shared by every slice): disable MIG mode on this GPU (nvidia-smi -i <gpu> -mig 0, then "
    "reset it) to use EnvPipe, or train with --envpipe-gpu none"
)


_CAP_SYS_ADMIN = 21


_init_lock = threading.RLock()


_init_state: dict[str, Any] = {"module": None, "count": 0}


def nvml_module() -> ModuleType:
    """``pynvml`` (from ``nvidia-ml-py``), imported on first use."""
    try:
        return importlib.import_module("pynvml")
    except ImportError as exc:
        raise GpuNotSupportedError(
            "the nvml GPU backend needs nvidia-ml-py: pip install nvidia-ml-py "
            "(or pip install 'megatron-envpipe[gpu]')"
        ) from exc


def nvml_acquire() -> ModuleType:
    """Initialise NVML once per process (refcounted) and return ``pynvml``.

    Every successful call must be paired with :func:`nvml_release`.
    """
    m = nvml_module()
    with _init_lock:
        if _init_state["module"] is not m:  # first use, or a different pynvml (tests)
            _init_state.update(module=m, count=0)
        if _init_state["count"] == 0:
            try:
                m.nvmlInit()
            except m.NVMLError as exc:
                raise GpuNotSupportedError(
                    f"NVML cannot start ({exc}): no NVIDIA driver or GPU on this machine? "
                    "(check with nvidia-smi)"
                ) from exc
        _init_state["count"] += 1
    return m


def nvml_release(m: ModuleType) -> None:
    """Undo one :func:`nvml_acquire`; the last one calls ``nvmlShutdown``."""
    with _init_lock:
        if _init_state["module"] is not m or _init_state["count"] <= 0:
            return
        _init_state["count"] -= 1
        if _init_state["count"] == 0:
            try:
                m.nvmlShutdown()
            except m.NVMLError:
                pass  # nothing to undo: the library is unusable either way


def _nvml_refcount() -> int:
    """How many NvmlGpu objects (and other users) hold NVML open in this process."""
    with _init_lock:
        return int(_init_state["count"])


def nvml_text(value: Any) -> str:
    if isinstance(value, bytes):
        return value.decode(errors="replace")
    return str(value)


def _map_nvml_error(m: ModuleType, exc: BaseException, call: str, label: str) -> GpuError:
    code = getattr(exc, "value", None)
    if code == m.NVML_ERROR_NO_PERMISSION:
        return GpuPermissionError(f"{call} on {label}: no permission ({exc}); {PERMISSION_HINT}")
    if code == m.NVML_ERROR_NOT_SUPPORTED:
        return GpuNotSupportedError(f"{call} is not supported on {label} ({exc})")
    return GpuError(f"NVML {call} failed on {label}: {exc} (NVML error {code})")


def nvml_call(m: ModuleType, call: str, label: str, *args: Any) -> Any:
    try:
        return getattr(m, call)(*args)
    except m.NVMLError as exc:
        raise _map_nvml_error(m, exc, call, label) from exc


# NVML's clock-event (throttle) reason bits (nvml.h, nvmlClocksEventReason*), stable across drivers.
_CLOCK_EVENT_REASONS = (
    (0x1, "gpu_idle"),
    (0x2, "user_defined_clocks"),  # formerly "applications clocks setting": a lock of ours sets it
    (0x4, "sw_power_cap"),
    (0x8, "hw_slowdown"),
    (0x10, "sync_boost"),
    (0x20, "sw_thermal_slowdown"),
    (0x40, "hw_thermal_slowdown"),
    (0x80, "hw_power_brake_slowdown"),
    (0x100, "display_clock_setting"),
    (0x200, "board_limit"),
    (0x400, "reliability"),
)


def decode_clock_event_reasons(mask: int) -> tuple[str, ...]:
    """Names of the bits set in an NVML clock-event reason mask; unknown bits as ``bit 0x...``."""
    names = [name for bit, name in _CLOCK_EVENT_REASONS if mask & bit]
    known = sum(bit for bit, _ in _CLOCK_EVENT_REASONS)
    rest = mask & ~known
    names += [f"bit {1 << i:#x}" for i in range(rest.bit_length()) if rest >> i & 1]
    return tuple(names)


def clock_permission(proc_status: str = "/proc/self/status", uid_map: str = "/proc/self/uid_map") -> tuple[bool, str]:
    """Whether this process may lock GPU clocks, and why; changes nothing.

    The NVIDIA driver's administrator test is ``capable(CAP_SYS_ADMIN)`` (in the
    initial user namespace). Root normally has it, but root inside a container
    started without ``--cap-add SYS_ADMIN`` (or in a rootless one) does not: we
    read the effective capability set (``CapEff`` bit 21) rather than the uid.
    """
    euid = os.geteuid() if hasattr(os, "geteuid") else -1
    try:
        with open(proc_status) as fh:
            status = fh.read()
    except OSError:
        ok = euid == 0
        return ok, "root" if ok else "not root (and the capability set is unreadable)"
    match = re.search(r"^CapEff:\s*([0-9a-fA-F]+)\s*$", status, re.MULTILINE)
    if match is None:
        ok = euid == 0
        return ok, "root" if ok else "not root (no CapEff in /proc/self/status)"
    if not int(match.group(1), 16) >> _CAP_SYS_ADMIN & 1:
        if euid == 0:
            return False, ("root, but without CAP_SYS_ADMIN (a container started without "
                           "--cap-add SYS_ADMIN?)")
        return False, "neither root nor CAP_SYS_ADMIN"
    try:
        with open(uid_map) as fh:
            fields = fh.read().split()
    except OSError:
        fields = ["0", "0", "4294967295"]
    if fields[:3] != ["0", "0", "4294967295"]:
        return False, ("CAP_SYS_ADMIN only inside a user namespace (rootless or userns-remapped "
                       "container): the driver checks it in the host's namespace")
    return True, "root" if euid == 0 else "CAP_SYS_ADMIN"
