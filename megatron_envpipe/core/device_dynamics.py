"""How a simulated GPU departs from an ideal one: clock latency, a stepped energy counter, heat.

One frozen value, :class:`DeviceDynamics`, that the simulated GPU runs on and the planner,
the clock-lead rule and the energy measurement read. Every figure is in seconds of
*simulated* time (the profile's), whatever the simulation's wall-time scale.

* ``clock_latency_s``: from the lock request until the SMs run at the new clock (the
  request-to-clock delay; includes the call). Real GPUs: NVML calls take 10-20 ms (Zeus
  issue #29) and the SMs reach the clock some time after the call returns, depending on the
  target clock (Velička et al., arXiv 2502.20075). Until then the SMs keep the old clock.
* ``nvml_call_s``: the part of the latency the lock call itself occupies on the thread
  that makes it (our one clock worker per process): a second request arriving meanwhile
  starts only when the first call returned.
* ``counter_period_s``: the total-energy counter moves only every this many seconds
  (about 100 ms on A100: ml.energy, "Thermally stable profiling", 2026); 0 = exact at
  every read.
* ``power_average_s``: power readings are averages over this window (1 s on Ampere and
  later, Zeus #45); 0 = instantaneous.
* ``thermal_drift``: a cold GPU draws ``1 - thermal_drift`` times the profile's power
  (the profile is the hot, steady state), approaching it as ``1 - drift * exp(-t / tau)``
  with ``thermal_tau_s`` seconds since the device started (power rises as the GPU heats
  over minutes; a cold start reads lower: ml.energy, same post).
* ``blocking_power_w``: the power of a GPU waiting on P2P (spinning on a flag, as NCCL's
  receive does), measured by ``envpipe gpu-check`` step 4; when given, the simulated GPU
  charges it outside units instead of the GPU table's P2P power. None (the default) keeps
  the table's.

:data:`EXACT` is today's ideal GPU (what exactness tests use); :func:`load_dynamics` reads
a named preset (``configs/realistic-gpu.toml``) or a TOML file. Pure Python.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace
from pathlib import Path

from megatron_envpipe.core.clock_latency import ClockLatency
from megatron_envpipe.core.file_numbers import file_number, loads_toml, one_line, short
from megatron_envpipe.core.flag_ranges import FlagRange
from megatron_envpipe.core.textfile import read_text
from megatron_envpipe.errors import UsageError

__all__ = ["DeviceDynamics", "DeviceDynamicsError", "EXACT", "PRESETS", "load_dynamics"]

# Upper bounds: beyond them a figure is a unit mistake (ms given as s), not a GPU.
MAX_LATENCY_S = 1.0
_MAX_COUNTER_PERIOD_S = 5.0
_MAX_POWER_AVERAGE_S = 10.0
_MAX_THERMAL_DRIFT = 0.5
_MAX_THERMAL_TAU_S = 3600.0
_MAX_BLOCKING_POWER_W = 2000.0  # above any single GPU's board power

# Preset name -> file in configs/ (the key ``realistic`` in that file's [dynamics] table).
PRESETS = {"exact": None, "realistic": "realistic-gpu.toml"}


class DeviceDynamicsError(UsageError, ValueError):
    """Device dynamics that cannot be used (a figure out of range, an unknown preset or key)."""


_RANGES = {
    "clock_latency_s": (0.0, MAX_LATENCY_S),
    "nvml_call_s": (0.0, MAX_LATENCY_S),
    "counter_period_s": (0.0, _MAX_COUNTER_PERIOD_S),
    "power_average_s": (0.0, _MAX_POWER_AVERAGE_S),
    "thermal_drift": (0.0, _MAX_THERMAL_DRIFT),
    "thermal_tau_s": (0.0, _MAX_THERMAL_TAU_S),
}


@dataclass(frozen=True)
class DeviceDynamics:
    """The ways a simulated GPU departs from an ideal one (module docstring); all zero = exact."""

    clock_latency_s: float = 0.0
    nvml_call_s: float = 0.0
    counter_period_s: float = 0.0
    power_average_s: float = 0.0
    thermal_drift: float = 0.0
    thermal_tau_s: float = 60.0
    source: str = "exact: clock changes at once, exact energy counter, no heat"
    blocking_power_w: float | None = None  # None: the simulated GPU's own P2P power (the GPU table's)

    def __post_init__(self) -> None:
        # Compared before any conversion (an int of 400 digits does not fit a float); nan and inf fail it too.
        for name, (low, high) in _RANGES.items():
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or not low <= value <= high:
                raise DeviceDynamicsError(f"device dynamics ({short(self.source, 200)}): {name} must be a number in "
                                          f"[{low:g}, {high:g}], got {short(value)}")
            object.__setattr__(self, name, float(value))
        power = self.blocking_power_w
        if power is not None:
            if isinstance(power, bool) or not isinstance(power, int | float) \
                    or not 0.0 <= power <= _MAX_BLOCKING_POWER_W:
                raise DeviceDynamicsError(f"device dynamics ({short(self.source, 200)}): blocking_power_w must be a "
                                          f"number in [0, {_MAX_BLOCKING_POWER_W:g}] W, got {short(power)}")
            object.__setattr__(self, "blocking_power_w", float(power))
        if self.nvml_call_s > self.clock_latency_s:
            raise DeviceDynamicsError(
                f"device dynamics ({self.source}): nvml_call_s ({self.nvml_call_s:g} s) is part of clock_latency_s "
                f"({self.clock_latency_s:g} s) and cannot exceed it")
        if self.thermal_drift > 0 and self.thermal_tau_s <= 0:
            raise DeviceDynamicsError(f"device dynamics ({self.source}): thermal_drift needs thermal_tau_s > 0")
        if not isinstance(self.source, str) or not self.source.strip():
            raise DeviceDynamicsError("device dynamics need a source: where the figures come from")
        if not self.source.isprintable():  # it is printed in log and error lines: a newline would split (forge) one
            raise DeviceDynamicsError(f"device dynamics: source {short(self.source, 200)} must be one line of "
                                      "printable text")

    @property
    def exact(self) -> bool:
        """No departure from the ideal GPU at all."""
        return (self.clock_latency_s == self.counter_period_s == self.power_average_s == self.thermal_drift == 0.0)

    @property
    def clock_latency(self) -> ClockLatency:
        """The same delays as the planner prices them (call, then settle)."""
        return ClockLatency(call_s=self.nvml_call_s, settle_s=self.clock_latency_s - self.nvml_call_s,
                            source=self.source)

    def power_factor(self, elapsed_s: float) -> float:
        """Power relative to the profile's (hot) power, ``elapsed_s`` simulated seconds after a cold start."""
        if self.thermal_drift == 0.0:
            return 1.0
        return 1.0 - self.thermal_drift * math.exp(-max(0.0, elapsed_s) / self.thermal_tau_s)

    def with_overrides(self, **figures: float | None) -> DeviceDynamics:
        """These dynamics with the given figures replaced (``None`` keeps a figure); the source says so."""
        given = {k: v for k, v in figures.items() if v is not None}
        unknown = sorted(set(given) - set(_RANGES))
        if unknown:
            raise DeviceDynamicsError(f"device dynamics: unknown figure(s) {', '.join(unknown)} "
                                      f"(known: {', '.join(_RANGES)})")
        if not given:
            return self
        # A latency set below the preset's call time takes the call down with it.
        if "clock_latency_s" in given and "nvml_call_s" not in given:
            given["nvml_call_s"] = min(self.nvml_call_s, given["clock_latency_s"])
        note = ", ".join(f"{k}={v:g}" for k, v in sorted(given.items()))
        return replace(self, **given, source=f"{self.source}; set per run: {note}")


EXACT = DeviceDynamics()

# TOML keys (units in the name, as users write them) -> field and factor to seconds.
# Every key but ``blocking_power_w`` (and ``source``, which defaults to the file's name) must be given:
# a file lacking a figure would silently run with the exact GPU's.
_TOML_KEYS = {
    "clock_latency_ms": ("clock_latency_s", 1e-3),
    "nvml_call_ms": ("nvml_call_s", 1e-3),
    "counter_period_ms": ("counter_period_s", 1e-3),
    "power_average_ms": ("power_average_s", 1e-3),
    "thermal_drift": ("thermal_drift", 1.0),
    "thermal_tau_s": ("thermal_tau_s", 1.0),
    "blocking_power_w": ("blocking_power_w", 1.0),
    "source": ("source", None),
}


_OPTIONAL_TOML_KEYS = frozenset({"blocking_power_w", "source"})
# Each figure's range in the file's own unit, checked before it is converted (x 1e-3 overflows for 10**400).
_TOML_RANGES = {key: FlagRange("float", 0.0, (_RANGES[name][1] if name in _RANGES else _MAX_BLOCKING_POWER_W) / factor,
                               {"ms": "ms", "s": "s", "w": "W"}.get(key.rpartition("_")[2], ""))
                for key, (name, factor) in _TOML_KEYS.items() if factor is not None}


def _preset_path(configs: Path, name: str) -> Path | None:
    """The file a preset name stands for in ``configs`` (None for ``exact``)."""
    if name not in PRESETS:
        raise DeviceDynamicsError(f"unknown simulated-GPU dynamics preset {name!r}: use one of "
                                  f"{', '.join(PRESETS)} or a path to a TOML file with a [dynamics] table")
    file = PRESETS[name]
    return None if file is None else configs / file


def load_dynamics(spec: str, configs: Path) -> DeviceDynamics:
    """``exact``, ``realistic`` (a file in ``configs``) or a path to a TOML file whose ``[dynamics]``
    table gives the figures (keys ``clock_latency_ms``, ``nvml_call_ms``, ``counter_period_ms``,
    ``power_average_ms``, ``thermal_drift``, ``thermal_tau_s``, ``source``; optional ``blocking_power_w``)."""
    if spec in PRESETS:
        path = _preset_path(configs, spec)
        if path is None:
            return EXACT
    else:
        path = Path(spec)
        if not path.exists():
            raise DeviceDynamicsError(f"no preset or file {spec!r}: use one of {', '.join(PRESETS)} or the path "
                                      "of a TOML file with a [dynamics] table")
    data = loads_toml(read_text(path, "simulated-GPU dynamics file", DeviceDynamicsError), str(path),
                      DeviceDynamicsError, {f"dynamics.{k}": r for k, r in _TOML_RANGES.items()})
    table = data.get("dynamics")
    if not isinstance(table, dict):
        raise DeviceDynamicsError(f"{path}: needs a [dynamics] table (keys: {', '.join(_TOML_KEYS)})")
    others = sorted(one_line(k) for k in data if k != "dynamics")
    if others:  # a misspelt [dynamics] twin, or figures meant for it, would otherwise be ignored
        raise DeviceDynamicsError(f"{path}: unknown table or key(s) {', '.join(others)} next to [dynamics]: a "
                                  "dynamics file is one [dynamics] table; move the figures into it or remove them")
    unknown = sorted(one_line(k) for k in set(table) - set(_TOML_KEYS))
    if unknown:
        raise DeviceDynamicsError(f"{path}: unknown key(s) {', '.join(unknown)} in [dynamics] "
                                  f"(known: {', '.join(_TOML_KEYS)})")
    values: dict[str, object] = {"source": f"{path.name}"}
    for key, value in table.items():
        name, factor = _TOML_KEYS[key]
        if factor is None:
            if not isinstance(value, str) or not value.strip():
                raise DeviceDynamicsError(f"{path}: [dynamics] {key} = {short(value)}: give a text saying where "
                                          "the figures come from")
            values[name] = value
        else:
            values[name] = file_number(value, _TOML_RANGES[key], f"{path}: [dynamics] {key}",
                                       DeviceDynamicsError) * factor
    missing = [k for k in _TOML_KEYS if k not in table and k not in _OPTIONAL_TOML_KEYS]
    if missing:
        raise DeviceDynamicsError(f"{path}: [dynamics] lacks {', '.join(missing)}: every figure is needed (only "
                                  "blocking_power_w and source are optional), else the exact GPU's would run "
                                  "silently; start from configs/realistic-gpu.toml")
    known = {f.name for f in fields(DeviceDynamics)}
    try:
        return DeviceDynamics(**{k: v for k, v in values.items() if k in known})
    except DeviceDynamicsError as exc:
        raise DeviceDynamicsError(f"{path}: {exc}") from None
