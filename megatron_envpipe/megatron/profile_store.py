"""The start-up profile's cache for the phase machine: look a profile up before profiling, store it after.

The cache itself is :class:`~megatron_envpipe.gpu.profiler.profile_cache.ProfileCache`; this module decides
which cache a run uses (``--envpipe-profile-cache``: off, a directory, or the default) and logs what it
reuses or stores. A cache that cannot be written never stops training.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from megatron_envpipe.config.groups import ProfilerSettings
from megatron_envpipe.core.profile import Profile
from megatron_envpipe.gpu.profiler.profile_cache import ProfileCache
from megatron_envpipe.gpu.profiler.sweep import ClockSweep

__all__ = ["cached_profile", "store_profile"]

log = logging.getLogger("megatron_envpipe")


def _cache(config: ProfilerSettings, key: Mapping[str, Any] | None) -> ProfileCache | None:
    if config.profile_cache == "off" or key is None:
        return None
    return ProfileCache(config.profile_cache) if config.profile_cache else ProfileCache()


def cached_profile(config: ProfilerSettings, key: Mapping[str, Any] | None) -> tuple[Profile, float | None] | None:
    """(the cached profile, its P2P power) for ``key``, or None (no cache, nothing cached)."""
    cache = _cache(config, key)
    if cache is None:
        return None
    profile = cache.load(key)
    if profile is None:
        return None
    meta = cache.meta(key) or {}
    log.info("EnvPipe profiler: reusing the cached profile %s", cache.describe(key))
    return profile, meta.get("p2p_power_w")


def store_profile(config: ProfilerSettings, key: Mapping[str, Any] | None, profile: Profile,
                  p2p_power_w: float | None, sweep: ClockSweep, device_name: str | None) -> None:
    """Cache the profile the sweep measured (logged; an unwritable cache is a warning)."""
    cache = _cache(config, key)
    if cache is None:
        return
    try:
        path = cache.store(key, profile, {
            "iterations_used": sweep.iterations_used,
            "p2p_power_w": p2p_power_w,
            "clocks_mhz": list(sweep.measured_clocks_mhz()),
            "stop_reason": sweep.stop_reason,
            "device": device_name,
        })
        log.info("EnvPipe profiler: profile cached at %s", path)
    except OSError as exc:  # a read-only home must not stop training
        log.warning("EnvPipe profiler: could not cache the profile: %s", exc)
