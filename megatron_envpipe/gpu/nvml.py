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

import importlib
import os
import re
import threading
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from megatron_envpipe.gpu.base import (
    PERMISSION_HINT,
    GpuDevice,
    GpuError,
    GpuInfo,
    GpuNotSupportedError,
    GpuPermissionError,
)

__all__ = [
    "NvmlGpu",
    "MIG_REFUSAL",
    "clock_permission",
    "CLOCK_EVENT_REASONS",
    "decode_clock_event_reasons",
    "normalize_pci_bus_id",
    "parse_cuda_visible_devices",
    "nvml_module",
    "nvml_acquire",
    "nvml_release",
]

MIG_REFUSAL = (
    "NVML cannot set clocks or read the energy of a MIG slice (clocks belong to the whole GPU and "
    "are shared by every slice): disable MIG mode on this GPU (nvidia-smi -i <gpu> -mig 0, then "
    "reset it) to use EnvPipe, or train with --envpipe-gpu none"
)

CAP_SYS_ADMIN = 21

# ---------------------------------------------------------------------------
# the pynvml module and a per-process, refcounted nvmlInit/nvmlShutdown
# ---------------------------------------------------------------------------

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


def nvml_refcount() -> int:
    """How many NvmlGpu objects (and other users) hold NVML open in this process."""
    with _init_lock:
        return int(_init_state["count"])


def _text(value: Any) -> str:
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


def _nvml_call(m: ModuleType, call: str, label: str, *args: Any) -> Any:
    try:
        return getattr(m, call)(*args)
    except m.NVMLError as exc:
        raise _map_nvml_error(m, exc, call, label) from exc


# NVML's clock-event (throttle) reason bits (nvml.h, nvmlClocksEventReason*), stable across drivers.
CLOCK_EVENT_REASONS = (
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
    names = [name for bit, name in CLOCK_EVENT_REASONS if mask & bit]
    known = sum(bit for bit, _ in CLOCK_EVENT_REASONS)
    rest = mask & ~known
    names += [f"bit {1 << i:#x}" for i in range(rest.bit_length()) if rest >> i & 1]
    return tuple(names)


# ---------------------------------------------------------------------------
# permissions
# ---------------------------------------------------------------------------


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
    if not int(match.group(1), 16) >> CAP_SYS_ADMIN & 1:
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


# ---------------------------------------------------------------------------
# device identity: PCI bus ids, CUDA_VISIBLE_DEVICES
# ---------------------------------------------------------------------------

_PCI_RE = re.compile(
    r"^\s*(?:(?P<domain>[0-9a-fA-F]{1,8}):)?(?P<bus>[0-9a-fA-F]{1,2}):(?P<dev>[0-9a-fA-F]{1,2})"
    r"(?:\.(?P<fn>[0-7]))?\s*$"
)


def normalize_pci_bus_id(text: str) -> str:
    """NVML's form ``DDDDDDDD:BB:DD.F`` (upper-case hex) of ``0000:3b:00.0``, ``3B:00.0``, ..."""
    match = _PCI_RE.match(_text(text))
    if match is None:
        raise GpuError(f"{text!r} is not a PCI bus id (expected domain:bus:device.function, e.g. 0000:3b:00.0)")
    domain = int(match.group("domain") or "0", 16)
    bus = int(match.group("bus"), 16)
    dev = int(match.group("dev"), 16)
    fn = int(match.group("fn") or "0", 16)
    return f"{domain:08X}:{bus:02X}:{dev:02X}.{fn:X}"


def parse_cuda_visible_devices(value: str | None) -> list[int | str] | None:
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
    for i in range(_nvml_call(m, "nvmlDeviceGetCount", "this node")):
        label = f"NVML device {i}"
        h = _nvml_call(m, "nvmlDeviceGetHandleByIndex", label, i)
        out.append(
            _Physical(
                nvml_index=i,
                handle=h,
                uuid=_text(_nvml_call(m, "nvmlDeviceGetUUID", label, h)),
                pci_bus_id=normalize_pci_bus_id(_text(_nvml_call(m, "nvmlDeviceGetPciInfo", label, h).busId)),
                name=_text(_nvml_call(m, "nvmlDeviceGetName", label, h)),
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
    entries = parse_cuda_visible_devices(raw)
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


def torch_pci_bus_id(local_index: int) -> str | None:
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
    :class:`~megatron_envpipe.gpu.safety.ClockGuard` (directly or via
    :class:`~megatron_envpipe.gpu.clocks.ClockController`), which resets them at
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
            self._uuid = _text(_nvml_call(m, "nvmlDeviceGetUUID", origin or "GPU", handle))
            self._pci = normalize_pci_bus_id(
                _text(_nvml_call(m, "nvmlDeviceGetPciInfo", self._uuid, handle).busId)
            )
            self._name = _text(_nvml_call(m, "nvmlDeviceGetName", self._uuid, handle))
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
                uuid = _text(uuid).strip()
                if uuid.upper().startswith("MIG-"):
                    raise GpuNotSupportedError(f"CUDA device {local_index} is MIG slice {uuid}: {MIG_REFUSAL}")
            if pci_bus_id is not None:
                bus = normalize_pci_bus_id(pci_bus_id)
                handle = _nvml_call(m, "nvmlDeviceGetHandleByPciBusId", f"PCI {bus}", bus)
                origin = f"CUDA device {local_index} = PCI {bus}"
            elif uuid is not None:
                full = uuid if uuid.upper().startswith("GPU-") else f"GPU-{uuid}"
                handle = _nvml_call(m, "nvmlDeviceGetHandleByUUID", full, full)
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
                pci = torch_pci_bus_id(local_index)
        except ImportError:
            pass
        return cls.for_cuda_device(0 if local_index is None else local_index, pci)

    @classmethod
    def for_uuid(cls, uuid: str, *, refuse_mig: bool = True) -> "NvmlGpu":
        """The GPU with this NVML UUID (``GPU-...``); used by the crash-repair path."""
        uuid = _text(uuid).strip()
        if uuid.upper().startswith("MIG-"):
            raise GpuNotSupportedError(f"{uuid}: {MIG_REFUSAL}")
        m = nvml_acquire()
        try:
            handle = _nvml_call(m, "nvmlDeviceGetHandleByUUID", uuid, uuid)
        except BaseException:
            nvml_release(m)
            raise
        return cls(m, handle, origin=uuid, refuse_mig=refuse_mig)

    @classmethod
    def for_nvml_index(cls, index: int, *, refuse_mig: bool = True) -> "NvmlGpu":
        """NVML's device ``index`` (NVML numbering: the whole node, not CUDA's)."""
        m = nvml_acquire()
        try:
            handle = _nvml_call(m, "nvmlDeviceGetHandleByIndex", f"NVML device {index}", index)
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
        return _nvml_call(self._m, call, self._label, self._h, *args)

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
            driver = _text(self._m.nvmlSystemGetDriverVersion())
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
                h = _nvml_call(m, "nvmlDeviceGetHandleByUUID", self._label, self._uuid)
                _nvml_call(m, "nvmlDeviceResetGpuLockedClocks", self._label, h)
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
        count = _nvml_call(m, "nvmlDeviceGetCount", "this node")
    finally:
        nvml_release(m)
    make = factory or (lambda i: NvmlGpu.for_nvml_index(i, refuse_mig=False))
    return [make(i) for i in range(count)]
