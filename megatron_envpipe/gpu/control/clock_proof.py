"""Clock control proven by trying: lock one clock, read it back, reset.

Capability bits (root, ``CAP_SYS_ADMIN``) say whether the driver *should* let this
process lock clocks; they are no proof. Virtual machines and cloud images refuse
locks even to root, and a lock can be accepted while the SMs run at another clock
(power or thermal capping; on Blackwell the locked minimum has no guarantee,
open-gpu-kernel-modules #1314). So before anything relies on clock control (the
start-up profiler, a plan that lowers clocks, the bench scripts),
:func:`prove_clock_control` locks one supported clock through the
:class:`~megatron_envpipe.gpu.control.safety.ClockGuard` (state file first, reset
guaranteed), reads the SM clock back a few times within a short bounded wait (a
real GPU needs some milliseconds to get there), reads the clock-event reasons,
and resets. Its :class:`ClockProof` says:

* ``ok``: the SMs reached the lock (within one clock step);
* ``unverified``: the lock was accepted but the backend cannot read the clock
  back, or the GPU was idle (an idle GPU's clock says nothing about the lock);
  clock control is trusted, as before this check existed;
* ``refused``: the driver said no (no permission, not supported);
* ``not_reached``: accepted, but the SMs run more than one clock step away.

Pure Python: :func:`cuda_spin_load` imports torch only when called.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import StrEnum

from megatron_envpipe.gpu.control.safety import ClockGuard
from megatron_envpipe.gpu.devices.base import (
    PERMISSION_HINT,
    GpuDevice,
    GpuError,
    GpuNotSupportedError,
    GpuPermissionError,
)

__all__ = ["ClockProof", "ProofOutcome", "clock_step_mhz", "cuda_spin_load", "prove_clock_control"]

# Plans lower clocks to roughly half to 90 % of the maximum: prove one in that range.
_PROBE_FRACTION = 0.6
# Long enough for a real GPU to settle on a locked clock (milliseconds; Velicka et al.,
# arXiv 2502.20075), short enough to cost nothing at start-up.
SETTLE_S = 0.25
POLL_S = 0.01
_SPIN_MHZ = 2000


class ProofOutcome(StrEnum):
    OK = "ok"
    UNVERIFIED = "unverified"
    REFUSED = "refused"
    NOT_REACHED = "not_reached"


@dataclass(frozen=True)
class ClockProof:
    """What one trial lock showed (see the module docstring for the outcomes)."""

    outcome: ProofOutcome
    requested_mhz: int | None  # the clock locked for the trial (None: nothing to try)
    readback_mhz: int | None  # the SM clock read last while locked (None: not readable)
    default_mhz: int | None  # the SM clock read before the lock
    tolerance_mhz: int  # one clock step: how far the read-back may be off
    reasons: tuple[str, ...] | None  # clock-event reasons while locked (None: not readable)
    wait_s: float  # from the lock until the last read-back
    message: str  # one line for logs and errors

    @property
    def control(self) -> bool:
        """Whether clocks may be planned and locked on this device."""
        return self.outcome in (ProofOutcome.OK, ProofOutcome.UNVERIFIED)


def clock_step_mhz(clocks: Sequence[int], near_mhz: int) -> int:
    """The gap between ``near_mhz`` and its nearest other supported clock (>= 1 MHz)."""
    gaps = [abs(c - near_mhz) for c in clocks if c != near_mhz]
    return max(1, min(gaps)) if gaps else 1


def _probe_clock_mhz(clocks: Sequence[int], default_mhz: int | None = None) -> int:
    """The clock to try: the supported one nearest 60 % of the maximum, other than the
    maximum, the minimum and the clock the GPU runs at now, where the list allows."""
    ordered = sorted({int(c) for c in clocks}, reverse=True)
    if not ordered:
        raise GpuError("no supported clocks to try a lock with")
    inner = ordered[1:-1] or ordered
    distinct = [c for c in inner if default_mhz is None or abs(c - default_mhz) > clock_step_mhz(ordered, c)]
    target = ordered[0] * _PROBE_FRACTION
    return min(distinct or inner, key=lambda c: (abs(c - target), c))


def _read_clock(device: GpuDevice) -> int | None:
    try:
        return device.current_sm_clock_mhz()
    except GpuError:  # a read that fails is a read we do not have
        return None


def _read_reasons(device: GpuDevice) -> tuple[str, ...] | None:
    try:
        return device.clock_event_reasons()
    except GpuError:
        return None


def _refusal(device: GpuDevice, freq_mhz: int, exc: BaseException) -> str:
    text = str(exc).replace(f"; {PERMISSION_HINT}", "").replace(f" {PERMISSION_HINT}", "")
    if device.can_set_clocks():
        why = device.permission_reason()
        has = f" although this process has {why}" if why else ""
        return (f"the lock to {freq_mhz} MHz was refused{has} (a VM, a cloud image or the driver forbids "
                f"clock changes): {text}")
    return f"the lock to {freq_mhz} MHz was refused ({device.permission_reason() or 'no permission'}): {text}"


def prove_clock_control(device: GpuDevice, guard: ClockGuard, *, freq_mhz: int | None = None,
                        load: Callable[[float], None] | None = None, settle_s: float = SETTLE_S,
                        poll_s: float = POLL_S, clock: Callable[[], float] = time.monotonic,
                        sleep: Callable[[float], None] = time.sleep) -> ClockProof:
    """Lock one clock through ``guard``, read it back within ``settle_s``, reset.

    ``load(seconds)`` (optional) keeps the GPU busy while the clock is read (an idle
    GPU may park its clock whatever is locked; :func:`cuda_spin_load` on CUDA).
    Errors other than a refusal (e.g. an unwritable state folder) propagate, unless
    the capability bits already say the process may not lock clocks.
    """
    clocks = device.supported_clocks_mhz()
    default = _read_clock(device)
    f = int(freq_mhz) if freq_mhz is not None else _probe_clock_mhz(clocks, default)
    tolerance = clock_step_mhz(clocks, f)

    def proof(outcome: ProofOutcome, message: str, seen: int | None = None,
              reasons: tuple[str, ...] | None = None, wait_s: float = 0.0) -> ClockProof:
        return ClockProof(outcome, f, seen, default, tolerance, reasons, wait_s, message)

    try:
        locked = guard.lock(device, f)
    except (GpuPermissionError, GpuNotSupportedError) as exc:
        return proof(ProofOutcome.REFUSED, _refusal(device, f, exc))
    except GpuError as exc:
        if device.can_set_clocks():
            raise
        return proof(ProofOutcome.REFUSED, _refusal(device, f, exc))
    if not locked:
        return proof(ProofOutcome.REFUSED, f"clock locking is switched off in this process ({guard.released})")
    try:
        start = clock()
        if load is not None:
            load(settle_s)
        reads_left = math.ceil(settle_s / poll_s) + 1  # bounded even if the clock stood still
        while True:
            seen = _read_clock(device)
            waited = clock() - start
            reads_left -= 1
            if seen is None or abs(seen - f) <= tolerance or waited >= settle_s or reads_left <= 0:
                break
            sleep(poll_s)
        reasons = _read_reasons(device)
    finally:
        guard.reset(device)
    said = f"clock-event reasons: {', '.join(reasons) if reasons else 'none reported'}"
    if seen is None:
        return proof(ProofOutcome.UNVERIFIED, f"locked {f} MHz; the SM clock cannot be read back, so the lock "
                     "is trusted unverified", None, reasons, waited)
    if abs(seen - f) <= tolerance:
        return proof(ProofOutcome.OK, f"locked {f} MHz and the SMs ran at {seen} MHz within {1000 * waited:.0f} "
                     "ms; clocks reset", seen, reasons, waited)
    if load is None and reasons is not None and "gpu_idle" in reasons:
        return proof(ProofOutcome.UNVERIFIED, f"locked {f} MHz but the idle GPU reads {seen} MHz ({said}): "
                     "trusted unverified", seen, reasons, waited)
    return proof(ProofOutcome.NOT_REACHED, f"locked {f} MHz, accepted, but the SMs ran at {seen} MHz after "
                 f"{1000 * waited:.0f} ms (more than one clock step, {tolerance} MHz, off; {said})",
                 seen, reasons, waited)


def cuda_spin_load() -> Callable[[float], None]:
    """A ``load`` for :func:`prove_clock_control` on CUDA: one spin kernel on the current stream
    (no memory, nothing to wait for), counted in cycles at a clock above any current GPU's
    maximum, so it runs at least the seconds asked for at whatever clock is locked."""

    def spin(seconds: float) -> None:
        import torch  # CUDA runs only: this layer imports without torch

        torch.cuda._sleep(int(seconds * _SPIN_MHZ * 1e6))

    return spin
