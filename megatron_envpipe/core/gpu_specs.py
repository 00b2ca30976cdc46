"""The GPU clock table (``configs/gpus.toml``): clock ranges, steps, P2P power.

Loaded and validated here so a bad table fails at start-up naming the key and
file. Pure Python (``tomllib``), no NVML: the runtime NVML backend refines the
candidate list with the device's own supported clocks.
"""

from __future__ import annotations

import os
import tomllib
from collections.abc import Iterable
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from megatron_envpipe.core.resources import configs_dir
from megatron_envpipe.errors import UsageError


class GpuSpecError(UsageError, ValueError):
    """A missing GPU entry or an invalid clock table."""


@dataclass(frozen=True)
class GpuSpec:
    key: str
    nvml_names: tuple[str, ...]
    max_clock_mhz: int
    min_clock_mhz: int
    clock_step_mhz: float
    profile_step_mhz: int
    reconfig_step_mhz: int
    p2p_power_w: float
    sources: tuple[str, ...]

    def candidate_clocks(self, available_mhz: Iterable[int] | None = None) -> tuple[int, ...]:
        """Clocks the planner may use, fastest first; the true maximum is always first.

        With ``available_mhz`` (a profile's or NVML's list) it is those inside
        [min, max]; without, the table's grid ``max - k*clock_step``.
        """
        if available_mhz is None:
            grid = []
            k = 0
            while True:
                f = int(round(self.max_clock_mhz - k * self.clock_step_mhz))
                if f < self.min_clock_mhz:
                    break
                grid.append(f)
                k += 1
            return tuple(grid)
        clocks = sorted({int(f) for f in available_mhz if self.min_clock_mhz <= f <= self.max_clock_mhz}, reverse=True)
        if not clocks:
            raise GpuSpecError(
                f"none of the available clocks lies in {self.key}'s range "
                f"{self.min_clock_mhz}..{self.max_clock_mhz} MHz: is --gpu right for this profile?"
            )
        return tuple(clocks)


_FIELDS = {
    "nvml_names": list,
    "max_clock_mhz": (int,),
    "min_clock_mhz": (int,),
    "clock_step_mhz": (int, float),
    "profile_step_mhz": (int,),
    "reconfig_step_mhz": (int,),
    "p2p_power_w": (int, float),
    "sources": list,
}


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
    path = Path(path) if path is not None else default_table_path()
    return dict(_load(str(path)))


@lru_cache(maxsize=8)
def _load(path: str) -> tuple[tuple[str, GpuSpec], ...]:
    try:
        with open(path, "rb") as fh:
            data = tomllib.load(fh)
    except OSError as exc:
        raise GpuSpecError(f"{path}: cannot read GPU table: {exc.strerror or exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise GpuSpecError(f"{path}: not valid TOML: {exc}") from None
    specs = []
    for key, entry in data.items():
        if not isinstance(entry, dict):
            raise GpuSpecError(f"{path}: [{key}] must be a table of clock settings")
        for name, types in _FIELDS.items():
            if name not in entry:
                raise GpuSpecError(f"{path}: [{key}] lacks {name}")
            value = entry[name]
            if isinstance(value, bool) or not isinstance(value, types if isinstance(types, tuple) else (types,)):
                raise GpuSpecError(f"{path}: [{key}] {name} = {value!r} has the wrong type")
        unknown = set(entry) - set(_FIELDS)
        if unknown:
            raise GpuSpecError(f"{path}: [{key}] has unknown key(s) {sorted(unknown)}")
        if not entry["min_clock_mhz"] < entry["max_clock_mhz"]:
            raise GpuSpecError(f"{path}: [{key}] min_clock_mhz must be below max_clock_mhz")
        for name in ("clock_step_mhz", "profile_step_mhz", "reconfig_step_mhz"):
            if entry[name] <= 0:
                raise GpuSpecError(f"{path}: [{key}] {name} must be positive")
        if entry["p2p_power_w"] < 0:
            raise GpuSpecError(f"{path}: [{key}] p2p_power_w must be >= 0")
        specs.append(
            (
                key,
                GpuSpec(
                    key=key,
                    nvml_names=tuple(entry["nvml_names"]),
                    max_clock_mhz=entry["max_clock_mhz"],
                    min_clock_mhz=entry["min_clock_mhz"],
                    clock_step_mhz=float(entry["clock_step_mhz"]),
                    profile_step_mhz=entry["profile_step_mhz"],
                    reconfig_step_mhz=entry["reconfig_step_mhz"],
                    p2p_power_w=float(entry["p2p_power_w"]),
                    sources=tuple(entry["sources"]),
                ),
            )
        )
    if not specs:
        raise GpuSpecError(f"{path}: GPU table is empty")
    return tuple(specs)


def get_gpu_spec(key: str, path: str | os.PathLike[str] | None = None) -> GpuSpec:
    table = load_gpu_table(path)
    spec = table.get(key.lower())
    if spec is None:
        raise GpuSpecError(f"unknown GPU {key!r}; known: {', '.join(sorted(table))} (configs/gpus.toml)")
    return spec


def spec_for_profile_source(source: str) -> GpuSpec | None:
    """The GPU a shipped profile's name starts with (``a40/gpt3-175b`` -> a40); None for a CSV or an unknown GPU."""
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
