"""Per-iteration clock plans at run time, for variable-length micro-batches (issue 25, part 3).

With Megatron's ``variable_seq_lengths`` every iteration's micro-batches cost differently, so one clock
plan for the average micro-batch wastes slack. Per schedule call ``i`` on every rank of the pipeline
(:class:`IterationPlans`, one per run, megatron/training_run.py):

1. **Sizes one iteration ahead.** The data iterators the schedule is handed are wrapped once in a
   :class:`~megatron_envpipe.megatron.lookahead.DataLookahead` (what training pulls does not change) and
   the wrapped ones are passed on. The pipeline's first stage reads data in Megatron-LM and in the tiny GPT
   alike: it reads ahead and posts one asynchronous broadcast over the pipeline group of iteration
   ``i + 1``'s sizes (``2 + 2 M`` int64: a "known" flag, M, tokens, attention_tokens2). Every rank posts it
   at the same point of the same call, so collectives keep one order. The sizes of iteration ``i`` come
   from the broadcast posted in call ``i - 1`` (complete long since; iteration 0's are broadcast once,
   blocking, at the first call). A first stage without data (e.g. a tensor-parallel rank that Megatron-LM
   feeds by broadcast) sends "unknown": those iterations keep the running plan.
2. **Sizes the cost model sees** (:class:`SizeMapping`, the one mapping): where the unit costs come from a
   shipped profile (``--envpipe-gpu simulated:<shipped>`` or ``--envpipe-profile <shipped>``), whose
   default length model has a reference micro-batch of one 2048-token sequence, each micro-batch's
   sequence lengths are scaled by ``k = reference tokens / (seq_length x micro_batch_size)``: this run's
   full (padded) micro-batch has the row's tokens, as ``micro_batch_size`` sequences of ``k x seq_length``
   (with one sequence per micro-batch, exactly the row; with more, its attention term is smaller), shorter
   ones less. Otherwise (a profile
   measured on this model) sizes are taken as they are. The executor hands these sizes to
   ``hooks.iteration_sizes`` every iteration, the same that the plans are made from.
3. **Plans in the background.** Once the start-up plan exists (profile agreed), one worker thread builds a
   :class:`~megatron_envpipe.planning.per_iteration.IterationPlanner` for the start-up order (programs then
   differ only in SetFrequency) with the length model (:func:`_length_model_for`), then per call plans
   iteration ``i + 1`` as soon as its sizes arrive. Every rank plans from the same inputs, so the same
   plan; each installs its own stage's clocks. A plan not ready when its iteration starts: the previous
   plan runs (logged once, counted, reported). The straggler follower's and online reconfiguration's
   plans take precedence (per-iteration plans replace only the steady plan).
4. **Report**: every energy-log interval the last rank logs the window's planned time and energy, the
   predicted saving against the stock order at f_max for the same sizes, planning time (as % of the
   iteration's wall time) and fallbacks; the run's summary gets one line (:meth:`IterationPlans.summary`).
   A window run wholly under its own plans is held on its energy line (and in the exit summary) to their
   predicted time and to the stock run they predict for the same sizes (:meth:`IterationPlans.window_prediction`).

Fixed-length runs never build this: no thread, no message.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from megatron_envpipe.config import EnvPipeConfig
from megatron_envpipe.config.groups import PlanSettings, ReportSettings
from megatron_envpipe.core.device_backends import model_profile
from megatron_envpipe.core.energy_report import Baseline
from megatron_envpipe.core.instructions import build_programs
from megatron_envpipe.core.kinds import plan_kind
from megatron_envpipe.core.length_costs import (
    LengthCostError,
    LengthCostModel,
    MicrobatchSize,
    default_length_model_for,
    fit_length_costs,
)
from megatron_envpipe.core.profile import Profile, ProfileError, instruction_of
from megatron_envpipe.megatron.groups import StageGroups
from megatron_envpipe.megatron.lookahead import DataLookahead, LookaheadError
from megatron_envpipe.megatron.reporting import log_interval
from megatron_envpipe.megatron.run_parts import IterationStep
from megatron_envpipe.megatron.runtime import EnvPipeRuntime, IterationPlan
from megatron_envpipe.planning.basis import planning_profile
from megatron_envpipe.planning.per_iteration import IterationPlan as PlannedIteration
from megatron_envpipe.planning.per_iteration import IterationPlanner

__all__ = ["IterationPlans", "SizeMapping"]

log = logging.getLogger("megatron_envpipe")

_STEADY = "steady"  # the runtime's phase whose plan per-iteration plans replace


@dataclass(frozen=True)
class SizeMapping:
    """This run's micro-batch sizes -> the sizes the length model sees: lengths x ``scale`` (module docstring)."""

    scale: float = 1.0
    why: str = "sizes as read (the profile's own units)"

    def apply(self, size: MicrobatchSize) -> MicrobatchSize:
        if self.scale == 1.0:
            return size
        tokens = max(1, round(size.tokens * self.scale))
        # Every sequence becomes k times longer: squares k**2 times larger; kept in tokens..tokens**2 after rounding.
        attention = min(tokens * tokens, max(tokens, round(size.attention_tokens2 * self.scale * self.scale)))
        return MicrobatchSize(tokens, attention)

    def sizes(self, sizes: Sequence[MicrobatchSize] | None) -> tuple[MicrobatchSize, ...] | None:
        return None if sizes is None else tuple(self.apply(s) for s in sizes)

    @classmethod
    def for_run(cls, config: EnvPipeConfig, seq_length: int, micro_batch_size: int) -> "SizeMapping":
        """Scaled to the shipped profile's default length model where the costs are a shipped profile's."""
        source = _costs_source(config)
        full_tokens = seq_length * micro_batch_size
        if source is None or full_tokens <= 0:
            return cls()
        try:
            reference = default_length_model_for(source).reference
        except LengthCostError:  # not a shipped model's profile: sizes as read
            return cls()
        # Sequences k times longer: a full micro-batch has the reference's tokens, as micro_batch_size
        # sequences (one sequence of them all where micro_batch_size is 1: then exactly the reference).
        k = reference.tokens / full_tokens
        return cls(k, f"scaled x {k:g}: a full micro-batch ({micro_batch_size} x {seq_length} tokens) has the "
                      f"{reference.tokens} tokens of {source}'s row ({reference}), as {micro_batch_size} "
                      f"sequence(s) of {k * seq_length:g}")


def _costs_source(config: EnvPipeConfig) -> str | None:
    """Where the unit costs come from, as config states it: the simulated GPU's profile, else --envpipe-profile."""
    source = model_profile(config.gpu)
    if source is not None:  # a modelled GPU's own profile
        return source or None
    return config.profile


def _length_model_for(profile: Profile, config: EnvPipeConfig) -> LengthCostModel:
    """The profile's own fit where it has rows at >= 2 sizes, else the default model of a shipped profile;
    raises :class:`LengthCostError` saying why there is none."""
    samples = profile.size_samples()
    if profile.reference_size is not None and len({s.size.tokens for s in samples}) >= 2:
        return fit_length_costs(samples, profile.reference_size, source=f"{profile.source} (fitted)")
    for source in (profile.source, _costs_source(config)):
        if source:
            try:
                return default_length_model_for(source)
            except LengthCostError:
                continue
    raise LengthCostError(f"{profile.source}: no micro-batch sizes in the profile (rows at >= 2 sizes) and no "
                          "shipped profile's default length model")


def _plans_wanted(config: PlanSettings) -> bool:
    """``--envpipe-per-iteration-plans`` (default: on with ``--envpipe-type optimal``); variable lengths apart."""
    wanted = config.per_iteration_plans
    return plan_kind(config.plan_type).per_iteration_plans if wanted is None else bool(wanted)


@dataclass
class _PlanStats:
    """What per-iteration planning did so far (and since the last log line)."""

    planned: int = 0  # iterations run under their own plan
    fallbacks: int = 0  # iterations whose plan was not ready: the previous one ran
    unknown: int = 0  # iterations without sizes: the previous plan ran
    planning_s: float = 0.0  # summed planner time of the plans run
    wall_s: float = 0.0  # summed wall time of the iterations before those (call to call)
    energy_j: float = 0.0  # predicted, summed over the plans run
    baseline_energy_j: float = 0.0  # stock order at f_max for the same sizes, summed
    time_s: float = 0.0
    baseline_time_s: float = 0.0

    def add(self, planned: PlannedIteration, wall_s: float) -> None:
        self.planned += 1
        self.wall_s += wall_s
        self.planning_s += planned.planner_seconds
        self.energy_j += planned.energy_j
        self.baseline_energy_j += planned.baseline_energy_j
        self.time_s += planned.iteration_time_s
        self.baseline_time_s += planned.baseline_time_s

    def line(self, total: "_PlanStats", label: str) -> str:
        n = self.planned
        if n == 0:
            return f"EnvPipe per-iteration plans | {label} | none ran | fallbacks {total.fallbacks} so far"
        saving = 1 - self.energy_j / self.baseline_energy_j if self.baseline_energy_j > 0 else 0.0
        share = f" ({100 * self.planning_s / self.wall_s:.1f} % of the iteration)" if self.wall_s > 0 else ""
        return (f"EnvPipe per-iteration plans | {label} | {n} plan(s): predicted {self.time_s / n:.4g} s, "
                f"{self.energy_j / n:.1f} J/iter vs stock at f_max for those sizes {self.baseline_time_s / n:.4g} s, "
                f"{self.baseline_energy_j / n:.1f} J/iter: saving {100 * saving:.2f} % | planning "
                f"{1000 * self.planning_s / n:.1f} ms/plan{share} | fallbacks {total.fallbacks} so far (plan late), "
                f"{total.unknown} without sizes")


class IterationPlans:
    """One run's sizes exchange and per-iteration planner (module docstring): a part of the run
    (megatron/training_run.py), made at the first variable-length call; it reads the phase machine."""

    def __init__(self, runtime: EnvPipeRuntime, mapping: SizeMapping) -> None:
        self.runtime = runtime
        self.mapping = mapping
        self.enabled = _plans_wanted(runtime.config.group(PlanSettings))
        self.off_reason: str | None = None if self.enabled else "--no-envpipe-per-iteration-plans"
        self._sources: list[Any] | None = None  # the iterators last wrapped (by identity)
        self._lookahead: DataLookahead | None = None
        self._m: int | None = None
        self._pending: tuple[Any, torch.Tensor] | None = None  # the broadcast of the next iteration's sizes
        self._pool: ThreadPoolExecutor | None = None
        self._planner: Future | None = None
        self._next: Future | None = None  # the plan for the next iteration
        self._current: tuple[PlannedIteration, IterationPlan] | None = None
        self._told_late = False
        self._last_call: float | None = None
        self.stats, self.window = _PlanStats(), _PlanStats()
        self.sizes: tuple[MicrobatchSize, ...] | None = None  # this iteration's, as the length model sees them

    # -- the run's begin/end of an iteration ---------------------------------------------
    def begin_iteration(self, step: IterationStep) -> None:
        """This iteration's sizes (:attr:`sizes`), and the next iteration's broadcast posted (:meth:`exchange`)."""
        self.exchange(step.groups, step.num_microbatches)

    def end_iteration(self, step: IterationStep) -> None:
        self.after_iteration(step.groups, step.iteration)

    # -- sizes ---------------------------------------------------------------------------
    def wrap(self, data_iterators: list[Any], num_microbatches: int) -> list[Any]:
        """The iterators to pass on: wrapped once per training iterator (the same objects every call)."""
        same = self._sources is not None and len(self._sources) == len(data_iterators) and all(
            a is b for a, b in zip(self._sources, data_iterators, strict=True))
        if not same:
            self._sources = list(data_iterators)
            self._m = num_microbatches
            try:
                self._lookahead = DataLookahead(list(data_iterators), num_microbatches)
            except LookaheadError as exc:  # e.g. a list, not an iterator: train on it as it is, sizes unknown
                log.warning("EnvPipe per-iteration plans: %s: sizes unknown (the previous plan keeps running)", exc)
                self._lookahead = None
        if self._lookahead is None:
            return data_iterators
        elif num_microbatches != self._m and self._m is not None:
            # The wrapped iterators still yield the same data; only their iteration count is off.
            log.warning("EnvPipe per-iteration plans: micro-batches per iteration changed from %d to %d: "
                        "sizes unknown from now on (the previous plan keeps running)", self._m, num_microbatches)
            self._m = None
        return self._lookahead.data_iterator

    def exchange(self, groups: StageGroups, num_microbatches: int) -> tuple[MicrobatchSize, ...] | None:
        """This iteration's sizes (from the last call's broadcast); posts the next iteration's broadcast."""
        first_call = self._pending is None
        if groups.tp_size > 1 and self.off_reason is None:
            # Only tensor-parallel rank 0 reads data in Megatron-LM: the other ranks of a stage would keep the
            # start-up plan while it ran per-iteration plans, and their all-reduces tie them to one pace.
            self.enabled, self.off_reason = False, "tensor parallelism > 1 (not supported yet)"
            log.warning("EnvPipe per-iteration plans off: %s", self.off_reason)
        if first_call:
            self._post(groups, num_microbatches, ahead=0)
        work, buffer = self._pending
        work.wait()  # posted a whole iteration ago (or just now, once, for iteration 0)
        sizes = _decode(buffer, num_microbatches)
        self._post(groups, num_microbatches, ahead=1)
        self.sizes = self.mapping.sizes(sizes)
        return self.sizes

    def _post(self, groups: StageGroups, m: int, ahead: int) -> None:
        sizes = None
        look = self._lookahead
        if groups.first and look is not None and self._m == m:
            look.read_ahead()
            reader = next((chunk for chunk in look.chunks if chunk is not None), None)
            if reader is not None:
                sizes = look.sizes(reader.iterations_started + ahead)
        buffer = _encode(sizes, m)
        if dist.get_backend(groups.pp_group) == "nccl":
            buffer = buffer.to(torch.device("cuda", torch.cuda.current_device()))
        src = dist.get_global_rank(groups.pp_group, 0)
        self._pending = (dist.broadcast(buffer, src=src, group=groups.pp_group, async_op=True), buffer)

    # -- plans ---------------------------------------------------------------------------
    def install(self, plan: IterationPlan, stage: int) -> IterationPlan:
        """This iteration's plan: the one planned for its sizes when ready (steady phase only), and start
        planning the next iteration."""
        now = time.perf_counter()
        # The last iteration's wall time (call to call): what this one's planning time is compared with.
        wall_s = now - self._last_call if self._last_call is not None else 0.0
        self._last_call = now
        rt = self.runtime
        if not self.enabled or plan.phase != _STEADY or plan.plan is None or rt.planned_with is None:
            self._next = None  # a plan made meanwhile would be for another iteration
            return plan
        first = self._planner is None
        if first:
            self._start(plan)
        ready, self._next = self._next, None
        if self.sizes is None:  # nothing to plan for: the previous plan runs
            if not first:
                self.stats.unknown += 1
                self.window.unknown += 1
        elif ready is not None and not ready.done():
            ready.cancel()  # still queued: never run it (a plan for a past iteration); the queue stays short
            self.stats.fallbacks += 1
            self.window.fallbacks += 1
            if not self._told_late:
                self._told_late = True
                log.warning("EnvPipe per-iteration plans: the plan for iteration %d was not ready when it "
                            "started: the previous plan runs (counted; logged once)", rt.iteration + 1)
        elif ready is not None:
            try:
                got = ready.result()
            except Exception as exc:  # noqa: BLE001 - a planner failure must not stop training
                log.warning("EnvPipe per-iteration plans: planning failed (%s): the previous plan runs", exc)
                got = None
            if got is not None and got[0].sizes == self.sizes:
                self._current = (got[0], _as_plan(plan, got[0].plan, rt.config.prefetch, stage, got[1]))
        pending = self._pending
        self._next = self._pool.submit(self._plan_next, pending, stage) if self.off_reason is None else None
        if self._current is None or self.off_reason is not None:
            return plan
        planned, installed = self._current
        if planned.sizes == self.sizes:
            self.stats.add(planned, wall_s)
            self.window.add(planned, wall_s)
        return installed

    def _start(self, plan: IterationPlan) -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="envpipe-iteration-plans")
        self._planner = self._pool.submit(self._build, plan)

    def _build(self, plan: IterationPlan) -> IterationPlanner | None:
        """The planner, on the worker thread, once (the start-up order, this run's length model)."""
        rt = self.runtime
        profile, m, pcfg = rt.planned_with
        try:
            model = _length_model_for(profile, rt.config)
            # Per-iteration deadlines are the stock run's for each iteration's sizes: no timing margin or
            # clock latency (the planner refuses them), the start-up order kept.
            cfg = dataclasses.replace(pcfg, timing_margin=0.0, clock_latency_s=0.0, clock_call_s=0.0,
                                      target_time_s=None)
            planner = IterationPlanner(profile.for_pipeline(plan.schedule.num_stages), model, m, cfg,
                                       schedule=plan.schedule)
        except Exception as exc:  # noqa: BLE001 - no planner: training goes on with the start-up plan
            self.off_reason = str(exc)
            log.warning("EnvPipe per-iteration plans off: %s", exc)
            return None
        log.info("EnvPipe per-iteration plans on: length model %s; sizes %s", model.source, self.mapping.why)
        if pcfg.timing_margin or pcfg.clock_latency_s:
            log.warning("EnvPipe per-iteration plans: the start-up plan's timing margin (%g) and clock latency "
                        "(%g s) are not applied to per-iteration plans: they meet the stock time of each "
                        "iteration's sizes exactly as profiled", pcfg.timing_margin, pcfg.clock_latency_s)
        return planner

    def _plan_next(self, pending: tuple[Any, torch.Tensor], stage: int
                   ) -> tuple[PlannedIteration, tuple[float, ...] | None] | None:
        planner = self._planner.result()
        if planner is None:
            return None
        work, buffer = pending
        work.wait()  # the next iteration's sizes: posted this call
        sizes = self.mapping.sizes(_decode(buffer.cpu(), planner.num_microbatches))
        if sizes is None:
            return None
        planned = planner.plan(sizes)
        return planned, _unit_times(planner, planned, stage)

    def passed_on(self, data_iterator: Any) -> Any:
        """What a call that falls back to Megatron's own schedule must read: the wrapped iterator(s) where
        ``data_iterator`` is what this object wraps (the micro-batches it read ahead stay next in line), else
        ``data_iterator`` itself (e.g. an evaluation iterator)."""
        look, sources = self._lookahead, self._sources
        if look is None or sources is None:
            return data_iterator
        given = data_iterator if isinstance(data_iterator, list) else [data_iterator]
        if len(given) != len(sources) or any(a is not b for a, b in zip(given, sources, strict=True)):
            return data_iterator
        wrapped = look.data_iterator
        return wrapped if isinstance(data_iterator, list) else wrapped[0]

    # -- report --------------------------------------------------------------------------
    def window_prediction(self, iterations: int) -> tuple[float, float, Baseline] | None:
        """(mean predicted iteration time, predicted saving, the stock run predicted for the same sizes: what
        the window's energy line compares with) of the energy window's ``iterations`` when each ran its own
        plan; None otherwise (the start-up plan's figures and baseline apply)."""
        w = self.window
        if iterations < 1 or w.planned != iterations or w.baseline_energy_j <= 0:
            return None
        n = w.planned
        return (w.time_s / n, 1.0 - w.energy_j / w.baseline_energy_j,
                Baseline.same_sizes(w.baseline_energy_j / n, w.baseline_time_s / n))

    def after_iteration(self, groups: StageGroups, iteration: int) -> None:
        """At every energy-log point: the window's line (on the last rank), and a new window (on every rank)."""
        if self.off_reason is not None or self._planner is None or (iteration + 1) % log_interval(self.runtime.config.group(ReportSettings)):
            return
        if dist.get_rank() == dist.get_world_size() - 1:
            log.info("%s", self.window.line(self.stats, f"iteration {iteration + 1}"))
        self.window = _PlanStats()  # on every rank: each one's energy line reads its own window

    def summary(self) -> str | None:
        if self._planner is None:
            return None
        if self.off_reason is not None:
            return f"EnvPipe per-iteration plans off: {self.off_reason}"
        return self.stats.line(self.stats, "run")

    def report(self) -> dict[str, Any]:
        """For ``--losses-out``: the counts and sums so far, and why planning is off (None: on)."""
        return {**dataclasses.asdict(self.stats), "off_reason": self.off_reason, "started": self._planner is not None,
                "size_mapping": dataclasses.asdict(self.mapping)}

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)


def _encode(sizes: Sequence[MicrobatchSize] | None, m: int) -> torch.Tensor:
    """``[known, M, tokens x M, attention_tokens2 x M]``: M travels along, so a message sent before the
    micro-batch count changed (Megatron-LM's batch-size ramp-up) reads as unknown, not as a crash."""
    if sizes is None or len(sizes) != m:
        return torch.tensor([0, m, *([0] * 2 * m)], dtype=torch.int64)
    return torch.tensor([1, m, *(s.tokens for s in sizes), *(s.attention_tokens2 for s in sizes)],
                        dtype=torch.int64)


def _decode(buffer: torch.Tensor, m: int) -> tuple[MicrobatchSize, ...] | None:
    """The sizes of a message for ``m`` micro-batches; None: unknown, for another M, or not sizes at all."""
    values = buffer.cpu().tolist()
    if len(values) != 2 + 2 * m or values[0] != 1 or values[1] != m:
        return None
    try:
        return tuple(MicrobatchSize(t, a) for t, a in zip(values[2:2 + m], values[2 + m:], strict=True))
    except LengthCostError:  # data the look-ahead could not size sensibly: keep the running plan
        return None


def _unit_times(planner: IterationPlanner, planned: PlannedIteration, stage: int) -> tuple[float, ...] | None:
    """This stage's units' predicted times at their clocks and sizes (for the GPU hooks' clock lead)."""
    plan, model = planned.plan, planner.length_model
    profile = planning_profile(planner.profile, planner.config)
    try:
        return tuple(profile.time_s(stage, instruction_of(u.kind), f, u.chunk)
                     * model.factors(stage, u.chunk, instruction_of(u.kind), f, planned.sizes[u.microbatch])[0]
                     for u, f in zip(plan.schedule.orders[stage], plan.freqs_mhz[stage], strict=True))
    except (ProfileError, LengthCostError):
        return None


def _as_plan(plan: IterationPlan, freqs: Any, prefetch: int, stage: int,
             unit_times: tuple[float, ...] | None) -> IterationPlan:
    """The executor's plan with the planned clocks (same order: the programs differ only in SetFrequency);
    predicted unit times for this stage only (the one its hooks read)."""
    times = None
    if unit_times is not None:
        times = tuple(unit_times if s == stage else () for s in range(freqs.schedule.num_stages))
    return dataclasses.replace(plan, plan=freqs, programs=tuple(build_programs(freqs.schedule, freqs, prefetch)),
                               unit_times_s=times)
