"""The profiles and GPU-table entries the ``--envpipe-*`` flags name: read once at argument parsing, each
failure one :class:`EnvPipeConfigError` line (which flag, what is wrong, what to do). Pure Python.
"""

from __future__ import annotations

from megatron_envpipe.core.device_backends import named_backend
from megatron_envpipe.core.gpu_specs import GpuSpec, get_gpu_spec
from megatron_envpipe.core.profile import Profile, ProfileError
from megatron_envpipe.core.resources import shipped_profile
from megatron_envpipe.flag_types import EnvPipeConfigError

__all__ = ["fit_profile", "load_profile", "table_gpu"]


def table_gpu(gpu: str | None) -> GpuSpec | None:
    """The GPU-table entry ``--envpipe-gpu`` names, or None (auto, none, nvml, simulated: known at run time)."""
    if not gpu or named_backend(gpu) is not None:
        return None
    return get_gpu_spec(gpu)  # validate() has checked the key


def load_profile(name: str, flag: str = "--envpipe-profile",
                 fix: str = "drop --envpipe-profile to measure at start-up") -> Profile:
    """The ``--envpipe-profile`` CSV (a path or a shipped name), parsed; EnvPipeConfigError if it
    cannot be read, is not UTF-8 text, or is not a valid Perseus-format profile. ``flag``/``fix``:
    the flag that names it and what else to do (``--envpipe-gpu simulated:<profile>`` reads one too)."""
    try:
        return Profile.from_csv(shipped_profile(name))
    except FileNotFoundError as exc:
        raise EnvPipeConfigError(f"{flag} {name}: {exc}") from None
    except UnicodeDecodeError as exc:
        raise EnvPipeConfigError(
            f"{flag} {name}: not a text CSV (byte {exc.start} is not UTF-8): give the Perseus-format "
            "CSV (columns stage,instruction,frequency,time,energy)") from None
    except ProfileError as exc:
        where = flag if name in str(exc) else f"{flag} {name}"  # it names the file (and line)
        raise EnvPipeConfigError(f"{where}: {exc}; fix the file, or {fix}") from None

def fit_profile(flag: str, profile: Profile, num_stages: int, virtual_stages: int) -> None:
    """The profile serves this pipeline's stages and model chunks (the run-time would fail on every rank)."""
    try:
        profile.for_pipeline(num_stages).for_chunks(virtual_stages)
    except ProfileError as exc:
        raise EnvPipeConfigError(f"{flag}: {exc} (--pipeline-model-parallel-size {num_stages}, "
                                 f"{virtual_stages} model chunk(s) per rank)") from None
