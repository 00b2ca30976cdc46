"""Two data-parallel replicas over real gloo, each a planned run-time fed simulated iteration times.

:func:`follow_run` starts two processes (one rank per replica, one pipeline each: the pipeline's stages
share one process, as the run-time plans them offline); replica 1 is ``factor`` times slower until
iteration ``recover_at`` (0-based). Each process runs :class:`~megatron_envpipe.megatron.stragglers.StragglerFollow`
after every iteration, with its real collectives (the asynchronous all-gather over the data-parallel
group, the gather over the pipeline group), and records, per iteration, whether the next iteration runs a
straggler's pace plan, its predicted time, and the energy-line note. Host speed never decides: the test
waits for the start-up frontier and for each gather before the window that reads it.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch.distributed as dist

from megatron_envpipe.config import EnvPipeConfig
from megatron_envpipe.core.profile import Profile
from megatron_envpipe.core.resources import shipped_profile
from megatron_envpipe.gpu.startup import DeviceFacts
from megatron_envpipe.megatron.groups import StageGroups
from megatron_envpipe.megatron.runtime import EnvPipeRuntime
from megatron_envpipe.megatron.stragglers import StragglerFollow
from megatron_envpipe.testing.harness import join_ranks, start_ranks

__all__ = ["follow_run"]

STAGES, MICROBATCHES = 2, 8


def _worker(rank: int, out_dir: str, factor: float, recover_at: int, iterations: int, follow: bool) -> None:
    dist.init_process_group("gloo", init_method=f"file://{out_dir}/store", rank=rank, world_size=2)
    try:
        pipelines = [dist.new_group([r]) for r in range(2)]  # every rank creates every group, in order
        groups = StageGroups.of(SimpleNamespace(pp=pipelines[rank], dp=dist.group.WORLD, tp=None, cp=None))
        config = EnvPipeConfig(plan_type="optimal", scheduling="ours", profile=str(Path(out_dir, "profile.csv")),
                               gpu="simulated:a40/gpt3-175b", baseline_iterations=0, follow_stragglers=follow)
        runtime = EnvPipeRuntime(config)
        clocks = tuple(sorted(runtime.profile.common_frequencies(), reverse=True))
        runtime.attach_device(DeviceFacts("simulated", "Simulated GPU", "simulated", clocks, control=True,
                                          energy=True, modelled=True))
        straggler = StragglerFollow(runtime)
        records: list[dict[str, Any]] = []
        for it in range(iterations):
            runtime.prepare(STAGES, MICROBATCHES, pace_plan=straggler.pace_plan)
            runtime.finish(STAGES, MICROBATCHES, None)
            own_pred = runtime.last_result.score.iteration_time_s
            running = straggler.running_predicted_s or own_pred  # a follower runs its pace plan's time
            slow = factor if rank == 1 and it < recover_at else 1.0
            straggler.after_iteration(groups, it, running * slow)
            if it == 0 and straggler.frontier is not None:
                straggler.frontier.result(120)  # ready before the first decision, whatever the host
            straggler.settle()
            records.append({"iteration": it, "following": straggler.pace_plan is not None,
                            "pace_time_s": straggler.pace_time_s, "note": straggler.pace_note,
                            "own_time_s": own_pred, "dp_wait": straggler.dp_wait})
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(records))
    finally:
        dist.destroy_process_group()


def follow_run(out_dir: str | os.PathLike, factor: float = 1.15, recover_at: int = 10 ** 9,
               iterations: int = 12, follow: bool = True) -> list[list[dict[str, Any]]]:
    """Per replica, per iteration: what :func:`_worker` recorded."""
    out = str(out_dir)
    # The shipped 8-stage A40 profile, merged into this pipeline's stages.
    Profile.from_csv(shipped_profile("a40/gpt3-175b")).for_pipeline(STAGES).to_csv(Path(out, "profile.csv"))
    # Fresh processes, forked from the harness's forkserver: torch is imported once, not per process.
    join_ranks(start_ranks(_worker, (out, factor, recover_at, iterations, follow), 2), timeout_s=300)
    return [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(2)]
