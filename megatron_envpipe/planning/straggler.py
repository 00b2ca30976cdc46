"""Following a straggler: when another data-parallel pipeline is slower, run slower clocks at its pace.

In data-parallel training every pipeline waits for the slowest one at the gradient all-reduce, blocking
at P2P power. A pipeline that is faster than the slowest one can instead run the minimum-energy plan for
the slowest one's pace (Perseus's "extrinsic" energy bloat): the iteration still lasts what the straggler
takes, and the time this pipeline would have spent waiting is spent at lower clocks.

Two pieces, both pure (no torch):

* :class:`StragglerFollower`: a state machine fed once per reconfiguration window with this pipeline's
  own pace and the slowest pace agreed over the data-parallel group. It decides whether to follow and at
  what pace, with a threshold to start (default 2 %), a lower one to stop (1 %: hysteresis, so noise
  around the threshold does not flip plans every window), and it is never slower than the slowest.
* :class:`FrontierPlans`: the time-energy frontier (:mod:`megatron_envpipe.planning.frontier`) computed
  once at start-up, in a background thread (:func:`start_background`; training never waits for it), and
  :meth:`FrontierPlans.plan_for` picks the plan for a target iteration time.

**Paces are natural paces.** Every pace compared here is what a pipeline takes *on its own plan*
(compute only, without the data-parallel wait). A pipeline that follows runs slower on purpose, so its
measured time is rescaled back (:func:`natural_time_s`) before it is reported to the group; otherwise
the follower would become the "slowest" itself and never release when the straggler recovers.
"""

from __future__ import annotations

import dataclasses
import math
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, NamedTuple, TypeVar

from megatron_envpipe.core.plan import FrequencyPlan
from megatron_envpipe.core.profile import Profile
from megatron_envpipe.core.timeline import PlanEvaluator
from megatron_envpipe.core.vocabulary import PlanType
from megatron_envpipe.planning.basis import PlannerConfig, PlannerError, planning_profile
from megatron_envpipe.planning.frontier import DEFAULT_POINTS, Frontier, compute_frontier
from megatron_envpipe.planning.planner import plan_envpipe
from megatron_envpipe.planning.switching import steady_clock_changes

T = TypeVar("T")


class StragglerError(PlannerError):
    """Bad straggler-following input: settings, a pace measurement or a target time."""


def _check_pace(name: str, value: float) -> float:
    if not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise StragglerError(f"{name} must be a finite time > 0 s, got {value!r}: pass a measured iteration time")
    return float(value)


@dataclass(frozen=True)
class FollowSettings:
    """When to follow the slowest pipeline (fractions of this pipeline's own pace)."""

    threshold: float = 0.02  # follow when the slowest is more than 2 % slower than this pipeline
    release: float = 0.01  # stop following when the slowest is within 1 % (below threshold: hysteresis)
    windows_to_switch: int = 1  # consecutive windows a change must hold before the plan changes
    # Follow at slowest x (1 - headroom): a window's noise then rarely puts the slowest below the target
    # (which would force a re-plan to stay never slower than the slowest). Costs ~headroom of the pace.
    # None: a quarter of the threshold (0.5 % at the default 2 %), so any threshold gets a valid one.
    headroom: float | None = None

    @property
    def headroom_fraction(self) -> float:
        """The headroom in use: the given one, else a quarter of the threshold."""
        return self.threshold / 4 if self.headroom is None else float(self.headroom)

    def __post_init__(self) -> None:
        if not (isinstance(self.threshold, (int, float)) and math.isfinite(self.threshold)
                and 0 < self.threshold < 1):
            raise StragglerError(f"straggler threshold must be a fraction in (0, 1), got {self.threshold!r} "
                                 "(e.g. 0.02 for 2 %)")
        if not (isinstance(self.release, (int, float)) and math.isfinite(self.release)
                and 0 <= self.release < self.threshold):
            raise StragglerError(f"straggler release must be in [0, threshold={self.threshold}), got "
                                 f"{self.release!r}: it must be below the threshold so following does not "
                                 "oscillate")
        if not isinstance(self.windows_to_switch, int) or isinstance(self.windows_to_switch, bool) \
                or self.windows_to_switch < 1:
            raise StragglerError(f"windows_to_switch must be an integer >= 1, got {self.windows_to_switch!r}")
        if self.headroom is not None and not (isinstance(self.headroom, (int, float)) and math.isfinite(self.headroom)
                                              and 0 <= self.headroom < self.threshold):
            raise StragglerError(f"straggler headroom must be in [0, threshold={self.threshold}), got "
                                 f"{self.headroom!r} (e.g. 0.005: follow 0.5 % faster than the slowest)")


@dataclass(frozen=True)
class PaceDecision:
    """What to run for the next window.

    ``target_time_s`` is the pace to follow (the slowest pipeline's natural pace less the headroom, never
    longer than the slowest), None when this pipeline runs its own plan. ``pace_ratio`` = target / own pace (1.0 when not following): multiply
    the own plan's *predicted* time by it to get the target in the planner's time base. ``changed`` is
    True when this decision differs from the previous one (a plan switch is due); ``reason`` says why, in
    one line, for the log.
    """

    follow: bool
    target_time_s: float | None
    reason: str
    pace_ratio: float = 1.0
    changed: bool = False


def natural_time_s(measured_time_s: float, running_predicted_s: float, own_predicted_s: float) -> float:
    """This pipeline's pace on its own plan, from a window measured while running another plan:
    the measurement scaled by (own plan's predicted time / running plan's predicted time)."""
    m = _check_pace("measured iteration time", measured_time_s)
    r = _check_pace("running plan's predicted time", running_predicted_s)
    o = _check_pace("own plan's predicted time", own_predicted_s)
    return m * o / r


class StragglerFollower:
    """Per pipeline: follow the slowest data-parallel pipeline's pace, with hysteresis.

    ``update`` is called once per window with this pipeline's natural pace and the slowest natural pace
    of the group (which includes this one). Rules (``h`` = headroom):

    * start following when slowest > own x (1 + threshold) for ``windows_to_switch`` windows in a row,
      at the target slowest x (1 - h);
    * stop when slowest <= own x (1 + release) for ``windows_to_switch`` windows in a row;
    * while following, the target is never longer than the slowest pace: it drops at once (to
      slowest x (1 - h)) when a window's slowest is below it, and rises only when the slowest exceeds
      it by more than the threshold, so window-to-window noise neither re-plans nor ratchets the pace;
    * the slowest pipeline itself (slowest <= own x (1 + threshold)) never starts following.
    """

    def __init__(self, settings: FollowSettings = FollowSettings(), own_time_s: float | None = None) -> None:
        if not isinstance(settings, FollowSettings):
            raise StragglerError(f"settings must be a FollowSettings, got {type(settings).__name__}")
        self.settings = settings
        self.own_time_s = None if own_time_s is None else _check_pace("own iteration time", own_time_s)
        self.following = False
        self.target_time_s: float | None = None
        self._streak = 0  # consecutive windows asking for the same pending change
        self._pending: str | None = None  # "follow", "release" or "raise"
        self.decisions = 0

    def _held(self, kind: str) -> bool:
        """Count a window asking for ``kind``; True once it has held ``windows_to_switch`` windows."""
        self._streak = self._streak + 1 if self._pending == kind else 1
        self._pending = kind
        if self._streak >= self.settings.windows_to_switch:
            self._pending, self._streak = None, 0
            return True
        return False

    def _idle(self) -> None:
        self._pending, self._streak = None, 0

    def update(self, own_time_s: float, slowest_time_s: float) -> PaceDecision:
        """The decision for the next window from this window's natural paces (see the module docstring)."""
        own = _check_pace("own iteration time", own_time_s)
        slowest = max(own, _check_pace("slowest pipeline's iteration time", slowest_time_s))
        self.own_time_s = own
        self.decisions += 1
        s = self.settings
        gap = slowest / own - 1.0
        pct = f"{100 * gap:.2f} %"
        aim = slowest * (1.0 - s.headroom_fraction)
        if not self.following:
            if slowest > own * (1 + s.threshold):
                if self._held("follow"):
                    self.following, self.target_time_s = True, aim
                    return self._decide(True, f"slowest pipeline is {pct} slower (> {100 * s.threshold:g} %): "
                                              f"following its pace, {aim:.6g} s")
                return self._decide(False, f"slowest pipeline is {pct} slower: following after "
                                           f"{s.windows_to_switch - self._streak} more window(s)", changed=False)
            self._idle()
            if slowest == own:
                return self._decide(False, "this pipeline is the slowest: keeps its own plan", changed=False)
            return self._decide(False, f"slowest pipeline is {pct} slower (<= {100 * s.threshold:g} %): own plan",
                                changed=False)
        target = self.target_time_s
        assert target is not None
        if slowest <= own * (1 + s.release):
            if self._held("release"):
                self.following, self.target_time_s = False, None
                return self._decide(False, f"straggler recovered (slowest {pct} slower, <= "
                                           f"{100 * s.release:g} %): back to own plan")
            if slowest < target:  # release pending, but never slower than the slowest meanwhile
                self.target_time_s = aim
                return self._decide(True, f"slowest {pct} slower, release pending: following at {aim:.6g} s")
            return self._decide(True, f"slowest {pct} slower: release pending", changed=False)
        if slowest < target:  # never slower than the slowest: lower at once
            self._idle()
            self.target_time_s = aim
            return self._decide(True, f"slowest pipeline sped up to {slowest:.6g} s: following at {aim:.6g} s")
        if slowest > target * (1 + s.threshold):
            if self._held("raise"):
                self.target_time_s = aim
                return self._decide(True, f"slowest pipeline slowed to {slowest:.6g} s ({pct} slower): "
                                          f"following at {aim:.6g} s")
            return self._decide(True, f"slowest pipeline slowed to {slowest:.6g} s: pace change pending",
                                changed=False)
        self._idle()
        return self._decide(True, f"following the slowest pipeline ({pct} slower) at {target:.6g} s",
                            changed=False)

    def _decide(self, follow: bool, reason: str, changed: bool = True) -> PaceDecision:
        own = self.own_time_s or 1.0
        target = self.target_time_s if follow else None
        return PaceDecision(follow=follow, target_time_s=target, reason=reason,
                            pace_ratio=(target / own) if target is not None else 1.0, changed=changed)


class PacePlan(NamedTuple):
    """The plan for a target pace, its predicted iteration time (<= target) and energy when iterations
    last the target (the wait until then charged at P2P power, as :meth:`Frontier.pick`)."""

    plan: FrequencyPlan
    predicted_time_s: float
    predicted_energy_j: float


@dataclass(frozen=True)
class FrontierPlans:
    """The start-up frontier, ready to give the plan for any pace (planner time base, seconds)."""

    frontier: Frontier

    @property
    def fastest_time_s(self) -> float:
        return self.frontier.points[0].time_s

    def plan_for(self, target_time_s: float) -> PacePlan:
        """The minimum-energy frontier plan when iterations last ``target_time_s``: the slowest plan not
        slower than it (a target faster than the fastest plan gets the fastest plan, never an error: a
        pipeline cannot be faster than all its units at f_max)."""
        target = _check_pace("target iteration time", target_time_s)
        point, energy_j, _ = self.frontier.pick(max(target, self.fastest_time_s))
        return PacePlan(point.plan, point.time_s, energy_j)


def _compute_frontier_plans(
    profile: Profile,
    num_microbatches: int,
    config: PlannerConfig = PlannerConfig("optimal", "ours", "default"),
    points: int = DEFAULT_POINTS,
    num_stages: int | None = None,
) -> FrontierPlans:
    """The frontier of ``profile`` (blocking): what :func:`start_background` runs in its thread."""
    return FrontierPlans(compute_frontier(profile, num_microbatches, config, points=points, num_stages=num_stages))


def _replan_for_pace(
    profile: Profile,
    num_microbatches: int,
    target_time_s: float,
    config: PlannerConfig = PlannerConfig("optimal", "ours", "default"),
    num_stages: int | None = None,
) -> PacePlan:
    """The direct minimum-energy plan for ``target_time_s`` (``--envpipe-target-time``): a fraction of a
    second at P = 4; better than the frontier beyond its last point (the LP valley), where the frontier
    can only offer its slowest plan. Scored by the timeline simulation plus the clock changes it keeps,
    stretched to the target."""
    target = _check_pace("target iteration time", target_time_s)
    cfg = dataclasses.replace(config, plan_type=PlanType.OPTIMAL, max_slowdown=0.0, target_time_s=target)
    res = plan_envpipe(profile, num_microbatches, cfg, num_stages)
    p2p = cfg.effective_p2p_power_w
    sc = PlanEvaluator(res.plan.schedule, planning_profile(profile, cfg), p2p).score(res.plan.flat())
    energy_j = sc.energy_j + cfg.effective_switch_cost_j * sum(steady_clock_changes(res.plan))
    stages = res.plan.schedule.num_stages
    return PacePlan(res.plan, sc.iteration_time_s,
                    energy_j + p2p * stages * max(0.0, target - sc.iteration_time_s))


class BackgroundResult(Generic[T]):
    """A computation running in a background thread: poll :meth:`ready`, then :meth:`result`."""

    def __init__(self) -> None:
        self._done = threading.Event()
        self._value: T | None = None
        self._error: BaseException | None = None

    def _run(self, compute: Callable[[], T]) -> None:
        try:
            self._value = compute()
        except BaseException as exc:  # noqa: BLE001 - handed to the caller of result(), not lost in the thread
            self._error = exc
        finally:
            self._done.set()

    def ready(self) -> bool:
        """True once the computation is done (or failed): :meth:`result` then returns at once."""
        return self._done.is_set()

    def result(self, timeout_s: float | None = None) -> T:
        """The value; waits up to ``timeout_s`` (None: until done). Re-raises the thread's error."""
        if not self._done.wait(timeout_s):
            raise StragglerError(f"the background plan is not ready after {timeout_s} s: poll ready() "
                                 "and keep the current plan until it is")
        if self._error is not None:
            raise self._error
        return self._value  # type: ignore[return-value]


FrontierHandle = BackgroundResult  # what start_background returns: BackgroundResult[FrontierPlans]


def _run_in_background(compute: Callable[[], T], name: str = "envpipe-frontier") -> BackgroundResult[T]:
    """Run ``compute`` in a daemon thread; return its handle at once."""
    handle: BackgroundResult[T] = BackgroundResult()
    threading.Thread(target=handle._run, args=(compute,), name=name, daemon=True).start()
    return handle


def start_background(
    profile: Profile,
    num_microbatches: int,
    config: PlannerConfig = PlannerConfig("optimal", "ours", "default"),
    points: int = DEFAULT_POINTS,
    num_stages: int | None = None,
) -> BackgroundResult[FrontierPlans]:
    """Start computing the frontier in a daemon thread and return at once (training never waits).

    Pure Python planning holds the GIL most of the time, so the training thread's Python work is
    slowed while it runs (seconds at start-up, see docs/stragglers.md); GPU work is not."""
    return _run_in_background(lambda: _compute_frontier_plans(profile, num_microbatches, config, points, num_stages))
