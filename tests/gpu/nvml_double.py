"""A test double of the ``pynvml`` module (nvidia-ml-py), for CPU tests only.

It models a node's GPUs (name, UUID, PCI bus id, MIG mode, supported clocks,
locked clocks, the SM clock they run at and why, energy counter, power) and
whether this process may set clocks (``permission=False``: every lock is refused
with NO_PERMISSION; ``lock_supported=False``: NOT_SUPPORTED; ``sm_clock_range``:
locks are accepted but the SMs are held in that range, as power capping or an
unenforced minimum does),
and raises the *real* ``pynvml.NVMLError`` subclasses (from the installed
nvidia-ml-py) with the real codes. It is a stand-in for the driver only: it is
used to test our own error handling, device mapping and clock bookkeeping; the
shipped code path imports the real ``pynvml``.

Use it in-process::

    double = NvmlDouble([FakeGpu(...), ...])
    monkeypatch.setitem(sys.modules, "pynvml", double.module())

or in a subprocess (state persisted to a JSON file, so effects are visible to
the test and to later processes)::

    double = NvmlDouble([...], state_file=tmp_path / "nvml.json")
    env[STATE_ENV] = str(tmp_path / "nvml.json")
    # the child runs:  import nvml_double; nvml_double.install_from_env()
"""

from __future__ import annotations

import ctypes
import json
import os
import sys
import tempfile
import types
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import pynvml as _imported

# The real module even if a double was already installed under the name.
_real = getattr(_imported, "_real", _imported)

STATE_ENV = "ENVPIPE_NVML_DOUBLE_STATE"

A40_CLOCKS = list(range(1740, 209, -15))  # 1740, 1725, ..., 210 (NVML order: descending)


@dataclass
class FakeGpu:
    uuid: str
    pci_bus_id: str  # NVML's canonical form, e.g. "00000000:3B:00.0"
    name: str = "NVIDIA A40"
    mig_mode: int | None = 0  # 0 disabled, 1 enabled, None: GPU without MIG (NOT_SUPPORTED)
    mig_uuids: list[str] = field(default_factory=list)  # MIG slices (handles by UUID)
    memory_clocks: list[int] = field(default_factory=lambda: [405, 7251])
    graphics_clocks: list[int] = field(default_factory=lambda: list(A40_CLOCKS))  # at the highest memory clock
    low_memory_graphics_clocks: list[int] = field(default_factory=lambda: [405, 300, 210])
    locked: list[int] | None = None  # [min, max] or None
    energy_mj: int = 1_000_000
    power_mw: int = 152_345
    energy_supported: bool = True
    lock_supported: bool = True
    lock_count: int = 0  # successful nvmlDeviceSetGpuLockedClocks calls
    reset_count: int = 0
    sm_clock_range: list[int] | None = None  # [low, high]: the SMs stay inside it whatever is locked
    event_reasons: int = 0  # clock-event reason bits reported besides those the double derives
    event_reasons_supported: bool = True


class _Handle:
    def __init__(self, uuid: str, mig: bool = False) -> None:
        self.uuid = uuid
        self.mig = mig

    def __repr__(self) -> str:
        return f"<fake nvmlDevice {self.uuid}{' MIG' if self.mig else ''}>"


class _PciInfo:
    def __init__(self, bus_id: str) -> None:
        self.busId = bus_id.encode()  # like the ctypes struct: bytes
        self.busIdLegacy = bus_id.encode()
        domain, bus, rest = bus_id.split(":")
        self.domain = int(domain, 16)
        self.bus = int(bus, 16)
        self.device = int(rest.split(".")[0], 16)


class NvmlDouble:
    """The driver state behind one fake ``pynvml`` module."""

    def __init__(self, gpus: list[FakeGpu], *, state_file: str | os.PathLike[str] | None = None,
                 permission: bool = True, driver_version: str = "550.54.15", no_driver: bool = False) -> None:
        self.gpus = list(gpus)
        self.permission = permission
        self.driver_version = driver_version
        self.no_driver = no_driver
        self.failures: dict[str, int] = {}  # call name -> NVML error code to raise
        self.state_file = Path(state_file) if state_file is not None else None
        self.init_count = 0
        self.calls: list[tuple[str, tuple[Any, ...]]] = []
        self.legacy_binding = False  # module() without the ...ClocksEventReasons name (nvidia-ml-py < 12.535)
        if self.state_file is not None:
            self._save()

    # -- persistence ------------------------------------------------------------

    @classmethod
    def from_file(cls, path: str | os.PathLike[str]) -> "NvmlDouble":
        obj = cls.__new__(cls)
        obj.state_file = Path(path)
        obj.init_count = 0
        obj.calls = []
        obj.legacy_binding = False
        obj._load()
        return obj

    def _load(self) -> None:
        if self.state_file is None:
            return
        data = json.loads(self.state_file.read_text())
        self.gpus = [FakeGpu(**g) for g in data["gpus"]]
        self.permission = data["permission"]
        self.driver_version = data["driver_version"]
        self.no_driver = data["no_driver"]
        self.failures = dict(data["failures"])

    def _save(self) -> None:
        if self.state_file is None:
            return
        data = {
            "gpus": [asdict(g) for g in self.gpus],
            "permission": self.permission,
            "driver_version": self.driver_version,
            "no_driver": self.no_driver,
            "failures": self.failures,
        }
        fd, tmp = tempfile.mkstemp(dir=self.state_file.parent, prefix=".nvml-double.")
        with os.fdopen(fd, "w") as fh:
            json.dump(data, fh)
        os.replace(tmp, self.state_file)

    def reload(self) -> "NvmlDouble":
        """Re-read the persisted state (after a subprocess changed it)."""
        self._load()
        return self

    def update(self, **changes: Any) -> None:
        """Change top-level state (``permission``, ``failures``, ...) and persist it."""
        self._load()
        for k, v in changes.items():
            setattr(self, k, v)
        self._save()

    def gpu(self, uuid: str) -> FakeGpu:
        self._load()
        for g in self.gpus:
            if g.uuid == uuid:
                return g
        raise KeyError(uuid)

    def set_gpu(self, uuid: str, **changes: Any) -> None:
        self._load()
        for g in self.gpus:
            if g.uuid == uuid:
                for k, v in changes.items():
                    setattr(g, k, v)
        self._save()

    # -- helpers ------------------------------------------------------------------

    @staticmethod
    def _err(code: int) -> Exception:
        return _real.NVMLError(code)

    def _enter(self, name: str, *args: Any) -> None:
        self.calls.append((name, args))
        if name not in ("nvmlInit", "nvmlInitWithFlags") and self.init_count <= 0:
            raise self._err(_real.NVML_ERROR_UNINITIALIZED)
        self._load()
        code = self.failures.get(name)
        if code is not None:
            raise self._err(code)

    def _find(self, handle: Any) -> FakeGpu:
        if not isinstance(handle, _Handle):
            raise self._err(_real.NVML_ERROR_INVALID_ARGUMENT)
        for g in self.gpus:
            if g.uuid == handle.uuid or handle.uuid in g.mig_uuids:
                return g
        raise self._err(_real.NVML_ERROR_GPU_IS_LOST)

    def _admin(self) -> None:
        if not self.permission:
            raise self._err(_real.NVML_ERROR_NO_PERMISSION)

    @staticmethod
    def _str(value: Any) -> str:
        return value.decode() if isinstance(value, bytes) else str(value)

    # -- the pynvml API subset we use ------------------------------------------------

    def nvmlInit(self) -> None:
        self._enter("nvmlInit")
        if self.no_driver:
            raise self._err(_real.NVML_ERROR_LIBRARY_NOT_FOUND)
        self.init_count += 1

    def nvmlShutdown(self) -> None:
        self._enter("nvmlShutdown")
        self.init_count -= 1

    def nvmlSystemGetDriverVersion(self) -> str:
        self._enter("nvmlSystemGetDriverVersion")
        return self.driver_version

    def nvmlDeviceGetCount(self) -> int:
        self._enter("nvmlDeviceGetCount")
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> _Handle:
        self._enter("nvmlDeviceGetHandleByIndex", index)
        if not 0 <= index < len(self.gpus):
            raise self._err(_real.NVML_ERROR_INVALID_ARGUMENT)
        return _Handle(self.gpus[index].uuid)

    def nvmlDeviceGetHandleByUUID(self, uuid: Any) -> _Handle:
        uuid = self._str(uuid)
        self._enter("nvmlDeviceGetHandleByUUID", uuid)
        for g in self.gpus:
            if g.uuid == uuid:
                return _Handle(uuid)
            if uuid in g.mig_uuids:
                return _Handle(uuid, mig=True)
        raise self._err(_real.NVML_ERROR_NOT_FOUND)

    def nvmlDeviceGetHandleByPciBusId(self, bus_id: Any) -> _Handle:
        bus_id = self._str(bus_id)
        self._enter("nvmlDeviceGetHandleByPciBusId", bus_id)
        for g in self.gpus:
            if g.pci_bus_id == bus_id:  # strict: the caller must pass NVML's canonical form
                return _Handle(g.uuid)
        raise self._err(_real.NVML_ERROR_NOT_FOUND)

    def nvmlDeviceGetUUID(self, handle: _Handle) -> str:
        self._enter("nvmlDeviceGetUUID", handle)
        self._find(handle)
        return handle.uuid

    def nvmlDeviceGetName(self, handle: _Handle) -> str:
        self._enter("nvmlDeviceGetName", handle)
        g = self._find(handle)
        return f"{g.name} MIG slice" if handle.mig else g.name

    def nvmlDeviceGetPciInfo(self, handle: _Handle) -> _PciInfo:
        self._enter("nvmlDeviceGetPciInfo", handle)
        return _PciInfo(self._find(handle).pci_bus_id)

    def nvmlDeviceIsMigDeviceHandle(self, handle: _Handle) -> ctypes.c_uint:
        self._enter("nvmlDeviceIsMigDeviceHandle", handle)
        self._find(handle)
        return ctypes.c_uint(1 if handle.mig else 0)  # the real binding returns the c_uint itself

    def nvmlDeviceGetMigMode(self, handle: _Handle) -> list[int]:
        self._enter("nvmlDeviceGetMigMode", handle)
        g = self._find(handle)
        if g.mig_mode is None or handle.mig:
            raise self._err(_real.NVML_ERROR_NOT_SUPPORTED)
        return [g.mig_mode, g.mig_mode]

    def nvmlDeviceGetSupportedMemoryClocks(self, handle: _Handle) -> list[int]:
        self._enter("nvmlDeviceGetSupportedMemoryClocks", handle)
        g = self._find(handle)
        if handle.mig:
            raise self._err(_real.NVML_ERROR_NOT_SUPPORTED)
        return list(g.memory_clocks)

    def nvmlDeviceGetSupportedGraphicsClocks(self, handle: _Handle, memory_mhz: int) -> list[int]:
        self._enter("nvmlDeviceGetSupportedGraphicsClocks", handle, memory_mhz)
        g = self._find(handle)
        if memory_mhz not in g.memory_clocks:
            raise self._err(_real.NVML_ERROR_NOT_FOUND)
        return list(g.graphics_clocks if memory_mhz == max(g.memory_clocks) else g.low_memory_graphics_clocks)

    def nvmlDeviceSetGpuLockedClocks(self, handle: _Handle, min_mhz: int, max_mhz: int) -> None:
        self._enter("nvmlDeviceSetGpuLockedClocks", handle, min_mhz, max_mhz)
        g = self._find(handle)
        if handle.mig or not g.lock_supported:
            raise self._err(_real.NVML_ERROR_NOT_SUPPORTED)
        self._admin()
        if min_mhz > max_mhz:
            raise self._err(_real.NVML_ERROR_INVALID_ARGUMENT)
        g.locked = [int(min_mhz), int(max_mhz)]
        g.lock_count += 1
        self._save()

    def nvmlDeviceResetGpuLockedClocks(self, handle: _Handle) -> None:
        self._enter("nvmlDeviceResetGpuLockedClocks", handle)
        g = self._find(handle)
        if handle.mig or not g.lock_supported:
            raise self._err(_real.NVML_ERROR_NOT_SUPPORTED)
        self._admin()
        g.locked = None
        g.reset_count += 1
        self._save()

    def nvmlDeviceGetTotalEnergyConsumption(self, handle: _Handle) -> int:
        self._enter("nvmlDeviceGetTotalEnergyConsumption", handle)
        g = self._find(handle)
        if handle.mig or not g.energy_supported:
            raise self._err(_real.NVML_ERROR_NOT_SUPPORTED)
        return g.energy_mj

    def nvmlDeviceGetPowerUsage(self, handle: _Handle) -> int:
        self._enter("nvmlDeviceGetPowerUsage", handle)
        g = self._find(handle)
        if handle.mig:
            raise self._err(_real.NVML_ERROR_NOT_SUPPORTED)
        return g.power_mw

    @staticmethod
    def _wanted(g: FakeGpu) -> int:
        return g.locked[1] if g.locked else max(g.graphics_clocks)

    @classmethod
    def _running(cls, g: FakeGpu) -> int:
        """The SM clock: the lock (or the maximum), held inside ``sm_clock_range``."""
        f = cls._wanted(g)
        if g.sm_clock_range is not None:
            f = min(max(f, g.sm_clock_range[0]), g.sm_clock_range[1])
        return f

    def nvmlDeviceGetClockInfo(self, handle: _Handle, clock_type: int) -> int:
        self._enter("nvmlDeviceGetClockInfo", handle, clock_type)
        g = self._find(handle)
        if clock_type == _real.NVML_CLOCK_MEM:
            return max(g.memory_clocks)
        return self._running(g)

    def nvmlDeviceGetCurrentClocksEventReasons(self, handle: _Handle) -> int:
        self._enter("nvmlDeviceGetCurrentClocksEventReasons", handle)
        g = self._find(handle)
        if handle.mig or not g.event_reasons_supported:
            raise self._err(_real.NVML_ERROR_NOT_SUPPORTED)
        mask = g.event_reasons | (0x2 if g.locked else 0)  # user-defined clocks
        if self._running(g) < self._wanted(g):
            mask |= 0x4  # held down: software power cap (a raised minimum reports nothing, #1314)
        return mask

    def nvmlDeviceGetCurrentClocksThrottleReasons(self, handle: _Handle) -> int:
        """The older binding's name of the same call."""
        return self.nvmlDeviceGetCurrentClocksEventReasons(handle)

    # -- the module -------------------------------------------------------------------

    def module(self) -> types.ModuleType:
        """A fresh module object standing in for ``pynvml``: the real constants and error
        classes, this double's functions."""
        mod = types.ModuleType("pynvml", "test double of pynvml (tests/gpu/nvml_double.py)")
        for name in dir(_real):
            if name.startswith(("NVML_", "NVMLError", "nvmlExceptionClass")):
                setattr(mod, name, getattr(_real, name))
        for name in dir(self):
            if name.startswith("nvml"):
                setattr(mod, name, getattr(self, name))
        if self.legacy_binding:
            del mod.nvmlDeviceGetCurrentClocksEventReasons
        mod.__nvml_double__ = self
        mod._real = _real
        return mod


def install(double: NvmlDouble) -> types.ModuleType:
    """Put ``double``'s module into ``sys.modules['pynvml']`` (for subprocesses; tests use monkeypatch)."""
    mod = double.module()
    sys.modules["pynvml"] = mod
    return mod


def install_from_env() -> NvmlDouble:
    """Bootstrap of a child process: load the persisted double named by $ENVPIPE_NVML_DOUBLE_STATE."""
    double = NvmlDouble.from_file(os.environ[STATE_ENV])
    install(double)
    return double


def node(n: int = 4, *, name: str = "NVIDIA A40", bus_ids: list[int] | None = None) -> list[FakeGpu]:
    """``n`` GPUs with distinct UUIDs and PCI buses (default 0x1B, 0x3B, 0x5B, ...)."""
    buses = bus_ids or [0x1B + 0x20 * i for i in range(n)]
    return [
        FakeGpu(uuid=f"GPU-{i:08x}-aaaa-bbbb-cccc-{bus:012x}", pci_bus_id=f"00000000:{bus:02X}:00.0", name=name)
        for i, bus in enumerate(buses)
    ]
