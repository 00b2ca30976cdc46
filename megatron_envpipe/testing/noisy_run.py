"""Offline training runs with unit-time jitter: does a plan's saving hold under noise?

:func:`run_noisy` plays ``iterations`` iterations of a plan on its profile, every
unit's time (and energy, at the unit's power) multiplied by a seeded
:class:`~megatron_envpipe.core.jitter.UnitJitter` factor, feeding each simulated
iteration to the online :class:`~megatron_envpipe.planning.reconfig.Reconfigurer`
exactly as the executor's measurement would be fed; the baseline (the same order
family at f_max) runs under the same noise. The figures it returns are what a
training run would report: per iteration time and energy, and the clock changes.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

from megatron_envpipe.core.jitter import UnitJitter
from megatron_envpipe.core.plan import FrequencyPlan
from megatron_envpipe.core.profile import Profile
from megatron_envpipe.core.timeline import PlanEvaluator, score_timeline
from megatron_envpipe.errors import InvalidValueError
from megatron_envpipe.planning.basis import PlanResult
from megatron_envpipe.planning.reconfig import DEFAULT_WINDOW, ClockLadder, Reconfigurer


@dataclass(frozen=True)
class _NoisyRun:
    """Per-iteration (time_s, energy_j) of a plan and its baseline under the same jitter."""

    time_s: tuple[float, ...]
    energy_j: tuple[float, ...]
    baseline_time_s: tuple[float, ...]
    baseline_energy_j: tuple[float, ...]
    raises: int
    lowers: int
    change_bound: int | None

    def tail(self, last: int) -> tuple[float, float, float, float]:
        """Medians over the last ``last`` iterations: (time, energy, baseline time, baseline energy)."""
        med = statistics.median
        return (med(self.time_s[-last:]), med(self.energy_j[-last:]),
                med(self.baseline_time_s[-last:]), med(self.baseline_energy_j[-last:]))

    def changes_ok(self) -> bool:
        """Whether the online changes stayed within the reconfigurer's proven bound."""
        return self.change_bound is None or self.raises + self.lowers <= self.change_bound

    def saving(self, last: int) -> float:
        _, e, _, be = self.tail(last)
        return 1.0 - e / be

    def slowdown(self, last: int) -> float:
        t, _, bt, _ = self.tail(last)
        return t / bt - 1.0


def _iteration(evaluator: PlanEvaluator, freqs: list[int], jitter: list[UnitJitter]):
    nominal = evaluator.durations(freqs)
    energy = evaluator.unit_energies(freqs)
    factors = [jitter[s].factor() for s in evaluator.graph.stage_of]
    timeline = evaluator.graph.simulate([d * f for d, f in zip(nominal, factors)])
    score = score_timeline(timeline, [e * f for e, f in zip(energy, factors)], evaluator.p2p_power_w)
    return timeline.measurement(), score.iteration_time_s, score.energy_j


def run_noisy(result: PlanResult, profile: Profile, iterations: int, jitter: float, seed: int = 0, *,
              online: bool = True, window: int = DEFAULT_WINDOW, two_way: bool = True,
              finish_limit: int = 10, step_mhz: int | None = None, plain_steps: bool = False) -> _NoisyRun:
    """``iterations`` noisy iterations of ``result``'s plan (corrected online unless ``online`` is False;
    ``window``, ``two_way`` and ``plain_steps`` (EnvPipe's ladder steps, profile not consulted) as the
    :class:`Reconfigurer`'s)."""
    if iterations < 1:
        raise InvalidValueError(f"need at least one iteration, got {iterations}")
    cfg = result.config
    p2p = cfg.effective_p2p_power_w
    evaluator = PlanEvaluator(result.schedule, profile, p2p, graph=result.timeline.graph)
    base_eval = PlanEvaluator(result.baseline_plan.schedule, profile, p2p)
    num_stages = result.schedule.num_stages
    noise = [UnitJitter(jitter, f"{seed}|plan|{s}") for s in range(num_stages)]
    base_noise = [UnitJitter(jitter, f"{seed}|baseline|{s}") for s in range(num_stages)]
    rc = None
    if online and cfg.reconfig != "default":
        ladder = ClockLadder(result.candidates_mhz, step_mhz or cfg.effective_reconfig_step_mhz)
        rc = Reconfigurer(result.plan, cfg.reconfig, ladder, finish_limit=finish_limit,
                          target_time_s=result.deadline_s, window=window, two_way=two_way,
                          profile=None if plain_steps else evaluator.profile)
    plan: FrequencyPlan = result.plan
    base_freqs = [f for row in result.baseline_plan.freqs_mhz for f in row]
    times, energies, btimes, benergies = [], [], [], []
    for _ in range(iterations):
        freqs = rc.freqs_flat() if rc is not None else [f for row in plan.freqs_mhz for f in row]
        measurement, t, e = _iteration(evaluator, freqs, noise)
        _, bt, be = _iteration(base_eval, base_freqs, base_noise)
        times.append(t)
        energies.append(e)
        btimes.append(bt)
        benergies.append(be)
        if rc is not None:
            rc.observe(measurement)
    return _NoisyRun(tuple(times), tuple(energies), tuple(btimes), tuple(benergies),
                    rc.raises if rc else 0, rc.lowers if rc else 0, rc.change_bound() if rc else None)
