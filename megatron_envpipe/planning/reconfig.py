"""Online reconfiguration: raise clocks on the measured critical path (EnvPipe §4).

A :class:`Reconfigurer` holds the current plan and, given one iteration's
measured unit timings, raises the clocks of units on the critical path by
:class:`ClockLadder` steps until that path is the outer envelope; it stops
after ``finish_limit`` iterations without progress, as EnvPipe does.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence

from megatron_envpipe.core.measurement import IterationMeasurement
from megatron_envpipe.core.plan import FrequencyPlan
from megatron_envpipe.core.schedule import (
    Unit,
)
from megatron_envpipe.core.timeline import outer_envelope
from megatron_envpipe.core.vocabulary import RECONFIG_POLICIES, ReconfigPolicy
from megatron_envpipe.planning.basis import PlannerError

GREEDY_STEP_FACTOR = 3  # EnvPipe: greedy raises 3 steps so it moves as fast as balanced
DEFAULT_FINISH_LIMIT = 10



class ClockLadder:
    """The candidate clocks and how a reconfiguration step moves along them."""

    def __init__(self, candidates_mhz: Sequence[int], step_mhz: int) -> None:
        if not candidates_mhz:
            raise PlannerError("no candidate clocks")
        self.ascending = sorted(set(int(f) for f in candidates_mhz))
        self.f_max = self.ascending[-1]
        self.step_mhz = step_mhz

    def raised(self, freq_mhz: int, steps: int = 1) -> int:
        """The lowest candidate at least ``steps*step`` above ``freq``, capped at f_max."""
        target = freq_mhz + steps * self.step_mhz
        if target >= self.f_max:
            return self.f_max
        i = bisect.bisect_left(self.ascending, target)
        return self.ascending[i]


class Reconfigurer:
    """One EnvPipe reconfiguration step per iteration, from a critical path.

    Used offline by :func:`plan_envpipe` (exact simulated path) and online by
    the executor (path walked from measured receive waits, as EnvPipe does).
    """

    def __init__(
        self,
        plan: FrequencyPlan,
        policy: str,
        ladder: ClockLadder,
        finish_limit: int = DEFAULT_FINISH_LIMIT,
        threshold_scale: float = 4.0,
        target_time_s: float | None = None,
        time_tolerance: float = 0.01,
    ) -> None:
        if policy not in RECONFIG_POLICIES:
            raise PlannerError(f"unknown reconfiguration policy {policy!r}")
        self.schedule = plan.schedule
        self.freqs = [list(row) for row in plan.freqs_mhz]
        self.policy = policy
        self.ladder = ladder
        self.envelope = outer_envelope(plan.schedule)
        # Position of each unit in its stage's order (the schedule never changes).
        self._index = [{u: i for i, u in enumerate(order)} for order in plan.schedule.orders]
        self.finish_limit = finish_limit
        self.threshold_scale = threshold_scale
        self.threshold_s: float | None = None
        # Plans with a deadline (type "optimal"): correct only iterations measured slower than
        # target_time_s * (1 + time_tolerance), whatever the path; the envelope rule does not apply.
        self.target_time_s = target_time_s
        self.time_tolerance = time_tolerance
        self.finish_count = 0
        self.iterations = 0
        # "default" never reconfigures: EnvPipe starts it finished.
        self.finished = policy == ReconfigPolicy.DEFAULT

    @property
    def plan(self) -> FrequencyPlan:
        return FrequencyPlan(self.schedule, tuple(tuple(r) for r in self.freqs))

    def freqs_flat(self) -> list[int]:
        return [f for row in self.freqs for f in row]

    def on_envelope(self, path: Sequence[tuple[int, Unit]]) -> bool:
        return all(node in self.envelope for node in path)

    def apply(self, path: Sequence[tuple[int, Unit]]) -> bool:
        """Raise clocks on ``path`` (ordered from the end of the iteration backwards).

        Returns whether any clock changed. A path already on the envelope
        changes nothing (unless the reconfigurer has a target time: then an
        empty path, i.e. an iteration on time, is what changes nothing).
        """
        if self.policy == ReconfigPolicy.DEFAULT or not path or (self.target_time_s is None and self.on_envelope(path)):
            return False
        index = self._index
        f_max = self.ladder.f_max
        if self.policy == ReconfigPolicy.GREEDY:
            for s, u in path:
                i = index[s][u]
                if self.freqs[s][i] < f_max:
                    self.freqs[s][i] = self.ladder.raised(self.freqs[s][i], GREEDY_STEP_FACTOR)
                    return True
            return False
        # balanced
        f_min = min(self.freqs[s][index[s][u]] for s, u in path)
        if f_min >= f_max:
            return False
        new = self.ladder.raised(f_min)
        for s, u in path:
            i = index[s][u]
            if self.freqs[s][i] == f_min:
                self.freqs[s][i] = new
        return True

    def step(self, path: Sequence[tuple[int, Unit]]) -> FrequencyPlan:
        """Online use: one iteration's critical path in, the next iteration's plan out.

        After ``finish_limit`` iterations in a row without progress (or with the
        path on the envelope) the reconfigurer is finished and keeps its plan.
        """
        if self.finished:
            return self.plan
        self.iterations += 1
        if self.apply(path):
            self.finish_count = 0
        else:
            self.finish_count += 1
            if self.finish_count > self.finish_limit:
                self.finished = True
        return self.plan

    def observe(self, measurement: IterationMeasurement) -> FrequencyPlan:
        """Online use: the executor's measurement of one iteration in, the next plan out."""
        for s, (stage, order) in enumerate(zip(measurement.stages, self.schedule.orders)):
            if tuple(t.unit for t in stage) != order:
                raise PlannerError(
                    f"stage {s}: measured units {' '.join(str(t.unit) for t in stage[:6])} ... do not "
                    f"follow the planned order {' '.join(str(u) for u in order[:6])} ..."
                )
        path = self.measured_critical_path(measurement.recv_wait_s())
        if self.target_time_s is not None and (
            measurement.iteration_time_s() <= self.target_time_s * (1 + self.time_tolerance)
        ):
            path = []  # on time: nothing to correct
        return self.step(path)

    def measured_critical_path(self, recv_wait_s: Sequence[Sequence[float]]) -> list[tuple[int, Unit]]:
        """EnvPipe's walk (envpipe.md §3.1) over measured receive waits.

        From stage 0's last unit: if the unit waited for its input at least the
        threshold, jump to the stage that produced it, else step to the previous
        unit of the same stage. Threshold = scale x the smallest non-zero wait
        on the last stage, fixed at the first call (EnvPipe's convention).
        """
        sched = self.schedule
        last = sched.num_stages - 1
        if self.threshold_s is None:
            nonzero = [w for w in recv_wait_s[last] if w > 0]
            self.threshold_s = self.threshold_scale * (min(nonzero) if nonzero else 0.0)
        threshold = self.threshold_s
        index = self._index
        s, i = 0, len(sched.orders[0]) - 1
        path = []
        for _ in range(sum(len(o) for o in sched.orders) + 1):
            unit = sched.orders[s][i]
            path.append((s, unit))
            if s == 0 and i == 0:
                break
            waited = recv_wait_s[s][i] >= threshold and recv_wait_s[s][i] > 0
            has_cross = (unit.is_forward and s > 0) or (not unit.is_forward and s < last)
            if (waited or i == 0) and has_cross:
                s = s - 1 if unit.is_forward else s + 1
                i = index[s][unit]
            elif i > 0:
                i -= 1
            else:
                break
        return path

