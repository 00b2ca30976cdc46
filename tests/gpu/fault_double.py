"""A GPU whose energy counter and clock control fail on cue: a test double around SimulatedGpu.

:class:`FaultyGpu` wraps a real :class:`~megatron_envpipe.gpu.devices.simulated.SimulatedGpu`
(time, energy and clocks are the model's) and injects, at once or from the n-th
unit on (``unit_begin`` count, so a training run hits the fault at the same
point every time):

* ``stall`` for ``seconds``: the counter stands still (the GPU still draws
  power), then catches up: NVML's counter is cumulative in the driver;
* ``back``: the counter restarts near 0 (a driver reload) and counts on from there;
* ``read_fail`` for ``seconds``: every read raises GpuError;
* ``lock_fail`` after ``after`` locks: later locks raise GpuPermissionError.

For a training run in subprocesses (torchrun), :func:`install_from_env` wraps
the GPUs that the EnvPipe executor opens on the stages named in
``$ENVPIPE_TEST_FAULTS`` (JSON: ``[{"fault": "stall", "stage": 1, "unit": 40,
"seconds": 1.0}, ...]``). It is a test knob: the package itself reads no such
variable.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable
from typing import Any

from megatron_envpipe.core.device_backends import DeviceCapabilities
from megatron_envpipe.gpu.devices.base import GpuDevice, GpuError, GpuInfo, GpuPermissionError

FAULTS_ENV = "ENVPIPE_TEST_FAULTS"
FAULTS = ("stall", "back", "read_fail", "lock_fail")


class FaultyGpu(GpuDevice):
    backend = "simulated"

    def __init__(self, inner: GpuDevice, clock: Callable[[], float] = time.perf_counter) -> None:
        self.inner = inner
        self._clock = clock
        self._lock = threading.Lock()
        self.units = 0  # unit_begin calls so far
        self._cued: list[tuple[int, dict[str, Any]]] = []
        self._stall_until: float | None = None
        self._stall_mj = 0.0
        self._offset_mj = 0.0
        self._fail_until: float | None = None
        self._locks_left: int | None = None
        self.lock_calls = 0  # set_locked_clocks calls, failed ones included
        self.reads_failed = 0
        self.fired: list[tuple[str, float]] = []  # (fault, clock time) as injected

    # -- injecting ------------------------------------------------------------------------
    def capabilities(self) -> DeviceCapabilities:
        return self.inner.capabilities()  # what it wraps can do; the faults are injected on top

    def inject(self, fault: str, **args: Any) -> None:
        """Inject ``fault`` now, or from unit ``args["unit"]`` on (1-based)."""
        if fault not in FAULTS:
            raise ValueError(f"unknown fault {fault!r}: one of {FAULTS}")
        unit = args.pop("unit", None)
        if unit is not None and unit > self.units:
            self._cued.append((int(unit), dict(args, fault=fault)))
            return
        now = self._clock()
        with self._lock:
            self.fired.append((fault, now))
            if fault == "stall":
                self._stall_mj = self._reported_mj()
                self._stall_until = now + float(args["seconds"])
            elif fault == "back":
                self._offset_mj = -self.inner.energy_mj()
            elif fault == "read_fail":
                self._fail_until = now + float(args["seconds"])
            else:
                self._locks_left = int(args.get("after", 0))

    def _reported_mj(self) -> float:
        return self.inner.energy_mj() + self._offset_mj

    # -- GpuDevice ------------------------------------------------------------------------
    def info(self) -> GpuInfo:
        return self.inner.info()

    def supported_clocks_mhz(self) -> tuple[int, ...]:
        return self.inner.supported_clocks_mhz()

    def can_set_clocks(self) -> bool:
        return self.inner.can_set_clocks()

    def set_locked_clocks(self, freq_mhz: int) -> None:
        with self._lock:
            self.lock_calls += 1
            if self._locks_left is not None:
                if self._locks_left <= 0:
                    raise GpuPermissionError("NVML_ERROR_NO_PERMISSION (injected: CAP_SYS_ADMIN lost)")
                self._locks_left -= 1
        self.inner.set_locked_clocks(freq_mhz)

    def reset_locked_clocks(self) -> None:
        self.inner.reset_locked_clocks()

    def locked_clock_mhz(self) -> int | None:
        return self.inner.locked_clock_mhz()

    def current_sm_clock_mhz(self) -> int | None:
        return self.inner.current_sm_clock_mhz()

    def clock_event_reasons(self) -> tuple[str, ...] | None:
        return self.inner.clock_event_reasons()

    def energy_mj(self) -> float:
        now = self._clock()
        with self._lock:
            if self._fail_until is not None and now < self._fail_until:
                self.reads_failed += 1
                raise GpuError("NVML_ERROR_UNKNOWN (injected)")
            if self._stall_until is not None and now < self._stall_until:
                return self._stall_mj
            return self._reported_mj()

    def power_w(self) -> float:
        return self.inner.power_w()

    def unit_begin(self, stage: int, kind: str) -> None:
        self.units += 1
        due = [args for unit, args in self._cued if unit <= self.units]
        self._cued = [(unit, args) for unit, args in self._cued if unit > self.units]
        for args in due:
            self.inject(**args)
        self.inner.unit_begin(stage, kind)

    def unit_end(self, stage: int, kind: str) -> None:
        self.inner.unit_end(stage, kind)

    def last_unit_window(self) -> tuple[str, float, float] | None:
        return self.inner.last_unit_window()

    def close(self) -> None:
        self.inner.close()


def install_from_env() -> list[dict[str, Any]]:
    """Wrap the GPUs the executor opens, per ``$ENVPIPE_TEST_FAULTS``; returns the faults."""
    from megatron_envpipe.gpu import stage_gpu  # where the executor's set-up opens each stage's GPU

    faults = json.loads(os.environ.get(FAULTS_ENV) or "[]")
    real_open = stage_gpu.open_gpu

    def open_faulty(*args: Any, stage: int = 0, **kwargs: Any) -> GpuDevice:
        device = real_open(*args, stage=stage, **kwargs)
        mine = [dict(f) for f in faults if f["stage"] == stage]
        if not mine:
            return device
        # Fault windows on the device's own clock: a simulated GPU in virtual time counts them in
        # simulated seconds, so what they cover does not depend on how fast the host runs the ranks.
        timebase = getattr(device, "timebase", None)
        gpu = FaultyGpu(device) if timebase is None else FaultyGpu(device, clock=timebase[0])
        for f in mine:
            del f["stage"]
            gpu.inject(f.pop("fault"), **f)
        return gpu

    stage_gpu.open_gpu = open_faulty
    return faults
