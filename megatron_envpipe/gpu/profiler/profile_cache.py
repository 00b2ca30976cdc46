"""On-disk cache of start-up profiles, so a job re-profiles only when something changed.

EnvPipe kept its profile in memory and re-profiled every run (envpipe.md §5).
A profile is valid for one model, parallel layout, micro-batch shape, GPU model
and driver: :class:`ProfileKey` names those, and its digest (SHA-256 of the
canonical JSON) names the files ``<digest>.csv`` (Perseus format, written with
:meth:`Profile.to_csv`) and ``<digest>.json`` (the key and how the profile was
made). The sidecar is written last, atomically, so a present sidecar means a
complete CSV; a corrupt or mismatched entry is a miss, never an error.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import logging
import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from megatron_envpipe.core.atomic import write_atomic
from megatron_envpipe.core.profile import Profile, ProfileError
from megatron_envpipe.core.textfile import read_text

log = logging.getLogger("megatron_envpipe")

_CACHE_ENV = "MEGATRON_ENVPIPE_CACHE"
# Bump when what a cached profile means changes (e.g. how units are timed).
_CACHE_FORMAT = 1


@dataclass(frozen=True)
class ProfileKey:
    """What a profile depends on. ``model`` is the architecture (layers, hidden size,
    heads, vocabulary, ... : anything that changes a stage's work); ``extra`` anything else."""

    model: Mapping[str, Any] | str
    tensor_parallel: int
    pipeline_parallel: int
    micro_batch_size: int
    seq_length: int
    dtype: str
    gpu_name: str
    driver_version: str
    data_parallel: int = 1
    context_parallel: int = 1
    extra: Mapping[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["model"] = dict(self.model) if isinstance(self.model, Mapping) else self.model
        d["extra"] = dict(self.extra)
        d["format"] = _CACHE_FORMAT
        return d


def _canonical_json(key: Mapping[str, Any]) -> str:
    """Key order and whitespace never change the digest; non-JSON values are errors."""
    try:
        return json.dumps(key, sort_keys=True, separators=(",", ":"), allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"profile cache key is not plain JSON data: {exc}") from None


def _key_dict(key: ProfileKey | Mapping[str, Any]) -> dict[str, Any]:
    return key.as_dict() if isinstance(key, ProfileKey) else dict(key)


def _key_digest(key: ProfileKey | Mapping[str, Any]) -> str:
    return hashlib.sha256(_canonical_json(_key_dict(key)).encode()).hexdigest()[:24]


def _default_cache_root() -> Path:
    env = os.environ.get(_CACHE_ENV)
    if env:
        return Path(env).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or "~/.cache"
    return Path(base).expanduser() / "megatron-envpipe" / "profiles"


@dataclass(frozen=True)
class ProfileMeta:
    """How a cached profile was made."""

    iterations_used: int
    p2p_power_w: float | None = None
    clocks_mhz: tuple[int, ...] = ()
    stop_reason: str = ""
    created_utc: str = ""  # filled in by store() when empty
    extra: Mapping[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["clocks_mhz"] = list(self.clocks_mhz)
        d["extra"] = dict(self.extra)
        return d


class ProfileCache:
    def __init__(self, root: str | os.PathLike[str] | None = None) -> None:
        self.root = Path(root).expanduser() if root is not None else _default_cache_root()

    def paths(self, key: ProfileKey | Mapping[str, Any]) -> tuple[Path, Path]:
        """(CSV, sidecar JSON) of ``key``, whether or not they exist."""
        digest = _key_digest(key)
        return self.root / f"{digest}.csv", self.root / f"{digest}.json"

    def lookup(self, key: ProfileKey | Mapping[str, Any]) -> Path | None:
        """The cached CSV for ``key``, or None (absent, incomplete, or another key's)."""
        csv_path, meta_path = self.paths(key)
        sidecar = self._read_sidecar(meta_path)
        if sidecar is None or not csv_path.is_file():
            return None
        if sidecar.get("key") != json.loads(_canonical_json(_key_dict(key))):
            log.warning("profile cache %s holds a different key (hash collision or edited); ignoring it", meta_path)
            return None
        return csv_path

    def load(self, key: ProfileKey | Mapping[str, Any]) -> Profile | None:
        """The cached profile, or None; a corrupt CSV is logged and treated as a miss."""
        path = self.lookup(key)
        if path is None:
            return None
        try:
            return Profile.from_csv(path)
        except ProfileError as exc:
            log.warning("ignoring corrupt cached profile: %s", exc)
            return None

    def meta(self, key: ProfileKey | Mapping[str, Any]) -> dict[str, Any] | None:
        """The sidecar's ``meta`` of a cached profile, or None."""
        if self.lookup(key) is None:
            return None
        sidecar = self._read_sidecar(self.paths(key)[1])
        return None if sidecar is None else sidecar.get("meta")

    def store(
        self, key: ProfileKey | Mapping[str, Any], profile: Profile, meta: ProfileMeta | Mapping[str, Any]
    ) -> Path:
        """Write the profile and its sidecar atomically; returns the CSV's path."""
        csv_path, meta_path = self.paths(key)
        meta_d = meta.as_dict() if isinstance(meta, ProfileMeta) else dict(meta)
        if not meta_d.get("created_utc"):
            meta_d["created_utc"] = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
        sidecar = {"key": _key_dict(key), "meta": meta_d, "csv": csv_path.name}
        text = json.dumps(sidecar, sort_keys=True, indent=2, allow_nan=False) + "\n"
        profile.to_csv(csv_path)  # atomic (temp file + rename); creates the directory
        write_atomic(meta_path, text)
        return csv_path

    def describe(self, key: ProfileKey | Mapping[str, Any]) -> str:
        """One line for the log: hit (what, when, how) or miss (where it will go)."""
        csv_path, _ = self.paths(key)
        profile = self.load(key)
        if profile is None:
            return f"profile cache miss: {csv_path} (will profile at start-up and store it there)"
        meta = self.meta(key) or {}
        clocks = profile.common_frequencies()
        p2p = meta.get("p2p_power_w")
        return (
            f"profile cache hit: {csv_path}: {profile.num_stages} stages, {len(clocks)} clocks "
            f"{clocks[0]}..{clocks[-1]} MHz, profiled {meta.get('created_utc', '?')} in "
            f"{meta.get('iterations_used', '?')} iterations, P2P power "
            f"{'unknown' if p2p is None else f'{p2p:.1f} W'}"
        )

    @staticmethod
    def _read_sidecar(path: Path) -> dict[str, Any] | None:
        if not path.exists():
            return None
        try:  # bounded, regular files only: a FIFO or /dev/zero planted in the cache must not hang a run
            data = json.loads(read_text(path, "profile cache sidecar", ProfileError))
        except (ProfileError, ValueError, RecursionError) as exc:
            log.warning("ignoring unreadable profile cache sidecar %s: %s", path, exc)
            return None
        return data if isinstance(data, dict) else None


