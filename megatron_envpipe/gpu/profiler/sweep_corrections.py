"""What the start-up profiler corrects in its clocks' results before they become a profile.

Two corrections, each from data the sweep gathered anyway: forwards and backwards told apart by the
stage's pooled backward/forward power ratio where the counter could not (units shorter than its
period: :mod:`megatron_envpipe.gpu.profiler.power_ratio`), and energies brought to the hot state by the
fitted heat drift (:mod:`megatron_envpipe.gpu.profiler.heat_drift`). Both scale a row's energy and standard
error; pure functions of the results, so the sweep's own record stays as measured.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import replace

from megatron_envpipe.gpu.profiler.heat_drift import HeatDrift
from megatron_envpipe.gpu.profiler.power_ratio import pool_ratio, pull_towards
from megatron_envpipe.gpu.profiler.sweep_results import ClockResult

__all__ = ["with_heat_drift", "with_ratio_prior"]


def with_ratio_prior(results: Sequence[ClockResult], num_stages: int) -> list[ClockResult]:
    """``results`` with each iteration's forward and backward powers pulled towards the stage's pooled
    backward/forward ratio. Rows at sized units, and a stage's rows at a clock where some iteration was
    attributed otherwise (no power fit), are left as measured."""
    pooled = [pool_ratio([f for r in results if r.kind_powers and not r.samples for f in r.kind_powers[s]])
              for s in range(num_stages)]
    if not any(pooled):
        return list(results)
    out = []
    for r in results:
        if not r.kind_powers or r.samples:
            out.append(r)
            continue
        factors: dict[tuple[int, str], float] = {}
        variances: dict[tuple[int, str], float] = {}
        for s in range(num_stages):
            fits = r.kind_powers[s]
            if pooled[s] is None or not fits or any(f is None for f in fits):
                continue
            pulls = [pull_towards(f, pooled[s]) for f in fits]
            n = len(pulls)
            factors[(s, "forward")] = math.fsum(p.forward_factor for p in pulls) / n
            factors[(s, "backward")] = math.fsum(p.backward_factor for p in pulls) / n
            variances[(s, "forward")] = math.fsum(p.forward_variance_factor for p in pulls) / n
            variances[(s, "backward")] = math.fsum(p.backward_variance_factor for p in pulls) / n
        rows = tuple(row._replace(energy_j=row.energy_j * factors.get((row.stage, row.instruction), 1.0))
                     for row in r.rows)
        ses = tuple(se * factors.get((row.stage, row.instruction), 1.0)
                    * math.sqrt(variances.get((row.stage, row.instruction), 1.0))
                    for row, se in zip(r.rows, r.energy_se_j))
        out.append(replace(r, rows=rows, energy_se_j=ses))
    return out


def with_heat_drift(results: Sequence[ClockResult], drift: Sequence[HeatDrift | None]) -> list[ClockResult]:
    """``results`` with each stage's energies divided by its fitted drift at the time they were measured
    (the hot state); as they are where no drift was fitted. The drift model is a fit too, extrapolated:
    half the largest correction it made on a stage adds to every row's standard error there."""
    if not any(drift):
        return list(results)
    out = []
    spread = [abs(1 / d.factor(d.t0_s) - 1) if d is not None else 0.0 for d in drift]
    for r in results:
        factors = [d.factor(t) if d is not None and t is not None else 1.0
                   for d, t in zip(drift, r.at_s or [None] * len(drift))]
        rows = tuple(row._replace(energy_j=row.energy_j / factors[row.stage]) for row in r.rows)
        averaged = tuple(row._replace(energy_j=row.energy_j / factors[row.stage]) for row in r.averaged)
        samples = tuple(replace(x, energy_j=x.energy_j / factors[x.stage]) for x in r.samples)
        ses = tuple(math.hypot(se / factors[row.stage], 0.5 * spread[row.stage] * new.energy_j)
                    for row, new, se in zip(r.rows, rows, r.energy_se_j))
        out.append(replace(r, rows=rows, energy_se_j=ses, samples=samples, averaged=averaged))
    return out
