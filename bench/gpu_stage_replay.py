#!/usr/bin/env python3
"""One-GPU check of the energy model: profile one Megatron GPT stage, plan P stages, replay the plans.

    python3 bench/gpu_stage_replay.py                                   # CPU: simulated GPU, tiny sizes
    sudo -E python3 bench/gpu_stage_replay.py --gpu nvml --hidden 4096 --heads 32 --layers 4 --seq 2048

1. Builds one middle pipeline stage (Megatron-core ``TransformerBlock``, local layer spec).
2. Measures the idle power and the energy counter's update period, then the stage's
   forward and backward time/energy at each clock (every ``--clock-step`` MHz) into a
   Perseus-format profile of ``--stages`` identical stages.
3. Plans ``--stages`` x ``--microbatches`` with ``envelope`` and ``optimal``, schedules
   ``1f1b`` and ``ours`` (the package's ``plan_envpipe``; blocking power = the idle power).
4. Replays every stage of every plan and of its baseline (1F1B at f_max) on the device in
   turn (:mod:`megatron_envpipe.gpu.replay`): real kernels, the planned clock requested
   before each unit through the executor's clock worker, planned waits as idle time.
5. Prints predicted vs measured energy and saving, the clock-switch latency the kernel
   timing sees, and the counter period; ``--out`` writes them as JSON (atomically).

On the CPU the device is the simulated GPU (``--gpu simulated:<profile>``: stage 0 of
that profile, time scaled so a forward at f_max lasts ``--sim-unit-ms``), run on simulated
time: the kernels run for real but take no simulated time, so a busy host cannot bias
the result, and prediction and measurement must agree within ``--tolerance``. Before any of it, one trial lock is
read back and reset (megatron-envpipe's start-up check), so a lock that is refused or not
reached ends the run in its first seconds. Exit status: 0 all replays within tolerance,
1 some not, 2 no usable device, 3 the lock refused (no permission), 4 the lock accepted
but not reached.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # a checkout works without installing

from megatron_envpipe.core.atomic import check_writable, write_json_atomic  # noqa: E402
from megatron_envpipe.core.gpu_specs import spec_for_profile_source  # noqa: E402
from megatron_envpipe.core.profile import Profile  # noqa: E402
from megatron_envpipe.core.resources import shipped_profile  # noqa: E402
from megatron_envpipe.core.virtual_clock import VirtualClock  # noqa: E402
from megatron_envpipe.errors import UsageError  # noqa: E402
from megatron_envpipe.gpu import PERMISSION_HINT, GpuError, GpuPermissionError, open_gpu  # noqa: E402
from megatron_envpipe.gpu.clock_proof import ProofOutcome, cuda_spin_load, prove_clock_control  # noqa: E402
from megatron_envpipe.gpu.hooks import GpuHooks  # noqa: E402
from megatron_envpipe.gpu.replay import PlanReplay, measure_idle, profile_stage, replay_plan  # noqa: E402
from megatron_envpipe.gpu.safety import default_guard  # noqa: E402
from megatron_envpipe.gpu.simulated import SimulatedGpu  # noqa: E402
from megatron_envpipe.gpu.sweep_clocks import sweep_candidates  # noqa: E402
from megatron_envpipe.megatron.stage_model import StageSpec, open_stage, parameter_count  # noqa: E402
from megatron_envpipe.planning.basis import PlannerConfig  # noqa: E402
from megatron_envpipe.planning.planner import plan_envpipe  # noqa: E402

PLANS = ("envelope:1f1b", "envelope:ours", "optimal:1f1b", "optimal:ours")
REPLAY_CLOCKS = ("planned", "max", "min")


class ClockNotReachedError(GpuError):
    """The trial lock was accepted but the SMs ran at another clock (exit status 4)."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gpu", default="simulated:a40/gpt3-175b",
                   help="'nvml' (CUDA device --device) or 'simulated:<profile>' (default simulated:a40/gpt3-175b)")
    p.add_argument("--device", type=int, default=0, help="local CUDA device with --gpu nvml (default 0)")
    p.add_argument("--hidden", type=int, default=32, help="hidden size (default 32: CPU-sized)")
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--layers", type=int, default=1, help="GPT layers in the stage (default 1)")
    p.add_argument("--seq", type=int, default=16, help="sequence length (default 16)")
    p.add_argument("--micro-batch", type=int, default=1, help="micro-batch size (default 1)")
    p.add_argument("--stages", type=int, default=4, help="pipeline stages P to plan, 2..32 (default 4)")
    p.add_argument("--microbatches", type=int, default=8, help="micro-batches M per iteration (default 8)")
    p.add_argument("--plans", default=",".join(PLANS), help=f"comma-separated type:schedule (default all: {PLANS})")
    p.add_argument("--clock-step", type=int, default=90, help="profile every STEP MHz from the maximum (default 90)")
    p.add_argument("--min-mhz", type=int, default=None, help="lowest clock to profile (default: the lowest)")
    p.add_argument("--reps", type=int, default=3, help="units per profile window (default 3)")
    p.add_argument("--iterations", type=int, default=1,
                   help="replays of each stage's iteration, back to back (a GPU: enough for >= 1 s per stage)")
    p.add_argument("--idle-s", type=float, default=0.5, help="idle window for power and counter period (default 0.5)")
    p.add_argument("--sim-unit-ms", type=float, default=10.0,
                   help="simulated GPU: simulated ms of a forward at f_max (default 10; the replay runs on "
                        "simulated time, so the host's speed does not matter)")
    p.add_argument("--replay-clocks", choices=REPLAY_CLOCKS, default="planned",
                   help="'max'/'min' replay every unit at that clock instead of the planned one: a deliberately "
                        "wrong replay, which the comparison must report as a mismatch")
    p.add_argument("--tolerance", type=float, default=0.01, help="allowed |measured/predicted - 1| (default 0.01)")
    p.add_argument("--out", default=None, help="write the results as JSON (atomically)")
    return p.parse_args(argv)


def check_args(args: argparse.Namespace) -> list[tuple[str, str]]:
    ranges = {"stages": (2, 32), "microbatches": (1, 4096), "clock_step": (1, 5000), "reps": (1, 1000),
              "iterations": (1, 100_000), "device": (0, 1023)}
    for name, (lo, hi) in ranges.items():
        if not lo <= getattr(args, name) <= hi:
            raise UsageError(f"--{name.replace('_', '-')} must be in {lo}..{hi}, got {getattr(args, name)}")
    for name, lo, hi in (("idle_s", 0.01, 600.0), ("sim_unit_ms", 0.1, 10_000.0), ("tolerance", 0.0, 1.0)):
        value = getattr(args, name)
        if not (math.isfinite(value) and lo <= value <= hi):
            raise UsageError(f"--{name.replace('_', '-')} must be a number in {lo}..{hi}, got {value}")
    plans = []
    for item in (x.strip() for x in args.plans.split(",") if x.strip()):
        if item not in PLANS:
            raise UsageError(f"--plans: unknown plan {item!r}; choose from {', '.join(PLANS)}")
        plans.append(tuple(item.split(":")))
    if not plans:
        raise UsageError(f"--plans: name at least one of {', '.join(PLANS)}")
    if args.out:
        check_writable(args.out, "--out")
    return plans


def open_device(args: argparse.Namespace) -> tuple[Any, bool, float]:
    """(device, cuda, time_scale) for ``--gpu``."""
    if args.gpu.startswith("simulated:"):
        source = args.gpu.partition(":")[2]
        profile = Profile.from_csv(shipped_profile(source))
        f_max = profile.max_frequency()
        scale = args.sim_unit_ms / 1000.0 / profile.time_s(0, "forward", f_max)
        table = spec_for_profile_source(source)
        # Simulated time: a unit lasts its modelled time whatever the host's load (the kernels
        # still run for real), so prediction and measurement agree by construction, not by luck.
        sim_time = VirtualClock()
        device = SimulatedGpu(profile, 0, time_scale=scale, p2p_power_w=table.p2p_power_w if table else 0.0,
                              name=f"Simulated GPU ({source})", clock=sim_time.now, sleep=sim_time.sleep)
        return device, False, scale
    if args.gpu != "nvml":
        raise UsageError(f"--gpu must be 'nvml' or 'simulated:<profile>', got {args.gpu!r}")
    import torch  # a GPU run only

    if not torch.cuda.is_available():
        raise SystemExit("gpu_stage_replay: no CUDA device visible (run on the CPU with --gpu simulated:<profile>)")
    torch.cuda.set_device(args.device)
    return open_gpu("nvml", args.device), True, 1.0


def summary(name: str, rep: PlanReplay, base: PlanReplay, tolerance: float) -> dict[str, Any]:
    return {
        "plan": name,
        "predicted_j": rep.predicted_j,
        "measured_j": rep.measured_j,
        "error": rep.error,
        "ok": abs(rep.error) <= tolerance,
        "predicted_saving": 1.0 - rep.predicted_j / base.predicted_j,
        "measured_saving": 1.0 - rep.measured_j / base.measured_j,
        "predicted_time_s": rep.predicted_time_s,
        "late_s": max(s.late_s for s in rep.stages),
        "switch_excess_ms": 1000.0 * rep.switch_excess_s,
        "stage_energy_j": [s.energy_j for s in rep.stages],
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the check; returns the results (``results[i]["ok"]`` per replay) that ``--out`` writes."""
    args = parse_args(argv)
    plans = check_args(args)
    spec = StageSpec(args.hidden, args.heads, args.layers, args.seq, args.micro_batch).validate()
    device, cuda, scale = open_device(args)
    try:  # seconds, before minutes of profiling at a clock that is not the one named
        proof = prove_clock_control(device, default_guard(), load=cuda_spin_load() if cuda else None)
    except BaseException:
        device.close()
        raise
    if not proof.control:
        device.close()
        if proof.outcome == ProofOutcome.REFUSED:
            raise GpuPermissionError(f"{device.info().label()}: {proof.message}; {PERMISSION_HINT}")
        raise ClockNotReachedError(f"{device.info().label()}: {proof.message}")
    print(f"clock check: {proof.message}", flush=True)
    hooks = GpuHooks(device, control=True, cuda=cuda, time_scale=scale)
    clock, sleep = device.timebase if isinstance(device, SimulatedGpu) else (time.perf_counter, time.sleep)
    results: list[dict[str, Any]] = []
    try:
        with open_stage(spec, "cuda" if cuda else "cpu") as stage:
            print(f"device: {device.info().label()}  stage: {spec} ({parameter_count(stage):,} parameters)")
            idle = measure_idle(hooks, stage, args.idle_s, clock, sleep)
            print(f"idle power {idle.power_w:.1f} W; energy counter period {1000 * idle.counter_period_s:.3f} ms "
                  f"({idle.counter_updates} updates seen{', simulated' if device.simulated else ''})")
            supported = device.supported_clocks_mhz()
            clocks = sweep_candidates(supported, args.clock_step, args.min_mhz)
            t0 = time.perf_counter()
            profile = profile_stage(hooks, stage, clocks, args.stages, idle.power_w, args.reps,
                                    source=f"stage replay ({device.info().name})", clock=clock)
            print(f"profiled {len(clocks)} clocks ({clocks[0]}..{clocks[-1]} MHz) in {time.perf_counter() - t0:.1f} s")
            wrong = {"planned": int, "max": lambda f: clocks[0], "min": lambda f: clocks[-1]}[args.replay_clocks]
            baselines: dict[str, PlanReplay] = {}
            for plan_type, scheduling in plans:
                cfg = PlannerConfig(plan_type=plan_type, scheduling=scheduling, p2p_power_w=idle.power_w)
                res = plan_envpipe(profile, args.microbatches, cfg, args.stages)
                key = repr(res.baseline_plan.freqs_mhz) + repr(res.baseline_plan.schedule.orders)
                if key not in baselines:
                    baselines[key] = replay_plan(hooks, stage, res.baseline_plan, res.baseline_timeline,
                                                 res.baseline.energy_j, profile, args.iterations,
                                                 clock=clock, sleep=sleep)
                rep = replay_plan(hooks, stage, res.plan, res.timeline, res.score.energy_j, profile,
                                  args.iterations, clocks=wrong, clock=clock, sleep=sleep)
                row = summary(f"{plan_type}:{scheduling}", rep, baselines[key], args.tolerance)
                row["baseline_error"] = baselines[key].error
                row["ok"] = row["ok"] and abs(baselines[key].error) <= args.tolerance
                results.append(row)
                print(f"{row['plan']:14s} predicted {row['predicted_j']:9.3f} J  measured {row['measured_j']:9.3f} J "
                      f"({100 * row['error']:+.2f} %; baseline {100 * row['baseline_error']:+.2f} %)  saving "
                      f"predicted {100 * row['predicted_saving']:5.2f} % measured {100 * row['measured_saving']:5.2f} %"
                      f"  switch excess {row['switch_excess_ms']:.3f} ms  {'OK' if row['ok'] else 'MISMATCH'}")
            if hooks.clock_control_lost is not None:
                raise GpuError(f"clock control was lost during the replay: {hooks.clock_control_lost}")
    finally:
        hooks.close()  # resets the clocks, stops the monitor, closes the device
    out = {"device": device.info().label(), "simulated": device.simulated, "spec": vars(spec),
           "stages": args.stages, "microbatches": args.microbatches, "replay_clocks": args.replay_clocks,
           "idle_power_w": idle.power_w, "counter_period_s": idle.counter_period_s,
           "profile_csv": profile.to_csv_text(), "results": results}
    if args.out:
        write_json_atomic(args.out, out)
    return out


def cli(argv: list[str] | None = None) -> int:
    try:
        out = main(argv)
    except UsageError as exc:
        print(f"gpu_stage_replay: {exc}", file=sys.stderr)
        return 2
    except ClockNotReachedError as exc:
        print(f"gpu_stage_replay: {exc}", file=sys.stderr)
        return 4
    except GpuError as exc:
        print(f"gpu_stage_replay: {exc}", file=sys.stderr)
        return 3
    return 0 if all(r["ok"] for r in out["results"]) else 1


if __name__ == "__main__":
    raise SystemExit(cli())
