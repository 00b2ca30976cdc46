"""Per-stage forward/backward unit orders: Megatron's 1F1B and EnvPipe's "ours".

A schedule is data, in the style of ``torch.distributed.pipelining``: one list
of units per stage, which prints (``S0: F0 F1 B0 ...``), parses back, and
validates. Pure Python, no torch.

EnvPipe's "ours" keeps every forward in its 1F1B slot but runs ``r_s`` extra
warm-up forwards on stage ``s`` before its first backward, so the slack that
1F1B leaves before ``B(s, 0)`` sits right after forwards that can then run at a
lower clock (reference notes, envpipe.md §2).
"""

from __future__ import annotations

import math
import numbers
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from megatron_envpipe.core.graph import topological_order
from megatron_envpipe.core.vocabulary import SCHEDULINGS, Scheduling, UnitKind
from megatron_envpipe.errors import UsageError

FORWARD = UnitKind.FORWARD
BACKWARD = UnitKind.BACKWARD


class ScheduleError(UsageError, ValueError):
    """A schedule that is malformed, incomplete or cannot execute."""


@dataclass(frozen=True, order=True)
class Unit:
    """One micro-batch forward (``F``) or backward (``B``) on one stage."""

    kind: UnitKind  # a plain "F"/"B" is accepted and stored as the enum member
    microbatch: int

    def __post_init__(self) -> None:
        if not isinstance(self.kind, UnitKind):
            try:
                object.__setattr__(self, "kind", UnitKind(self.kind))
            except ValueError:
                raise ScheduleError(f"unit kind must be 'F' or 'B', got {self.kind!r}") from None
        if self.microbatch < 0:
            raise ScheduleError(f"micro-batch id must be >= 0, got {self.microbatch}")

    @property
    def is_forward(self) -> bool:
        return self.kind == FORWARD

    def __str__(self) -> str:
        return f"{self.kind}{self.microbatch}"

    @classmethod
    def parse(cls, text: str) -> "Unit":
        match = re.fullmatch(r"\s*([FB])(\d+)\s*", text)
        if not match:
            raise ScheduleError(f"cannot parse unit {text!r}: expected F<id> or B<id>, e.g. F3")
        return cls(match.group(1), int(match.group(2)))


def F(microbatch: int) -> Unit:  # noqa: N802 - reads like the printed form
    return Unit(FORWARD, microbatch)


def B(microbatch: int) -> Unit:  # noqa: N802
    return Unit(BACKWARD, microbatch)


@dataclass(frozen=True)
class Schedule:
    """The execution order of every stage of one pipeline iteration."""

    num_microbatches: int
    orders: tuple[tuple[Unit, ...], ...]
    name: str = "custom"
    # Extra warm-up forwards per stage beyond 1F1B's (EnvPipe's r_s); informational.
    extra_warmup: tuple[int, ...] = ()

    @property
    def num_stages(self) -> int:
        return len(self.orders)

    def forwards_before_first_backward(self, stage: int) -> int:
        """``min(M, P-s)`` for 1F1B, ``min(M, P-s+r_s)`` for EnvPipe.

        (Megatron's ``num_warmup_microbatches`` is this minus one, except when
        every forward comes first; the order alone cannot tell those apart.)
        """
        count = 0
        for unit in self.orders[stage]:
            if not unit.is_forward:
                break
            count += 1
        return count

    def peak_inflight(self) -> tuple[int, ...]:
        """Peak number of activations each stage holds (forwards not yet backwarded)."""
        peaks = []
        for order in self.orders:
            live = peak = 0
            for unit in order:
                live += 1 if unit.is_forward else -1
                peak = max(peak, live)
            peaks.append(peak)
        return tuple(peaks)

    def position(self, stage: int, unit: Unit) -> int:
        return self.orders[stage].index(unit)

    def validate(self) -> "Schedule":
        """Check completeness, per-stage F-before-B, and that the stages cannot deadlock.

        Returns ``self`` so it chains. Raises :class:`ScheduleError` naming the stage.
        """
        if self.num_microbatches < 1:
            raise ScheduleError(f"need at least one micro-batch, got {self.num_microbatches}")
        if self.num_stages < 1:
            raise ScheduleError("a schedule needs at least one stage")
        expected = {F(m) for m in range(self.num_microbatches)} | {
            B(m) for m in range(self.num_microbatches)
        }
        for s, order in enumerate(self.orders):
            seen: set[Unit] = set()
            for unit in order:
                if unit in seen:
                    raise ScheduleError(f"stage {s}: {unit} appears more than once")
                if unit not in expected:
                    raise ScheduleError(
                        f"stage {s}: {unit} is outside micro-batches 0..{self.num_microbatches - 1}"
                    )
                if not unit.is_forward and F(unit.microbatch) not in seen:
                    raise ScheduleError(f"stage {s}: {unit} runs before F{unit.microbatch}")
                seen.add(unit)
            missing = sorted(expected - seen)
            if missing:
                shown = " ".join(str(u) for u in missing[:6])
                raise ScheduleError(f"stage {s}: missing {shown}{' ...' if len(missing) > 6 else ''}")
        # Cross-stage feasibility: the dependency graph must be acyclic, otherwise
        # the stages wait on each other forever.
        dag = unit_dag(self)
        execution_order(dag.nodes, dag.preds())
        return self

    def __str__(self) -> str:
        width = len(f"S{self.num_stages - 1}")
        lines = [
            f"# schedule {self.name}: {self.num_stages} stages x {self.num_microbatches} micro-batches"
        ]
        if self.extra_warmup:
            lines[0] += f", extra warm-up {list(self.extra_warmup)}"
        for s, order in enumerate(self.orders):
            lines.append(f"{f'S{s}':<{width}}: " + " ".join(str(u) for u in order))
        return "\n".join(lines)

    @classmethod
    def parse(cls, text: str, name: str = "custom") -> "Schedule":
        """Parse the printed form: one ``S<k>: F0 F1 B0 ...`` line per stage.

        Lines starting with ``#`` and blank lines are ignored. Stages must be
        numbered 0..P-1. The result is validated.
        """
        rows: dict[int, tuple[Unit, ...]] = {}
        for lineno, raw in enumerate(text.splitlines(), start=1):
            line = raw.strip()
            if not line or line.startswith("#"):
                continue
            match = re.fullmatch(r"S(\d+)\s*:\s*(.*)", line)
            if not match:
                raise ScheduleError(f"line {lineno}: expected 'S<stage>: F0 B0 ...', got {raw!r}")
            stage = int(match.group(1))
            if stage in rows:
                raise ScheduleError(f"line {lineno}: stage {stage} given twice")
            try:
                rows[stage] = tuple(Unit.parse(tok) for tok in match.group(2).split())
            except ScheduleError as exc:
                raise ScheduleError(f"line {lineno}: {exc}") from None
        if not rows:
            raise ScheduleError("no stage lines found")
        if sorted(rows) != list(range(len(rows))):
            raise ScheduleError(f"stages must be numbered 0..{len(rows) - 1}, got {sorted(rows)}")
        num_mb = 1 + max((u.microbatch for order in rows.values() for u in order), default=-1)
        schedule = cls(num_mb, tuple(rows[s] for s in range(len(rows))), name=name)
        return schedule.validate()


@dataclass(frozen=True)
class UnitDag:
    """A schedule's units as DAG nodes (stage by stage, in order) and the dependencies the schedule implies.

    Edges: the same stage's previous unit (a GPU runs one unit at a time) and
    the message a unit receives, ``F(s-1, m) -> F(s, m)`` (activation) and
    ``B(s+1, m) -> B(s, m)`` (gradient).
    """

    nodes: tuple[tuple[int, Unit], ...]
    index: dict[tuple[int, Unit], int]
    stage_pred: tuple[int, ...]  # the same stage's previous unit, or -1
    message_pred: tuple[int, ...]  # the unit whose activation or gradient this one receives, or -1

    def preds(self) -> list[list[tuple[int, float]]]:
        """Per node ``(u, latency_s)``, no latencies: the stage predecessor first, then the message's sender."""
        return [
            [(u, 0.0) for u in (self.stage_pred[v], self.message_pred[v]) if u >= 0] for v in range(len(self.nodes))
        ]


def unit_dag(schedule: Schedule) -> UnitDag:
    """The units of ``schedule`` and their dependencies; ScheduleError if a message's sender is missing."""
    nodes: list[tuple[int, Unit]] = []
    index: dict[tuple[int, Unit], int] = {}
    for s, order in enumerate(schedule.orders):
        for unit in order:
            index[(s, unit)] = len(nodes)
            nodes.append((s, unit))
    stage_pred = [-1] * len(nodes)
    for s, order in enumerate(schedule.orders):
        for i in range(1, len(order)):
            stage_pred[index[(s, order[i])]] = index[(s, order[i - 1])]
    message_pred = [-1] * len(nodes)
    last = schedule.num_stages - 1
    for v, (s, unit) in enumerate(nodes):
        if unit.is_forward and s > 0:
            message_pred[v] = unit_index(index, (s - 1, unit), "dependency source")
        elif not unit.is_forward and s < last:
            message_pred[v] = unit_index(index, (s + 1, unit), "dependency source")
    return UnitDag(tuple(nodes), index, tuple(stage_pred), tuple(message_pred))


def unit_index(index: dict[tuple[int, Unit], int], key: tuple[int, Unit], role: str) -> int:
    """``index[key]``, or ScheduleError naming the ``role`` of the missing unit."""
    v = index.get(key)
    if v is None:
        raise ScheduleError(f"{role} S{key[0]} {key[1]} is not in the schedule")
    return v


def execution_order(nodes: Sequence[tuple[int, Unit]], preds: Sequence[Sequence[tuple[int, float]]]) -> list[int]:
    """A topological order of the unit DAG; ScheduleError naming the deadlocked stages if it has a cycle."""
    order = topological_order(preds)
    if len(order) != len(nodes):
        done = set(order)
        stuck = [node for v, node in enumerate(nodes) if v not in done]
        stages = sorted({s for s, _ in stuck})
        first = ", ".join(f"S{s} {u}" for s, u in stuck[:4])
        raise ScheduleError(
            f"the schedule cannot execute: stages {stages} wait on each other in a cycle "
            f"(deadlock), e.g. at {first}"
        )
    return order


def _stage_order(num_microbatches: int, warmup: int) -> tuple[Unit, ...]:
    """Megatron's non-interleaved loop for one stage with ``warmup`` warm-up forwards.

    warm-up: F0..F(w-1); steady: F(w+i) B(i) for i < M-w; cool-down: the remaining B.
    """
    m = num_microbatches
    w = max(0, min(warmup, m))
    order = [F(i) for i in range(w)]
    for i in range(m - w):
        order += [F(w + i), B(i)]
    order += [B(i) for i in range(m - w, m)]
    return tuple(order)


def one_f_one_b(num_stages: int, num_microbatches: int) -> Schedule:
    """Megatron-core's non-interleaved 1F1B: stage s warms up with min(P-s-1, M) forwards."""
    _check_sizes(num_stages, num_microbatches)
    orders = tuple(
        _stage_order(num_microbatches, num_stages - s - 1) for s in range(num_stages)
    )
    return Schedule(num_microbatches, orders, name="1f1b", extra_warmup=(0,) * num_stages)


def envpipe_schedule(num_stages: int, num_microbatches: int, extra_warmup: Sequence[int]) -> Schedule:
    """EnvPipe's "ours": stage s warms up with min(M, P-s-1+r_s) forwards.

    ``extra_warmup`` must already be clamped (see :func:`clamp_extra_warmup`).
    """
    _check_sizes(num_stages, num_microbatches)
    r = check_extra_warmup(num_stages, extra_warmup)
    problem = _extra_warmup_problem(num_stages, num_microbatches, r)
    if problem:
        raise ScheduleError(problem)
    orders = tuple(
        _stage_order(num_microbatches, num_stages - s - 1 + r[s]) for s in range(num_stages)
    )
    return Schedule(num_microbatches, orders, name="ours", extra_warmup=r)


def _check_sizes(num_stages: int, num_microbatches: int) -> None:
    if num_stages < 1:
        raise ScheduleError(f"need at least 1 pipeline stage, got {num_stages}")
    if num_microbatches < 1:
        raise ScheduleError(f"need at least 1 micro-batch, got {num_microbatches}")


def check_extra_warmup(num_stages: int, extra_warmup: Sequence[int]) -> tuple[int, ...]:
    """``extra_warmup`` as ints, after checking it has one whole number >= 0 per stage.

    Clamping fixes values a schedule cannot run; a wrong count or a negative
    value is a mistake in the input, so it is reported (ScheduleError) instead.
    """
    try:
        values = list(extra_warmup)
    except TypeError:
        raise ScheduleError(f"extra warm-up must be a list of whole numbers, got {extra_warmup!r}") from None
    if len(values) != num_stages:
        raise ScheduleError(
            f"extra warm-up has {len(values)} value(s) {values} for {num_stages} stages: give {num_stages} "
            "whole numbers >= 0, one per stage (the last stage's is always 0)"
        )
    out = []
    for s, value in enumerate(values):
        # bool is an int subclass; an integral float (from JSON, say) is fine, 2.5 or nan is not.
        whole = isinstance(value, numbers.Integral) or (isinstance(value, float) and value.is_integer())
        if isinstance(value, bool) or not whole:
            raise ScheduleError(f"extra warm-up of stage {s} is {value!r}, not a whole number")
        if value < 0:
            raise ScheduleError(f"extra warm-up of stage {s} is negative ({value}): give values >= 0")
        out.append(int(value))
    return tuple(out)


def _extra_warmup_problem(num_stages: int, num_microbatches: int, r: Sequence[int]) -> str | None:
    for s, value in enumerate(r):
        if value < 0:
            return f"extra warm-up of stage {s} is negative ({value})"
        if value > max(0, num_microbatches - (num_stages - s)):
            return (
                f"extra warm-up of stage {s} is {value}, above M-(P-s) = "
                f"{max(0, num_microbatches - (num_stages - s))}"
            )
    if r and r[-1] != 0:
        return f"the last stage cannot run extra warm-up forwards (got {r[-1]})"
    for s in range(len(r) - 1):
        if r[s + 1] > r[s]:
            return (
                f"extra warm-up must be non-increasing over stages: stage {s + 1} has {r[s + 1]} "
                f"> stage {s}'s {r[s]}"
            )
    return None


def raw_extra_warmup(
    num_stages: int,
    backward_time_fmax_s: Sequence[float],
    forward_time_fopt_s: Sequence[float],
) -> list[int]:
    """EnvPipe's unclamped ``r_s = floor((P-s-1) * T_B(f_max) / T_F(f_opt))``.

    The bubble before stage s's first backward is (P-s-1) downstream backwards
    long; r_s forwards at the slow clock fit into it. Last stage: 0.
    """
    r = []
    for s in range(num_stages):
        tf = forward_time_fopt_s[s]
        if tf <= 0:
            raise ScheduleError(f"stage {s}: forward time must be positive to size the warm-up")
        # Tiny epsilon so that an exact ratio (e.g. 3.0 computed as 2.9999999) floors right.
        r.append(int(math.floor((num_stages - s - 1) * backward_time_fmax_s[s] / tf + 1e-9)))
    if r:
        r[-1] = 0
    return r


def clamp_extra_warmup(
    num_stages: int,
    num_microbatches: int,
    raw: Sequence[int],
    max_inflight: Sequence[int | None] | int | None = None,
) -> tuple[int, ...]:
    """Clamp EnvPipe's r_s: memory budget, ``M-(P-s)``, then non-increasing over stages.

    ``max_inflight`` is the activation-memory budget per stage, counted in
    in-flight micro-batch activations (1F1B needs ``P-s``); ``None`` = unbounded.

    Saturated-stage exception (envpipe.md §2.2): EnvPipe lets a stage that
    already runs all its forwards first be followed by a stage with a *larger*
    r. With the KISTI communication order this can deadlock (§8.3), so we do
    not allow it: r is strictly non-increasing. The cost is nil in practice —
    the next stage only loses extra forwards that its own bubble rarely fits.

    ``raw`` needs one value >= 0 per stage (:func:`check_extra_warmup`): only
    values a schedule cannot run are clamped, input mistakes raise ScheduleError.
    """
    raw = check_extra_warmup(num_stages, raw)
    if isinstance(max_inflight, int) or max_inflight is None:
        budgets: list[int | None] = [max_inflight] * num_stages
    else:
        budgets = list(max_inflight)
        if len(budgets) != num_stages:
            raise ScheduleError(
                f"activation budget (max-inflight) {','.join(str(b).lower() for b in budgets)} has {len(budgets)} "
                f"entries but the pipeline has {num_stages} stages: give one per stage, first stage first"
            )
    r = []
    for s in range(num_stages):
        value = raw[s]
        budget = budgets[s]
        if budget is not None:
            base = min(num_microbatches, num_stages - s)  # what 1F1B already holds
            if budget < base:
                raise ScheduleError(
                    f"stage {s}: activation budget (max-inflight) {budget} is below the {base} in-flight "
                    f"activations that 1F1B itself needs there: give at least {base} for stage {s}"
                )
            value = min(value, budget - base)
        value = min(value, max(0, num_microbatches - (num_stages - s)))
        r.append(value)
    if r:
        r[-1] = 0
    for s in range(1, num_stages):
        r[s] = min(r[s], r[s - 1])
    return tuple(r)


def build_schedule(
    scheduling: str,
    num_stages: int,
    num_microbatches: int,
    extra_warmup: Sequence[int] | None = None,
) -> Schedule:
    """Schedule by name: ``1f1b`` or ``ours`` (``ours`` needs clamped ``extra_warmup``, one per stage)."""
    if scheduling == Scheduling.ONE_F_ONE_B:
        # 1F1B has no extra warm-up: silently dropping a non-zero one would hide a mistake.
        if extra_warmup is not None and any(check_extra_warmup(num_stages, extra_warmup)):
            raise ScheduleError(
                f"scheduling '1f1b' has no extra warm-up (got {list(extra_warmup)}): use scheduling 'ours' or drop it"
            )
        return one_f_one_b(num_stages, num_microbatches)
    if scheduling == Scheduling.OURS:
        if extra_warmup is None:
            raise ScheduleError("scheduling 'ours' needs the extra warm-up per stage")
        return envpipe_schedule(num_stages, num_microbatches, extra_warmup)
    raise ScheduleError(f"unknown scheduling {scheduling!r}; choose one of {', '.join(SCHEDULINGS)}")


def units_in_order(schedule: Schedule) -> Iterable[tuple[int, int, Unit]]:
    """(stage, position, unit) for every unit, stage by stage."""
    for s, order in enumerate(schedule.orders):
        for i, unit in enumerate(order):
            yield s, i, unit
