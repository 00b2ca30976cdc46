"""A rank's GPU at the first iteration: may it lock clocks, and what the pipeline agrees on.

Whether a rank may lock clocks is proven by trying (:func:`clock_control`, with
:func:`~megatron_envpipe.gpu.control.clock_proof.prove_clock_control`): a refused lock takes
the no-permission path (``--envpipe-on-no-permission``: stop, or measure only); a
lock accepted but not reached makes the rank monitor-only, with the reason logged once.
A rank without clock control says so once, in one line: what EnvPipe still does there
(Megatron's own order; energy where the GPU has a counter) and what to ask an administrator for.

Every rank of a pipeline opens its own device, describes it as a
:class:`StageDevice`, and the executor gathers those over the pipeline;
:func:`combine_stage_devices` turns them into the :class:`DeviceFacts` every
stage plans with (identical everywhere, because every rank combines the same
list). Pure Python: the gathering itself is the executor's.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from megatron_envpipe.gpu.control.clock_proof import ClockProof, ProofOutcome, prove_clock_control
from megatron_envpipe.gpu.control.safety import ClockGuard, default_guard
from megatron_envpipe.gpu.devices.base import PERMISSION_HINT, GpuDevice, GpuPermissionError
from megatron_envpipe.gpu.devices.simulated import SimulatedGpu

__all__ = ["HOOKS_BACKEND", "ClockDecision", "DeviceFacts", "StageDevice", "clock_control",
           "combine_stage_devices"]

log = logging.getLogger("megatron_envpipe")

# The backend of a rank whose hooks were given to install(): the hooks apply the clocks, not EnvPipe.
HOOKS_BACKEND = "hooks"
# What a rank without clock control asks for. Locked clocks (nvmlDeviceSetGpuLockedClocks) need root or
# CAP_SYS_ADMIN whatever `nvidia-smi -acp` says: that unrestricts only application clocks.
_NO_CONTROL_ADVICE = ("to save energy, ask an administrator to run the job as root or with CAP_SYS_ADMIN "
                     "(containers: --cap-add SYS_ADMIN), which locking GPU clocks needs (README: Not root?)")


@dataclass(frozen=True)
class ClockDecision:
    """Whether this rank locks clocks, and why not where it was tried and not reached."""

    control: bool  # this rank will lock clocks
    lost: str | None = None  # accepted but not reached: why this rank is monitor-only
    proof: ClockProof | None = None  # the trial lock (None: none was tried)


def clock_control(device: GpuDevice, sets_clocks: bool, on_no_permission: str, stage: int,
                  guard: ClockGuard | None = None, *, load: Callable[[float], None] | None = None) -> ClockDecision:
    """Whether this rank will lock clocks, proven by one trial lock (see the module docstring);
    fails fast when the lock is refused (unless ``on_no_permission`` is ``monitor``).

    Only plans that lower clocks need control (``sets_clocks``: the plan type's capability,
    core/kinds.py): ``baseline`` runs at the driver's default clocks, needs no privilege and tries nothing.
    """
    info = device.info()
    if not sets_clocks:
        return ClockDecision(False)
    if not device.capabilities().can_lock_clocks:
        log.warning("EnvPipe stage %d: no GPU clock control (%s): EnvPipe runs Megatron's own order and nothing "
                    "else (no extra warm-up, no clock plan, no energy counter to read); to save energy, train on "
                    "GPUs whose clocks this job may lock", stage, info.name)
        return ClockDecision(False)
    # Wait for the lock on the device's own time: a simulated GPU in virtual time moves only when slept on.
    timebase: dict[str, Callable] = {}
    if isinstance(device, SimulatedGpu):
        timebase["clock"], timebase["sleep"] = device.timebase
    proof = prove_clock_control(device, guard if guard is not None else default_guard(), load=load, **timebase)
    if proof.outcome == ProofOutcome.NOT_REACHED:
        # Logged once, by the hooks' clock controller falling back (GpuHooks(lost=...)).
        return ClockDecision(False, lost=f"clock check at start-up: {proof.message}", proof=proof)
    if proof.control:
        log.info("EnvPipe stage %d: clock control on %s: %s", stage, info.label(), proof.message)
        return ClockDecision(True, proof=proof)
    if on_no_permission == "fail":
        raise GpuPermissionError(f"EnvPipe stage {stage}: {info.label()}: {proof.message}; {PERMISSION_HINT}")
    log.warning("EnvPipe stage %d: cannot lock clocks on %s (%s): measuring energy only, per iteration, in "
                "Megatron's own order (no extra warm-up, no clock plan; --envpipe-on-no-permission monitor); %s",
                stage, info.label(), proof.message, _NO_CONTROL_ADVICE)
    return ClockDecision(False, proof=proof)


@dataclass(frozen=True)
class StageDevice:
    """One rank's device as it reports it to the rest of the pipeline."""

    backend: str  # nvml | simulated | none | hooks (given to install(): they apply the clocks)
    name: str
    driver_version: str
    clocks_mhz: tuple[int, ...]  # supported SM clocks
    control: bool  # this rank will lock clocks
    energy: bool  # this rank measures energy
    modelled: bool = False  # a model of a GPU (DeviceCapabilities.modelled): its figures are labelled simulated
    time_scale: float = 1.0  # clock seconds per device second (a simulated GPU in scaled wall time)

    @classmethod
    def of(cls, device: GpuDevice, control: bool) -> "StageDevice":
        info = device.info()
        caps = device.capabilities()
        return cls(backend=device.backend, name=info.name, driver_version=info.driver_version,
                   clocks_mhz=tuple(device.supported_clocks_mhz()), control=control,
                   energy=caps.energy_scope != "none", modelled=caps.modelled,
                   time_scale=float(getattr(device, "time_scale", 1.0)))

    @classmethod
    def absent(cls) -> "StageDevice":
        """A rank whose hooks were given to ``install()``: it drives no device of its own."""
        return cls(backend=HOOKS_BACKEND, name="hooks given to install()", driver_version="", clocks_mhz=(),
                   control=False, energy=False)


@dataclass(frozen=True)
class DeviceFacts:
    """What the executor learned about the pipeline's GPUs at the first iteration."""

    backend: str  # nvml | simulated | none | hooks (the first stage's)
    name: str
    driver_version: str
    clocks_mhz: tuple[int, ...]  # supported by every stage, fastest first
    control: bool  # clocks can be locked on every stage
    energy: bool  # energy is measured
    modelled: bool = False  # any stage is a model of a GPU: figures are labelled simulated
    # Clock seconds per device second: measured times are divided by it (1 but for a simulated
    # GPU in scaled wall time, --envpipe-sim-time wall).
    time_scale: float = 1.0


def combine_stage_devices(everyone: Sequence[StageDevice]) -> DeviceFacts:
    """The pipeline's facts: the first stage's identity, the clocks every stage supports,
    control and energy only where every stage has them, simulated if any stage is."""
    if not everyone:
        raise ValueError("combine_stage_devices needs at least one stage")
    first = everyone[0]
    common = set(first.clocks_mhz)
    for other in everyone[1:]:
        common &= set(other.clocks_mhz)
    return DeviceFacts(
        backend=first.backend, name=first.name, driver_version=first.driver_version,
        clocks_mhz=tuple(sorted(common, reverse=True)),
        control=all(e.control for e in everyone) and bool(common),
        energy=all(e.energy for e in everyone), modelled=any(e.modelled for e in everyone),
        time_scale=first.time_scale,
    )
