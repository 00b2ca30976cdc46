"""What the tiny GPT records for ``--losses-out``: per-iteration losses, which schedule function every rank
ran (and whether EnvPipe was installed or its executor even imported), and what EnvPipe planned and measured.

Split from :mod:`megatron_envpipe.apps.train_tiny_gpt` (the training loop), which re-exports these names.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch.distributed as dist

from megatron_envpipe.core.atomic import write_json_atomic
from megatron_envpipe.megatron.host_p2p import current_counts
from megatron_envpipe.megatron.state import STATE
from megatron_envpipe.planning.deadline import saving_against

__all__ = ["envpipe_installed", "envpipe_summary", "function_name", "gather_schedules", "write_losses"]


def function_name(fn: Any) -> str:
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"


def gather_schedules(ran: list[str], records: list[dict[str, Any]]) -> None:
    """Every rank's schedule functions, EnvPipe state and loaded executor, onto the last stage's records."""
    mine: dict[str, Any] = {"functions": ran, "envpipe_installed": envpipe_installed(),
                            "executor_imported": "megatron_envpipe.megatron.executor" in sys.modules}
    counts = current_counts()
    if counts is not None:  # --p2p-transport host: what this rank staged so far (P2P messages, not objects)
        mine["host_staged"] = {"sends": counts.sends, "recvs": counts.recvs, "collectives": counts.collectives,
                               "bytes": counts.bytes_staged}
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    for record in records:
        record["schedule"] = everyone


def envpipe_installed() -> bool:
    # Looked up, not imported: a --no-envpipe run must not load the patch or the executor.
    patch = sys.modules.get("megatron_envpipe.megatron.patch")
    return bool(patch is not None and patch.is_installed())


def write_losses(path: Path, args: argparse.Namespace, records: list[dict[str, Any]],
                 envpipe_run: dict[str, Any] | None = None,
                 stock_reference: list[dict[str, Any]] | None = None) -> None:
    """JSON with ``losses`` (per-iteration per-token mean, exact floats) and context; atomic."""
    payload: dict[str, Any] = {
        "envpipe_run": envpipe_run or {},
        "losses": [r["lm_loss"] for r in records],
        "tokens": [r["tokens"] for r in records],
        "elapsed_s": [r["elapsed_s"] for r in records],
        # None: --no-envpipe, stock Megatron.
        "envpipe": None if args.no_envpipe else {"type": args.envpipe_plan_type,
                                                 "scheduling": args.envpipe_scheduling,
                                                 "reconfig": args.envpipe_reconfig},
        # Per rank: the schedule functions it called (module.qualname), whether EnvPipe was
        # installed at the end of training, and whether EnvPipe's executor was imported at all.
        "schedule": records[0]["schedule"] if records else [],
        "pipeline_model_parallel_size": args.pipeline_model_parallel_size,
        "virtual_pipeline_model_parallel_size": args.virtual_pipeline_model_parallel_size,
        "num_microbatches": args.num_microbatches,
        "seed": args.seed,
        "device": args.device,
        "p2p_transport": args.p2p_transport,
    }
    if stock_reference:
        payload["stock_reference"] = {"losses": [r["lm_loss"] for r in stock_reference],
                                      "tokens": [r["tokens"] for r in stock_reference],
                                      "schedule": stock_reference[0]["schedule"]}
    write_json_atomic(path, payload)


def envpipe_summary() -> dict[str, Any]:
    """What EnvPipe planned and measured in this process (for --losses-out)."""
    run = STATE.run
    if run is None:
        return {}
    runtime = run.phases
    out: dict[str, Any] = {"energy": [dict(asdict(r), saving=r.saving) for r in run.energy.energy_log],
                           "planned_at_iteration": runtime.planned_at}
    if runtime.device is not None:
        out["device"] = asdict(runtime.device)
    if run.iteration_plans is not None:  # variable-length micro-batches
        out["per_iteration_plans"] = run.iteration_plans.report()
    result = runtime.last_result
    if result is not None:
        out["plan"] = {
            "extra_warmup": list(result.schedule.extra_warmup),
            "peak_inflight_activations": list(result.schedule.peak_inflight()),
            "predicted_saving": result.energy_saving,
            "predicted_slowdown": result.slowdown,
            "predicted_energy_j": result.score.energy_j,
            "predicted_baseline_energy_j": result.baseline.energy_j,
            "frequencies": result.plan.to_dict()["stages"],
        }
        deadline = runtime.deadline
        if deadline is not None:  # --envpipe-deadline-from 1f1b: 1F1B at f_max as predicted, the plan against it
            out["plan"]["deadline_from"] = {
                "schedule": "1f1b", "reference_time_s": deadline.reference.iteration_time_s,
                "reference_energy_j": deadline.reference.energy_j, "predicted_time_s": result.score.iteration_time_s,
                "predicted_energy_j": result.energy_j, "predicted_saving_vs_1f1b": saving_against(result, deadline.reference),
            }
    return out
