"""The activation-memory budget of EnvPipe's ``ours`` order: its forms, 1F1B's need, budgets from memory.

Stage ``s`` of 1F1B holds at most ``min(M, P-s)`` micro-batch activations; ``ours`` holds
``r_s`` more (its extra warm-up forwards). A budget caps that per stage, in micro-batch
activations (``clamp_extra_warmup`` applies it). ``--envpipe-max-inflight`` takes:

* ``auto`` (training's default): derive it from the memory one micro-batch's activations
  take and the memory still free at 1F1B's peak, per stage (measured on CUDA, or given by a
  :class:`MemoryModel` on CPU and the simulated GPU); where nothing can be measured, no
  budget (as ``none``);
* ``none`` / ``unlimited``: no budget;
* ``N``: the same budget on every stage;
* ``b0,b1,...``: one per stage, first stage first (later stages hold fewer activations in
  1F1B, so a memory-derived budget differs per stage).

Pure Python.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from megatron_envpipe.core.flag_ranges import RANGES
from megatron_envpipe.errors import InvalidValueError

AUTO = "auto"
_UNLIMITED_WORDS = ("none", "unlimited")
MIB = 2**20
_GIB = 2**30
# Kept free on top of the activations: allocator fragmentation and what one measured
# iteration cannot see. 10 % of the free memory, at least 512 MiB.
_MARGIN_FRACTION = 0.10
_MIN_MARGIN_BYTES = 512 * MIB

Budget = int | tuple[int | None, ...] | None  # what the planner takes: per stage, None = no limit
MaxInflight = Budget | str  # what the flag holds: a budget or AUTO


def parse_max_inflight(text: str) -> MaxInflight:
    """``auto`` -> AUTO, ``none``/``unlimited`` -> None, ``8`` -> 8, ``4,3,2,2`` -> (4, 3, 2, 2).

    Numbers are not range-checked here (0 or a negative entry is reported with its flag
    by the caller); anything else raises ValueError saying what is expected.
    """
    body = text.strip().lower()
    if body == AUTO:
        return AUTO
    if body in _UNLIMITED_WORDS:
        return None
    parts = [p.strip() for p in body.split(",")]
    try:
        values = [int(p) for p in parts]
    except ValueError:
        raise InvalidValueError(
            f"expected auto, none, a whole number of micro-batch activations or one per stage "
            f"(e.g. 8 or 4,3,2,2), got {text!r}"
        ) from None
    return tuple(values) if "," in body else values[0]


def show_budget(budget: MaxInflight) -> str:
    """A budget as the flag spells it: ``auto``, ``none``, ``8``, ``4,3,2,2``."""
    if budget is None:
        return "none"
    if isinstance(budget, tuple):
        return ",".join("none" if b is None else str(b) for b in budget)
    return str(budget)


def _one_f_one_b_need(num_stages: int, num_microbatches: int | None) -> tuple[int, ...]:
    """Peak in-flight activations of 1F1B per stage, ``min(M, P-s)`` (``P-s`` when M is unknown)."""
    return tuple(num_stages - s if num_microbatches is None else min(num_microbatches, num_stages - s)
                 for s in range(num_stages))


def budget_problem(num_stages: int, num_microbatches: int | None, budget: Budget) -> str | None:
    """Why ``budget`` cannot run on this pipeline (wrong length, a stage below 1F1B's need), or None."""
    if budget is None:
        return None
    need = _one_f_one_b_need(num_stages, num_microbatches)
    example = ",".join(str(n) for n in need)
    if isinstance(budget, int):
        if budget < need[0]:
            return (f"{budget} is below the {need[0]} micro-batch activations that 1F1B itself keeps in flight "
                    f"on stage 0: give at least {need[0]} (more allows extra warm-up)")
        return None
    if len(budget) != num_stages:
        return (f"{show_budget(budget)} has {len(budget)} entries but the pipeline has {num_stages} stages: "
                f"give one per stage, first stage first, e.g. {example} (what 1F1B itself holds)")
    for s, b in enumerate(budget):
        if b is not None and b < need[s]:
            return (f"{show_budget(budget)}: stage {s}'s budget {b} is below the {need[s]} micro-batch activations "
                    f"that 1F1B itself keeps in flight there: give at least {example} (more allows extra warm-up)")
    return None


def within_budget(peaks: Sequence[int], budget: Budget) -> bool:
    """Whether every stage's peak in-flight count fits its budget."""
    if budget is None:
        return True
    limits = [budget] * len(peaks) if isinstance(budget, int) else list(budget)
    return all(b is None or p <= b for p, b in zip(peaks, limits, strict=True))


@dataclass(frozen=True)
class StageMemory:
    """One stage's memory as the budget needs it, in bytes."""

    activation_bytes: int  # what one micro-batch's forward keeps alive until its backward
    free_bytes: int  # still allocatable at 1F1B's peak (the most activations 1F1B holds)

    def merge(self, other: "StageMemory") -> "StageMemory":
        """Two measurements of the stage, taken pessimistically: the larger activation, the smaller free."""
        return StageMemory(max(self.activation_bytes, other.activation_bytes), min(self.free_bytes, other.free_bytes))


@dataclass(frozen=True)
class MemoryModel:
    """Stands in for the device on CPU and the simulated GPU: every stage has ``free_gib`` free
    at 1F1B's peak and a micro-batch's activations take ``mib_per_microbatch``."""

    free_gib: float
    mib_per_microbatch: float

    @classmethod
    def parse(cls, text: str) -> "MemoryModel":
        """``GIB_FREE,MIB_PER_MICROBATCH``, e.g. ``2,256``; ValueError saying what is wrong."""
        parts = [p.strip() for p in text.split(",")]
        try:
            free, act = (float(p) for p in parts)
        except ValueError:
            raise InvalidValueError(f"expected GIB_FREE,MIB_PER_MICROBATCH, e.g. 2,256, got {text!r}") from None
        model = cls(free, act)
        problem = model.problem()
        if problem:
            raise InvalidValueError(f"{text!r}: {problem}")
        return model

    def __str__(self) -> str:
        """As the flag is typed: ``2,256``."""
        return f"{self.free_gib:g},{self.mib_per_microbatch:g}"

    def problem(self) -> str | None:
        # Bounded above too: 1e300 GiB overflows to inf bytes, and int(inf) would kill every rank.
        for what, value, key in (("free memory", self.free_gib, "sim_free_gib"),
                                 ("activation memory per micro-batch", self.mib_per_microbatch, "sim_mib_per_microbatch")):
            problem = RANGES[key].problem(value)
            if problem:
                return f"{what} {problem}, got {value!r}"
        return None

    def stage_memory(self) -> StageMemory:
        return StageMemory(int(self.mib_per_microbatch * MIB), int(self.free_gib * _GIB))


def _margin_bytes(free_bytes: int) -> int:
    return max(_MIN_MARGIN_BYTES, int(_MARGIN_FRACTION * free_bytes))


def derive_budget(num_microbatches: int, memory: Sequence[StageMemory]) -> tuple[int | None, ...]:
    """Per stage: what 1F1B holds plus the activations that fit in the free memory less the margin.

    ``floor((free - margin) / activation) + min(M, P-s)``, never below 1F1B's need and at most
    M (a stage never holds more); None (no limit) where a micro-batch measured no memory.
    """
    need = _one_f_one_b_need(len(memory), num_microbatches)
    out: list[int | None] = []
    for s, mem in enumerate(memory):
        if mem.activation_bytes <= 0:
            out.append(None)
            continue
        extra = max(0, (mem.free_bytes - _margin_bytes(mem.free_bytes)) // mem.activation_bytes)
        out.append(min(num_microbatches, need[s] + extra))
    return tuple(out)


def _one_or_list(values: Sequence[float], fmt: str) -> str:
    shown = [format(v, fmt) for v in values]
    return shown[0] if len(set(shown)) == 1 else "[" + ", ".join(shown) + "]"


def budget_line(budget: Sequence[int | None], memory: Sequence[StageMemory], source: str) -> str:
    """``activation budget per stage [...] (X MiB per micro-batch, Y GiB free)``, X and Y per stage when they differ."""
    act = _one_or_list([m.activation_bytes / MIB for m in memory], ".0f")
    free = _one_or_list([m.free_bytes / _GIB for m in memory], ".3g")
    shown = "[" + ", ".join("none" if b is None else str(b) for b in budget) + "]"
    return (f"activation budget per stage {shown} ({act} MiB per micro-batch, {free} GiB free at 1F1B's peak, "
            f"{source}; margin 10 %, at least 512 MiB)")
