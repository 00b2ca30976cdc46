"""Files shipped with the package: GPU table, real A40 profiles, reference results.

In a source checkout they live in ``configs/`` and ``data/`` at the repo root;
an installed package carries them as ``megatron_envpipe/configs`` and
``megatron_envpipe/data`` (setup.py maps the folders).
"""

from __future__ import annotations

from pathlib import Path

# megatron_envpipe/ (this file is megatron_envpipe/core/resources.py)
_PACKAGE = Path(__file__).resolve().parent.parent


def _shipped_dir(name: str, marker: str) -> Path:
    """``name/`` inside the installed package, else at the checkout's root; ``marker`` must exist in it."""
    for candidate in (_PACKAGE / name, _PACKAGE.parent / name):
        if (candidate / marker).exists():
            return candidate
    raise FileNotFoundError(f"{name}/{marker} not found next to {_PACKAGE}; reinstall megatron-envpipe")


def data_dir() -> Path:
    """Profiles, reference results, the tiny corpus."""
    return _shipped_dir("data", "profiles")


def configs_dir() -> Path:
    """``gpus.toml`` (the GPU table) and ``demo.toml``."""
    return _shipped_dir("configs", "gpus.toml")


def shipped_profiles() -> dict[str, Path]:
    """``{"a40/gpt3-175b": path, ...}`` for every shipped stage profile."""
    root = data_dir() / "profiles"
    out = {}
    for path in sorted(root.glob("*/*-stage-profile.csv")):
        model = path.name.split("_")[0]
        out[f"{path.parent.name}/{model}"] = path
    return out


def shipped_profile(name: str) -> Path:
    """Path of a shipped profile by short name (``a40/gpt3-175b``) or file path."""
    profiles = shipped_profiles()
    if name in profiles:
        return profiles[name]
    path = Path(name)
    if path.exists():  # not just is_file(): a FIFO or device is named as such when read (core.textfile)
        return path
    raise FileNotFoundError(
        f"no profile {name!r}: give a CSV path or one of {', '.join(profiles)}"
    )

