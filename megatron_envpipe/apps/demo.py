"""``envpipe demo``: what EnvPipe does, end to end, on this machine.

Trains the tiny GPT (``megatron_envpipe.apps.train_tiny_gpt``) as a 4-stage
Megatron-core pipeline twice — Megatron's 1F1B at the maximum clock, then
EnvPipe (envelope / ours / balanced) — on a GPU when one is present (NVML), or
on CPU with the simulated GPU driven by a shipped real A40 profile. It shows
the schedule, the plan (EnvPipe's printout), a timeline picture of baseline vs
EnvPipe, the energy and time measured on the (simulated) GPUs, the saving, and
that the losses are bit-for-bit identical.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megatron_envpipe.apps.plot import PlotUnavailableError, draw_timelines
from megatron_envpipe.config import EnvPipeConfig
from megatron_envpipe.core.gpu_specs import get_gpu_spec
from megatron_envpipe.core.plan import format_envpipe
from megatron_envpipe.core.profile import Profile
from megatron_envpipe.core.resources import configs_dir, shipped_profile
from megatron_envpipe.core.vocabulary import PlanType, ReconfigPolicy, Scheduling
from megatron_envpipe.errors import EnvPipeError
from megatron_envpipe.megatron.localhost import free_port
from megatron_envpipe.planning.planner import plan_envpipe


class DemoError(EnvPipeError, RuntimeError):
    """The demo could not run; the message says why."""


@dataclass(frozen=True)
class DemoConfig:
    """``configs/demo.toml``: the embedded default the demo runs."""

    stages: int = 4
    microbatches: int = 8
    iterations: int = 6  # measured iterations after the plan took over
    profile: str = "a40/gpt3-175b"  # drives the simulated GPU
    sim_time_scale: float = 0.3
    profile_step_mhz: int = 150
    profile_iterations: int = 1
    plan_type: str = PlanType.ENVELOPE.value  # TOML strings; EnvPipeConfig turns them into the vocabulary's members
    scheduling: str = Scheduling.OURS.value
    reconfig: str = ReconfigPolicy.BALANCED.value

    @classmethod
    def load(cls, path: str | Path | None = None) -> "DemoConfig":
        if not path:
            try:
                path = configs_dir() / "demo.toml"
            except FileNotFoundError as exc:
                raise DemoError(str(exc)) from None
        path = Path(path)
        try:
            data = tomllib.loads(path.read_text())
        except OSError as exc:
            raise DemoError(f"{path}: cannot read demo config: {exc.strerror or exc}") from None
        except tomllib.TOMLDecodeError as exc:
            raise DemoError(f"{path}: not valid TOML: {exc}") from None
        known = {f: type(getattr(cls(), f)) for f in cls.__dataclass_fields__}
        values = {}
        for key, value in data.get("demo", {}).items():
            if key not in known:
                raise DemoError(f"{path}: [demo] has unknown key {key!r}; known: {', '.join(known)}")
            want = known[key]
            if want is float and isinstance(value, int) and not isinstance(value, bool):
                value = float(value)
            if not isinstance(value, want) or isinstance(value, bool):
                raise DemoError(f"{path}: [demo] {key} = {value!r} should be a {want.__name__}")
            values[key] = value
        cfg = cls(**values)
        if cfg.stages < 2 or cfg.microbatches < cfg.stages or cfg.iterations < 1:
            raise DemoError(f"{path}: [demo] needs stages >= 2, microbatches >= stages, iterations >= 1")
        return cfg

    def envpipe_config(self) -> EnvPipeConfig:
        """The EnvPipe flags of the demo's EnvPipe run (plan type, scheduling, reconfiguration)."""
        return EnvPipeConfig(plan_type=self.plan_type, scheduling=self.scheduling, reconfig=self.reconfig)


def _gpus() -> int:
    try:
        import torch

        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except ImportError:
        return 0


def _train(cfg: DemoConfig, out: Path, name: str, envpipe: list[str], iters: int, device: str,
           nproc: int) -> dict[str, Any]:
    """One torchrun of the tiny GPT; returns its --losses-out summary."""
    result = out / f"{name}.json"
    log = out / f"{name}.log"
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
        "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
        "-m", "megatron_envpipe.apps.train_tiny_gpt",
        "--pipeline-model-parallel-size", str(nproc), "--device", device,
        "--global-batch-size", str(cfg.microbatches * 2), "--micro-batch-size", "2",
        "--train-iters", str(iters), "--losses-out", str(result), "--envpipe-log-interval", "1",
        "--cache-dir", str(out / "cache"), *envpipe,
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    started = time.perf_counter()
    with open(log, "w") as fh:
        proc = subprocess.run(cmd, stdout=fh, stderr=subprocess.STDOUT, env=env)
    if proc.returncode != 0:
        tail = "".join(log.read_text().splitlines(keepends=True)[-15:])
        raise DemoError(f"the {name} run failed (exit {proc.returncode}); log {log}:\n{tail}")
    data = json.loads(result.read_text())
    data["wall_s"] = time.perf_counter() - started
    data["log"] = str(log)
    return data


def _steady(run: dict[str, Any]) -> tuple[float, float, int]:
    """Median (time_s, energy_j) per iteration after the plan took over (skipping one)."""
    env = run.get("envpipe_run", {})
    first = (env.get("planned_at_iteration") or 0) + 1
    reports = [e for e in env.get("energy", []) if e["iteration"] > first]
    if not reports:
        raise DemoError(f"no energy was measured after iteration {first} (log {run['log']})")
    return (statistics.median(e["time_s"] for e in reports),
            statistics.median(e["energy_j"] for e in reports), len(reports))


def run_demo(out: str | Path = "out/demo", config: str | Path | None = None, gpu: str | None = None) -> int:
    cfg = DemoConfig.load(config)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    gpus = _gpus()
    if gpu is None:
        gpu = "auto" if gpus >= 2 else f"simulated:{cfg.profile}"
    simulated = gpu.startswith("simulated")
    device = "cpu" if simulated or gpus < 2 else "cuda"
    nproc = cfg.stages if device == "cpu" else min(cfg.stages, gpus)
    label = "simulated A40 GPUs (CPU, gloo)" if simulated else f"{nproc} GPUs ({gpu}, NCCL)"
    print(f"EnvPipe demo: a tiny GPT as a {nproc}-stage Megatron-core pipeline x {cfg.microbatches} "
          f"micro-batches on {label}.\n")

    # 1. What EnvPipe will do, planned on the profile of the simulated GPUs.
    profile = Profile.from_csv(shipped_profile(cfg.profile)).for_pipeline(nproc)
    gpu_key = cfg.profile.split("/")[0]
    pcfg = cfg.envpipe_config().planner_config(get_gpu_spec(gpu_key))
    plan = plan_envpipe(profile, cfg.microbatches, pcfg)
    print("Schedule ('ours': extra warm-up forwards put the slack right after them):")
    print(plan.schedule)
    print(f"peak in-flight activations per stage {list(plan.schedule.peak_inflight())} "
          f"(1F1B {list(plan.baseline_plan.schedule.peak_inflight())})\n")
    print(f"Plan {cfg.plan_type}/{cfg.scheduling}/{cfg.reconfig} on {profile.source} "
          "(unit, SM clock MHz, receive wait ms; [critical path]):")
    print(format_envpipe(plan.plan, None, plan.timeline.critical_units()))
    print(f"predicted: energy -{100 * plan.energy_saving:.1f}% at {100 * plan.slowdown:+.2f}% iteration time\n")
    try:
        png = draw_timelines([("baseline: 1F1B, every unit at f_max", plan.baseline_plan, plan.baseline_timeline),
                              (f"EnvPipe: {cfg.plan_type}/{cfg.scheduling}/{cfg.reconfig}", plan.plan, plan.timeline)],
                             out / "timeline.png")
        print(f"timeline picture (baseline vs EnvPipe): {png}\n")
    except PlotUnavailableError as exc:  # matplotlib missing: the rest still runs
        print(f"(no timeline picture: {exc})\n")

    # 2. Train twice, measure.
    common = ["--envpipe-gpu", gpu, "--envpipe-sim-time-scale", str(cfg.sim_time_scale),
              "--envpipe-profile-cache", str(out / "profiles"), "--envpipe-on-no-permission", "monitor"]
    print("training with Megatron's 1F1B at the maximum clock ...", flush=True)
    base = _train(cfg, out, "baseline", ["--envpipe-type", "baseline", "--envpipe-scheduling", "1f1b", *common],
                  cfg.iterations + 2, device, nproc)
    print(f"  done in {base['wall_s']:.0f} s (log {base['log']})")
    print("training with EnvPipe (start-up profiler on first run, then the plan) ...", flush=True)
    sweep_iters = 2 + len(range(855, 1741, cfg.profile_step_mhz)) * cfg.profile_iterations
    env = _train(cfg, out, "envpipe",
                 ["--envpipe-type", cfg.plan_type, "--envpipe-scheduling", cfg.scheduling,
                  "--envpipe-reconfig", cfg.reconfig, "--envpipe-profile-step", str(cfg.profile_step_mhz),
                  "--envpipe-profile-iterations", str(cfg.profile_iterations), *common],
                 sweep_iters + cfg.iterations + 2, device, nproc)
    print(f"  done in {env['wall_s']:.0f} s (log {env['log']})\n")

    # 3. Results.
    bt, be, bn = _steady(base)
    et, ee, en = _steady(env)
    same = [x.hex() for x in base["losses"]] == [x.hex() for x in env["losses"][: len(base["losses"])]]
    what = "simulated" if simulated else "measured"
    print(f"{'':12}{'iteration time':>16}{'energy / iteration':>20}   ({what}, median of {bn} / {en} iterations)")
    print(f"{'1F1B @ max':12}{bt:>14.3f} s{be:>18.1f} J")
    print(f"{'EnvPipe':12}{et:>14.3f} s{ee:>18.1f} J")
    print(f"\nenergy saving {100 * (1 - ee / be):.1f}%, iteration time {100 * (et / bt - 1):+.1f}%  "
          f"(planned: -{100 * plan.energy_saving:.1f}% at {100 * plan.slowdown:+.2f}%)")
    print(f"losses identical to Megatron's 1F1B bit for bit: {'yes' if same else 'NO'}")
    summary = {"baseline": {"time_s": bt, "energy_j": be}, "envpipe": {"time_s": et, "energy_j": ee},
               "saving": 1 - ee / be, "slowdown": et / bt - 1, "losses_identical": same, "simulated": simulated,
               "planned_saving": plan.energy_saving}
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    print(f"summary: {out / 'summary.json'}")
    return 0 if same else 1
