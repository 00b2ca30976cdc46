"""A GPU waiting as it waits on NCCL P2P: one kernel spinning on a device flag, and its power.

NCCL's point-to-point kernels poll a flag in device memory until the peer's data arrives; a
pipeline stage that waits draws the power of that spin (Perseus's "blocking power"), at the
clock locked for the wait. :class:`FlagSpin` reproduces it: ``start(max_s)`` launches one
small kernel (one program) that loops on a volatile load of a flag, ``release()`` sets the flag
from a side stream (ordered after the flag's reset by an event) and waits for the kernel.

* ``spin_kind == "triton_flag"``: that kernel in Triton, checked at construction (it compiles,
  returns at once on a set flag, and a release ends it early). Its loop is also bounded by an
  iteration count worth ``_SAFETY_FACTOR`` times the longest spin asked for at the calibrated
  rate, so a release that never lands cannot hang the GPU for long.
* ``spin_kind == "torch_sleep"``: without Triton (or when the check fails), ``torch.cuda._sleep``
  spins on the SM's cycle counter for ``max_s`` at the clock given: the same one busy program,
  without the memory loads, and not releasable early (``release()`` waits it out).

:func:`measure_blocking_power` is the measurement (gpu-check step 4), backend-neutral so it
runs on the simulated GPU in CI: per clock, lock through the guard, start the spin, measure
one energy window (:func:`~megatron_envpipe.apps.gpu_check.energy_window.measure_window`) while it
spins, release, reset; then one window idle with clocks unlocked.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from megatron_envpipe.apps.gpu_check.energy_window import WindowEnergy, measure_window
from megatron_envpipe.errors import OutOfOrderError
from megatron_envpipe.gpu.control.safety import ClockGuard
from megatron_envpipe.gpu.devices.base import GpuDevice, GpuError

__all__ = ["BlockingPower", "FlagSpin", "measure_blocking_power", "spin_clocks_mhz"]

# The flag kernel's iteration bound, in multiples of the longest spin asked for (at the calibrated rate).
_SAFETY_FACTOR = 3.0
# Cycles per second _sleep counts when no clock is known: above any current GPU's maximum, so it
# spins at least the time asked for.
_SLEEP_MHZ_FALLBACK = 2200
# Time the SMs get to reach a newly locked clock before a window starts (real GPUs: under ~100 ms).
SETTLE_S = 0.2


try:  # optional (CUDA machines): without it FlagSpin spins with torch.cuda._sleep
    import triton
    import triton.language as tl
except Exception as exc:  # noqa: BLE001 - a missing or broken Triton only means the fallback
    triton = tl = None
    _TRITON_MISSING = f"Triton not importable ({type(exc).__name__}: {exc})"
else:
    _TRITON_MISSING = ""

    # One program loops on a volatile (uncached) load of the flag, as NCCL's P2P wait does, bounded
    # by max_iters; it stores how often it looped. max_iters is not specialised: no recompiles.
    @triton.jit(do_not_specialize=["max_iters"])
    def _flag_spin(flag_ptr, out_ptr, max_iters):
        i = tl.program_id(0) * 0
        while (tl.load(flag_ptr, volatile=True) == 0) & (i < max_iters):
            i += 1
        tl.store(out_ptr, i)


class FlagSpin:
    """One busy program on ``device_index`` until released (module docstring)."""

    def __init__(self, device_index: int = 0, *, prefer_triton: bool = True) -> None:
        import torch  # CUDA runs only: this layer imports without torch

        self._torch: Any = torch
        self._device = torch.device("cuda", device_index)
        self._main = torch.cuda.Stream(device=self._device)
        self._side = torch.cuda.Stream(device=self._device)
        self._flag = torch.zeros(1, dtype=torch.int32, device=self._device)
        self._iters = torch.zeros(1, dtype=torch.int32, device=self._device)
        torch.cuda.synchronize(self._device)  # the side streams must not race the allocations' zeroing
        self._kernel: Any = None
        self._running: tuple[float, int, int] | None = None  # (max_s, clock MHz, the kernel's iteration bound)
        self.iters_per_s = 0.0
        self.early_ends = 0  # spins that hit their bound before release: the GPU idled part of that wait
        self.spin_kind = "torch_sleep"
        self.fallback_reason = _TRITON_MISSING or "Triton not asked for"
        if prefer_triton and triton is not None:
            try:
                self._kernel = _flag_spin
                self._check_triton()
                self.spin_kind, self.fallback_reason = "triton_flag", ""
            except Exception as exc:  # no compiler, a release that does not land: spin with _sleep
                self._kernel = None
                self._running = None
                self.early_ends = 0  # the check's own spin, not a measurement's
                self._main.synchronize()
                self.fallback_reason = f"{type(exc).__name__}: {' '.join(str(exc).split())[:200]}"

    def _launch(self, max_iters: int) -> None:
        with self._torch.cuda.device(self._device):  # Triton launches on the current device and stream
            self._kernel[(1,)](self._flag, self._iters, max(2, int(max_iters)))

    def _check_triton(self) -> None:
        torch = self._torch
        with torch.cuda.stream(self._main):
            self._flag.fill_(1)
            self._launch(1 << 30)  # a set flag: returns at once (compiles here)
            self._main.synchronize()
            if int(self._iters.item()) != 0:
                raise GpuError("the flag kernel did not see a set flag")
            # Calibrate, timed by events: a short run first (an idle GPU's clock ramps up within it),
            # then ~0.2 s runs; the fastest rate seen, so the bound is never short at the maximum clock.
            self._flag.zero_()
            n = 200_000
            for _ in range(3):
                begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                begin.record(self._main)
                self._launch(n)
                end.record(self._main)
                end.synchronize()
                self.iters_per_s = max(self.iters_per_s, n / max(1e-6, begin.elapsed_time(end) / 1000.0))
                n = int(min(1 << 30, max(n, 0.2 * self.iters_per_s)))
        # A release must end a spin long before its bound.
        self.start(1.0)
        time.sleep(0.05)
        iters = self.release()
        if iters >= int(self.iters_per_s * 1.0 * _SAFETY_FACTOR):
            raise GpuError("a release from the side stream did not end the spin (streams serialised?)")

    def start(self, max_s: float, clock_mhz: int | None = None) -> None:
        """Launch the spin (returns at once); it lasts until :meth:`release`, at most about ``max_s``
        (``torch_sleep``: exactly ``max_s`` at ``clock_mhz``, the clock the SMs run at)."""
        torch = self._torch
        if self._running is not None:
            raise OutOfOrderError("FlagSpin.start while a spin is running: release it first")
        bound = min((1 << 31) - 1, max(2, int(self.iters_per_s * max_s * _SAFETY_FACTOR)))
        with torch.cuda.stream(self._main):
            if self._kernel is not None:
                self._flag.zero_()
                reset = torch.cuda.Event()
                reset.record(self._main)
                self._side.wait_event(reset)  # the release is ordered after the reset
                self._launch(bound)
            else:
                torch.cuda._sleep(int(max_s * (clock_mhz or _SLEEP_MHZ_FALLBACK) * 1e6))
        self._running = (max_s, clock_mhz or 0, bound)

    def release(self) -> int:
        """Set the flag, wait for the spin to end; returns the kernel's iterations (0 for ``torch_sleep``)."""
        torch = self._torch
        if self._running is None:
            return 0
        bound = self._running[2]
        self._running = None
        if self._kernel is None:
            self._main.synchronize()
            return 0
        with torch.cuda.stream(self._side):
            self._flag.fill_(1)
        self._main.synchronize()
        iters = int(self._iters.item())
        if iters >= bound:
            self.early_ends += 1
        return iters

    def spin(self, duration_s: float, clock_mhz: int | None = None) -> None:
        """Spin for ``duration_s`` host seconds and return when the GPU is done (for replay waits)."""
        self.start(duration_s, clock_mhz)
        if self._kernel is not None:
            time.sleep(duration_s)
        self.release()

    @contextlib.contextmanager
    def spinning(self, max_s: float, clock_mhz: int | None = None) -> Iterator[None]:
        """Spin while the ``with`` block runs (at most about ``max_s``)."""
        self.start(max_s, clock_mhz)
        try:
            yield
        finally:
            self.release()


@dataclass(frozen=True)
class BlockingPower:
    """Step 4's figures."""

    idle_power_w: float | None
    blocking_power_w_by_clock: dict[str, float]   # "<MHz>" -> W, spinning at that locked clock
    reached_mhz_by_clock: dict[str, int | None]   # the SM clock read back during each window
    uncertainty_w_by_clock: dict[str, float]
    windows: tuple[WindowEnergy, ...]

    @property
    def blocking_power_w(self) -> float | None:
        """At the highest clock measured."""
        if not self.blocking_power_w_by_clock:
            return None
        return self.blocking_power_w_by_clock[max(self.blocking_power_w_by_clock, key=int)]


def spin_clocks_mhz(supported_mhz: Sequence[int]) -> tuple[int, ...]:
    """Max, ~75 %, ~50 % and min of the supported clocks (the nearest supported, distinct, fastest first)."""
    clocks = sorted({int(c) for c in supported_mhz}, reverse=True)
    if not clocks:
        return ()
    top, low = clocks[0], clocks[-1]
    wanted = (top, 0.75 * top, 0.5 * top, low)
    picked = [min(clocks, key=lambda c, w=w: (abs(c - w), -c)) for w in wanted]
    return tuple(sorted(set(picked), reverse=True))


def measure_blocking_power(device: GpuDevice, guard: ClockGuard, clocks_mhz: Sequence[int],
                           spinning: Callable[[float, int], contextlib.AbstractContextManager[Any]], *,
                           counter_period_s: float, window_s: float, settle_s: float = SETTLE_S,
                           clock: Callable[[], float] = time.monotonic,
                           sleep: Callable[[float], None] = time.sleep,
                           left_s: Callable[[], float] | None = None) -> BlockingPower:
    """Blocking power per locked clock, and idle power unlocked (module docstring).

    ``spinning(max_s, clock_mhz)`` keeps the GPU spinning while its ``with`` block runs (on the
    simulated GPU: a no-op, the GPU draws its P2P power between units). A window lasts
    ``window_s`` plus its edges (up to two counter periods); clocks whose window would not fit
    in ``left_s()`` are left out. The clocks are reset after each window whatever happens."""
    max_s = window_s + 3 * counter_period_s + settle_s + 1.0  # the edges, the settle, a margin
    by_clock: dict[str, float] = {}
    reached: dict[str, int | None] = {}
    spread: dict[str, float] = {}
    windows: list[WindowEnergy] = []

    def wait() -> None:
        sleep(window_s)

    for f in clocks_mhz:
        if left_s is not None and left_s() < 2 * max_s:  # keep room for the idle window
            break
        if not guard.lock(device, int(f)):
            break  # the guard was released (SIGTERM): stop locking
        try:
            sleep(settle_s)
            with spinning(max_s, int(f)):
                w = measure_window(device, wait, counter_period_s=counter_period_s, clock=clock, sleep=sleep)
                seen = device.current_sm_clock_mhz()
        finally:
            guard.reset(device)
        windows.append(w)
        by_clock[str(int(f))] = w.power_w
        spread[str(int(f))] = w.uncertainty_j / w.time_s if w.time_s > 0 else 0.0
        reached[str(int(f))] = seen
    idle: float | None = None
    if left_s is None or left_s() >= max_s:
        sleep(settle_s)
        w = measure_window(device, wait, counter_period_s=counter_period_s, clock=clock, sleep=sleep)
        windows.append(w)
        idle = w.power_w
    return BlockingPower(idle, by_clock, reached, spread, tuple(windows))
