"""``--compat perseus``: EnvPipe exactly as Perseus (SOSP '24) re-implemented it.

Perseus's artifact ships an offline EnvPipe (``lowtime/scripts/envpipe.py`` on
the ``kronos`` branch of ``ml-energy/zeus``, Apache-2.0) and reports EnvPipe's
numbers with it. This module reproduces that procedure on top of our own
schedule/profile/timeline code, so our planner can be compared with the
numbers in the Perseus paper and artifact. Nothing of Lowtime or networkx is
imported; the behaviour below is re-derived from reading the script.

What Perseus does (and what we do here)
---------------------------------------
* **Options per (stage, instruction).** Every profiled clock is an option
  ``(time, energy)``; its duration in time units is ``quant = time // tau``
  (Python float floor division, ``tau`` = 1 ms by default; note ``//`` and
  ``floor(time / tau)`` differ on some inputs, e.g. ``1.0 // 0.1 == 9`` and
  ``2.0 // 1e-3 == 1999``).
  The *candidate* options are the strictly Pareto-optimal ones (no other option
  is faster *and* cheaper), then one per quantised duration (the most expensive
  of each bucket: on the Pareto front that is the fastest, whose real time is
  closest to the quantised one). Candidates are only used for the start clock: the slowest candidate.
* **Start plan (1F1B).** The outer envelope (whole last stage, every ``F0``,
  every ``B(M-1)``) runs at ``f_max``, the highest clock in the profile; every
  other unit at its instruction's start clock.
* **Loop.** Durations are the quantised integers. The zero-slack (critical)
  sub-DAG is computed; of its source-to-sink paths Perseus takes the *first*
  one networkx enumerates. Because of how Lowtime converts the graph to
  activity-on-arc form, that path is the greedy walk from ``F(0, 0)`` that at
  every unit steps to the critical successor visited first by a breadth-first
  search of the activity-on-node DAG whose successor lists are ordered
  ``[next unit on the same stage, cross-stage consumer]``; a successor ``w`` of
  ``v`` is critical iff ``EF(v) == LS(w)``. Every unit on that path running at
  the path's minimum clock is raised by one step (+15 MHz on A40/A100; here the
  profile's own clock spacing unless ``step_mhz`` is given), unless that would
  exceed ``f_max``. The loop ends when every unit on the path is in the outer
  envelope.
* **No-progress guard.** When the path leaves the envelope but every unit on it
  already runs at ``f_max`` (Bloom: the last stage is *not* the heaviest),
  Perseus changes nothing and picks the same path again until its 10,000
  iteration cap — in its own words it is "not going to terminate anyway". The
  state is a fixed point, so we stop at the first such iteration and say
  ``stalled``; Perseus's reported Bloom numbers are exactly this state.
* **Final plan.** Envelope units are forced to ``f_max`` (a no-op in practice,
  they never leave it).
* **Reported numbers** (what Perseus's log prints for the last iteration, and
  what its ``envpipe_result.csv`` holds):

  - iteration time ``T`` = the sum of the *real* (unquantised) profiled times
    of the units on the chosen critical path — not a simulated makespan (it is
    at most the real makespan, since the path was chosen on quantised times);
  - energy ``E = sum_stages [ sum_units E(f) + k * (T - sum_units t(f)) * P_p2p ]``,
    where Perseus hard-codes ``k = 8``. That factor is the emulation's
    ``energy_scale / time_scale = 80 / 10`` (the profiles are pre-scaled by
    time x10, energy x80; ``SOURCES.md``), i.e. the blocking power scales with
    energy/time. Pass ``p2p_power_w`` = the raw blocking power (70.38 W on A40)
    and ``p2p_power_scale = energy_scale / time_scale``; the effective blocking
    power ``p2p_power_w * p2p_power_scale`` (563.04 W for the A40 emulation)
    is also what our own scoring uses.

API
---
:func:`plan_envpipe_perseus` returns a :class:`PerseusCompatResult`:

* ``result`` — a regular :class:`~megatron_envpipe.planning.planner.PlanResult`: the
  final plan, its exact simulated timeline/score and the 1F1B-at-``f_max``
  baseline, both scored by :class:`~megatron_envpipe.core.timeline.PlanEvaluator`
  (makespan, Perseus's energy formula) with the effective blocking power;
  ``iterations``, ``converged``, ``stop_reason`` (``"outer envelope
  reached"`` or ``"stalled: ..."``), ``planner_seconds``. Its ``valley_mhz``
  holds, per stage, the lower of the forward/backward start clocks (the
  per-instruction pair is in ``start_clocks_mhz``).
* ``reported_time_s`` / ``reported_energy_j`` — the numbers exactly as Perseus
  computes and reports them; ``reported_baseline_time_s`` /
  ``reported_baseline_energy_j`` — the same convention for 1F1B at ``f_max``.
* ``iterations`` (Perseus's loop index at the end = reconfiguration steps
  applied), ``step_mhz``, ``unit_time_s``, ``p2p_power_w`` (effective),
  ``critical_path`` (the last chosen path, ``(stage, Unit)`` from ``F(0,0)``).

:func:`_plan_envpipe_perseus_emulation` applies Perseus's emulation scaling
(time x10, energy x80, blocking power x8) and calls the planner.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from megatron_envpipe.core.graph import earliest_times, latest_times, successors
from megatron_envpipe.core.plan import FrequencyPlan
from megatron_envpipe.core.profile import Profile
from megatron_envpipe.core.schedule import Unit, one_f_one_b
from megatron_envpipe.core.timeline import PipelineGraph, PlanEvaluator, outer_envelope
from megatron_envpipe.core.vocabulary import INSTRUCTIONS
from megatron_envpipe.planning.basis import SLOWDOWN_WARNING, PlannerConfig, PlannerError, PlanResult
from megatron_envpipe.planning.compat_perseus_options import (  # noqa: F401 (re-exported: this module's API)
    PerseusOption,
    candidate_options,
    clock_step_mhz,
    quantize,
    start_clock,
)

# Perseus's large-scale emulation (evaluation.ipynb, SOURCES.md): profiles are
# scaled by time x10 and energy x10*tp (tp = 8).
_PERSEUS_EMULATION_TIME_SCALE = 10.0
_PERSEUS_EMULATION_ENERGY_SCALE = 80.0
# Raw P2P blocking power hard-coded in the artifact scripts, W.
_PERSEUS_P2P_POWER_W = {"a40": 70.38, "a100": 83.64}
_PERSEUS_UNIT_TIME_S = 1e-3
_PERSEUS_MAX_ITERATIONS = 10_000  # the script's own cap (it has no stall guard)

_STOP_ENVELOPE = "outer envelope reached"


@dataclass
class PerseusCompatResult:
    """A Perseus-compatible EnvPipe plan and the numbers Perseus would report."""

    result: PlanResult
    reported_time_s: float
    reported_energy_j: float
    reported_baseline_time_s: float
    reported_baseline_energy_j: float
    iterations: int
    step_mhz: int
    unit_time_s: float
    p2p_power_w: float  # effective: raw x p2p_power_scale
    start_clocks_mhz: tuple[tuple[int, int], ...]  # per stage: (forward, backward)
    critical_path: tuple[tuple[int, Unit], ...]

    @property
    def converged(self) -> bool:
        return self.result.converged

    @property
    def stop_reason(self) -> str:
        return self.result.stop_reason

    @property
    def reported_energy_saving(self) -> float:
        return 1.0 - self.reported_energy_j / self.reported_baseline_energy_j

    @property
    def reported_slowdown(self) -> float:
        return self.reported_time_s / self.reported_baseline_time_s - 1.0

    def summary(self) -> str:
        r = self.result
        return (
            f"perseus-compat EnvPipe: T = {self.reported_time_s:.3f} s, E = {self.reported_energy_j:.3f} J "
            f"(baseline {self.reported_baseline_time_s:.3f} s, {self.reported_baseline_energy_j:.3f} J; "
            f"saving {100 * self.reported_energy_saving:.2f}%, slowdown {100 * self.reported_slowdown:.2f}%) "
            f"after {self.iterations} iterations, {r.stop_reason}; step {self.step_mhz} MHz, "
            f"unit {self.unit_time_s * 1e3:g} ms, P_p2p {self.p2p_power_w:.2f} W"
        )


class _PerseusDag:
    """The 1F1B DAG with Perseus's durations, critical path and report."""

    def __init__(self, graph: PipelineGraph) -> None:
        self.graph = graph
        n = len(graph.nodes)
        self.n = n
        if any(len(lst) > 1 for lst in graph.cross_preds):
            raise PlannerError("perseus compat expects plain 1F1B dependencies")
        self.order = list(graph.order)
        self.preds = graph.preds
        self.succs_with_latency = successors(graph.preds)
        # Successors in Lowtime's AON insertion order: same-stage next, then cross-stage.
        stage_of = graph.stage_of
        aon_succs = [
            sorted((w for w, _ in succ), key=lambda w, s=stage_of[v]: stage_of[w] != s)
            for v, succ in enumerate(self.succs_with_latency)
        ]
        sources = [v for v in range(n) if not graph.preds[v]]
        sinks = [v for v in range(n) if not aon_succs[v]]
        if len(sources) != 1 or len(sinks) != 1:
            raise PlannerError("perseus compat expects a 1F1B DAG with one first and one last unit")
        self.source, self.sink = sources[0], sinks[0]
        # Breadth-first visiting order from the source; the AOA conversion leaves
        # every unit's successors ordered by it, and networkx's first path follows it.
        rank = [-1] * n
        rank[self.source] = 0
        queue = deque([self.source])
        counter = 1
        while queue:
            v = queue.popleft()
            for w in aon_succs[v]:
                if rank[w] < 0:
                    rank[w] = counter
                    counter += 1
                    queue.append(w)
        self.succs = [sorted(s, key=rank.__getitem__) for s in aon_succs]
        # Perseus's envelope test is our outer envelope: last stage, every F0, every B(M-1).
        envelope = outer_envelope(graph.schedule)
        self.is_envelope = [node in envelope for node in graph.nodes]

    def critical_path(self, dur: Sequence[int]) -> list[int]:
        """Perseus's chosen zero-slack path (node indices, source to sink).

        The arc v -> w is critical iff v's earliest finish is w's latest start
        for the makespan (EF(v) == LS(w)). Durations are whole time units, so
        the float sums are exact and the test is an exact equality.
        """
        _, finish = earliest_times(self.order, self.preds, dur)
        latest_start, _ = latest_times(self.order, self.succs_with_latency, dur, finish[self.sink])
        succs = self.succs
        v = self.source
        path = [v]
        while v != self.sink:
            ef = finish[v]
            for w in succs[v]:
                if ef == latest_start[w]:
                    v = w
                    break
            else:  # pragma: no cover - impossible for a consistent DAG
                raise AssertionError("critical path walk lost the critical sub-DAG")
            path.append(v)
        return path


def plan_envpipe_perseus(
    profile: Profile,
    num_microbatches: int,
    p2p_power_w: float,
    unit_time_s: float = _PERSEUS_UNIT_TIME_S,
    step_mhz: int | None = None,
    p2p_power_scale: float = 1.0,
    max_iterations: int = 100_000,
) -> PerseusCompatResult:
    """Run Perseus's EnvPipe re-implementation on ``profile`` (already scaled, if wanted).

    ``p2p_power_w`` is the raw blocking power; the energy charges
    ``p2p_power_w * p2p_power_scale`` per idle GPU-second (Perseus: 70.38 W x 8
    for the A40 emulation). ``step_mhz`` defaults to the profile's clock spacing.
    """
    t0 = time.perf_counter()
    if num_microbatches < 1:
        raise PlannerError(f"need at least one micro-batch, got {num_microbatches}")
    if not unit_time_s > 0:
        raise PlannerError(f"unit time must be > 0 s, got {unit_time_s}")
    if p2p_power_w < 0:
        raise PlannerError(f"P2P blocking power must be >= 0 W, got {p2p_power_w}")
    if not p2p_power_scale > 0:
        raise PlannerError(f"P2P power scale must be > 0, got {p2p_power_scale}")
    if max_iterations < 1:
        raise PlannerError("max_iterations must be >= 1")
    step = clock_step_mhz(profile) if step_mhz is None else int(step_mhz)
    if step <= 0:
        raise PlannerError(f"reconfiguration step must be positive, got {step} MHz")
    p2p_eff = p2p_power_w * p2p_power_scale
    num_stages = profile.num_stages

    # f_max is the highest clock anywhere in the profile; every instruction needs it.
    f_max = profile.max_frequency()
    for s in range(num_stages):
        for ins in INSTRUCTIONS:
            if f_max not in profile.frequencies(s, ins):
                raise PlannerError(
                    f"{profile.source}: stage {s} {ins} is not profiled at {f_max} MHz, the profile's "
                    "highest clock, where the outer envelope must run"
                )
    starts = {
        (s, ins): start_clock(profile.points(s, ins), unit_time_s)
        for s in range(num_stages)
        for ins in INSTRUCTIONS
    }
    # Per (stage, instruction): clocks ascending, and real time / energy / quantised time per clock.
    ladders = {key: sorted(profile.frequencies(*key)) for key in starts}
    times = {key: {p.freq_mhz: p.time_s for p in profile.points(*key)} for key in starts}
    energies = {key: {p.freq_mhz: p.energy_j for p in profile.points(*key)} for key in starts}
    quants = {key: {f: quantize(t, unit_time_s) for f, t in tbl.items()} for key, tbl in times.items()}

    def raised(key: tuple[int, str], freq: int) -> int | None:
        """Perseus's +step: ``freq + step`` (the lowest profiled clock at least that), or None past f_max."""
        target = freq + step
        if target > f_max:
            return None
        for f in ladders[key]:
            if f >= target:
                return f
        return None  # pragma: no cover - f_max is profiled for every key

    schedule = one_f_one_b(num_stages, num_microbatches)
    graph = PipelineGraph(schedule)
    dag = _PerseusDag(graph)
    keys = list(zip(graph.stage_of, graph.instruction_of))
    knob = [f_max if env else starts[key] for key, env in zip(keys, dag.is_envelope)]
    dur = [quants[key][f] for key, f in zip(keys, knob)]

    def path_time(path: Sequence[int], freqs: Sequence[int]) -> float:
        total = 0.0
        for v in path:
            total += times[keys[v]][freqs[v]]
        return total

    iteration = 0
    converged = False
    stop_reason = ""
    path: list[int] = []
    last_raise: list[tuple[int, int]] = []  # (node, clock before) of the last iteration's raise
    while True:
        path = dag.critical_path(dur)
        min_freq = f_max
        for v in path:
            if knob[v] < min_freq:
                min_freq = knob[v]
        last_raise = []
        for v in path:
            if knob[v] == min_freq:
                new = raised(keys[v], knob[v])
                if new is not None:
                    last_raise.append((v, knob[v]))
                    knob[v] = new
                    dur[v] = quants[keys[v]][new]
        if all(dag.is_envelope[v] for v in path):
            converged, stop_reason = True, _STOP_ENVELOPE
            break
        if not last_raise:
            off = [graph.nodes[v] for v in path if not dag.is_envelope[v]]
            shown = ", ".join(f"S{s} {u}" for s, u in off[:3]) + (" ..." if len(off) > 3 else "")
            why = (
                f"every unit on it already runs at f_max = {f_max} MHz (the last stage is not the heaviest)"
                if min_freq == f_max
                else f"its slowest units ({min_freq} MHz) cannot rise {step} MHz without passing "
                f"f_max = {f_max} MHz"
            )
            stop_reason = (
                f"stalled: the critical path leaves the outer envelope (at {shown}) but {why}; "
                f"Perseus's script would repeat this state until its {_PERSEUS_MAX_ITERATIONS}-iteration cap"
            )
            break
        if iteration + 1 >= max_iterations:
            stop_reason = f"stopped after max_iterations={max_iterations} without reaching the outer envelope"
            break
        iteration += 1
    # Perseus times the chosen path with the clocks it had when it was chosen,
    # i.e. before that iteration's raise (empty when the loop ended on the
    # envelope or stalled), and logs the energy with the raised clocks.
    timed = list(knob)
    for v, old in last_raise:
        timed[v] = old
    reported_time = path_time(path, timed)
    reported_energy = _perseus_energy(graph, keys, knob, times, energies, reported_time, p2p_eff)
    # The script's final pass: make sure the envelope runs at f_max (it never
    # leaves it, so this changes nothing; kept for fidelity).
    for v, env in enumerate(dag.is_envelope):
        if env:
            knob[v] = f_max

    # Perseus-convention numbers for the baseline (1F1B, every unit at f_max).
    base_knob = [f_max] * dag.n
    base_path = dag.critical_path([quants[key][f_max] for key in keys])
    base_time = path_time(base_path, base_knob)
    base_energy = _perseus_energy(graph, keys, base_knob, times, energies, base_time, p2p_eff)

    plan = FrequencyPlan.from_flat(schedule, knob)
    evaluator = PlanEvaluator(schedule, profile, p2p_eff, graph=graph)
    timeline = evaluator.simulate(knob)
    score = evaluator.score(knob, timeline)
    baseline_plan = FrequencyPlan.constant(schedule, [f_max] * num_stages)
    baseline_timeline = evaluator.simulate(base_knob)
    baseline_score = evaluator.score(base_knob, baseline_timeline)
    start_pairs = tuple((starts[(s, "forward")], starts[(s, "backward")]) for s in range(num_stages))
    config = PlannerConfig(
        plan_type="envelope",
        scheduling="1f1b",
        reconfig="balanced",
        p2p_power_w=p2p_eff,
        reconfig_step_mhz=step,
        max_iterations=max_iterations,
    )
    warnings: list[str] = []
    result = PlanResult(
        config=config,
        plan=plan,
        score=score,
        timeline=timeline,
        baseline_plan=baseline_plan,
        baseline=baseline_score,
        baseline_timeline=baseline_timeline,
        f_max_mhz=f_max,
        valley_mhz=tuple(min(pair) for pair in start_pairs),
        candidates_mhz=profile.common_frequencies(),
        iterations=iteration,
        converged=converged,
        stop_reason=stop_reason,
        planner_seconds=0.0,
        warnings=warnings,
    )
    if not converged and stop_reason.startswith("stalled"):
        warnings.append(
            "Perseus-compat EnvPipe stalled before the outer envelope; the reported numbers are the "
            "stalled state, as in Perseus's own results"
        )
    if result.slowdown > SLOWDOWN_WARNING:
        warnings.append(
            f"this plan is {100 * result.slowdown:.2f}% slower than the baseline (1F1B at {f_max} MHz)"
        )
    result.planner_seconds = time.perf_counter() - t0
    return PerseusCompatResult(
        result=result,
        reported_time_s=reported_time,
        reported_energy_j=reported_energy,
        reported_baseline_time_s=base_time,
        reported_baseline_energy_j=base_energy,
        iterations=iteration,
        step_mhz=step,
        unit_time_s=unit_time_s,
        p2p_power_w=p2p_eff,
        start_clocks_mhz=start_pairs,
        critical_path=tuple(graph.nodes[v] for v in path),
    )


def _perseus_energy(
    graph: PipelineGraph,
    keys: Sequence[tuple[int, str]],
    freqs: Sequence[int],
    times: dict[tuple[int, str], dict[int, float]],
    energies: dict[tuple[int, str], dict[int, float]],
    iteration_time_s: float,
    p2p_power_w: float,
) -> float:
    """Perseus's logged cost: per stage, compute energy + blocking power x (T - busy time)."""
    stage_time = [0.0] * graph.schedule.num_stages
    stage_energy = [0.0] * graph.schedule.num_stages
    for v, (s, _) in enumerate(graph.nodes):
        stage_time[s] += times[keys[v]][freqs[v]]
        stage_energy[s] += energies[keys[v]][freqs[v]]
    total = 0.0
    for s in range(graph.schedule.num_stages):
        total += stage_energy[s] + (iteration_time_s - stage_time[s]) * p2p_power_w
    return total


def _plan_envpipe_perseus_emulation(
    profile: Profile,
    num_microbatches: int,
    p2p_power_w: float = _PERSEUS_P2P_POWER_W["a40"],
    time_scale: float = _PERSEUS_EMULATION_TIME_SCALE,
    energy_scale: float = _PERSEUS_EMULATION_ENERGY_SCALE,
    **kwargs: object,
) -> PerseusCompatResult:
    """Perseus's large-scale emulation: profile scaled by (time, energy), P_p2p by energy/time."""
    scaled = profile.scaled(time_scale, energy_scale)
    return plan_envpipe_perseus(
        scaled,
        num_microbatches,
        p2p_power_w,
        p2p_power_scale=energy_scale / time_scale,
        **kwargs,  # type: ignore[arg-type]
    )
