"""What the start-up profiler compares between two iterations at one clock to call a stage steady.

Split from :mod:`megatron_envpipe.gpu.profiler.sweep`; pure Python.
"""

from __future__ import annotations

import math

from megatron_envpipe.core.length_costs import MicrobatchSize
from megatron_envpipe.gpu.profiler.attribution import StageSamples
from megatron_envpipe.gpu.profiler.sweep_lengths import iteration_estimates
from megatron_envpipe.gpu.profiler.sweep_stats import robust_mean_se

__all__ = ["counter_updates_note", "stage_estimates"]

# Fewer counter increments per iteration than this and the per-iteration power fit (forward, backward, P2P
# wait, the rest) is barely determined: bench/fast_gpus.py, units x0.05 on 4 stages (4 updates), errs by 80 %.
_MIN_COUNTER_UPDATES = 5


def stage_estimates(it: StageSamples, reference: MicrobatchSize | None = None, trim_fraction: float = 0.2,
                    combine: bool = False) -> dict[tuple[str, str], tuple[float, float]]:
    """One stage's iteration: (mean, standard error) per (kind, "time"/"energy"); sized units at
    ``reference``. ``combine`` (with the power fit at hand): a forward and a backward's energy together,
    key ("F+B", "energy"): what the counter resolves in one iteration even when the two kinds are shorter
    than its period (their split comes from the pooled ratio, gpu/profiler/power_ratio.py, not from more
    iterations at one clock)."""
    sized = iteration_estimates(it.units, reference, trim_fraction) if reference is not None else None
    if sized is not None:
        return sized
    out = {}
    for kind in ("F", "B"):
        units = [u for u in it.units if u.kind == kind]
        out[(kind, "time")] = robust_mean_se([u.time_s for u in units], trim_fraction)
        out[(kind, "energy")] = robust_mean_se([u.energy_j for u in units], trim_fraction)
    fit = it.kind_powers
    if combine and fit is not None:
        (ef, sf), (eb, sb) = out.pop(("F", "energy")), out.pop(("B", "energy"))
        tf, tb = out[("F", "time")][0], out[("B", "time")][0]
        fit_var = tf * tf * fit.var_forward + tb * tb * fit.var_backward + 2 * tf * tb * fit.cov
        out[("F+B", "energy")] = (ef + eb, math.sqrt(sf * sf + sb * sb + max(fit_var, 0.0)))
    return out


def counter_updates_note(updates: list[int]) -> str:
    """For the sweep's summary: how many energy-counter updates an iteration spanned (median over stages and
    iterations), and a warning where too few tell units apart (docs/fast-gpus.md: about 5 or more, e.g.
    0.5 s iterations on a 100 ms counter)."""
    if not updates:
        return ""
    median = sorted(updates)[len(updates) // 2]
    note = f"; iterations spanned {median} energy-counter updates (median)"
    if median < _MIN_COUNTER_UPDATES:
        note += ("; TOO FEW to tell forwards, backwards and waits apart, rows may err by tens of percent: profile "
                 "with more micro-batches per iteration, or give --envpipe-profile (docs/fast-gpus.md)")
    return note
