"""Clock changes off the training thread, in order, at unit boundaries.

EnvPipe changed the clock with a full ``torch.cuda.synchronize()`` on the
training thread followed by a fire-and-forget thread per change (no ordering
between two quick changes). :class:`ClockController` instead owns ONE
long-lived worker thread that takes requests from a FIFO queue:

* ``request(f, after=event)``: ``event`` is anything with ``.synchronize()``,
  normally a CUDA event recorded on the compute stream at the unit boundary.
  The worker waits for it (the training thread never synchronizes the device),
  then locks the clock through the :class:`~megatron_envpipe.gpu.control.safety.ClockGuard`.
* Requests are applied strictly in order; redundant ones (same as the last
  requested clock, or as the clock already locked) are skipped and counted.
* An error in the worker (permission lost, GPU lost, a failed event) is kept and
  re-raised in the training thread at the next ``request`` / ``flush`` /
  ``close``; later queued requests are dropped, never applied out of order.
* ``on_error="monitor"`` (what training uses): the first error instead switches
  the controller to *monitor-only* for good: the clocks are reset to the
  driver's default at once, one warning says so, and every later request is
  dropped without touching the GPU or raising; energy is still measured.
* ``close(reset=True)`` drains the queue, stops the worker and resets the clocks.
* :class:`DelayedEvent` is the ``after`` of a raise requested ahead of a unit
  boundary (the clock lead, :mod:`megatron_envpipe.core.clock_lead`): the worker
  waits for an event recorded when the unit before the boundary *begins*, then
  sleeps the lead's offset, so NVML is called ``latency`` before the boundary.

Pure Python: no torch import.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

from megatron_envpipe.errors import EnvPipeError, InvalidValueError
from megatron_envpipe.gpu.control.safety import REPAIR_HINT, ClockGuard, default_guard
from megatron_envpipe.gpu.devices.base import GpuDevice, GpuError

__all__ = ["ClockController", "DelayedEvent", "Synchronizable"]

log = logging.getLogger("megatron_envpipe")

_ON_ERROR = ("raise", "monitor")


class Synchronizable(Protocol):
    def synchronize(self) -> Any: ...


class DelayedEvent:
    """Done ``delay_s`` seconds after ``event`` (None: at once) is: ``synchronize()`` waits for both.

    The delay starts when the worker sees the event done: when it was busy with an earlier
    change meanwhile, the request comes that much later (never earlier than planned).
    """

    def __init__(self, event: Synchronizable | None, delay_s: float,
                 sleep: Callable[[float], None] = time.sleep) -> None:
        if not delay_s >= 0:
            raise ValueError(f"a clock request's delay must be a number of seconds >= 0, got {delay_s!r}")
        self.event = event
        self.delay_s = float(delay_s)
        self._sleep = sleep

    def synchronize(self) -> None:
        if self.event is not None:
            self.event.synchronize()
        if self.delay_s > 0:
            self._sleep(self.delay_s)

    def __repr__(self) -> str:
        return f"DelayedEvent({self.event!r}, delay_s={self.delay_s:g})"


class ClockController:
    """One worker thread applying ordered SM-clock requests to one device.

    Create it from the main thread (so the guard's SIGTERM/SIGINT handlers can be
    installed), one per process and device; use it as a context manager or call
    :meth:`close` in a ``finally``.
    """

    def __init__(self, device: GpuDevice, guard: ClockGuard | None = None, *,
                 drain_timeout_s: float = 60.0, name: str = "envpipe-clocks", on_error: str = "raise") -> None:
        if on_error not in _ON_ERROR:
            raise InvalidValueError(f"on_error must be one of {_ON_ERROR}, got {on_error!r}")
        self.device = device
        self.on_error = on_error
        self.monitor_only: str | None = None  # why clock control stopped (on_error="monitor")
        self.guard = guard if guard is not None else default_guard()
        self.guard.ensure_signal_handlers()  # main thread only; a no-op when already installed
        self.drain_timeout_s = drain_timeout_s
        self._queue: queue.SimpleQueue[tuple[int, Synchronizable | None] | None] = queue.SimpleQueue()
        self._cv = threading.Condition()
        self._apply_lock = threading.Lock()
        self._pending = 0
        self._last_requested: int | None = None
        self._error: BaseException | None = None
        self._error_reported = False
        self._closed = False
        self._stopping = False
        # counters, for reports
        self.requested = 0        # calls to request()
        self.applied = 0          # clock changes made through NVML (or the backend)
        self.skipped = 0          # redundant requests: at request time or found already in place
        self.dropped = 0          # queued after an error, or left over at a timed-out close
        self.refused = 0          # the guard was released (termination signal, exit)
        self.set_seconds = 0.0    # time spent in the backend's set call
        self.wait_seconds = 0.0   # time the worker waited for `after` events
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    # -- training-thread API ------------------------------------------------------

    def request(self, freq_mhz: int, after: Synchronizable | None = None) -> bool:
        """Queue a change to ``freq_mhz``, applied once ``after.synchronize()`` returns.

        Returns False when the request was redundant and dropped, or the
        controller is monitor-only. Raises a stored worker error (once as
        raised, then as a :class:`GpuError`) unless ``on_error="monitor"``.
        """
        self._raise_error()
        if self._closed:
            raise GpuError("clock controller is closed")
        if self.monitor_only is not None:
            self.dropped += 1
            return False
        f = int(freq_mhz)
        with self._cv:
            self.requested += 1
            if self._pending > 0:
                redundant = f == self._last_requested
            else:
                redundant = self.device.locked_clock_mhz() == f
            if redundant:
                self.skipped += 1
                return False
            self._last_requested = f
            self._pending += 1
        self._queue.put((f, after))
        return True

    def flush(self, timeout: float | None = None) -> None:
        """Wait until every queued request was applied (or dropped); re-raise a worker error."""
        with self._cv:
            done = self._cv.wait_for(lambda: self._pending == 0, timeout)
        if not done:
            raise GpuError(f"clock changes still pending after {timeout} s (an `after` event that never completes?)")
        self._raise_error()

    def fall_back(self, cause: BaseException | str) -> None:
        """Switch to monitor-only for good: no more clock changes, the clocks reset to the
        driver's default now (the guard still resets at exit if this fails), one warning."""
        with self._apply_lock:
            if self.monitor_only is not None:
                return
            self.monitor_only = str(cause) or repr(cause)
            try:
                self.guard.reset(self.device)
                now = "clocks reset to the driver's default"
            except (EnvPipeError, OSError, RuntimeError) as exc:
                now = f"resetting the clocks failed too ({exc}; {REPAIR_HINT})"
        log.warning("EnvPipe: clock control on %s failed (%s): continuing monitor-only, %s; energy is "
                    "still measured", self.device.info().label(), self.monitor_only, now)

    def close(self, reset: bool = True) -> None:
        """Drain, stop the worker, reset the clocks (``reset``); idempotent.

        The reset happens even when the worker failed; its error is raised
        afterwards unless it was already raised in the training thread (or
        reported by the monitor-only warning).
        """
        if self._closed:
            return
        self._closed = True
        with self._cv:
            self._cv.wait_for(lambda: self._pending == 0, self.drain_timeout_s)
        with self._apply_lock:
            self._stopping = True  # anything still in flight is dropped, never applied after the reset
        self._queue.put(None)
        self._thread.join(timeout=self.drain_timeout_s)
        if reset:
            self.guard.reset(self.device)
        if self._error is not None and not self._error_reported:
            self._raise_error()

    def __enter__(self) -> "ClockController":
        return self

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> None:
        if exc is None:
            self.close()
            return
        try:
            self.close()
        except BaseException as second:  # do not hide the original exception
            exc.add_note(f"also, closing the clock controller failed: {second!r}")

    @property
    def pending(self) -> int:
        return self._pending

    @property
    def error(self) -> BaseException | None:
        return self._error

    @property
    def worker_alive(self) -> bool:
        """Whether the worker thread still runs (False once :meth:`close` returned)."""
        return self._thread.is_alive()

    def stats(self) -> dict[str, Any]:
        return {
            "requested": self.requested,
            "applied": self.applied,
            "skipped": self.skipped,
            "dropped": self.dropped,
            "refused": self.refused,
            "set_seconds": self.set_seconds,
            "wait_seconds": self.wait_seconds,
            "mean_set_ms": 1000.0 * self.set_seconds / self.applied if self.applied else 0.0,
        }

    def __repr__(self) -> str:
        return (f"ClockController({self.device!r}, applied={self.applied}, skipped={self.skipped}, "
                f"pending={self._pending})")

    # -- internals ----------------------------------------------------------------

    def _raise_error(self) -> None:
        err = self._error
        if err is None or self.on_error == "monitor":
            return
        if not self._error_reported:
            self._error_reported = True
            raise err
        raise GpuError(f"clock controller stopped after an earlier error: {err}") from err

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            freq, after = item
            try:
                if self._error is not None or self._stopping or self.monitor_only is not None:
                    self.dropped += 1
                    continue
                if after is not None:
                    t0 = time.perf_counter()
                    after.synchronize()
                    self.wait_seconds += time.perf_counter() - t0
                with self._apply_lock:
                    if self._stopping or self.monitor_only is not None:  # never re-lock after a fall-back
                        self.dropped += 1
                    elif self.device.locked_clock_mhz() == freq:
                        self.skipped += 1
                    else:
                        t0 = time.perf_counter()
                        locked = self.guard.lock(self.device, freq)
                        self.set_seconds += time.perf_counter() - t0
                        if locked:
                            self.applied += 1
                        else:
                            self.refused += 1
            except BaseException as exc:  # kept and re-raised in the training thread
                if self._error is None:
                    self._error = exc
                    if self.on_error == "monitor":
                        self.fall_back(exc)
            finally:
                with self._cv:
                    self._pending -= 1
                    self._cv.notify_all()
