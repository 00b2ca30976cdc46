"""The contract between ``envpipe gpu-check``'s runner and its steps.

Every step runs in a child process of its own (``child.py``) with a hard time
limit: a step that hangs or crashes is recorded as failed and the next one runs,
and the runner resets the GPU's clocks after every step. A step is a function
``run(ctx: StepContext) -> StepResult`` named by ``Step.entry`` ("module:function"),
imported only in the child, so the runner itself never loads torch or CUDA.

Steps never write into the output folder themselves: they return the text of
their files (``StepResult.files``, names from ``OUTPUT_FILES`` only) and the
runner writes them atomically, so the folder never holds more than
``len(OUTPUT_FILES)`` files and never a half-written one.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

__all__ = ["OUTPUT_FILES", "STEP_FILES", "Step", "StepContext", "StepResult", "StepStatus"]

# Everything the check writes, summary first. Steps may return only the files listed for them.
OUTPUT_FILES = (
    "summary.md",           # runner: what ran, what was skipped and why, the key figures (rewritten after each step)
    "results.json",         # runner: every step's status, reason and figures (the machine-readable record)
    "check.log",            # runner: every step's stdout/stderr, in order
    "counter.csv",          # step 2: energy-counter samples (time, energy) idle and under load
    "clock-trace.csv",      # step 3: GPU-side timer traces around clock changes
    "profile.csv",          # step 5: the stage profile, Perseus CSV plus reached-clock/uncertainty columns
    "replay.csv",           # step 6: predicted vs measured energy and time per plan and stage
    "calibrated-gpu.toml",  # step 8: the simulated GPU's dynamics preset from these measurements
)
STEP_FILES = {"counter": ("counter.csv",), "clock_changes": ("clock-trace.csv",), "profile": ("profile.csv",),
              "replay": ("replay.csv",), "preset": ("calibrated-gpu.toml",)}

StepStatus = Literal["ok", "failed", "skipped"]


@dataclass(frozen=True)
class Step:
    """One step of the check, as the runner plans it."""

    number: int
    name: str                # key in results.json and in StepContext.earlier
    title: str               # one line for the summary
    planned_s: float         # the hard limit: the child is stopped after this many seconds
    needs: frozenset[str]    # of "gpu" (an NVML device), "cuda" (torch with CUDA), "clock_control"
                             # (step 1 proved a lock works), "megatron" (megatron-core importable)
    entry: str               # "package.module:function", imported in the child only


@dataclass(frozen=True)
class StepContext:
    """What a step is given (JSON-serialisable: it crosses into the child process)."""

    out_dir: Path
    device: str                                   # "cuda" (a real GPU) or "cpu" (CI: simulated GPU, CPU tensors)
    device_index: int                             # local CUDA index, mapped to NVML by PCI bus id
    limit_s: float                                # this step's hard limit
    started_monotonic: float                      # time.monotonic() when the child started the step
    earlier: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)  # figures of steps already run, by name
    state_dir: str | None = None                  # ClockGuard state directory (None: the default)

    def left_s(self, margin_s: float = 0.0) -> float:
        """Seconds left before the runner stops this step, minus ``margin_s`` (never negative)."""
        return max(0.0, self.limit_s - (time.monotonic() - self.started_monotonic) - margin_s)

    def to_json(self) -> dict[str, Any]:
        return {"out_dir": str(self.out_dir), "device": self.device, "device_index": self.device_index,
                "limit_s": self.limit_s, "earlier": dict(self.earlier), "state_dir": self.state_dir}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> "StepContext":
        return cls(out_dir=Path(data["out_dir"]), device=str(data["device"]), device_index=int(data["device_index"]),
                   limit_s=float(data["limit_s"]), started_monotonic=time.monotonic(),
                   earlier=dict(data.get("earlier", {})), state_dir=data.get("state_dir"))


@dataclass(frozen=True)
class StepResult:
    """What a step found. ``figures`` must be JSON-serialisable, with units in the key names."""

    status: StepStatus
    reason: str = ""                                   # one line; required unless ok
    figures: Mapping[str, Any] = field(default_factory=dict)
    lines: tuple[str, ...] = ()                        # the step's lines in summary.md (key figures, short)
    files: Mapping[str, str] = field(default_factory=dict)  # file name (from STEP_FILES) -> its text

    def __post_init__(self) -> None:
        if self.status not in ("ok", "failed", "skipped"):
            raise ValueError(f"step status must be ok, failed or skipped, got {self.status!r}")
        if self.status != "ok" and not self.reason.strip():
            raise ValueError(f"a {self.status} step must say why (reason is empty)")
        for name in self.files:
            if name not in OUTPUT_FILES:
                raise ValueError(f"step file {name!r} is not one of {OUTPUT_FILES}")
        _check_finite(self.figures, "figures")

    def to_json(self) -> dict[str, Any]:
        return {"status": self.status, "reason": self.reason, "figures": dict(self.figures),
                "lines": list(self.lines), "files": dict(self.files)}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> "StepResult":
        return cls(status=data["status"], reason=data.get("reason", ""), figures=dict(data.get("figures", {})),
                   lines=tuple(data.get("lines", ())), files=dict(data.get("files", {})))


def _check_finite(value: Any, where: str) -> None:
    """NaN/inf never reach results.json: a measurement that failed is None with a reason."""
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"step result {where} is not finite ({value!r}): report None and say why")
    if isinstance(value, Mapping):
        for key, item in value.items():
            _check_finite(item, f"{where}.{key}")
    elif isinstance(value, list | tuple):
        for i, item in enumerate(value):
            _check_finite(item, f"{where}[{i}]")
