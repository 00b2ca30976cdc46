"""The ``nvml`` backend: a real NVIDIA GPU through ``nvidia-ml-py`` (``import pynvml``).

``pynvml`` is imported lazily, on the first NVML call, so this module imports
anywhere; without the package or without a driver the constructors raise
:class:`GpuNotSupportedError` saying so.

Which GPU is "ours"? CUDA and NVML number GPUs differently: NVML enumerates
every GPU on the node, CUDA only those in ``CUDA_VISIBLE_DEVICES`` (indices,
``GPU-<uuid>`` prefixes or ``MIG-`` entries), in ``CUDA_DEVICE_ORDER``
(default ``FASTEST_FIRST``). EnvPipe's "CUDA index == NVML index" is wrong as
soon as a job sees a subset of the node. :meth:`NvmlGpu.for_cuda_device`
therefore takes the PCI bus id (or UUID) CUDA reports for the device when the
caller has it (:meth:`NvmlGpu.for_torch_device` reads it from torch), and
otherwise resolves ``CUDA_VISIBLE_DEVICES`` the way CUDA does.

MIG slices are refused: NVML can neither lock the clocks of nor read the energy
of a MIG slice (clocks are per physical GPU, shared by every slice).
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from megatron_envpipe.gpu.devices.base import (
    GpuDevice,
    GpuError,
    GpuInfo,
    GpuNotSupportedError,
)
from megatron_envpipe.gpu.devices.nvml_library import (
    MIG_REFUSAL,
    clock_permission,
    decode_clock_event_reasons,
    nvml_acquire,
    nvml_call,
    nvml_release,
    nvml_text,
)

__all__ = ["NvmlGpu"]


# ---------------------------------------------------------------------------
# the pynvml module and a per-process, refcounted nvmlInit/nvmlShutdown
# ---------------------------------------------------------------------------


# ---------------------------------------------------------------------------
# permissions
# ---------------------------------------------------------------------------


# ---------------------------------------------------------------------------
# device identity: PCI bus ids, CUDA_VISIBLE_DEVICES
# ---------------------------------------------------------------------------

_PCI_RE = re.compile(
    r"^\s*(?:(?P<domain>[0-9a-fA-F]{1,8}):)?(?P<bus>[0-9a-fA-F]{1,2}):(?P<dev>[0-9a-fA-F]{1,2})"
    r"(?:\.(?P<fn>[0-7]))?\s*$"
)


def _normalize_pci_bus_id(text: str) -> str:
    """NVML's form ``DDDDDDDD:BB:DD.F`` (upper-case hex) of ``0000:3b:00.0``, ``3B:00.0``, ..."""
    match = _PCI_RE.match(nvml_text(text))
    if match is None:
        raise GpuError(f"{text!r} is not a PCI bus id (expected domain:bus:device.function, e.g. 0000:3b:00.0)")
    domain = int(match.group("domain") or "0", 16)
    bus = int(match.group("bus"), 16)
    dev = int(match.group("dev"), 16)
    fn = int(match.group("fn") or "0", 16)
    return f"{domain:08X}:{bus:02X}:{dev:02X}.{fn:X}"


def _parse_cuda_visible_devices(value: str | None) -> list[int | str] | None:
    """``CUDA_VISIBLE_DEVICES`` as CUDA reads it: None when unset (all GPUs).

    Entries are indices, ``GPU-<uuid or unique prefix>`` or ``MIG-...``; like
    CUDA, the first invalid (or repeated) entry ends the list.
    """
    if value is None:
        return None
    out: list[int | str] = []
    for raw in value.split(","):
        entry = raw.strip()
        if re.fullmatch(r"\d+", entry):
            item: int | str = int(entry)
        elif len(entry) > 4 and entry[:4].upper() in ("GPU-", "MIG-"):
            item = entry[:4].upper() + entry[4:]
        else:
            break
        if item in out:
            break
        out.append(item)
    return out


@dataclass(frozen=True)
class _Physical:
    nvml_index: int
    handle: Any
    uuid: str
    pci_bus_id: str
    name: str


def _enumerate(m: ModuleType) -> list[_Physical]:
    """Every GPU NVML sees, in PCI bus order (CUDA's PCI_BUS_ID order)."""
    out = []
    for i in range(nvml_call(m, "nvmlDeviceGetCount", "this node")):
        label = f"NVML device {i}"
        h = nvml_call(m, "nvmlDeviceGetHandleByIndex", label, i)
        out.append(
            _Physical(
                nvml_index=i,
                handle=h,
                uuid=nvml_text(nvml_call(m, "nvmlDeviceGetUUID", label, h)),
                pci_bus_id=_normalize_pci_bus_id(nvml_text(nvml_call(m, "nvmlDeviceGetPciInfo", label, h).busId)),
                name=nvml_text(nvml_call(m, "nvmlDeviceGetName", label, h)),
            )
        )
    out.sort(key=lambda d: d.pci_bus_id)
    return out


def _by_cuda_index(devices: list[_Physical], index: int, where: str) -> _Physical:
    if index >= len(devices):
        raise GpuError(f"CUDA device {index} ({where}) does not exist: NVML sees {len(devices)} GPU(s) on this node")
    order = os.environ.get("CUDA_DEVICE_ORDER", "FASTEST_FIRST").strip().upper()
    names = sorted({d.name for d in devices})
    if order != "PCI_BUS_ID" and len(names) > 1:
        raise GpuError(
            f"cannot tell which GPU CUDA device {index} ({where}) is: this node mixes GPU models "
            f"({', '.join(names)}) and CUDA's default FASTEST_FIRST order is not NVML's PCI order; "
            "set CUDA_DEVICE_ORDER=PCI_BUS_ID, list GPU UUIDs in CUDA_VISIBLE_DEVICES, or pass the "
            "device's PCI bus id (NvmlGpu.for_torch_device does)"
        )
    return devices[index]


def _resolve_visible(m: ModuleType, local_index: int) -> tuple[Any, str]:
    """(handle, description) of CUDA device ``local_index`` from CUDA_VISIBLE_DEVICES alone."""
    raw = os.environ.get("CUDA_VISIBLE_DEVICES")
    entries = _parse_cuda_visible_devices(raw)
    devices = _enumerate(m)
    if entries is None:
        d = _by_cuda_index(devices, local_index, "CUDA_VISIBLE_DEVICES unset")
        return d.handle, f"CUDA device {local_index} = NVML {d.nvml_index} (CUDA_VISIBLE_DEVICES unset)"
    where = f"CUDA_VISIBLE_DEVICES={raw}"
    if local_index >= len(entries):
        raise GpuError(
            f"{where} makes {len(entries)} GPU(s) visible to CUDA; local device {local_index} does not exist"
        )
    entry = entries[local_index]
    if isinstance(entry, int):
        d = _by_cuda_index(devices, entry, where)
        return d.handle, f"CUDA device {local_index} = physical {entry} = NVML {d.nvml_index} ({where})"
    if entry.startswith("MIG-"):
        raise GpuNotSupportedError(f"CUDA device {local_index} is MIG slice {entry} ({where}): {MIG_REFUSAL}")
    matches = [d for d in devices if d.uuid.upper().startswith(entry.upper())]
    if len(matches) != 1:
        what = "no GPU" if not matches else f"{len(matches)} GPUs"
        raise GpuError(f"{where}: entry {entry} matches {what} on this node (NVML sees "
                       f"{', '.join(d.uuid for d in devices) or 'none'})")
    d = matches[0]
    return d.handle, f"CUDA device {local_index} = {d.uuid} = NVML {d.nvml_index} ({where})"


def _torch_pci_bus_id(local_index: int) -> str | None:
    """The PCI bus id torch/CUDA reports for a local CUDA device, or None without it."""
    try:
        import torch  # optional: the gpu layer imports without torch
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    props = torch.cuda.get_device_properties(local_index)
    try:
        return f"{props.pci_domain_id:08X}:{props.pci_bus_id:02X}:{props.pci_device_id:02X}.0"
    except AttributeError:  # torch without the pci_* properties
        return None


# ---------------------------------------------------------------------------
# the device
# ---------------------------------------------------------------------------


class NvmlGpu(GpuDevice):
    """A whole, physical NVIDIA GPU (not a MIG slice) through NVML.

    Build it with :meth:`for_cuda_device`, :meth:`for_torch_device`,
    :meth:`for_uuid` or :meth:`for_nvml_index`; each holds one NVML reference
    until :meth:`close`. Locking clocks on a device should go through a
    :class:`~megatron_envpipe.gpu.control.safety.ClockGuard` (directly or via
    :class:`~megatron_envpipe.gpu.control.clocks.ClockController`), which resets them at
    exit, on SIGTERM/SIGINT, and leaves a state file for crash repair.
    """

    backend = "nvml"
    simulated = False

    def __init__(self, nvml: ModuleType, handle: Any, *, origin: str = "", refuse_mig: bool = True) -> None:
        """Internal: use the ``for_*`` constructors. Takes over one :func:`nvml_acquire` reference."""
        self._m = nvml
        self._h = handle
        self._open = True
        self.origin = origin
        self._locked: int | None = None
        self._clocks: tuple[int, ...] | None = None
        m = nvml
        try:
            self._uuid = nvml_text(nvml_call(m, "nvmlDeviceGetUUID", origin or "GPU", handle))
            self._pci = _normalize_pci_bus_id(
                nvml_text(nvml_call(m, "nvmlDeviceGetPciInfo", self._uuid, handle).busId)
            )
            self._name = nvml_text(nvml_call(m, "nvmlDeviceGetName", self._uuid, handle))
            self._label = f"GPU {self._uuid} ({self._name}, PCI {self._pci})"
            if refuse_mig:
                self._refuse_mig()
        except BaseException:
            self._open = False
            nvml_release(m)
            raise

    # -- constructors -------------------------------------------------------

    @classmethod
    def for_cuda_device(cls, local_index: int, pci_bus_id: str | None = None, *, uuid: str | None = None) -> "NvmlGpu":
        """The GPU behind CUDA device ``local_index`` of this process.

        Pass the PCI bus id CUDA reports (``torch.cuda.get_device_properties(i)``:
        ``pci_domain_id:pci_bus_id:pci_device_id``) or its UUID when known;
        without either, ``CUDA_VISIBLE_DEVICES`` is resolved as CUDA does.
        """
        if local_index < 0:
            raise GpuError(f"local CUDA device index must be >= 0, not {local_index}")
        m = nvml_acquire()
        try:
            if uuid is not None:
                uuid = nvml_text(uuid).strip()
                if uuid.upper().startswith("MIG-"):
                    raise GpuNotSupportedError(f"CUDA device {local_index} is MIG slice {uuid}: {MIG_REFUSAL}")
            if pci_bus_id is not None:
                bus = _normalize_pci_bus_id(pci_bus_id)
                handle = nvml_call(m, "nvmlDeviceGetHandleByPciBusId", f"PCI {bus}", bus)
                origin = f"CUDA device {local_index} = PCI {bus}"
            elif uuid is not None:
                full = uuid if uuid.upper().startswith("GPU-") else f"GPU-{uuid}"
                handle = nvml_call(m, "nvmlDeviceGetHandleByUUID", full, full)
                origin = f"CUDA device {local_index} = {full}"
            else:
                handle, origin = _resolve_visible(m, local_index)
        except BaseException:
            nvml_release(m)
            raise
        return cls(m, handle, origin=origin)

    @classmethod
    def for_torch_device(cls, local_index: int | None = None) -> "NvmlGpu":
        """The GPU of torch's CUDA device ``local_index`` (default: the current one), by PCI bus id."""
        pci = None
        try:
            import torch  # optional: the gpu layer imports without torch

            if torch.cuda.is_available():
                if local_index is None:
                    local_index = torch.cuda.current_device()
                pci = _torch_pci_bus_id(local_index)
        except ImportError:
            pass
        return cls.for_cuda_device(0 if local_index is None else local_index, pci)

    @classmethod
    def for_uuid(cls, uuid: str, *, refuse_mig: bool = True) -> "NvmlGpu":
        """The GPU with this NVML UUID (``GPU-...``); used by the crash-repair path."""
        uuid = nvml_text(uuid).strip()
        if uuid.upper().startswith("MIG-"):
            raise GpuNotSupportedError(f"{uuid}: {MIG_REFUSAL}")
        m = nvml_acquire()
        try:
            handle = nvml_call(m, "nvmlDeviceGetHandleByUUID", uuid, uuid)
        except BaseException:
            nvml_release(m)
            raise
        return cls(m, handle, origin=uuid, refuse_mig=refuse_mig)

    @classmethod
    def for_nvml_index(cls, index: int, *, refuse_mig: bool = True) -> "NvmlGpu":
        """NVML's device ``index`` (NVML numbering: the whole node, not CUDA's)."""
        m = nvml_acquire()
        try:
            handle = nvml_call(m, "nvmlDeviceGetHandleByIndex", f"NVML device {index}", index)
        except BaseException:
            nvml_release(m)
            raise
        return cls(m, handle, origin=f"NVML device {index}", refuse_mig=refuse_mig)

    # -- helpers --------------------------------------------------------------

    def _refuse_mig(self) -> None:
        m = self._m
        try:
            is_mig = m.nvmlDeviceIsMigDeviceHandle(self._h)
        except m.NVMLError:  # pre-Ampere driver/GPU: no MIG
            is_mig = 0
        if getattr(is_mig, "value", is_mig):
            raise GpuNotSupportedError(f"{self._label} is a MIG slice: {MIG_REFUSAL}")
        try:
            current, _pending = m.nvmlDeviceGetMigMode(self._h)
        except m.NVMLError:  # NOT_SUPPORTED: a GPU without MIG
            return
        if current == m.NVML_DEVICE_MIG_ENABLE:
            raise GpuNotSupportedError(f"{self._label} has MIG mode enabled: {MIG_REFUSAL}")

    def _call(self, call: str, *args: Any) -> Any:
        if not self._open:
            raise GpuError(f"{self._label}: device is closed")
        return nvml_call(self._m, call, self._label, self._h, *args)

    @property
    def uuid(self) -> str:
        return self._uuid

    @property
    def pci_bus_id(self) -> str:
        return self._pci

    @property
    def handle(self) -> Any:
        """The raw NVML handle (for tools such as the gpu-check steps)."""
        return self._h

    def __repr__(self) -> str:
        return f"NvmlGpu({self._label}, {self.origin or 'unknown origin'}, locked={self._locked})"

    # -- GpuDevice --------------------------------------------------------------

    def info(self) -> GpuInfo:
        try:
            driver = nvml_text(self._m.nvmlSystemGetDriverVersion())
        except self._m.NVMLError:
            driver = "unknown"
        return GpuInfo(name=self._name, uuid=self._uuid, pci_bus_id=self._pci, driver_version=driver,
                       backend=self.backend)

    def supported_clocks_mhz(self) -> tuple[int, ...]:
        if self._clocks is None:
            mem = self._call("nvmlDeviceGetSupportedMemoryClocks")
            if not mem:
                raise GpuNotSupportedError(f"{self._label} reports no supported memory clocks")
            graphics = self._call("nvmlDeviceGetSupportedGraphicsClocks", max(mem))
            if not graphics:
                raise GpuNotSupportedError(f"{self._label} reports no supported SM clocks at {max(mem)} MHz memory")
            self._clocks = tuple(sorted({int(f) for f in graphics}, reverse=True))
        return self._clocks

    def can_set_clocks(self) -> bool:
        return clock_permission()[0]

    def permission_reason(self) -> str:
        """Why :meth:`can_set_clocks` says what it says (one phrase)."""
        return clock_permission()[1]

    def set_locked_clocks(self, freq_mhz: int) -> None:
        f = int(freq_mhz)
        if f <= 0 or f != freq_mhz:
            raise GpuError(f"{self._label}: clock must be a positive whole number of MHz, not {freq_mhz!r}")
        clocks = self.supported_clocks_mhz()
        if not clocks[-1] <= f <= clocks[0]:
            raise GpuError(f"{self._label}: {f} MHz is outside the supported SM clocks {clocks[-1]}..{clocks[0]} MHz")
        self._call("nvmlDeviceSetGpuLockedClocks", f, f)
        self._locked = f

    def reset_locked_clocks(self) -> None:
        if not self._open:  # closed while still locked: reopen just for the reset
            m = nvml_acquire()
            try:
                h = nvml_call(m, "nvmlDeviceGetHandleByUUID", self._label, self._uuid)
                nvml_call(m, "nvmlDeviceResetGpuLockedClocks", self._label, h)
            finally:
                nvml_release(m)
        else:
            self._call("nvmlDeviceResetGpuLockedClocks")
        self._locked = None

    def locked_clock_mhz(self) -> int | None:
        return self._locked

    def energy_mj(self) -> float:
        try:
            return float(self._call("nvmlDeviceGetTotalEnergyConsumption"))
        except GpuNotSupportedError as exc:
            raise GpuNotSupportedError(
                f"{exc}: the cumulative energy counter needs a Volta or newer GPU"
            ) from exc.__cause__

    def power_w(self) -> float:
        return self._call("nvmlDeviceGetPowerUsage") / 1000.0

    def current_sm_clock_mhz(self) -> int | None:
        """The SM clock the GPU runs at right now (NVML_CLOCK_SM); None where NVML does not report it."""
        try:
            return int(self._call("nvmlDeviceGetClockInfo", self._m.NVML_CLOCK_SM))
        except GpuNotSupportedError:
            return None

    def clock_event_reasons(self) -> tuple[str, ...] | None:
        """The active clock-event (throttle) reasons by name; None where NVML does not report them."""
        # nvidia-ml-py >= 12.535 names it ...ClocksEventReasons; older bindings only ...ThrottleReasons.
        for call in ("nvmlDeviceGetCurrentClocksEventReasons", "nvmlDeviceGetCurrentClocksThrottleReasons"):
            if hasattr(self._m, call):
                try:
                    return decode_clock_event_reasons(int(self._call(call)))
                except GpuNotSupportedError:
                    return None
        return None

    def close(self) -> None:
        if self._open:
            self._open = False
            nvml_release(self._m)


def open_nvml_devices(factory: Callable[[int], NvmlGpu] | None = None) -> list[NvmlGpu]:
    """Every whole GPU on the node (NVML numbering), MIG-enabled ones included; caller closes them."""
    m = nvml_acquire()
    try:
        count = nvml_call(m, "nvmlDeviceGetCount", "this node")
    finally:
        nvml_release(m)
    make = factory or (lambda i: NvmlGpu.for_nvml_index(i, refuse_mig=False))
    return [make(i) for i in range(count)]
