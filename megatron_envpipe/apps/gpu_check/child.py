"""One step of ``envpipe gpu-check`` in a process of its own.

``python -m megatron_envpipe.apps.gpu_check.child ENTRY CONTEXT.json RESULT.json``: reads the
:class:`StepContext` the runner wrote, imports ``ENTRY`` ("package.module:function") here, runs it
and writes its :class:`StepResult` as JSON. A step that raises is a ``failed`` result naming the
exception (its traceback goes to stderr, which the runner keeps in check.log); the runner stops a
child that outlives its limit. The time limit counts from when the runner started this process
(``started_monotonic`` in the context file: CLOCK_MONOTONIC is one clock for every process of the
machine), so Python's and torch's start-up are charged to the step, as the runner charges them.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import sys
import traceback
from collections.abc import Sequence
from pathlib import Path

from megatron_envpipe.apps.gpu_check.step_api import StepContext, StepResult
from megatron_envpipe.core.atomic import write_json_atomic

__all__ = ["main"]


def _run_entry(entry: str, ctx: StepContext) -> StepResult:
    """Import and run one step; any exception becomes a failed result (one line, the type and message)."""
    try:
        module_name, _, func_name = entry.partition(":")
        func = getattr(importlib.import_module(module_name), func_name or "run")
        result = func(ctx)
        if not isinstance(result, StepResult):
            raise TypeError(f"{entry} returned {type(result).__name__}, not a StepResult")
        return result
    except Exception as exc:  # a step's bug or missing dependency is a result, not the end of the check
        traceback.print_exc(file=sys.stderr)
        text = " ".join(str(exc).split())[:300] or "(no message)"
        return StepResult("failed", f"{type(exc).__name__}: {text}")


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 3:
        print("usage: python -m megatron_envpipe.apps.gpu_check.child ENTRY CONTEXT.json RESULT.json",
              file=sys.stderr)
        return 2
    entry, ctx_path, result_path = args
    data = json.loads(Path(ctx_path).read_text())
    ctx = StepContext.from_json(data)
    if "started_monotonic" in data:
        ctx = dataclasses.replace(ctx, started_monotonic=float(data["started_monotonic"]))
    result = _run_entry(entry, ctx)
    try:
        write_json_atomic(result_path, result.to_json())
    except (TypeError, ValueError) as exc:  # figures JSON cannot hold (StepResult checks NaN; other types end here)
        write_json_atomic(result_path, StepResult("failed", f"the step's result is not JSON: {exc}").to_json())
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
