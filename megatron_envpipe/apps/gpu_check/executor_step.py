"""Step 7 of ``envpipe gpu-check``: EnvPipe's executor on one GPU, losses against stock Megatron.

The tiny GPT (``megatron_envpipe.apps.train_tiny_gpt``) runs as a 4-stage
pipeline, ``torchrun --nproc-per-node 4 --standalone``, twice: with EnvPipe
(envelope plan, ``ours`` scheduling) and as stock Megatron-core
(``--no-envpipe``: EnvPipe never installed, its executor never imported). On a
GPU the four ranks share the device under test (``CUDA_VISIBLE_DEVICES``), so
they talk over gloo with every point-to-point tensor staged through host memory
(``--p2p-transport host``, both runs alike), and EnvPipe's clocks and energy
come from the simulated GPU (stages sharing a device cannot own its clock).
With ``ctx.device == "cpu"`` the very same commands run on CPU tensors: that is
how CI runs this step.

The plan comes from the shipped a40/gpt3-175b profile cut to 4 stages (no
start-up profiling): two baseline iterations at the top clock, then the plan.
The step passes when both runs' per-iteration losses are equal bit for bit and
each side ran the schedule function it should. The tokenizer is trained into a
temporary cache (about 0.1 s on a cold cache), so the machine's cache is untouched.
This module imports no torch: the work happens in the torchrun processes.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megatron_envpipe.apps.gpu_check.step_api import StepContext, StepResult
from megatron_envpipe.core.profile import Profile
from megatron_envpipe.core.resources import shipped_profile

__all__ = ["MEGATRON_1F1B", "STAGES", "run"]

STAGES = 4
_ITERATIONS = 4          # 2 baseline iterations at the top clock, then 2 planned
_SIM_PROFILE = "a40/gpt3-175b"
MEGATRON_1F1B = "megatron.core.pipeline_parallel.schedules.forward_backward_pipelining_without_interleaving"
_EXECUTOR = "megatron_envpipe.megatron.executor.envpipe_forward_backward"
# --envpipe-max-inflight none: one plan on CPU and GPU (a GPU shared by 4 ranks has no per-stage memory to budget).
_ENVPIPE_FLAGS = ("--envpipe-type", "envelope", "--envpipe-scheduling", "ours",
                 "--envpipe-gpu", f"simulated:{_SIM_PROFILE}", "--envpipe-max-inflight", "none",
                 "--envpipe-log-interval", "1")
_MIN_RUN_S = 15.0        # less time than this left: do not start the runs
MARGIN_S = 4.0          # kept back from the step's limit for writing the result
_LOG_TAIL_LINES = 40     # of each run's output, into check.log


@dataclass(frozen=True)
class _RunOutcome:
    """One torchrun: its exit status, wall time, output and the ``--losses-out`` JSON (None if absent)."""

    label: str
    returncode: int | None  # None: stopped at its time limit
    wall_s: float
    output: str
    losses: Mapping[str, Any] | None


def _train_command(device: str, cache_dir: Path, losses_out: Path, extra: Sequence[str]) -> list[str]:
    """The torchrun command of one run (the same on CPU and GPU but for ``--device``)."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(STAGES),
            "-m", "megatron_envpipe.apps.train_tiny_gpt",
            "--pipeline-model-parallel-size", str(STAGES), "--device", device, "--p2p-transport", "host",
            "--train-iters", str(_ITERATIONS), "--cache-dir", str(cache_dir), "--losses-out", str(losses_out),
            *extra]


def _child_env(ctx: StepContext) -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    if ctx.device == "cuda":
        # All four ranks on the device under test (ctx.device_index counts within any visible set).
        visible = [d for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
        env["CUDA_VISIBLE_DEVICES"] = visible[ctx.device_index] if ctx.device_index < len(visible) \
            else str(ctx.device_index)
        env["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"  # deterministic cuBLAS: both runs must match bit for bit
    return env


@dataclass
class _Running:
    """A torchrun, left in the step's process group (the runner stops that whole group at the step's
    limit), its output going to a file (a pipe unread while the other run is waited on could stall it)."""

    label: str
    proc: subprocess.Popen[bytes]
    log_path: Path
    losses_out: Path
    started: float
    ended: float | None = None

    @classmethod
    def start(cls, label: str, command: list[str], env: Mapping[str, str], work: Path) -> "_Running":
        log_path = work / f"{label}.log"
        with log_path.open("wb") as log:
            proc = subprocess.Popen(command, env=dict(env), stdout=log, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL)
        return cls(label, proc, log_path, work / f"{label}.json", time.monotonic())

    def poll(self) -> bool:
        """True once the run has ended (its end time noted the first time it is seen)."""
        if self.ended is None and self.proc.poll() is not None:
            self.ended = time.monotonic()
        return self.ended is not None

    def stop(self) -> None:
        """Past the deadline: stop the ranks, then torchrun (by process id: they share our process group)."""
        if not self.poll():
            for pid in [*_descendants(self.proc.pid), self.proc.pid]:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGKILL)
            self.proc.wait()
            self.ended = time.monotonic()

    def outcome(self, timed_out: bool) -> _RunOutcome:
        code = None if timed_out else self.proc.returncode
        losses = json.loads(self.losses_out.read_text()) if code == 0 and self.losses_out.is_file() else None
        wall_s = (self.ended or time.monotonic()) - self.started
        return _RunOutcome(self.label, code, wall_s, self.log_path.read_text(errors="replace"), losses)


def _descendants(pid: int) -> list[int]:
    """Process ids below ``pid`` (children first found, deepest last), from /proc; [] where there is none."""
    parents: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            # "pid (comm) state ppid ...": comm may hold spaces and parentheses, so split after the last ')'.
            text = stat.read_text()
            parents.setdefault(int(text.rsplit(")", 1)[1].split()[1]), []).append(int(text.split(" ", 1)[0]))
    found, queue = [], [pid]
    while queue:
        for child in parents.get(queue.pop(), []):
            found.append(child)
            queue.append(child)
    return found


def _wait_all(running: Sequence[_Running], deadline: float, poll_s: float = 0.1) -> list[_RunOutcome]:
    """Wait for every run until ``deadline`` (monotonic s); the ones still going then are stopped."""
    while not all([r.poll() for r in running]) and time.monotonic() < deadline:  # a list: poll every run
        time.sleep(poll_s)
    timed_out = [not r.poll() for r in running]
    for r, late in zip(running, timed_out, strict=True):
        if late:
            r.stop()
    return [r.outcome(late) for r, late in zip(running, timed_out, strict=True)]


def _functions(losses: Mapping[str, Any]) -> list[str]:
    """The schedule functions the ranks ran, in rank order, without repeats."""
    seen: list[str] = []
    for rank in losses.get("schedule", []):
        for name in rank.get("functions", []):
            if name not in seen:
                seen.append(name)
    return seen


def _staged(losses: Mapping[str, Any]) -> tuple[int, int]:
    """(P2P messages, bytes) staged through host memory over all ranks; (0, 0) when the transport was bypassed."""
    ranks = [r.get("host_staged") or {} for r in losses.get("schedule", [])]
    return (sum(int(r.get("sends", 0)) + int(r.get("recvs", 0)) for r in ranks),
            sum(int(r.get("bytes", 0)) for r in ranks))


def _compare_runs(envpipe: _RunOutcome, stock: _RunOutcome) -> StepResult:
    """The step's verdict from its two runs: ok only if the losses agree bit for bit and each side ran
    the schedule it should, through the host-staged transport."""
    for outcome in (envpipe, stock):
        if outcome.losses is None:
            how = "ran past its time limit" if outcome.returncode is None else f"exited {outcome.returncode}"
            return StepResult("failed", f"the {outcome.label} run {how} after {outcome.wall_s:.1f} s "
                                        f"(its output is in check.log)",
                              figures={f"{outcome.label}_run_s": round(outcome.wall_s, 2)})
    envpipe_losses, stock_losses = envpipe.losses or {}, stock.losses or {}
    mine, ref = list(envpipe_losses.get("losses", [])), list(stock_losses.get("losses", []))
    equal = len(mine) == len(ref) == _ITERATIONS and [x.hex() for x in mine] == [x.hex() for x in ref]
    diff = max((abs(a - b) for a, b in zip(mine, ref, strict=False)), default=None)
    run_info = envpipe_losses.get("envpipe_run") or {}
    plan = run_info.get("plan") or {}
    energy = run_info.get("energy") or []
    staged_envpipe, bytes_envpipe = _staged(envpipe_losses)
    staged_stock, bytes_stock = _staged(stock_losses)
    figures: dict[str, Any] = {
        "device": envpipe_losses.get("device"),
        "stages": STAGES,
        "iterations": len(mine),
        "losses_equal": equal,
        "max_abs_loss_diff": diff,
        "tokens_equal": envpipe_losses.get("tokens") == stock_losses.get("tokens"),
        "loss_first": mine[0] if mine else None,
        "loss_last": mine[-1] if mine else None,
        "losses_envpipe": mine,
        "losses_stock": ref,
        "schedule_functions_envpipe": _functions(envpipe_losses),
        "schedule_functions_stock": _functions(stock_losses),
        "predicted_saving": plan.get("predicted_saving"),
        "predicted_slowdown": plan.get("predicted_slowdown"),
        "simulated_saving_last_iteration": energy[-1].get("saving") if energy else None,
        "host_staged_p2p_messages_envpipe": staged_envpipe,
        "host_staged_p2p_messages_stock": staged_stock,
        "host_staged_bytes_envpipe": bytes_envpipe,
        "host_staged_bytes_stock": bytes_stock,
        "envpipe_run_s": round(envpipe.wall_s, 2),
        "stock_run_s": round(stock.wall_s, 2),
    }
    problems = []
    if not equal:
        problems.append(f"losses differ from stock Megatron's (largest difference {diff!r})")
    if figures["schedule_functions_envpipe"] != [_EXECUTOR]:
        problems.append(f"the EnvPipe run ran {figures['schedule_functions_envpipe']}, not {_EXECUTOR}")
    if figures["schedule_functions_stock"] != [MEGATRON_1F1B]:
        problems.append(f"the stock run ran {figures['schedule_functions_stock']}, not Megatron's 1F1B")
    if any(r.get("envpipe_installed") or r.get("executor_imported") for r in stock_losses.get("schedule", [])):
        problems.append("the stock run installed EnvPipe or imported its executor")
    if not staged_envpipe or not staged_stock:
        problems.append("a run's P2P tensors did not go through host memory (--p2p-transport host bypassed)")
    saving = figures["predicted_saving"]
    lines = (f"{STAGES} stages sharing one {figures['device']} device over gloo, P2P staged through host memory: "
             f"losses {'equal bit for bit' if equal else 'DIFFER'} over {len(mine)} iterations "
             f"({figures['loss_first']!r} .. {figures['loss_last']!r})",
             "EnvPipe ran " + ", ".join(figures["schedule_functions_envpipe"]) + "; stock ran "
             + ", ".join(figures["schedule_functions_stock"]),
             f"simulated {_SIM_PROFILE} plan: predicted saving "
             + (f"{100 * saving:.2f} %" if isinstance(saving, float) else "none (no plan)")
             + f"; runs took {envpipe.wall_s:.1f} s (EnvPipe) and {stock.wall_s:.1f} s (stock)")
    if problems:
        return StepResult("failed", "; ".join(problems), figures=figures, lines=lines)
    return StepResult("ok", figures=figures, lines=lines)


def _print_tail(outcome: _RunOutcome) -> None:
    tail = outcome.output.splitlines()[-_LOG_TAIL_LINES:]
    print(f"--- step 7, {outcome.label} run (exit {outcome.returncode}, {outcome.wall_s:.1f} s), last "
          f"{len(tail)} lines:", *tail, sep="\n", flush=True)


def run(ctx: StepContext) -> StepResult:
    """Both runs at once (8 processes; the GPU's host has the cores, and each run alone idles in its
    pipeline's bubbles), each stopped at the step's limit less a margin; then :func:`_compare_runs`."""
    if ctx.device not in ("cpu", "cuda"):
        return StepResult("failed", f"step 7: unknown device {ctx.device!r} (cpu or cuda)")
    left_s = ctx.left_s(MARGIN_S)
    if left_s < _MIN_RUN_S:
        return StepResult("failed", f"only {left_s:.0f} s left for step 7's runs (they need {_MIN_RUN_S:.0f} s "
                                    f"at the very least)")
    deadline = time.monotonic() + left_s
    env = _child_env(ctx)
    with tempfile.TemporaryDirectory(prefix="envpipe-step7-") as tmp:
        work = Path(tmp)
        profile_csv = work / f"profile-{STAGES}-stages.csv"
        Profile.from_csv(shipped_profile(_SIM_PROFILE)).for_pipeline(STAGES).to_csv(profile_csv)
        # One tokenizer cache for both runs, trained by the first rank to get its lock (about 0.1 s).
        cache = work / "cache"
        running = [_Running.start(label, _train_command(ctx.device, cache, work / f"{label}.json", extra), env, work)
                   for label, extra in (("envpipe", [*_ENVPIPE_FLAGS, "--envpipe-profile", str(profile_csv)]),
                                        ("stock", ["--no-envpipe"]))]
        envpipe, stock = _wait_all(running, deadline)
        for outcome in (envpipe, stock):
            _print_tail(outcome)
        return _compare_runs(envpipe, stock)
