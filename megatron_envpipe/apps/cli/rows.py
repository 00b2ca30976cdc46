"""The per-stage rows of a plan (``Stage 0 | [F0 1740 0.0]  F1 1140 0.0 ...``), in full or as a summary.

EnvPipe's printout lists every unit with its clock and receive wait: about 15 characters a unit, so
a row of 8 stages x 96 micro-batches runs to ~2,900 characters. Past :data:`ROW_LIMIT_CHARS` the
rows print as a summary by default: each stage's clocks run-length compressed in unit order
(``1740x1 1140x1 1110x3 ... 1230x159``, or a count per clock where they alternate), its clock
changes, total receive wait and critical units.
``--rows full`` prints every unit whatever the length; ``--json`` always holds every unit.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection, Sequence

from megatron_envpipe.core.plan import FrequencyPlan, format_envpipe
from megatron_envpipe.core.units import Unit

ROWS_CHOICES = ("auto", "full", "summary")
# Rows up to this long print in full under --rows auto: the README's 8 stages x 12 micro-batches
# (~360 characters a row) stay as EnvPipe printed them; 8 x 24 (~720) becomes a summary.
ROW_LIMIT_CHARS = 400
# A summary shows clock runs where every stage's fit in this many characters, else a count per clock.
_RUNS_LIMIT_CHARS = 120


def _full_rows(plan: FrequencyPlan, recv_wait_ms: Sequence[Sequence[float]] | None,
              critical: Collection[tuple[int, Unit]] = ()) -> str:
    """Every unit: ``F0 1740 0.0`` (unit, MHz, receive wait in ms), or ``F0 1740`` where no wait is known."""
    if recv_wait_ms is not None:
        return format_envpipe(plan, recv_wait_ms, critical)
    crit = set(critical)
    lines = []
    for s, (order, freqs) in enumerate(zip(plan.schedule.orders, plan.freqs_mhz)):
        cells = [f"[{u} {f}]" if (s, u) in crit else f" {u} {f} " for u, f in zip(order, freqs)]
        lines.append(f"Stage {s} | " + " ".join(cells))
    return "\n".join(lines)


def _clock_runs(freqs_mhz: Sequence[int]) -> str:
    """``1740x1 1140x1 1110x3``: each clock and how many consecutive units run at it, in unit order."""
    runs: list[list[int]] = []
    for f in freqs_mhz:
        if runs and runs[-1][0] == f:
            runs[-1][1] += 1
        else:
            runs.append([f, 1])
    return " ".join(f"{f}x{n}" for f, n in runs)


def _clock_counts(freqs_mhz: Sequence[int]) -> str:
    """``1035:45 1380:60 1560:87``: each clock (MHz, ascending) and how many units run at it."""
    return " ".join(f"{f}:{n}" for f, n in sorted(Counter(freqs_mhz).items()))


def _summary_rows(plan: FrequencyPlan, recv_wait_ms: Sequence[Sequence[float]] | None,
                 critical: Collection[tuple[int, Unit]] = ()) -> str:
    """One short row per stage: its clocks, total receive wait (when known) and critical units.

    The clocks as runs in unit order (``1740x1 1140x1 1110x3 ... 1230x159``) where every stage's runs
    fit in :data:`_RUNS_LIMIT_CHARS`, as envelope plans' do; else (plans whose clocks alternate unit by
    unit, as optimal ones can) as a count per clock (``1035:45 1380:60 1560:87``)."""
    runs = [_clock_runs(freqs) for freqs in plan.freqs_mhz]
    if max(map(len, runs), default=0) <= _RUNS_LIMIT_CHARS:
        lines = ["clocks per stage as runs: MHz x consecutive units, in unit order (--rows full lists every unit)"]
    else:
        runs = [_clock_counts(freqs) for freqs in plan.freqs_mhz]
        lines = ["clocks per stage: MHz:units, ascending; they change too often for runs (--rows full lists "
                 "every unit)"]
    crit = set(critical)
    changes = plan.clock_changes()  # as the plan's report counts them: the first lock too
    for s, order in enumerate(plan.schedule.orders):
        parts = [f"Stage {s} | {runs[s]}", f"{len(order)} units, {changes[s]} clock changes"]
        if recv_wait_ms is not None:
            parts.append(f"receive wait {sum(recv_wait_ms[s]):.1f} ms")
        if crit:
            parts.append(f"{sum(1 for u in order if (s, u) in crit)} critical")
        lines.append(" | ".join(parts))
    return "\n".join(lines)


def plan_rows(plan: FrequencyPlan, recv_wait_ms: Sequence[Sequence[float]] | None,
              critical: Collection[tuple[int, Unit]] = (), rows: str = "auto") -> str:
    """The rows as ``--rows`` asks: ``full``, ``summary``, or ``auto`` (full while no row is longer
    than :data:`ROW_LIMIT_CHARS`)."""
    full = _full_rows(plan, recv_wait_ms, critical) if rows != "summary" else ""
    if rows == "full" or (rows == "auto" and max(map(len, full.splitlines()), default=0) <= ROW_LIMIT_CHARS):
        return full
    return _summary_rows(plan, recv_wait_ms, critical)
