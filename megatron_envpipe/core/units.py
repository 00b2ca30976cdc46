"""The data of a pipeline schedule: units, per-stage orders, and the dependency DAG they imply.

A schedule is data, in the style of ``torch.distributed.pipelining``: one list
of units per stage, which prints (``S0: F0 F1 B0 ...``), parses back, and
validates. A unit is one micro-batch's forward or backward of one *model
chunk* on its stage: Megatron's interleaved pipeline (virtual stages) gives
each of the P ranks V chunks, chunk v of rank s holding virtual stage v*P+s;
without it every unit is chunk 0. Units print as ``F3`` (chunk 0) or ``F3v1``.

The orders themselves (1F1B, EnvPipe's "ours", Megatron's interleaved) are
built in :mod:`~megatron_envpipe.core.schedule` and
:mod:`~megatron_envpipe.core.interleaved`. Pure Python, no torch.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from megatron_envpipe.core.graph import topological_order
from megatron_envpipe.core.vocabulary import UnitKind
from megatron_envpipe.errors import UsageError

FORWARD = UnitKind.FORWARD
BACKWARD = UnitKind.BACKWARD


class ScheduleError(UsageError, ValueError):
    """A schedule that is malformed, incomplete or cannot execute."""


@dataclass(frozen=True, order=True)
class Unit:
    """One micro-batch forward (``F``) or backward (``B``) of one model chunk on one stage.

    ``chunk`` is Megatron's ``model_chunk_id`` on the rank (0 without virtual stages).
    """

    kind: UnitKind  # a plain "F"/"B" is accepted and stored as the enum member
    microbatch: int
    chunk: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.kind, UnitKind):
            try:
                object.__setattr__(self, "kind", UnitKind(self.kind))
            except ValueError:
                raise ScheduleError(f"unit kind must be 'F' or 'B', got {self.kind!r}") from None
        if self.microbatch < 0:
            raise ScheduleError(f"micro-batch id must be >= 0, got {self.microbatch}")
        if self.chunk < 0:
            raise ScheduleError(f"model chunk id must be >= 0, got {self.chunk}")

    @property
    def is_forward(self) -> bool:
        return self.kind == FORWARD

    def __str__(self) -> str:
        # Chunk 0 prints bare so that one-chunk schedules read (and parse) as before.
        return f"{self.kind}{self.microbatch}" + (f"v{self.chunk}" if self.chunk else "")

    @classmethod
    def parse(cls, text: str) -> "Unit":
        match = re.fullmatch(r"\s*([FB])(\d+)(?:v(\d+))?\s*", text)
        if not match:
            raise ScheduleError(
                f"cannot parse unit {text!r}: expected F<id> or B<id>, optionally v<chunk>, e.g. F3 or B3v1"
            )
        return cls(match.group(1), int(match.group(2)), int(match.group(3) or 0))


def F(microbatch: int, chunk: int = 0) -> Unit:  # noqa: N802 - reads like the printed form
    return Unit(FORWARD, microbatch, chunk)


def B(microbatch: int, chunk: int = 0) -> Unit:  # noqa: N802
    return Unit(BACKWARD, microbatch, chunk)


@dataclass(frozen=True)
class Schedule:
    """The execution order of every stage of one pipeline iteration."""

    num_microbatches: int
    orders: tuple[tuple[Unit, ...], ...]
    name: str = "custom"
    # Extra warm-up forwards per stage beyond 1F1B's (EnvPipe's r_s); informational.
    extra_warmup: tuple[int, ...] = ()
    # Model chunks per stage (Megatron's virtual pipeline size V); every stage runs every chunk.
    num_chunks: int = 1

    @property
    def num_stages(self) -> int:
        return len(self.orders)

    def forwards_before_first_backward(self, stage: int) -> int:
        """``min(M, P-s)`` for 1F1B, ``min(M, P-s+r_s)`` for EnvPipe (chunk forwards with model chunks).

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
        """Peak number of activations each stage holds (forwards not yet backwarded).

        Counted in units: with model chunks one unit holds one chunk's activations (about 1/V of a stage's).
        """
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

    def expected_units(self) -> set[Unit]:
        """Every unit each stage must run once: F and B of every (micro-batch, chunk)."""
        return {
            make(m, v) for make in (F, B) for m in range(self.num_microbatches) for v in range(self.num_chunks)
        }

    def validate(self) -> "Schedule":
        """Check completeness, per-stage F-before-B, and that the stages cannot deadlock.

        The deadlock check covers every message, the wrap-around ones of model
        chunks included (see :func:`unit_dag`). Returns ``self`` so it chains.
        Raises :class:`ScheduleError` naming the stage.
        """
        if self.num_microbatches < 1:
            raise ScheduleError(f"need at least one micro-batch, got {self.num_microbatches}")
        if self.num_stages < 1:
            raise ScheduleError("a schedule needs at least one stage")
        if isinstance(self.num_chunks, bool) or not isinstance(self.num_chunks, int) or self.num_chunks < 1:
            raise ScheduleError(f"need at least one model chunk per stage, got num_chunks={self.num_chunks!r}")
        expected = self.expected_units()
        for s, order in enumerate(self.orders):
            seen: set[Unit] = set()
            for unit in order:
                if unit in seen:
                    raise ScheduleError(f"stage {s}: {unit} appears more than once")
                if unit not in expected:
                    chunks = f" and chunks 0..{self.num_chunks - 1}" if self.num_chunks > 1 or unit.chunk else ""
                    raise ScheduleError(
                        f"stage {s}: {unit} is outside micro-batches 0..{self.num_microbatches - 1}{chunks}"
                    )
                if not unit.is_forward and F(unit.microbatch, unit.chunk) not in seen:
                    raise ScheduleError(f"stage {s}: {unit} runs before {F(unit.microbatch, unit.chunk)}")
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
        if self.num_chunks > 1:
            lines[0] += f" x {self.num_chunks} model chunks"
        if self.extra_warmup:
            lines[0] += f", extra warm-up {list(self.extra_warmup)}"
        for s, order in enumerate(self.orders):
            lines.append(f"{f'S{s}':<{width}}: " + " ".join(str(u) for u in order))
        return "\n".join(lines)

    @classmethod
    def parse(cls, text: str, name: str = "custom") -> "Schedule":
        """Parse the printed form: one ``S<k>: F0 F1 B0 ...`` line per stage.

        Lines starting with ``#`` and blank lines are ignored. Stages must be
        numbered 0..P-1; the micro-batch and chunk counts are the highest ids
        plus one. The result is validated.
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
        units = [u for order in rows.values() for u in order]
        num_mb = 1 + max((u.microbatch for u in units), default=-1)
        num_chunks = 1 + max((u.chunk for u in units), default=0)
        schedule = cls(num_mb, tuple(rows[s] for s in range(len(rows))), name=name, num_chunks=num_chunks)
        return schedule.validate()


@dataclass(frozen=True)
class UnitDag:
    """A schedule's units as DAG nodes (stage by stage, in order) and the dependencies the schedule implies.

    Edges: the same stage's previous unit (a GPU runs one unit at a time) and
    the message a unit receives: within a chunk ``F(s-1, v, m) -> F(s, v, m)``
    (activation) and ``B(s+1, v, m) -> B(s, v, m)`` (gradient); across the
    wrap-around of model chunks, the last stage's chunk v feeds the first
    stage's chunk v+1: ``F(P-1, v, m) -> F(0, v+1, m)`` and ``B(0, v+1, m) -> B(P-1, v, m)``.
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


def message_source(num_stages: int, num_chunks: int, stage: int, unit: Unit) -> tuple[int, Unit] | None:
    """The (stage, unit) whose activation or gradient ``unit`` on ``stage`` receives; None if it reads data / loss.

    Virtual stage v*P+s receives from v*P+s-1 (forward) or v*P+s+1 (backward).
    """
    last = num_stages - 1
    mb, chunk = unit.microbatch, unit.chunk
    if unit.is_forward:
        if stage > 0:
            return stage - 1, F(mb, chunk)
        return (last, F(mb, chunk - 1)) if chunk > 0 else None
    if stage < last:
        return stage + 1, B(mb, chunk)
    return (0, B(mb, chunk + 1)) if chunk < num_chunks - 1 else None


def unit_dag(schedule: Schedule) -> UnitDag:
    """The units of ``schedule`` and their dependencies; ScheduleError if a message's sender is missing.

    Each unit is hashed once (for ``index``); senders are then found by
    :func:`message_source`'s rule on integer keys, without building units
    (16k of them at P = 32, M = 256).
    """
    nodes: list[tuple[int, Unit]] = []
    index: dict[tuple[int, Unit], int] = {}
    for s, order in enumerate(schedule.orders):
        for unit in order:
            index[(s, unit)] = len(nodes)
            nodes.append((s, unit))
    if len(index) < len(nodes):  # a unit twice on a stage (validate() rejects it): the general rule
        return _unit_dag_by_lookup(schedule, nodes, index)
    stage_pred: list[int] = []
    at: list[dict[tuple[bool, int, int], int]] = []  # per stage: (forward?, micro-batch, chunk) -> node
    v = 0
    for order in schedule.orders:
        keys: dict[tuple[bool, int, int], int] = {}
        for i, unit in enumerate(order):
            stage_pred.append(v - 1 if i else -1)
            keys[(unit.kind is FORWARD, unit.microbatch, unit.chunk)] = v
            v += 1
        at.append(keys)
    last, top = len(at) - 1, schedule.num_chunks - 1
    message_pred = [-1] * len(nodes)
    for v, (s, unit) in enumerate(nodes):
        mb, chunk = unit.microbatch, unit.chunk
        if unit.kind is FORWARD:
            if s > 0:
                u = at[s - 1].get((True, mb, chunk), -1)
            elif chunk > 0:
                u = at[last].get((True, mb, chunk - 1), -1)
            else:
                continue  # reads the data
        elif s < last:
            u = at[s + 1].get((False, mb, chunk), -1)
        elif chunk < top:
            u = at[0].get((False, mb, chunk + 1), -1)
        else:
            continue  # reads the loss
        if u < 0:
            _missing_source(schedule, index, s, unit)
        message_pred[v] = u
    return UnitDag(tuple(nodes), index, tuple(stage_pred), tuple(message_pred))


def _unit_dag_by_lookup(
    schedule: Schedule, nodes: list[tuple[int, Unit]], index: dict[tuple[int, Unit], int]
) -> UnitDag:
    """:func:`unit_dag` by looking every neighbour up in ``index`` (what a repeated unit needs)."""
    stage_pred = [-1] * len(nodes)
    for s, order in enumerate(schedule.orders):
        for i in range(1, len(order)):
            stage_pred[index[(s, order[i])]] = index[(s, order[i - 1])]
    message_pred = [-1] * len(nodes)
    for v, (s, unit) in enumerate(nodes):
        source = message_source(schedule.num_stages, schedule.num_chunks, s, unit)
        if source is not None:
            message_pred[v] = unit_index(index, source, "dependency source")
    return UnitDag(tuple(nodes), index, tuple(stage_pred), tuple(message_pred))


def _missing_source(schedule: Schedule, index: dict[tuple[int, Unit], int], stage: int, unit: Unit) -> None:
    """Raise the ScheduleError naming the sender ``unit`` on ``stage`` waits for."""
    source = message_source(schedule.num_stages, schedule.num_chunks, stage, unit)
    if source is not None:
        unit_index(index, source, "dependency source")
    raise ScheduleError(f"S{stage} {unit}: its message's sender is not in the schedule")


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
