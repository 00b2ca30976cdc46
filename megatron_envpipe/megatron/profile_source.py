"""Where the phase machine's profile comes from: the flag's, the cache's, the first stage's, or the sweep's.

:class:`ProfileSource` owns the profile the phase machine (megatron/runtime.py) plans from, its P2P power,
and the start-up clock sweep that measures one when none was given or cached
(:mod:`~megatron_envpipe.gpu.profiler.sweep`; the cache is megatron/profile_store.py's). It changes only
through its own methods (tests/test_run_state_ownership.py).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

from megatron_envpipe.config import EnvPipeConfig
from megatron_envpipe.config.groups import ProfilerSettings
from megatron_envpipe.core.gpu_specs import GpuSpec
from megatron_envpipe.core.profile import Profile
from megatron_envpipe.gpu.profiler.sweep import ClockSweep, startup_sweep
from megatron_envpipe.gpu.startup import DeviceFacts
from megatron_envpipe.megatron.profile_store import cached_profile, store_profile

__all__ = ["ProfileSource"]

log = logging.getLogger("megatron_envpipe")


class ProfileSource:
    """The profile and the sweep measuring it (module docstring)."""

    def __init__(self, profile: Profile | None) -> None:
        self.profile = profile  # --envpipe-profile's, until the cache, the first stage or the sweep give one
        self.p2p_power_w: float | None = None  # the profile's P2P-blocking power, where it measured one
        self.sweep: ClockSweep | None = None
        self.sweep_clock: int | None = None  # the clock of the sweep iteration handed out last

    @property
    def profiling(self) -> bool:
        return self.sweep is not None and not self.sweep.done

    def adopt(self, profile: Profile | None, p2p_power_w: float | None) -> None:
        """The profile (and its P2P power) the pipeline agreed on at set-up."""
        self.profile, self.p2p_power_w = profile, p2p_power_w

    def use_cached(self, config: EnvPipeConfig, cache_key: Mapping[str, Any] | None) -> None:
        """Without a profile: the cached one for this layout and device, if any."""
        if self.profile is None:
            cached = cached_profile(config.group(ProfilerSettings), cache_key)
            if cached is not None:
                self.profile, self.p2p_power_w = cached

    def sweep_for(self, config: EnvPipeConfig, gpu: GpuSpec | None, device: DeviceFacts) -> ClockSweep:
        """The start-up sweep over ``device``'s clocks, made (and logged) at the first call."""
        if self.sweep is None:
            step = config.profile_step_mhz or (gpu.profile_step_mhz if gpu else 90)
            refine = config.reconfig_step_mhz or (gpu.reconfig_step_mhz if gpu else 30)
            sweep = self.sweep = startup_sweep(device.clocks_mhz, step, refine, config.profile_iterations,
                                               config.p2p_power_w)
            candidates = sweep.candidates_mhz
            how = (f"{config.profile_iterations} iterations each until two agree, then one; then up to "
                   f"{sweep.refine_clocks} more near the valley, {refine} MHz apart"
                   if sweep.adaptive else f"{config.profile_iterations} iteration(s) each")
            log.info("EnvPipe profiler: sweeping %d clocks %s MHz, %s, from %s", len(candidates), list(candidates),
                     how, device.name)
        return self.sweep

    def next_clock(self) -> int:
        """The clock of the next sweep iteration (the sweep is under way)."""
        self.sweep_clock = self.sweep.next_clock()
        return self.sweep_clock

    def record(self, samples: Sequence[Any], config: EnvPipeConfig, cache_key: Mapping[str, Any] | None,
               device_name: str | None) -> None:
        """A sweep iteration's energy samples (every stage's); once the sweep is done, its profile (cached)."""
        sweep = self.sweep
        sweep.record(self.sweep_clock, samples)
        if not sweep.done:
            return
        if not sweep.results:  # no clock's energy was measured: plan without a profile
            log.warning("EnvPipe profiler: %s; planning without a profile", sweep.summary())
            return
        self.profile = sweep.profile()
        self.p2p_power_w = sweep.p2p_power_w()
        log.info("EnvPipe profiler: %s", sweep.summary())
        store_profile(config.group(ProfilerSettings), cache_key, self.profile, self.p2p_power_w, sweep, device_name)
