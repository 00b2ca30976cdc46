"""The GPU clock table (``configs/gpus.toml``): clock ranges, steps, P2P power.

Loaded and validated here so a bad table fails at start-up naming the key and
file. Pure Python (``tomllib``), no NVML: the runtime NVML backend refines the
candidate list with the device's own supported clocks. A GPU whose P2P
blocking power nobody has published a measurement of says ``"unknown"``:
:meth:`GpuSpec.known_p2p_power_w` then raises instead of planning with 0 W.
"""

from __future__ import annotations

import math
import os
import tomllib
from collections.abc import Iterable
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from megatron_envpipe.core.clock_latency import DEFAULT_CLOCK_LATENCY, MAX_CLOCK_LATENCY_S, ClockLatency
from megatron_envpipe.core.resources import configs_dir, shipped_profiles
from megatron_envpipe.core.textfile import read_text
from megatron_envpipe.errors import UsageError


class GpuSpecError(UsageError, ValueError):
    """A missing GPU entry or an invalid clock table."""


class P2PPowerUnknownError(GpuSpecError):
    """The table has no P2P blocking power for this GPU, and none was given."""


# What the table says where no P2P blocking power has been measured and published.
_P2P_UNKNOWN = "unknown"


@dataclass(frozen=True)
class GpuSpec:
    key: str
    nvml_names: tuple[str, ...]
    max_clock_mhz: int | None  # None: "unknown" in the table (unpublished: NVML's list decides, gpu-check reads it)
    min_clock_mhz: int | None
    clock_step_mhz: float
    profile_step_mhz: int
    reconfig_step_mhz: int
    p2p_power_w: float | None  # None: "unknown" in the table
    sources: tuple[str, ...]
    # The table's clock_call_ms / clock_settle_ms / clock_latency_source, else DEFAULT_CLOCK_LATENCY.
    clock_latency: ClockLatency = DEFAULT_CLOCK_LATENCY

    def known_p2p_power_w(self) -> float:
        """P2P blocking power from the table; P2PPowerUnknownError where it is unknown.

        Planning with 0 W would score idle time as free and favour slow clocks
        wrongly, so a caller without a value of its own must not go on.
        """
        if self.p2p_power_w is None:
            raise P2PPowerUnknownError(
                f"P2P blocking power of {self.key.upper()} is unknown (configs/gpus.toml has no published "
                "measurement): give --p2p-power W (--envpipe-p2p-power W in training; measure it with Zeus's "
                "examples/pipeline_frequency_optimizer/profile_p2p.py) or let the start-up profiler measure it "
                "(train without --envpipe-profile)"
            )
        return self.p2p_power_w

    def on_ladder(self, clocks_mhz: Iterable[int]) -> bool:
        """Whether any of ``clocks_mhz`` is on this GPU's clock grid (always, where its range is unknown: a
        profile measured on it then says which clocks it has)."""
        if self.max_clock_mhz is None or self.min_clock_mhz is None:
            return True
        return bool(set(clocks_mhz) & set(self.candidate_clocks()))

    def candidate_clocks(self, available_mhz: Iterable[int] | None = None) -> tuple[int, ...]:
        """Clocks the planner may use, fastest first; the true maximum is always first.

        With ``available_mhz`` (a profile's or NVML's list) it is those inside
        [min, max]; without, the table's grid ``max - k*clock_step``.
        """
        if available_mhz is None:
            if self.max_clock_mhz is None or self.min_clock_mhz is None:
                raise GpuSpecError(f"{self.key}'s clock range is unknown until `envpipe gpu-check` reads it from the "
                                   "GPU (configs/gpus.toml): plan from a profile, whose clocks are then used")
            grid = []
            k = 0
            while True:
                f = int(round(self.max_clock_mhz - k * self.clock_step_mhz))
                if f < self.min_clock_mhz:
                    break
                grid.append(f)
                k += 1
            return tuple(grid)
        low = self.min_clock_mhz if self.min_clock_mhz is not None else 0
        high = self.max_clock_mhz if self.max_clock_mhz is not None else math.inf
        clocks = sorted({int(f) for f in available_mhz if low <= f <= high}, reverse=True)
        if not clocks:
            raise GpuSpecError(
                f"none of the available clocks lies in {self.key}'s range "
                f"{self.min_clock_mhz}..{self.max_clock_mhz} MHz: is --gpu right for this profile?"
            )
        return tuple(clocks)


_FIELDS = {
    "nvml_names": list,
    "max_clock_mhz": (int, str),  # a string only as UNKNOWN
    "min_clock_mhz": (int, str),
    "clock_step_mhz": (int, float),
    "profile_step_mhz": (int,),
    "reconfig_step_mhz": (int,),
    "p2p_power_w": (int, float, str),  # a string only as _P2P_UNKNOWN
    "sources": list,
}
# Optional: a GPU's own clock-change latency (core/clock_latency.py), all three or none.
_LATENCY_FIELDS = ("clock_call_ms", "clock_settle_ms", "clock_latency_source")


# Beyond these a number is a unit mistake or garbage; a clock step this fine would also make
# candidate_clocks() list millions of clocks.
MAX_CLOCK_MHZ = 100_000
MAX_CLOCKS = 100_000
MAX_P2P_POWER_W = 10_000.0


def default_table_path() -> Path:
    """``configs/gpus.toml``: shipped as package data, or the repo's configs/ in a checkout."""
    env = os.environ.get("ENVPIPE_GPU_TABLE")
    if env:
        return Path(env)
    try:
        return configs_dir() / "gpus.toml"
    except FileNotFoundError as exc:
        raise GpuSpecError(f"{exc}, or set ENVPIPE_GPU_TABLE") from None


def load_gpu_table(path: str | os.PathLike[str] | None = None) -> dict[str, GpuSpec]:
    if path is not None or not os.environ.get("ENVPIPE_GPU_TABLE"):
        return dict(_load(str(Path(path) if path is not None else default_table_path())))
    try:
        return dict(_load(str(default_table_path())))
    except GpuSpecError as exc:  # say where the path came from, so the user knows what to fix
        raise GpuSpecError(f"{exc} (the table named by ENVPIPE_GPU_TABLE: fix it or unset the variable)") from None


@lru_cache(maxsize=8)
def _load(path: str) -> tuple[tuple[str, GpuSpec], ...]:
    text = read_text(path, "GPU table", GpuSpecError)
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise GpuSpecError(f"{path}: not valid TOML: {exc}") from None
    specs = []
    owners: dict[str, str] = {}  # NVML name -> the entry naming it: a device must match one entry only
    for key, entry in data.items():
        if not isinstance(entry, dict):
            raise GpuSpecError(f"{path}: [{key}] must be a table of clock settings")
        if key != key.lower():  # get_gpu_spec() looks names up in lower case
            raise GpuSpecError(f"{path}: [{key}]: GPU names are lower case; rename it [{key.lower()}]")
        for name, types in _FIELDS.items():
            if name not in entry:
                raise GpuSpecError(f"{path}: [{key}] lacks {name}; every entry needs {', '.join(_FIELDS)}")
            value = entry[name]
            if isinstance(value, bool) or not isinstance(value, types if isinstance(types, tuple) else (types,)):
                want = {list: "a list of strings", (int,): "an integer", (int, str): f'an integer or "{_P2P_UNKNOWN}"',
                        (int, float, str): f'a number (W) or "{_P2P_UNKNOWN}"'}.get(types, "a number")
                raise GpuSpecError(f"{path}: [{key}] {name} = {value!r} has the wrong type: give {want}")
            if isinstance(value, float) and not math.isfinite(value):  # TOML has nan and inf
                raise GpuSpecError(f"{path}: [{key}] {name} = {value!r} must be a finite number")
            if types is list and not all(isinstance(item, str) for item in value):
                raise GpuSpecError(f"{path}: [{key}] {name} must be a list of strings")
        unknown = set(entry) - set(_FIELDS) - set(_LATENCY_FIELDS)
        if unknown:
            raise GpuSpecError(f"{path}: [{key}] has unknown key(s) {sorted(unknown)}")
        _check_nvml_names(path, key, entry["nvml_names"], owners)
        high, low = (_clock_or_unknown(path, key, name, entry[name]) for name in ("max_clock_mhz", "min_clock_mhz"))
        if high is not None and low is not None and not 0 < low < high:
            raise GpuSpecError(f"{path}: [{key}] needs 0 < min_clock_mhz < max_clock_mhz <= {MAX_CLOCK_MHZ}, got "
                               f"{low} and {high}")
        for name in ("clock_step_mhz", "profile_step_mhz", "reconfig_step_mhz"):
            if entry[name] <= 0:
                raise GpuSpecError(f"{path}: [{key}] {name} must be positive")
            if entry[name] > (high if high is not None else MAX_CLOCK_MHZ):
                raise GpuSpecError(f"{path}: [{key}] {name} = {entry[name]} is above max_clock_mhz")
        if high is not None and low is not None and (high - low) / entry["clock_step_mhz"] > MAX_CLOCKS:
            raise GpuSpecError(f"{path}: [{key}] clock_step_mhz = {entry['clock_step_mhz']} gives over {MAX_CLOCKS} "
                               "clocks: give NVML's clock spacing in MHz (e.g. 15)")
        p2p = entry["p2p_power_w"]
        if isinstance(p2p, str):
            if p2p != _P2P_UNKNOWN:
                raise GpuSpecError(f'{path}: [{key}] p2p_power_w = "{p2p}": give a number (W) or "{_P2P_UNKNOWN}"')
            p2p = None
        elif not 0 < p2p <= MAX_P2P_POWER_W:  # 0 W is no measurement: write "unknown"
            raise GpuSpecError(f"{path}: [{key}] p2p_power_w must be between 0 and {MAX_P2P_POWER_W:g} W, "
                               f'got {p2p} (write "{_P2P_UNKNOWN}" where it has not been measured)')
        specs.append(
            (
                key,
                GpuSpec(
                    key=key,
                    nvml_names=tuple(entry["nvml_names"]),
                    max_clock_mhz=high,
                    min_clock_mhz=low,
                    clock_step_mhz=float(entry["clock_step_mhz"]),
                    profile_step_mhz=entry["profile_step_mhz"],
                    reconfig_step_mhz=entry["reconfig_step_mhz"],
                    p2p_power_w=float(p2p) if p2p is not None else None,
                    sources=tuple(entry["sources"]),
                    clock_latency=_clock_latency(path, key, entry),
                ),
            )
        )
    if not specs:
        raise GpuSpecError(f"{path}: GPU table is empty")
    return tuple(specs)


def _clock_or_unknown(path: str, key: str, name: str, value: int | str) -> int | None:
    """A clock of the table: an integer in (0, MAX_CLOCK_MHZ], or "unknown" (None: not published)."""
    if isinstance(value, str):
        if value != _P2P_UNKNOWN:
            raise GpuSpecError(f'{path}: [{key}] {name} = {value!r} has the wrong type: give an integer (MHz) or '
                               f'"{_P2P_UNKNOWN}"')
        return None
    if not 0 < value <= MAX_CLOCK_MHZ:
        raise GpuSpecError(f"{path}: [{key}] needs 0 < min_clock_mhz < max_clock_mhz <= {MAX_CLOCK_MHZ}: {name} = "
                           f"{value} (MHz)")
    return value


def _clock_latency(path: str, key: str, entry: dict) -> ClockLatency:
    """The entry's clock-change latency: its three optional keys (all or none), else the default."""
    given = [name for name in _LATENCY_FIELDS if name in entry]
    if not given:
        return DEFAULT_CLOCK_LATENCY
    if len(given) != len(_LATENCY_FIELDS):
        missing = [name for name in _LATENCY_FIELDS if name not in entry]
        raise GpuSpecError(f"{path}: [{key}] gives {', '.join(given)} but not {', '.join(missing)}: a clock "
                           f"latency needs all of {', '.join(_LATENCY_FIELDS)} (or none: the default)")
    limit_ms = 1000 * MAX_CLOCK_LATENCY_S
    for name in ("clock_call_ms", "clock_settle_ms"):
        value = entry[name]
        if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value <= limit_ms:
            raise GpuSpecError(f"{path}: [{key}] {name} = {value!r} must be a number of milliseconds between 0 "
                               f"and {limit_ms:g}")
    source = entry["clock_latency_source"]
    if not isinstance(source, str) or not source.strip():
        raise GpuSpecError(f'{path}: [{key}] clock_latency_source must say where the figures come from (or '
                           f'"assumed"), got {source!r}')
    return ClockLatency(entry["clock_call_ms"] / 1000, entry["clock_settle_ms"] / 1000, source)


def _check_nvml_names(path: str, key: str, names: list[str], owners: dict[str, str]) -> None:
    """Each of ``nvml_names`` a non-blank name given once in the whole table (``owners`` collects them): an empty
    name prefix-matches every device, a duplicate makes the device's entry depend on table order. (An empty list
    is fine: an entry only ``--gpu`` names.)"""
    for name in names:
        if not name.strip():
            raise GpuSpecError(f"{path}: [{key}] nvml_names has an empty name {name!r}: give the name NVML reports")
        if name in owners:
            where = "twice in it" if owners[name] == key else f"also in [{owners[name]}]"
            raise GpuSpecError(f"{path}: [{key}] nvml_names has {name!r} {where}: a device name must "
                               "belong to one entry, once")
        owners[name] = key


def get_gpu_spec(key: str, path: str | os.PathLike[str] | None = None) -> GpuSpec:
    table = load_gpu_table(path)
    spec = table.get(key.lower())
    if spec is None:
        raise GpuSpecError(f"unknown GPU {key!r}; known: {', '.join(sorted(table))} (configs/gpus.toml)")
    return spec


def spec_for_profile_source(source: str) -> GpuSpec | None:
    """The GPU a shipped profile's name starts with (``a40/gpt3-175b`` -> a40), also when the shipped
    file is given by its path; None for another CSV or an unknown GPU."""
    if source.endswith(".csv"):
        # The same file makes the same GPU (P2P power, clock table) whichever way it is named.
        path = Path(source).resolve()
        source = next((name for name, p in shipped_profiles().items() if p.resolve() == path), source)
    if "/" not in source or source.endswith(".csv"):
        return None
    try:
        return get_gpu_spec(source.split("/")[0])
    except GpuSpecError:
        return None


def spec_for_nvml_name(name: str, path: str | os.PathLike[str] | None = None) -> GpuSpec | None:
    """The table entry whose ``nvml_names`` contains ``name`` (exact, then prefix match)."""
    table = load_gpu_table(path)
    for spec in table.values():
        if name in spec.nvml_names:
            return spec
    for spec in table.values():
        if any(name.startswith(n) or n.startswith(name) for n in spec.nvml_names):
            return spec
    return None
