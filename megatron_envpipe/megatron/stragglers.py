"""Data-parallel stragglers at run time: a simulated slow replica, detecting the slowest pipeline, following it.

Every pipeline waits for the slowest one at the gradient sync. After each planned iteration every rank
hands :meth:`StragglerFollow.after_iteration` its pipeline's own iteration time (without that wait: the
device time in virtual time, :mod:`~megatron_envpipe.megatron.device_time`; else the wall time up to the
gradient sync). Once per window (``--envpipe-straggler-window`` iterations):

* the last stage of every pipeline launches one all-gather of its window's mean pace over the
  data-parallel group, asynchronously, and reads it at the *next* window, when every replica has long
  contributed (a whole window of gradient syncs later), so nobody waits at it (never more often than the
  window; the same collectives in the same order on every replica);
* the last stage decides with :class:`~megatron_envpipe.planning.straggler.StragglerFollower` (threshold,
  hysteresis, never slower than the slowest; the slowest pipeline keeps its own plan) and, once the
  start-up frontier is ready (:func:`~megatron_envpipe.planning.straggler.start_background`, computed in a
  thread on the last stage: training never waits), picks the plan for that pace;
* every rank of the pipeline receives the decision (plan, or back to the own plan) in one gather over the
  pipeline group, so all stages switch at the same iteration to the same plan.

Paces are natural paces (:func:`~megatron_envpipe.planning.straggler.natural_time_s`): a follower reports
what it would take on its own plan, so it never becomes "the slowest" itself and releases when the
straggler recovers. The energy line says whom a pipeline follows, at what pace and what it saves.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from megatron_envpipe.config.groups import StragglerSettings
from megatron_envpipe.core.energy_report import SLOWER_THAN_PLANNED, EnergyReport
from megatron_envpipe.core.kinds import plan_kind
from megatron_envpipe.core.plan import FrequencyPlan
from megatron_envpipe.megatron.groups import StageGroups
from megatron_envpipe.megatron.run_parts import IterationStep
from megatron_envpipe.megatron.runtime import EnvPipeRuntime
from megatron_envpipe.planning.straggler import (
    FollowSettings,
    FrontierHandle,
    StragglerFollower,
    natural_time_s,
    start_background,
)
from megatron_envpipe.planning.switching import steady_clock_changes

__all__ = ["SimStraggler", "StragglerFollow"]

log = logging.getLogger("megatron_envpipe")


def _replica_of(groups: StageGroups) -> tuple[int, int]:
    """(this rank's data-parallel replica, the number of replicas)."""
    g = groups.replicas
    return (g.rank(), g.size()) if g is not None else (0, 1)


def _apply_sim_straggler(config: StragglerSettings, hooks: Any, groups: StageGroups, iteration: int) -> None:
    """``--envpipe-sim-straggler``: slow this rank's simulated GPU if it belongs to the straggling replica
    and ``iteration`` (0-based) has reached the start iteration; the replica is checked on every rank."""
    sim = config.sim_straggler
    if sim is None:
        return
    replica, size = _replica_of(groups)
    config.check_replicas(size)  # the same EnvPipeConfigError on every rank, before any unit runs
    device = getattr(hooks, "device", None)
    modelled = device is not None and hasattr(device, "capabilities") and device.capabilities().modelled
    if replica == sim.replica and modelled and iteration >= sim.start_iteration:
        if device.slowdown != sim.factor:
            log.info("EnvPipe: simulated straggler: replica %d's GPU (stage %d) runs every unit %gx longer from "
                     "iteration %d", replica, groups.stage, sim.factor, iteration + 1)
        device.slowdown = sim.factor


@dataclass(frozen=True)
class SimStraggler:
    """``--envpipe-sim-straggler`` as a part of the run: slows the straggling replica's GPU as each iteration
    begins (:func:`_apply_sim_straggler`)."""

    settings: StragglerSettings

    def begin_iteration(self, step: IterationStep) -> None:
        _apply_sim_straggler(self.settings, step.hooks, step.groups, step.iteration)

    def end_iteration(self, step: IterationStep) -> None:
        pass


@dataclass(frozen=True)
class _PaceSwitch:
    """The last stage's decision, sent to every stage: run ``plan`` (None: back to the own plan)."""

    plan: FrequencyPlan | None
    predicted_time_s: float | None  # the plan's predicted iteration time (planner time base)
    pace_s: float | None  # the pace it follows, planner time base: what the energy line compares with
    note: str | None  # for the energy line: whom it follows, at what pace, what it saves


@dataclass
class _Tally:
    """Log windows added up: energy and time per iteration, weighted by their iterations."""

    energy_j: float = 0.0
    time_s: float = 0.0
    iterations: int = 0
    first: int = 0  # 1-based iterations covered (the first and the last window's)
    last: int = 0

    def add(self, report: EnergyReport) -> None:
        self.first = self.first or report.first_iteration
        self.last = report.iteration
        self.energy_j += report.energy_j * report.iterations
        self.time_s += report.time_s * report.iterations
        self.iterations += report.iterations

    def mean(self) -> tuple[float, float]:
        return self.energy_j / self.iterations, self.time_s / self.iterations

    def span(self) -> str:
        return f"iterations {self.first}-{self.last}" if self.first != self.last else f"iteration {self.last}"


@dataclass
class _FollowLedger:
    """What following a straggler measurably saves, in this run: a pipeline's energy per iteration while it
    waited for the slowest replica on its own plan (planned windows slower than the plan) against while it
    ran the plan for that replica's pace. Both at the straggler's pace: said only when their times agree."""

    waiting: _Tally = field(default_factory=_Tally)
    following: _Tally = field(default_factory=_Tally)
    whom: int | None = None  # the replica followed
    told: bool = False  # the first comparison was logged
    summarized: bool = False
    at_exit: bool = False  # the run's exit summarises it (claim_exit_summary)

    def claim_exit_summary(self) -> bool:
        """True once, when following has run and nothing is summarised yet: the caller registers the summary
        for the run's exit."""
        if self.at_exit or self.summarized or not self.following.iterations:
            return False
        self.at_exit = True
        return True

    def summary(self, simulated: bool, replica: int) -> str | None:
        """The comparison for the run's summary, once (None: already given, or none to make)."""
        line = None if self.summarized else self.comparison(simulated, replica)
        self.summarized = self.summarized or line is not None
        return line

    def comparison(self, simulated: bool, replica: int) -> str | None:
        if not self.waiting.iterations or not self.following.iterations or self.whom is None:
            return None
        (wait_j, wait_s), (follow_j, follow_s) = self.waiting.mean(), self.following.mean()
        if abs(follow_s / wait_s - 1) > SLOWER_THAN_PLANNED:  # not the same pace: no like-for-like figure
            return None
        label = " (simulated)" if simulated else ""
        return (f"replica {replica} | following replica {self.whom}'s pace: {follow_j:.1f} J per iteration "
                f"({self.following.span()}, {follow_s:.3f} s) vs {wait_j:.1f} J waiting for it on its own plan "
                f"({self.waiting.span()}, {wait_s:.3f} s): {100 * (1 - follow_j / wait_j):.1f} % less energy per "
                f"iteration than waiting (measured in this run{label and ', simulated'})")


class StragglerFollow:
    """One process's straggler detection and following (one per run, megatron/training_run.py). It owns
    the plan for the slowest pipeline's pace that replaces the own plan (the same on every stage of the
    pipeline; the run hands it to the phase machine's prepare()), its predicted time and energy-line note,
    and ``dp_wait``; it reads the phase machine (``runtime``) and never writes it."""

    def __init__(self, runtime: EnvPipeRuntime) -> None:
        cfg = runtime.config
        self.runtime = runtime
        self.pace_plan: FrequencyPlan | None = None  # following a straggler: its pace's plan (None: the own)
        self.pace_time_s: float | None = None  # the pace it follows, planner time base
        self.pace_note: str | None = None  # for the energy line: whom it follows, at what pace, what it saves
        # (slowest replica, its pace s) while the last agreement found this pipeline waiting for a slower one
        # at the gradient sync (followed or not): iterations then last longer than planned, and that is why.
        self.dp_wait: tuple[int, float] | None = None
        self.window = max(1, cfg.straggler_window)
        # Release at half the threshold: hysteresis, so noise around the threshold does not flip plans.
        self.follower = StragglerFollower(FollowSettings(threshold=cfg.straggler_threshold,
                                                         release=cfg.straggler_threshold / 2))
        self.frontier: FrontierHandle | None = None
        self.failed = False  # the frontier could not be computed: keep the own plan
        self._sum_s = 0.0  # natural pace summed over the window so far
        self._count = 0  # iterations of the window so far
        self._measured = 0  # of those, with a measured pace
        self._pending: tuple[Any, list[torch.Tensor], float] | None = None  # (work, buffers, own pace sent)
        self.applied_target_s: float | None = None  # the pace the running plan follows (measured seconds)
        self.running_predicted_s: float | None = None  # the running follow plan's predicted time
        self.switches = 0
        self.engaged = False  # detection ran on a planned iteration: replicas compare paces
        self.agreed = False  # a comparison of paces was read (the last stage)
        self.pace_setter: tuple[float, float] | None = None  # this pipeline is the slowest: (its pace, the fastest's)
        self.told_pace_setter = False
        self.state_since = 0  # 0-based first iteration under the running plan (own or a pace's)
        self.ledger = _FollowLedger()

    # -- every rank ---------------------------------------------------------------------
    def begin_iteration(self, step: IterationStep) -> None:
        pass

    def end_iteration(self, step: IterationStep) -> None:
        """The run's end of an iteration: :meth:`after_iteration` (switches from the next iteration on)."""
        self.after_iteration(step.groups, step.iteration, step.own_time_s)

    def active(self, groups: StageGroups, iteration: int) -> bool:
        """Whether detection applies: data parallelism, ``--envpipe-type optimal`` (the frontier's plans are
        optimal ones), clocks set, a plan running (not corrected online): facts every rank of every pipeline
        shares, so they all join the collectives or none does. With ``--no-envpipe-follow-stragglers`` the
        pipelines still agree on the slowest pace (the energy line then knows why iterations last longer
        than planned), but never switch plans."""
        rt = self.runtime
        result = rt.last_result
        return (plan_kind(rt.config.plan_type).follows_stragglers
                and groups.replicas is not None and rt.sets_clocks
                and rt.device is not None and rt.device.control and rt.is_planned_iteration(iteration)
                and result is not None and result.plan is not None and rt.planned_with is not None
                and not rt.reconfiguring)

    def after_iteration(self, groups: StageGroups, iteration: int, own_time_s: float | None) -> None:
        """After iteration ``iteration`` (0-based) on every rank; ``own_time_s``: the pipeline's own
        iteration time in device seconds (None: not measured)."""
        if not self.active(groups, iteration):
            return
        self.engaged = True
        if groups.last and self.frontier is None and not self.failed and self.runtime.config.follow_stragglers:  # at once: ready by the first decision
            profile, m, pcfg = self.runtime.planned_with
            self.frontier = start_background(profile, m, pcfg,
                                             num_stages=self.runtime.last_result.schedule.num_stages)
        own_pred = self.runtime.last_result.score.iteration_time_s
        running = self.running_predicted_s or own_pred
        if own_time_s is not None and own_time_s > 0:  # windows count every iteration, on every stage alike
            self._sum_s += natural_time_s(own_time_s, running, own_pred)
            self._measured += 1
        self._count += 1
        if self._count < self.window:
            return
        pace_s = self._sum_s / self._measured if self._measured else None
        self._sum_s, self._count, self._measured = 0.0, 0, 0
        switch = self._decide(groups, pace_s) if groups.last else None
        switch = groups.gather_stages(switch)[-1]  # the last stage's decision, on every stage
        for group in groups.model_parallel:  # tensor/context-parallel peers take their first rank's
            box = [switch]
            dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0), group=group)
            switch = box[0]
        if switch is not None:
            self._apply(switch)
            self.state_since = iteration + 1

    def _apply(self, switch: _PaceSwitch) -> None:
        self.pace_plan, self.pace_note, self.pace_time_s = switch.plan, switch.note, switch.pace_s
        self.running_predicted_s = switch.predicted_time_s
        self.switches += 1

    # -- a pipeline's last stage, at a log point (reporting) ------------------------------
    def note_window(self, groups: StageGroups, report: EnergyReport, replica: int) -> str | None:
        """Add a planned log window to the ledger (windows wholly under one plan only); the comparison, the
        first time there is one (to log once), else None."""
        # Asked here too: the energy log comes before after_iteration on a plan's first iteration.
        self.engaged = self.engaged or self.active(groups, report.iteration - 1)
        if report.planned_time_s is None or report.first_iteration - 1 < self.state_since:
            return None
        if self.pace_plan is not None:
            self.ledger.following.add(report)
        elif self.pace_setter is None and report.time_s > report.planned_time_s * (1 + SLOWER_THAN_PLANNED):
            self.ledger.waiting.add(report)  # own plan, slower than planned: waiting at the gradient sync
        line = None if self.ledger.told else self.ledger.comparison(report.simulated, replica)
        self.ledger.told = self.ledger.told or line is not None
        return line

    def explains_slow_window(self, report: EnergyReport, replica: int) -> tuple[bool, str | None]:
        """For a window slower than planned: (whether data parallelism explains it, a line to log once).

        Until the replicas first compared paces nobody knows who waits for whom: held. The slowest
        pipeline (the pace-setter) says so once; a waiting one is handled by the caller (``dp_wait``)."""
        if not self.engaged:
            return False, None
        if not self.agreed:
            return True, None
        if self.pace_setter is None:
            return False, None
        if self.told_pace_setter:
            return True, None
        self.told_pace_setter = True
        pace_s, fastest_s = self.pace_setter
        label = " (simulated)" if report.simulated else ""
        others = "follow its pace" if self.runtime.config.follow_stragglers else "wait for it at the gradient sync"
        return True, (f"EnvPipe{label} | replica {replica}: {report.span()} lasted {report.time_s:.3f} s, not the "
                      f"planned {report.planned_time_s:.3f} s: this pipeline is the data-parallel pace-setter, the "
                      f"slowest replica (pace {pace_s:.3f} s, the fastest {fastest_s:.3f} s; its own GPUs run slower "
                      f"than its profile says); the other replicas {others}. Said once, not every line")

    def settle(self) -> None:
        """Wait for the gather in flight, if any (tests; a run never needs to: it reads it a window later)."""
        if self._pending is not None:
            self._pending[0].wait()

    # -- the last stage -----------------------------------------------------------------
    def _decide(self, groups: StageGroups, pace_s: float | None) -> _PaceSwitch | None:
        """Read last window's gather, launch this window's; the switch to make, or None.

        Every replica launched last window's gather at the same iteration and has been through a whole
        window of gradient syncs since, so it is complete: waiting costs nothing and keeps every replica's
        collectives in one order (NCCL needs that: the group is Megatron's data-parallel group)."""
        replica, size = _replica_of(groups)
        switch = None
        if self._pending is not None:
            work, buffers, sent = self._pending
            work.wait()
            self._pending = None
            times = [float(b.item()) for b in buffers]
            known = [t for t in times if math.isfinite(t)]  # NaN: a replica that measured nothing
            if math.isfinite(sent) and known:
                slowest = max(known)
                slow_replica = times.index(slowest)
                self.agreed = True
                fastest = min(known)
                leads = slow_replica == replica and slowest > fastest * (1 + self.follower.settings.threshold)
                self.pace_setter = (slowest, fastest) if leads else None
                # This pipeline waits for a slower one at the gradient sync: its iterations last longer
                # than planned for that reason (the energy line says so once instead of warning).
                waits = slow_replica != replica and slowest > sent * (1 + SLOWER_THAN_PLANNED)
                self.dp_wait = (slow_replica, slowest) if waits else None
                if self.runtime.config.follow_stragglers:
                    decision = self.follower.update(sent, slowest)
                    if decision.changed:
                        log.info("EnvPipe replica %d: %s", replica, decision.reason)
                    switch = self._switch_for(decision.target_time_s, slow_replica, sent, slowest)
        if self._pending is None:  # always: one gather per window on every replica
            mine = torch.tensor([math.nan if pace_s is None else pace_s], dtype=torch.float64)
            buffers = [torch.zeros(1, dtype=torch.float64) for _ in range(size)]
            if groups.replicas is not None and dist.get_backend(groups.replicas) == "nccl":
                device = torch.device("cuda", torch.cuda.current_device())
                mine, buffers = mine.to(device), [b.to(device) for b in buffers]
            work = dist.all_gather(buffers, mine, group=groups.replicas, async_op=True)
            self._pending = (work, buffers, math.nan if pace_s is None else pace_s)
        return switch

    def _switch_for(self, target_s: float | None, slowest_replica: int, own_s: float,
                    slowest_s: float) -> _PaceSwitch | None:
        """The switch to ``target_s`` (None: the own plan) if it differs from the running one and can be
        made (the frontier is ready; until then the own plan keeps running)."""
        if target_s == self.applied_target_s:
            return None
        if target_s is None:
            self.applied_target_s = None
            return _PaceSwitch(None, None, None, None)
        frontier = self._frontier()
        if frontier is None:
            return None
        result = self.runtime.last_result
        own_pred = result.score.iteration_time_s
        target_pred = own_pred * target_s / own_s  # in the planner's time base
        pace = frontier.plan_for(target_pred)
        cost_j = self.runtime.planned_with[2].effective_switch_cost_j
        stretched = _waiting_energy_j(result.score.energy_j, result.plan, cost_j, own_pred, target_pred,
                                     frontier.frontier.p2p_power_w, frontier.frontier.num_stages)
        note = (f"following replica {slowest_replica}'s pace {slowest_s:.3f} s (+{100 * (slowest_s / own_s - 1):.1f} %), "
                f"saving {stretched - pace.predicted_energy_j:.1f} J/iter vs not following (predicted)")
        log.info("EnvPipe: %s: plan for %.4g s (predicted %.4g s)", note, target_pred, pace.predicted_time_s)
        self.applied_target_s = target_s
        self.ledger.whom = slowest_replica
        return _PaceSwitch(pace.plan, pace.predicted_time_s, target_pred, note)

    def _frontier(self) -> Any:
        handle = self.frontier
        if handle is None or self.failed or not handle.ready():
            return None
        try:
            return handle.result(0)
        except Exception as exc:  # noqa: BLE001 - a planner failure must not stop training
            self.failed = True
            log.warning("EnvPipe: the start-up frontier failed (%s): not following stragglers", exc)
            return None


def _waiting_energy_j(energy_j: float, plan: FrequencyPlan, switch_cost_j: float, time_s: float,
                     target_s: float, p2p_power_w: float, num_stages: int) -> float:
    """Energy per iteration of not following: the own plan's (``energy_j`` in ``time_s``) plus the clock
    changes it keeps, as the frontier's plans count theirs, then every stage blocking at P2P power until
    the straggler is done at ``target_s`` (planner time base)."""
    switches_j = switch_cost_j * sum(steady_clock_changes(plan))
    return energy_j + switches_j + p2p_power_w * num_stages * max(0.0, target_s - time_s)
