"""The pipeline iteration as a DAG, and an exact simulation of a frequency plan.

Nodes are the units of a :class:`~megatron_envpipe.core.schedule.Schedule`. Edges:

* same-stage order: a GPU runs one unit at a time, in schedule order;
* ``F(s, v, m) -> F(s+1, v, m)``: the activation (v: the model chunk, 0 without virtual stages);
* ``B(s+1, v, m) -> B(s, v, m)``: the gradient;
* with model chunks, the wrap-around: ``F(P-1, v, m) -> F(0, v+1, m)`` and
  ``B(0, v+1, m) -> B(P-1, v, m)`` (virtual stage v*P+P-1 feeds (v+1)*P);
* optional extra edges: dependencies a communication plan adds (e.g. holding
  an activation until a gradient arrives), so plans are scored on what runs.

A unit costs what the profile gives for its (stage, chunk, instruction) at its
clock (:attr:`PlanEvaluator.cost_keys`); with per-micro-batch sizes, that row
scaled by a length cost model (:mod:`~megatron_envpipe.core.length_costs`).

Every stage starts at t = 0. Iteration energy is Perseus's formula
``sum_units E(f) + P_p2p * sum_stages (T - busy_s)``: compute is charged its
profiled energy, everything else (bubbles, waiting, P2P) the blocking power.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass, field

from megatron_envpipe.core.graph import EdgeLists, critical_path, earliest_times
from megatron_envpipe.core.length_costs import LengthCostError, LengthCostModel, MicrobatchSize, size_classes
from megatron_envpipe.core.measurement import IterationMeasurement, UnitTiming
from megatron_envpipe.core.profile import Profile, ProfilePoint, instruction_of
from megatron_envpipe.core.schedule import B, F, Schedule, ScheduleError, Unit, execution_order, unit_dag, unit_index
from megatron_envpipe.errors import InvalidValueError

# Relative tolerance when deciding which predecessor made a unit wait.
_TIGHT_RTOL = 1e-9
# Graphs PipelineGraph.shared keeps (the last few built): 16k units (P = 32, M = 256) take ~15 MB.
_SHARED_GRAPHS_MAX = 4


@dataclass(frozen=True)
class Dependency:
    """``dst`` on stage ``dst_stage`` cannot start before ``src`` ends (+ latency)."""

    src_stage: int
    src: Unit
    dst_stage: int
    dst: Unit
    latency_s: float = 0.0


class PipelineGraph:
    """The static structure of one iteration: nodes, edges, a topological order.

    Built once per schedule (:meth:`shared` hands out the one already built);
    simulating a plan is then one linear pass. ``preds`` (and :attr:`succs`)
    are frozen :class:`~megatron_envpipe.core.graph.EdgeLists`, walked flat by
    :func:`~megatron_envpipe.core.graph.earliest_times` / ``latest_times``.
    """

    _shared: dict[tuple[int, str, tuple[Dependency, ...]], "PipelineGraph"] = {}
    _shared_lock = threading.Lock()  # the start-up frontier plans in a background thread

    def __init__(
        self,
        schedule: Schedule,
        p2p_latency_s: float = 0.0,
        extra_dependencies: Sequence[Dependency] = (),
    ) -> None:
        if p2p_latency_s < 0:
            raise ScheduleError(f"P2P latency must be >= 0 s, got {p2p_latency_s}")
        self.schedule = schedule
        self.p2p_latency_s = p2p_latency_s
        self.extra_dependencies = tuple(extra_dependencies)
        dag = unit_dag(schedule)
        self.nodes: list[tuple[int, Unit]] = list(dag.nodes)
        self.index: dict[tuple[int, Unit], int] = dag.index
        # Per node: the same-stage predecessor (or -1) and the cross-stage ones.
        self.stage_pred: list[int] = list(dag.stage_pred)
        self.cross_preds: list[list[tuple[int, float]]] = [
            [(u, p2p_latency_s)] if u >= 0 else [] for u in dag.message_pred
        ]
        for dep in self.extra_dependencies:
            if dep.latency_s < 0:
                raise ScheduleError(f"dependency latency must be >= 0 s: {dep}")
            dst = unit_index(self.index, (dep.dst_stage, dep.dst), "dependency target")
            src = unit_index(self.index, (dep.src_stage, dep.src), "dependency source")
            self.cross_preds[dst].append((src, dep.latency_s))
        # Per node: the stage predecessor first, then the messages (the order every walk sums in).
        preds = [
            ((sp, 0.0), *cross) if sp >= 0 else tuple(cross) for sp, cross in zip(self.stage_pred, self.cross_preds)
        ]
        self.preds: EdgeLists = EdgeLists(preds, execution_order(self.nodes, preds))
        # The edge lists' own (frozen) tuple: a shared graph's order cannot be changed, and walks handed
        # it take the flat steps on an identity check instead of comparing 16k entries per walk.
        self.order: tuple[int, ...] = self.preds.order
        self.stage_of = [s for s, _ in self.nodes]
        self.chunk_of = [u.chunk for _, u in self.nodes]
        instructions = {kind: instruction_of(kind) for kind in {u.kind for _, u in self.nodes}}
        self.instruction_of = [instructions[u.kind] for _, u in self.nodes]

    @classmethod
    def shared(
        cls, schedule: Schedule, p2p_latency_s: float = 0.0, extra_dependencies: Sequence[Dependency] = ()
    ) -> "PipelineGraph":
        """The graph of this very ``schedule`` object, built once while it is among the last few asked for.

        Planning scores one schedule from several places (the basis, the
        time-energy model, the switching pass); a graph is never changed
        after it is built, so they can share it. Keyed by the schedule's
        identity (it is frozen; the cache holds it, so the id stays its own).
        """
        deps = tuple(extra_dependencies)
        key = (id(schedule), repr(p2p_latency_s), deps)
        with cls._shared_lock:
            graph = cls._shared.get(key)
        if graph is not None and graph.schedule is schedule:
            return graph
        graph = cls(schedule, p2p_latency_s, deps)
        with cls._shared_lock:
            while len(cls._shared) >= _SHARED_GRAPHS_MAX:
                del cls._shared[next(iter(cls._shared))]  # the oldest
            cls._shared[key] = graph
        return graph

    @property
    def succs(self) -> EdgeLists:
        """Per node its successors ``(w, latency_s)`` (:func:`~megatron_envpipe.core.graph.successors`), built once."""
        return self.preds.successors()

    def node(self, stage: int, unit: Unit) -> int:
        return self.index[(stage, unit)]

    def simulate(self, durations_s: Sequence[float]) -> "Timeline":
        """Earliest-start simulation: each unit starts when all its inputs are ready."""
        n = len(self.nodes)
        if len(durations_s) != n:
            raise ValueError(f"need {n} unit durations, got {len(durations_s)}")
        start, end = earliest_times(self.order, self.preds, durations_s)
        return Timeline(self, start, end, list(durations_s))


@dataclass
class Timeline:
    """Start and end of every unit of one simulated (or measured) iteration."""

    graph: PipelineGraph
    start_s: list[float]
    end_s: list[float]
    duration_s: list[float]
    _critical: list[int] | None = field(default=None, repr=False)

    @property
    def iteration_time_s(self) -> float:
        return max(self.end_s) if self.end_s else 0.0

    def busy_s(self) -> list[float]:
        busy = [0.0] * self.graph.schedule.num_stages
        for v, s in enumerate(self.graph.stage_of):
            busy[s] += self.duration_s[v]
        return busy

    def idle_s(self) -> list[float]:
        t = self.iteration_time_s
        return [t - b for b in self.busy_s()]

    def recv_wait_s(self, v: int) -> float:
        """How long unit ``v`` waited for a message after its own stage was free."""
        if not self.graph.cross_preds[v]:
            return 0.0
        sp = self.graph.stage_pred[v]
        free_at = self.end_s[sp] if sp >= 0 else 0.0
        return max(0.0, self.start_s[v] - free_at)

    def recv_wait_ms_rows(self) -> list[list[float]]:
        """Per stage, per unit in order: how long it waited for its input, ms (EnvPipe's printout)."""
        rows: list[list[float]] = [[] for _ in range(self.graph.schedule.num_stages)]
        for v, (s, _) in enumerate(self.graph.nodes):
            rows[s].append(1000.0 * self.recv_wait_s(v))
        return rows

    def measurement(self) -> IterationMeasurement:
        """This iteration as the executor would measure it: every stage's units in order, with their
        start, end and receive wait (what the online reconfigurer is fed)."""
        graph = self.graph
        return IterationMeasurement(tuple(
            tuple(UnitTiming(u, self.start_s[v], self.end_s[v], self.recv_wait_s(v))
                  for u, v in ((u, graph.node(s, u)) for u in order))
            for s, order in enumerate(graph.schedule.orders)
        ))

    def critical_path(self) -> list[int]:
        """Node indices from the last-finishing unit back to a unit starting at 0.

        At each unit we step to the predecessor that made it start when it did.
        When the stage's own previous unit and a message were ready at the same
        moment, the same-stage one wins, like EnvPipe's receive-wait threshold
        (a unit that did not wait for its input is not limited by it).
        """
        if self._critical is not None:
            return self._critical
        graph = self.graph
        t_end = self.iteration_time_s
        tol = _TIGHT_RTOL * max(t_end, 1e-30)
        # Prefer stage 0's last unit: EnvPipe's walk starts at B(0, M-1).
        last0 = graph.index[(0, graph.schedule.orders[0][-1])]
        v = last0 if self.end_s[last0] >= t_end - tol else max(range(len(self.end_s)), key=self.end_s.__getitem__)
        path = critical_path(v, self.start_s, self.end_s, graph.preds, tol, preferred=graph.stage_pred)
        self._critical = path
        return path

    def critical_units(self) -> list[tuple[int, Unit]]:
        return [self.graph.nodes[v] for v in self.critical_path()]


@dataclass(frozen=True)
class PlanScore:
    """What a plan costs: time, energy split into compute and blocking, per stage."""

    iteration_time_s: float
    energy_j: float
    compute_energy_j: float
    blocking_energy_j: float
    busy_s: tuple[float, ...]
    stage_energy_j: tuple[float, ...]


class PlanEvaluator:
    """Scores per-unit clock assignments of one schedule against one profile, fast.

    ``freqs`` is a flat list aligned with ``graph.nodes`` (stage by stage, in order).
    A unit's time and energy are the profile's for ``cost_keys[v]`` =
    (stage, chunk, instruction). For a schedule with V model chunks the
    profile is taken through :meth:`Profile.for_chunks` (a profile of whole
    stages is split evenly; ``self.profile`` is the one used).

    ``microbatch_sizes`` (one :class:`MicrobatchSize` per micro-batch; needs ``length_model``): units
    cost the profile's row scaled to their micro-batch's size, and the keys are (stage, chunk,
    instruction, size class), micro-batches of equal size sharing a class. None: as without sizes.
    :meth:`key_points` gives a key's points, fastest first, for planners that build options per key.
    """

    def __init__(
        self,
        schedule: Schedule,
        profile: Profile,
        p2p_power_w: float = 0.0,
        p2p_latency_s: float = 0.0,
        extra_dependencies: Sequence[Dependency] = (),
        graph: PipelineGraph | None = None,
        microbatch_sizes: Sequence[MicrobatchSize] | None = None,
        length_model: LengthCostModel | None = None,
    ) -> None:
        if profile.num_stages != schedule.num_stages:
            raise ScheduleError(
                f"profile {profile.source} has {profile.num_stages} stages but the schedule has "
                f"{schedule.num_stages}"
            )
        if p2p_power_w < 0:
            raise InvalidValueError(f"P2P blocking power must be >= 0 W, got {p2p_power_w}")
        profile = profile.for_chunks(schedule.num_chunks)
        self.schedule = schedule
        self.profile = profile
        self.p2p_power_w = p2p_power_w
        self.graph = graph or PipelineGraph.shared(schedule, p2p_latency_s, extra_dependencies)
        self.microbatch_sizes = None if microbatch_sizes is None else tuple(microbatch_sizes)
        self.cost_keys: list[tuple] = list(
            zip(self.graph.stage_of, self.graph.chunk_of, self.graph.instruction_of)
        )
        if self.microbatch_sizes is None:
            self._points = {key: profile.points(key[0], key[2], key[1]) for key in set(self.cost_keys)}
        else:
            classes, self.size_classes = _check_sizes(self.microbatch_sizes, length_model, schedule)
            self.cost_keys = [(*key, classes[unit.microbatch]) for key, (_, unit) in zip(self.cost_keys, self.graph.nodes)]
            self._points = {key: _sized_points(profile, length_model, key, self.size_classes[key[3]])  # type: ignore[arg-type]
                            for key in set(self.cost_keys)}
        self._point_at = {key: {p.freq_mhz: p for p in pts} for key, pts in self._points.items()}
        self._time = {key: {p.freq_mhz: p.time_s for p in pts} for key, pts in self._points.items()}
        self._energy = {key: {p.freq_mhz: p.energy_j for p in pts} for key, pts in self._points.items()}
        self._keys = self.cost_keys
        # Per node its key's clock -> time / energy table (one lookup per unit instead of two).
        self._time_at = [self._time[k] for k in self._keys]
        self._energy_at = [self._energy[k] for k in self._keys]

    def key_points(self, key: tuple) -> tuple[ProfilePoint, ...]:
        """The points (clock, time, energy) of one of :attr:`cost_keys`, fastest clock first."""
        return self._points[key]

    def key_point(self, key: tuple, freq_mhz: int) -> ProfilePoint:
        """One of :attr:`cost_keys` at one clock (sized where the evaluator has sizes); ProfileError if unprofiled."""
        point = self._point_at[key].get(freq_mhz)
        if point is None:
            return self.profile.point(key[0], key[2], freq_mhz, key[1])  # raises ProfileError with the clock list
        return point

    def durations(self, freqs: Sequence[int]) -> list[float]:
        try:
            return [table[f] for table, f in zip(self._time_at, freqs)]
        except KeyError:
            self._raise_unprofiled(freqs)
            raise

    def unit_energies(self, freqs: Sequence[int]) -> list[float]:
        try:
            return [table[f] for table, f in zip(self._energy_at, freqs)]
        except KeyError:
            self._raise_unprofiled(freqs)
            raise

    def _raise_unprofiled(self, freqs: Sequence[int]) -> None:
        for key, f in zip(self._keys, freqs):
            if f not in self._time[key]:
                self.profile.point(key[0], key[2], f, key[1])  # raises ProfileError with the clock list

    def simulate(self, freqs: Sequence[int]) -> Timeline:
        return self.graph.simulate(self.durations(freqs))

    def score(self, freqs: Sequence[int], timeline: Timeline | None = None) -> PlanScore:
        timeline = timeline or self.simulate(freqs)
        return score_timeline(timeline, self.unit_energies(freqs), self.p2p_power_w)


def _check_sizes(sizes: tuple[MicrobatchSize, ...], length_model: LengthCostModel | None, schedule: Schedule
                 ) -> tuple[tuple[int, ...], tuple[MicrobatchSize, ...]]:
    """Size class per micro-batch and the classes' sizes; errors say what to pass."""
    if length_model is None:
        raise LengthCostError("per-micro-batch sizes need a length cost model (length_model) to cost them")
    if len(sizes) != schedule.num_microbatches:
        raise LengthCostError(f"{len(sizes)} micro-batch sizes for a schedule of {schedule.num_microbatches} "
                              "micro-batches: give one size per micro-batch")
    bad = [i for i, size in enumerate(sizes) if not isinstance(size, MicrobatchSize)]
    if bad:
        raise LengthCostError(f"micro-batch size {bad[0]} is {sizes[bad[0]]!r}, not a MicrobatchSize")
    return size_classes(sizes)


def _sized_points(profile: Profile, model: LengthCostModel, key: tuple[int, int, str, int], size: MicrobatchSize
                  ) -> tuple[ProfilePoint, ...]:
    """The profile's points of (stage, chunk, instruction) scaled to a micro-batch of ``size``."""
    stage, chunk, ins, _ = key
    points = profile.points(stage, ins, chunk)
    factors = model.factors_at(stage, chunk, ins, [p.freq_mhz for p in points], size)
    return tuple(ProfilePoint(p.freq_mhz, p.time_s * ft, p.energy_j * fe) for p, (ft, fe) in zip(points, factors))


def score_timeline(timeline: Timeline, unit_energy_j: Sequence[float], p2p_power_w: float) -> PlanScore:
    """Perseus's iteration energy: compute energy + blocking power x non-compute time."""
    t = timeline.iteration_time_s
    num_stages = timeline.graph.schedule.num_stages
    compute = [0.0] * num_stages
    for v, s in enumerate(timeline.graph.stage_of):
        compute[s] += unit_energy_j[v]
    busy = timeline.busy_s()
    blocking = [p2p_power_w * (t - b) for b in busy]
    stage_energy = tuple(c + b for c, b in zip(compute, blocking))
    return PlanScore(
        iteration_time_s=t,
        energy_j=sum(stage_energy),
        compute_energy_j=sum(compute),
        blocking_energy_j=sum(blocking),
        busy_s=tuple(busy),
        stage_energy_j=stage_energy,
    )


def outer_envelope(schedule: Schedule) -> frozenset[tuple[int, Unit]]:
    """EnvPipe's outer envelope: the whole last stage, every F0, every B(M-1).

    It is the critical path of an ideal pipeline whose inner units have slack:
    the fill diagonal, the last stage, the drain diagonal (envpipe.md §3).

    With V model chunks (Megatron's interleaved order), the same path through
    the chain of virtual stages: the fill is F0 of chunk 0 on every stage;
    the last stage then never idles, so all its units up to B(M-1) of chunk
    V-1 follow; the drain is B(M-1) of chunk V-1 on every stage, then the
    first stage's units after it (the rest of its cool-down: the last
    micro-batch group's backwards of the lower chunks). When every forward
    takes one time and every backward another, these units form one path
    through the iteration with zero slack (checked for P up to 8, V up to 4,
    several M and group sizes and forward:backward ratios in tests/core/test_timeline.py).
    Real stages differ (the last one holds the LM head), and then the last
    stage's own cool-down and the other chunks' fill (F0) and drain (B(M-1))
    chains turn critical at f_max, so the envelope also holds those: every
    unit of the last stage and F0 and B(M-1) of every chunk on every stage
    (without them EnvPipe's stopping rule can never hold on GPT-3's profile).
    For 1F1B and "ours" that is EnvPipe's envelope above; one-chunk schedules keep exactly it.
    """
    last = schedule.num_stages - 1
    drain = B(schedule.num_microbatches - 1, schedule.num_chunks - 1)
    if schedule.num_chunks == 1:
        members = {(last, u) for u in schedule.orders[last]}
        for s in range(schedule.num_stages):
            members.add((s, F(0)))
            members.add((s, drain))
        return frozenset(members)
    last_order, first_order = schedule.orders[last], schedule.orders[0]
    if drain not in last_order or drain not in first_order:
        raise ScheduleError(f"the schedule lacks {drain} on stage 0 or {last}: validate() it first")
    members = {(last, u) for u in last_order}
    members |= {(0, u) for u in first_order[first_order.index(drain):]}
    for s in range(schedule.num_stages):
        for v in range(schedule.num_chunks):
            members.add((s, F(0, v)))
            members.add((s, B(schedule.num_microbatches - 1, v)))
    return frozenset(members)
