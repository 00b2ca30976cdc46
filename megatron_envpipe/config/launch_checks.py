"""Start-up checks that need the launch's shape (world size, iterations, micro-batch lengths). Pure Python.

Each was once found only inside the first iteration, where every rank then crashed with a
traceback: the data-parallel size is known before any rank starts (the launcher's world size
over the model-parallel sizes, :func:`~megatron_envpipe.flag_types.data_parallel_size_of`), and
so is whether the simulated GPU can cost micro-batches of varying length.
"""

from __future__ import annotations

from typing import Any

from megatron_envpipe.core.atomic import OutputPathError, check_output
from megatron_envpipe.core.device_backends import model_profile
from megatron_envpipe.core.device_dynamics import PRESETS
from megatron_envpipe.core.energy_csv import check_energy_csv
from megatron_envpipe.core.gpu_specs import spec_for_profile_source
from megatron_envpipe.core.length_costs import LengthCostError, default_length_model_for, fit_length_costs
from megatron_envpipe.core.profile import Profile
from megatron_envpipe.core.resources import shipped_profile
from megatron_envpipe.errors import UsageError
from megatron_envpipe.flag_types import EnvPipeConfigError, data_parallel_size_of

__all__ = ["check_launch", "check_output_files"]


def check_launch(config: Any, args: Any, pipeline_size: int, simulated: Profile | None, source: str | None) -> None:
    """``config`` (an EnvPipeConfig) against Megatron's ``args``: the straggler's replica, and
    ``--variable-seq-lengths`` on the simulated GPU of profile ``simulated`` (read from ``source``)."""
    dp = data_parallel_size_of(args, pipeline_size)
    if dp is not None:
        config.check_replicas(dp)
    # (its start iteration against --train-iters, and DP >= 2: config/flag_table.py, before this)
    _check_profile_clocks(config, source)
    if simulated is not None and source:
        _check_blocking_power(config, source)
        # The simulated GPU fits its sized rows whenever it opens (inside every rank): a bad fit is refused here.
        problem = _length_model_problem(simulated, source) if simulated.length_samples else None
        if problem:
            raise EnvPipeConfigError(f"--envpipe-gpu simulated:{source}: {problem}: fix or remove those rows "
                                     "(columns tokens,attention_tokens2)")
    if simulated is not None and source and getattr(args, "variable_seq_lengths", None):
        problem = _length_model_problem(simulated, source)
        if problem:
            raise EnvPipeConfigError(
                f"--variable-seq-lengths on --envpipe-gpu simulated:{source}: {problem}, so the simulated GPU "
                "cannot cost micro-batches of other lengths: give a profile measured at >= 2 micro-batch sizes "
                "(columns tokens,attention_tokens2) or a shipped one, or drop --variable-seq-lengths")


def _check_profile_clocks(config: Any, source: str | None) -> None:
    """``--envpipe-profile`` rows above the highest clock of the simulated GPU's table entry (a40 tops out at
    1740 MHz) are no measurement of it: refused, not quietly dropped by the planner."""
    spec = spec_for_profile_source(source) if config.profile and source else None
    if spec is None or spec.max_clock_mhz is None:
        return
    try:
        profile = Profile.from_csv(shipped_profile(config.profile))
    except (OSError, UsageError):
        return  # refused by the profile's own check, with its own message
    above = sorted({p.freq_mhz for stage in range(profile.num_stages) for chunk in range(profile.num_chunks)
                    for ins in ("forward", "backward") for p in profile.points(stage, ins, chunk)
                    if p.freq_mhz > spec.max_clock_mhz})
    if above:
        raise EnvPipeConfigError(
            f"--envpipe-profile {config.profile}: rows at {above[0]}{f'..{above[-1]}' if len(above) > 1 else ''} MHz, "
            f"above {spec.key}'s highest clock, {spec.max_clock_mhz} MHz (configs/gpus.toml), so it was not measured "
            f"on the GPU of --envpipe-gpu {config.gpu}: give the profile of that GPU, or drop those rows")


def _check_blocking_power(config: Any, source: str) -> None:
    """A CSV that names no GPU of the table gives the simulated GPU 0 W between units; with a stepped
    energy counter (dynamics ``counter_period_s`` > 0) the counter then stands still between units and
    every iteration reads as stalled (unmeasured): refused unless a blocking power is given."""
    dynamics = config.device_dynamics
    if (spec_for_profile_source(source) is None and config.p2p_power_w is None
            and dynamics.blocking_power_w is None and dynamics.counter_period_s > 0):
        raise EnvPipeConfigError(
            f"--envpipe-gpu simulated:{source} names no GPU of configs/gpus.toml, so the simulated GPU would draw "
            f"0 W between units and its stepped energy counter ({dynamics.counter_period_s:g} s, "
            f"--envpipe-sim-dynamics {config.sim_dynamics}) would stand still there: every iteration would read as "
            "stalled: give --envpipe-p2p-power W (or blocking_power_w in the dynamics file)")


def _length_model_problem(profile: Profile, source: str) -> str | None:
    """Why the simulated GPU would have no length model (gpu.sim_lengths.simulated_length_model's rule), or None."""
    if profile.length_samples:
        try:
            fit_length_costs(profile.size_samples(), profile.reference_size, source=source)
        except LengthCostError as exc:
            return f"its sized rows fit no length model ({exc})"
        return None
    try:
        default_length_model_for(source)
    except LengthCostError:
        return "the profile has no sized rows and is no shipped profile"
    return None


def _input_files(config: Any) -> list[tuple[str, str | None]]:
    """``(flag, path)`` of every file the run reads (``config``: an EnvPipeConfig): no output may be one of them."""
    cache = config.profile_cache if config.profile_cache != "off" else None
    found: list[tuple[str, str | None]] = [("the input --envpipe-profile-cache", cache)]
    simulated = model_profile(config.gpu)
    for flag, name in (("--envpipe-profile", config.profile), (f"--envpipe-gpu {config.gpu}", simulated)):
        if name:
            try:
                found.append((f"the input {flag}", str(shipped_profile(name))))
            except FileNotFoundError:
                pass  # refused by its own check
    if config.sim_dynamics not in PRESETS:
        found.append(("the input --envpipe-sim-dynamics", config.sim_dynamics))
    return found


def check_output_files(config: Any, losses_out: str | None = None) -> None:
    """``--envpipe-energy-csv`` (and the tiny GPT's ``--losses-out``): writable now, none of the run's inputs,
    not each other; the CSV empty or an energy CSV already. One-line EnvPipeConfigError."""
    inputs = _input_files(config)
    try:
        if config.energy_csv is not None:
            check_energy_csv(config.energy_csv, [*inputs, ("--losses-out", losses_out)])
        if losses_out is not None:
            check_output(losses_out, "--losses-out", inputs)
    except OutputPathError as exc:
        raise EnvPipeConfigError(str(exc)) from None
