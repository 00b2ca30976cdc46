"""What ``envpipe gpu-check`` writes about itself: the plan, summary.md and results.json.

:class:`StepRecord` is one step's row, mutable only through the runner (``pending``, then
``running``, then ``ok``/``failed``/``skipped``); :func:`summary_markdown` and :func:`results_json`
render the whole check from the records at any moment, so a check killed half-way leaves a
summary that is true up to that moment.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from typing import Any

from megatron_envpipe.apps.gpu_check.step_api import Step

__all__ = ["CheckRecord", "StepRecord", "plan_lines", "results_json", "summary_markdown"]


def _format_duration(seconds: float) -> str:
    """``455`` -> ``7 min 35 s`` (whole seconds; under a minute just ``45 s``)."""
    total = int(round(seconds))
    minutes, secs = divmod(total, 60)
    return f"{minutes} min {secs} s" if minutes else f"{secs} s"


NOT_SELECTED = "not selected (--steps)"


def _planned_line(steps: Sequence[Step], selected: Collection[str] | None = None) -> str:
    """``N steps, planned total T``: of the steps that will run (``selected``: the ``--steps`` names)."""
    chosen = [s for s in steps if selected is None or s.name in selected]
    total = sum(s.planned_s for s in chosen)
    count = f"{len(chosen)} steps" if selected is None else f"{len(chosen)} of {len(steps)} steps (--steps)"
    return f"{count}, planned total {_format_duration(total)} (each step stopped at its limit)"


def plan_lines(steps: Sequence[Step], selected: Collection[str] | None = None) -> list[str]:
    """The plan printed at the start: every step with its limit, then the planned total of those selected."""
    lines = [f"envpipe gpu-check: {_planned_line(steps, selected)}"]
    width = max(len(s.name) for s in steps)
    lines += [f"  {s.number} {s.name:<{width}} {s.planned_s:>4g} s  {s.title}"
              + ("" if selected is None or s.name in selected else "  (not selected)") for s in steps]
    return lines


@dataclass
class StepRecord:
    """One step as the check saw it so far."""

    step: Step
    status: str = "pending"         # pending, running, ok, failed, skipped
    reason: str = ""
    figures: dict[str, Any] = field(default_factory=dict)
    lines: tuple[str, ...] = ()
    files: tuple[str, ...] = ()
    time_s: float | None = None
    clocks: str = ""                # what the reset after the step did
    exit_status: int | None = None

    def to_json(self) -> dict[str, Any]:
        s = self.step
        return {"number": s.number, "name": s.name, "title": s.title, "limit_s": s.planned_s,
                "needs": sorted(s.needs), "status": self.status, "reason": self.reason, "figures": self.figures,
                "lines": list(self.lines), "files": list(self.files), "time_s": self.time_s,
                "clocks_after": self.clocks, "exit_status": self.exit_status}


@dataclass
class CheckRecord:
    """The whole check: where it ran and every step's record."""

    device: str                     # "cuda" or "cpu"
    device_index: int
    device_label: str               # the GPU (or why there is none)
    started_utc: str
    steps: list[StepRecord]
    state: str = "running"          # running, finished, interrupted (by SIGTERM/SIGINT)
    finished_utc: str | None = None
    clocks_at_exit: str = ""
    notes: list[str] = field(default_factory=list)


def _cell(text: str) -> str:
    return " ".join(str(text).split()).replace("|", "\\|")


def summary_markdown(check: CheckRecord) -> str:
    steps = [r.step for r in check.steps]
    skipped = {r.step.name for r in check.steps if r.reason == NOT_SELECTED}
    selected = None if not skipped else {s.name for s in steps} - skipped
    out = ["# envpipe gpu-check", "",
           f"- device: {check.device} {check.device_index}: {_cell(check.device_label)}",
           f"- started: {check.started_utc} UTC; state: **{check.state}**"
           + (f"; finished {check.finished_utc} UTC" if check.finished_utc else ""),
           f"- planned: {_planned_line(steps, selected)}"]
    if check.clocks_at_exit:
        out.append(f"- clocks at exit: {_cell(check.clocks_at_exit)}")
    out += [f"- note: {_cell(n)}" for n in check.notes]
    out += ["", "| # | step | limit | status | time | clocks after | reason |", "|---|---|---|---|---|---|---|"]
    for r in check.steps:
        took = "" if r.time_s is None else f"{r.time_s:.1f} s"
        out.append(f"| {r.step.number} | {r.step.name} | {r.step.planned_s:g} s | {r.status} | {took} | "
                   f"{_cell(r.clocks)} | {_cell(r.reason)} |")
    for r in check.steps:
        if r.lines or r.files:
            out += ["", f"## {r.step.number} {r.step.name}: {r.status}", ""]
            out += [f"- {_cell(line)}" for line in r.lines]
            if r.files:
                out.append(f"- files: {', '.join(r.files)}")
    return "\n".join(out) + "\n"


def results_json(check: CheckRecord) -> dict[str, Any]:
    return {"check": "envpipe gpu-check", "device": check.device, "device_index": check.device_index,
            "device_label": check.device_label, "started_utc": check.started_utc,
            "finished_utc": check.finished_utc, "state": check.state,
            "planned_total_s": sum(r.step.planned_s for r in check.steps),
            "clocks_at_exit": check.clocks_at_exit, "notes": list(check.notes),
            "steps": [r.to_json() for r in check.steps]}
