"""Online reconfiguration: correct clocks from the measured critical path (EnvPipe §4).

A :class:`Reconfigurer` holds the current plan. Offline (:meth:`Reconfigurer.step`,
the planner's exact simulated path) it raises the clocks of units on the critical
path by :class:`ClockLadder` steps until that path is the outer envelope, as
EnvPipe does. Online (:meth:`Reconfigurer.observe`, measured and noisy timings) it
decides on the median of a window of iterations rather than one, and corrects in
both directions: a late window raises clocks, a window on time with raised
clocks lowers the most recent raise again (two-way, with hysteresis). A raise
that follows a lowering pins every raise made so far, which bounds the number
of changes (:meth:`Reconfigurer.change_bound`): the clocks cannot oscillate.
It stops after ``finish_limit`` iterations without a change.
"""

from __future__ import annotations

import bisect
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from megatron_envpipe.core.measurement import IterationMeasurement
from megatron_envpipe.core.plan import FrequencyPlan
from megatron_envpipe.core.profile import Profile, ProfileError, instruction_of
from megatron_envpipe.core.schedule import Unit
from megatron_envpipe.core.timeline import outer_envelope
from megatron_envpipe.core.vocabulary import RECONFIG_POLICIES, ReconfigPolicy
from megatron_envpipe.planning.basis import PlannerError

_GREEDY_STEP_FACTOR = 3  # EnvPipe: greedy raises 3 steps so it moves as fast as balanced
_DEFAULT_FINISH_LIMIT = 10
# Iterations whose median decides one online correction: 3 outvotes one outlier (a data-loader
# stall, a NCCL hiccup) yet reacts within 3 iterations. 1 is EnvPipe's own one-iteration rule.
DEFAULT_WINDOW = 3
_THRESHOLD_CAP = 0.01  # of the last stage's median unit time (measured_critical_path)


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

    def levels_above(self, freq_mhz: int) -> int:
        """Candidates above ``freq``: the most single steps a unit at ``freq`` can be raised."""
        return len(self.ascending) - bisect.bisect_right(self.ascending, freq_mhz)


@dataclass(frozen=True)
class _Correction:
    """One online raise: which units (stage, position in its order) went from which clock to which."""

    changes: tuple[tuple[int, int, int, int], ...]  # (stage, index, old MHz, new MHz)
    pinned: bool = False  # raised again after a lowering: never lowered again


class Reconfigurer:
    """EnvPipe's reconfiguration of one plan: offline per simulated path, online per measured window.

    Used offline by :func:`plan_envpipe` (exact simulated path, :meth:`step`, raises only) and
    online by the run-time (:meth:`observe`: path walked from measured receive waits, as EnvPipe
    does, over the median of ``window`` iterations; raises and lowers).
    """

    def __init__(
        self,
        plan: FrequencyPlan,
        policy: str,
        ladder: ClockLadder,
        finish_limit: int = _DEFAULT_FINISH_LIMIT,
        threshold_scale: float = 4.0,
        target_time_s: float | None = None,
        time_tolerance: float = 0.01,
        window: int = DEFAULT_WINDOW,
        two_way: bool = True,
        profile: Profile | None = None,
    ) -> None:
        if policy not in RECONFIG_POLICIES:
            raise PlannerError(f"unknown reconfiguration policy {policy!r}")
        if isinstance(window, bool) or not isinstance(window, int) or window < 1:
            raise PlannerError(f"reconfiguration window must be a whole number of iterations >= 1, got {window!r}")
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
        self.window = window
        self.two_way = two_way  # False: raise only, as EnvPipe (kept for comparison)
        # Online, a raise skips clocks the profile says are no faster (measured profiles are flat and
        # noisy near f_max: one 30 MHz step up can be slower). Offline keeps EnvPipe's plain steps.
        self.profile = profile
        self.finish_count = 0
        self.iterations = 0
        self.raises = 0
        self.lowers = 0
        self.stack: list[_Correction] = []  # online raises still in force, oldest first
        self._recent: list[tuple[list[list[float]], float]] = []  # (receive waits, time) since the last change
        self._lowered_since_raise = False
        self._last_unit_s: float | None = None  # last stage's median unit time, until the threshold is fixed
        # The most single-step raises the plan's units can take: bounds the stack's depth.
        self.depth_bound = sum(ladder.levels_above(f) for row in self.freqs for f in row)
        # "default" never reconfigures: EnvPipe starts it finished.
        self.finished = policy == ReconfigPolicy.DEFAULT

    @property
    def plan(self) -> FrequencyPlan:
        return FrequencyPlan(self.schedule, tuple(tuple(r) for r in self.freqs))

    @property
    def changes(self) -> int:
        """Online clock changes so far (raises + lowers)."""
        return self.raises + self.lowers

    def change_bound(self) -> int:
        """The most online changes this reconfigurer can ever make: (D + 1)(2D + 1), D = depth_bound.

        Proof. Each correction raises at least one unit by at least one ladder step and the
        stack holds only corrections in force, so it never holds more than D. A lowering pops
        the newest unpinned correction; a raise after a lowering pins the whole stack, itself
        included, and pinned corrections are never popped, so the pinned depth grows by at
        least one at each such raise: at most D of them. Between two of them the stack only
        grows, then only shrinks (a raise after a shrink ends the segment): at most D raises,
        D lowerings and the one pinning raise per segment, D + 1 segments in all.
        """
        d = self.depth_bound
        return (d + 1) * (2 * d + 1)

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
        return bool(self._raise(path))

    def raise_off_envelope(self, positions: Sequence[tuple[int, int]]) -> tuple[tuple[int, int, int, int], ...]:
        """:meth:`apply` on a path that leaves the outer envelope, given as (stage, position in its order) pairs
        (the offline planner's loop: no unit lookups); the changes made, (stage, position, old MHz, new MHz)."""
        if self.policy == ReconfigPolicy.DEFAULT or not positions:
            return ()
        return self._raise_at(positions)

    def _raise(self, path: Sequence[tuple[int, Unit]]) -> tuple[tuple[int, int, int, int], ...]:
        """The policy's raise on ``path``, applied; the changes made (none: nothing to raise)."""
        index = self._index
        return self._raise_at([(s, index[s][u]) for s, u in path])

    def _raise_at(self, positions: Sequence[tuple[int, int]]) -> tuple[tuple[int, int, int, int], ...]:
        """:meth:`_raise` on (stage, position) pairs."""
        orders = self.schedule.orders
        freqs = self.freqs
        f_max = self.ladder.f_max
        if self.policy == ReconfigPolicy.GREEDY:
            for s, i in positions:
                if freqs[s][i] < f_max:
                    old = freqs[s][i]
                    freqs[s][i] = self._raised(s, orders[s][i], old, _GREEDY_STEP_FACTOR)
                    return ((s, i, old, freqs[s][i]),)
            return ()
        # balanced: every unit of the path at the path's lowest clock, one step up
        f_min = min([freqs[s][i] for s, i in positions])
        if f_min >= f_max:
            return ()
        changes = []
        if self.profile is None:  # the plain step depends on the clock only: one target for the whole path
            new = self.ladder.raised(f_min, 1)
            for s, i in positions:
                row = freqs[s]
                if row[i] == f_min:
                    row[i] = new
                    changes.append((s, i, f_min, new))
            return tuple(changes)
        for s, i in positions:
            if freqs[s][i] == f_min:
                freqs[s][i] = new = self._raised(s, orders[s][i], f_min, 1)
                changes.append((s, i, f_min, new))
        return tuple(changes)

    def _raised(self, stage: int, unit: Unit, freq_mhz: int, steps: int) -> int:
        """``steps`` ladder steps up from ``freq``; with a profile, on to the first clock that is faster."""
        new = self.ladder.raised(freq_mhz, steps)
        if self.profile is None:
            return new
        ins = instruction_of(unit.kind)
        try:
            now = self.profile.time_s(stage, ins, freq_mhz, unit.chunk)
            while new < self.ladder.f_max and not self.profile.time_s(stage, ins, new, unit.chunk) < now:
                new = self.ladder.raised(new)
        except ProfileError:  # a clock the profile lacks: the plain step
            return self.ladder.raised(freq_mhz, steps)
        return new

    def step(self, path: Sequence[tuple[int, Unit]]) -> FrequencyPlan:
        """Offline use: one iteration's exact critical path in, the next iteration's plan out.

        After ``finish_limit`` iterations in a row without progress (or with the
        path on the envelope) the reconfigurer is finished and keeps its plan.
        """
        if self.finished:
            return self.plan
        self.iterations += 1
        if self.apply(path):
            self.finish_count = 0
        else:
            self._quiet()
        return self.plan

    def _quiet(self) -> None:
        self.finish_count += 1
        if self.finish_count > self.finish_limit:
            self.finished = True

    def observe(self, measurement: IterationMeasurement) -> FrequencyPlan:
        """Online use: the executor's measurement of one iteration in, the next plan out.

        Iterations since the last change are kept; once ``window`` of them are in, their
        median receive waits give the critical path (and their median time is compared
        with the target). Late: raise on that path. On time with raised clocks: undo the
        newest unpinned raise (the slack came back). Either resets the window.
        """
        for s, (stage, order) in enumerate(zip(measurement.stages, self.schedule.orders)):
            if tuple(t.unit for t in stage) != order:
                raise PlannerError(
                    f"stage {s}: measured units {' '.join(str(t.unit) for t in stage[:6])} ... do not "
                    f"follow the planned order {' '.join(str(u) for u in order[:6])} ..."
                )
        if self.finished:
            return self.plan
        self.iterations += 1
        self._recent.append((measurement.recv_wait_s(), measurement.iteration_time_s()))
        if self.threshold_s is None:  # the last stage's median unit time caps the walk's threshold, once
            self._last_unit_s = statistics.median(t.end_s - t.start_s for t in measurement.stages[-1])
        if len(self._recent) < self.window:
            self._quiet()
            return self.plan
        waits = [[statistics.median(column) for column in zip(*rows)]
                 for rows in zip(*(w for w, _ in self._recent))]
        time_s = statistics.median(t for _, t in self._recent)
        path = self.measured_critical_path(waits, self._last_unit_s)
        if self.target_time_s is not None:
            late = time_s > self.target_time_s * (1 + self.time_tolerance)
            slack = time_s <= self.target_time_s  # hysteresis: lower only well inside the tolerance
        else:
            late = not self.on_envelope(path)
            slack = not late
        changed = False
        if late and self.policy != ReconfigPolicy.DEFAULT:
            changes = self._raise(path)
            if changes:
                pin = self._lowered_since_raise
                if pin:  # a lowering went too far: what is in force now stays
                    self.stack = [_Correction(c.changes, pinned=True) for c in self.stack]
                self.stack.append(_Correction(changes, pinned=pin))
                self._lowered_since_raise = False
                self.raises += 1
                changed = True
        elif slack and self.two_way and self.stack and not self.stack[-1].pinned:
            for s, i, old, _new in self.stack.pop().changes:
                self.freqs[s][i] = old
            self._lowered_since_raise = True
            self.lowers += 1
            changed = True
        if changed:
            self._recent = []
            self.finish_count = 0
        else:
            self._recent.pop(0)  # a sliding window while nothing changes
            self._quiet()
        return self.plan

    def measured_critical_path(self, recv_wait_s: Sequence[Sequence[float]],
                               unit_time_s: float | None = None) -> list[tuple[int, Unit]]:
        """EnvPipe's walk (envpipe.md §3.1) over measured receive waits.

        From stage 0's last unit: if the unit waited for its input at least the
        threshold, jump to the stage that produced it, else step to the previous
        unit of the same stage. Threshold: a noise floor, ``threshold_scale`` x the
        median non-zero wait on the last stage (EnvPipe: the smallest, which one quiet
        receive on a noisy host drives to ~0), fixed at the first call, with two
        corrections: the last stage's first unit is left out (its wait is the pipeline
        fill, not noise; with nothing else the floor is 0, as in an exact simulation),
        and it is capped at 1 % of the last stage's median unit time, so a noisy floor
        never hides the slack a plan keeps behind its slowed units (``unit_time_s``:
        that median, when known).
        """
        sched = self.schedule
        last = sched.num_stages - 1
        if self.threshold_s is None:
            nonzero = [w for w in recv_wait_s[last][1:] if w > 0]
            floor = self.threshold_scale * statistics.median(nonzero) if nonzero else 0.0
            self.threshold_s = floor if unit_time_s is None else min(floor, _THRESHOLD_CAP * unit_time_s)
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

