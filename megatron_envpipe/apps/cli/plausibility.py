"""Physical plausibility of a profile on the GPU the command names (issue 39): a row measured above the
GPU's highest clock (5000 MHz "on an A40", which tops out at 1740 MHz) is no measurement of that GPU.

The planner would quietly drop such rows and ``envpipe simulate --freq`` would run on them; both are
refused here instead, with one line naming the file, the clocks and what to do.
"""

from __future__ import annotations

from megatron_envpipe.apps.cli.common import CliError
from megatron_envpipe.core.gpu_specs import GpuSpec
from megatron_envpipe.core.profile import Profile

__all__ = ["check_profile_on_gpu"]


def check_profile_on_gpu(profile: Profile, gpu: GpuSpec | None, freq_mhz: int | None = None) -> None:
    """Every row of ``profile`` (and ``--freq``, if given) at or below ``gpu``'s highest clock; no check without
    a GPU or where the table does not know its clock range (NVML's list decides there)."""
    if gpu is None or gpu.max_clock_mhz is None:
        return
    top = gpu.max_clock_mhz
    if freq_mhz is not None and freq_mhz > top:
        raise CliError(f"--freq {freq_mhz} MHz is above {gpu.key}'s highest clock, {top} MHz (configs/gpus.toml): "
                       f"give a clock of at most {top} MHz, or the --gpu the profile was measured on")
    above = sorted({f for stage in range(profile.num_stages) for chunk in range(profile.num_chunks)
                    for instruction in ("forward", "backward")
                    for f in profile.frequencies(stage, instruction, chunk) if f > top})
    if above:
        clocks = f"{above[0]}" if len(above) == 1 else f"{above[0]}..{above[-1]}"
        raise CliError(f"{profile.source}: rows at {clocks} MHz, above {gpu.key}'s highest clock, {top} MHz "
                       "(configs/gpus.toml), so this profile was not measured on it: give the --gpu it was "
                       "measured on, or drop those rows")
