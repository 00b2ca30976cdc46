"""``envpipe demo``: what EnvPipe does, end to end, on this machine.

Trains the tiny GPT (``megatron_envpipe.apps.train_tiny_gpt``) as a 4-stage
Megatron-core pipeline twice — Megatron's 1F1B at the maximum clock, then
EnvPipe (envelope / ours / balanced) — on a GPU when one is present (NVML), or
on CPU with the simulated GPU driven by a shipped real A40 profile. It shows
the schedule, the plan (EnvPipe's printout), a timeline picture of baseline vs
EnvPipe, the energy and time measured on the (simulated) GPUs, the saving, and
that the losses are bit-for-bit identical.

Everything is checked before anything is created or started: the config
(also through the very parser and :class:`~megatron_envpipe.config.EnvPipeConfig`
checks the training processes will run), ``--gpu`` (a ``simulated:<csv>``
profile is loaded and validated), the output folder. A training process that
fails anyway is reported as one line, the failing rank's own error and its log.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from megatron_envpipe.apps.demo_errors import DemoError, training_failure
from megatron_envpipe.apps.menu_table import print_menu
from megatron_envpipe.apps.plot import PlotUnavailableError, draw_timelines
from megatron_envpipe.config import EnvPipeConfig, add_envpipe_args
from megatron_envpipe.core.atomic import check_writable, write_json_atomic
from megatron_envpipe.core.device_backends import backend_traits, model_profile
from megatron_envpipe.core.file_numbers import loads_toml
from megatron_envpipe.core.gpu_specs import GpuSpecError, get_gpu_spec
from megatron_envpipe.core.jitter import MAX_JITTER
from megatron_envpipe.core.kinds import scheduling_kind
from megatron_envpipe.core.plan import format_envpipe
from megatron_envpipe.core.profile import Profile
from megatron_envpipe.core.resources import configs_dir, shipped_profile, shipped_profiles
from megatron_envpipe.core.textfile import read_text
from megatron_envpipe.core.vocabulary import (
    PLAN_TYPES,
    RECONFIG_POLICIES,
    SCHEDULINGS,
    PlanType,
    ReconfigPolicy,
    Scheduling,
)
from megatron_envpipe.errors import EnvPipeError, UsageError
from megatron_envpipe.gpu import open_gpu
from megatron_envpipe.megatron.localhost import free_port
from megatron_envpipe.planning.basis import PlannerConfig
from megatron_envpipe.planning.menu import build_menu
from megatron_envpipe.planning.planner import plan_envpipe

# The range of each number in configs/demo.toml: past these the demo would spawn hundreds of
# processes or train for days. Stages are also capped by the profile's own stage count.
_RANGES: dict[str, tuple[float, float]] = {
    "stages": (2, 64),
    "microbatches": (1, 1024),
    "iterations": (1, 1000),
    "profile_step_mhz": (15, 1000),  # NVML's clock spacing up to a handful of clocks in 855..1740 MHz
    "profile_iterations": (1, 100),
    "sim_jitter": (0.0, MAX_JITTER),  # as --envpipe-sim-jitter: 0 (none) up to a quarter of a unit's time
}
_ABOVE_LOW: frozenset[str] = frozenset()  # keys that must exceed their low bound; the others may equal it
# Keys a demo config once had that can no longer act: refused, saying why (never silently ignored).
_INERT_KEYS = {"sim_time_scale": "the demo's simulated GPUs run in virtual time (host speed takes no GPU time), "
                                 "where a wall-time scale does nothing: drop the key"}
# Steady-state figures: the median of at most this many iterations at the end of each run.
_STEADY_ITERATIONS = 20
_NAMES = {"plan_type": PLAN_TYPES, "scheduling": SCHEDULINGS, "reconfig": RECONFIG_POLICIES}
# The training flag each [demo] key becomes: a message of the training's own checks is shown with
# the key, since the demo has no such flag.
_TRAINING_FLAGS = {
    "plan_type": "--envpipe-type", "scheduling": "--envpipe-scheduling", "reconfig": "--envpipe-reconfig",
    "profile_step_mhz": "--envpipe-profile-step", "profile_iterations": "--envpipe-profile-iterations",
    "sim_jitter": "--envpipe-sim-jitter",
    "sim_dynamics": "--envpipe-sim-dynamics",
}
# The tiny GPT's layers (train_tiny_gpt's default), for the training's pipeline checks.
_NUM_LAYERS = 8


@dataclass(frozen=True)
class _DemoConfig:
    """``configs/demo.toml``: the embedded default the demo runs."""

    stages: int = 4
    microbatches: int = 8
    iterations: int = 6  # measured iterations after the plan took over
    profile: str = "a40/gpt3-175b"  # drives the simulated GPU
    profile_step_mhz: int = 150
    profile_iterations: int = 1
    sim_jitter: float = 0.0  # simulated GPU: unit-time noise (fraction), in both runs
    sim_dynamics: str = "realistic"  # simulated GPU: clock latency, stepped counter, heat (core.device_dynamics)
    plan_type: str = PlanType.ENVELOPE.value  # TOML strings; EnvPipeConfig turns them into the vocabulary's members
    scheduling: str = Scheduling.OURS.value
    reconfig: str = ReconfigPolicy.BALANCED.value

    @classmethod
    def load(cls, path: str | Path | None = None) -> "_DemoConfig":
        if not path:
            try:
                path = configs_dir() / "demo.toml"
            except FileNotFoundError as exc:
                raise DemoError(str(exc)) from None
        path = Path(path)
        # Numbers bounded while parsing: a 400-digit integer is one line naming the key, not an OverflowError.
        data = loads_toml(read_text(path, "demo config", DemoError), str(path), DemoError)
        if set(data) != {"demo"} or not isinstance(data["demo"], dict):
            raise DemoError(f"{path}: a demo config is one [demo] table (found {', '.join(data) or 'nothing'}): "
                            "start from configs/demo.toml")
        known = {f: type(getattr(cls(), f)) for f in cls.__dataclass_fields__}
        values = {}
        for key, value in data["demo"].items():
            if key in _INERT_KEYS:
                raise DemoError(f"{path}: [demo] {key} = {value!r}: {_INERT_KEYS[key]}")
            if key not in known:
                raise DemoError(f"{path}: [demo] has unknown key {key!r}; known: {', '.join(known)}")
            want = known[key]
            if want is float and isinstance(value, int) and not isinstance(value, bool):
                value = float(value)
            if not isinstance(value, want) or isinstance(value, bool):
                raise DemoError(f"{path}: [demo] {key} = {value!r} should be a {want.__name__}")
            problem = _value_problem(key, value)
            if problem:
                raise DemoError(f"{path}: [demo] {key} = {value!r}: {problem}")
            values[key] = value
        # Every key: a truncated file must not run on defaults nobody chose.
        missing = [key for key in known if key not in values]
        if missing:
            raise DemoError(f"{path}: [demo] lacks {', '.join(missing)}: every key of configs/demo.toml is needed")
        cfg = cls(**values)
        if cfg.microbatches < cfg.stages:
            raise DemoError(f"{path}: [demo] needs microbatches >= stages, got {cfg.microbatches} < {cfg.stages}")
        cfg._check_profile(path)
        # As the demo's two training runs will see them (on the simulated GPUs of the config's profile).
        _check_training_flags(cfg, path, _training_runs(cfg, f"simulated:{cfg.profile}", Path("out")), cfg.stages)
        return cfg

    def _check_profile(self, path: Path) -> None:
        """The profile is a shipped one (its GPU sets the clocks) with at least ``stages`` stages."""
        if self.profile not in shipped_profiles():
            raise DemoError(f"{path}: [demo] profile = {self.profile!r} is not a shipped profile: "
                            f"choose one of {', '.join(shipped_profiles())}")
        try:
            get_gpu_spec(self.profile.split("/")[0])
            stages = Profile.from_csv(shipped_profile(self.profile)).num_stages
        except UsageError as exc:
            raise DemoError(f"{path}: [demo] profile = {self.profile!r}: {exc}") from None
        if self.stages > stages:
            raise DemoError(f"{path}: [demo] stages = {self.stages}: the profile {self.profile} has only {stages} "
                            f"stages; give stages <= {stages}")

    def envpipe_config(self) -> EnvPipeConfig:
        """The EnvPipe flags of the demo's EnvPipe run (plan type, scheduling, reconfiguration)."""
        return EnvPipeConfig(plan_type=self.plan_type, scheduling=self.scheduling, reconfig=self.reconfig)


def _value_problem(key: str, value: Any) -> str | None:
    """What is wrong with one [demo] value of the right type (None: nothing)."""
    if isinstance(value, float) and not math.isfinite(value):
        return "must be a finite number"
    if key in _RANGES:
        low, high = _RANGES[key]
        above = key in _ABOVE_LOW
        if not (value > low if above else value >= low) or value > high:
            return f"needs {key} {'>' if above else '>='} {low:g} and <= {high:g}"
    if key in _NAMES and value not in _NAMES[key]:
        return f"choose one of {', '.join(_NAMES[key])}"
    if key == "scheduling" and scheduling_kind(value).model_chunks:
        return ("the demo trains one model chunk per stage (no virtual pipeline): choose "
                f"{', '.join(s for s in SCHEDULINGS if not scheduling_kind(s).model_chunks)}")
    if key == "profile" and not value:
        return "give a shipped profile name, e.g. a40/gpt3-175b"
    return None


class _FlagParser(argparse.ArgumentParser):
    """The training's --envpipe-* flags, parsed as its processes will; an error raises instead of exiting."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise DemoError(message)


def _training_runs(cfg: _DemoConfig, gpu: str, out: Path) -> list[tuple[str, list[str], int]]:
    """``(name, --envpipe-* flags, iterations)`` of the demo's two training runs: baseline, then EnvPipe.

    The baseline is EnvPipe's executor in 1F1B order at f_max: EnvPipe measures its energy. Its
    processes first train a fresh model with stock Megatron, before EnvPipe is installed
    (--stock-reference-iters): the reference both runs' losses must equal, at no extra start-up
    (a third torchrun would add ~15 s to a ~70 s demo on 2 cores).
    """
    simulated = backend_traits(gpu).modelled
    # No --envpipe-sim-time-scale: the simulated GPUs run in virtual time, where it would do nothing (refused).
    common = ["--envpipe-gpu", gpu,
              *(["--envpipe-sim-jitter", str(cfg.sim_jitter)] if simulated and cfg.sim_jitter else []),
              *(["--envpipe-sim-dynamics", cfg.sim_dynamics] if simulated and cfg.sim_dynamics != "exact" else []),
              "--envpipe-profile-cache", str(out / "profiles"), "--envpipe-on-no-permission", "monitor"]
    clocks = len(range(855, 1741, cfg.profile_step_mhz)) if cfg.profile_step_mhz > 0 else 0  # else refused below
    sweep_iters = 2 + clocks * cfg.profile_iterations
    # Both runs last equally long: a GPU warms up over minutes (drawing a few % more power), so each
    # run's last iterations, the ones compared, are measured at the same time since a cold start.
    return [
        ("baseline", ["--envpipe-type", "baseline", "--envpipe-scheduling", "1f1b", *common],
         sweep_iters + cfg.iterations + 2),
        ("envpipe", ["--envpipe-type", cfg.plan_type, "--envpipe-scheduling", cfg.scheduling,
                     "--envpipe-reconfig", cfg.reconfig, "--envpipe-profile-step", str(cfg.profile_step_mhz),
                     "--envpipe-profile-iterations", str(cfg.profile_iterations), *common],
         sweep_iters + cfg.iterations + 2),
    ]


def _check_training_flags(cfg: _DemoConfig, where: str | Path, runs: list[tuple[str, list[str], int]],
                         nproc: int) -> None:
    """Each run's --envpipe-* flags pass the training's own parser and its start-up checks
    (``EnvPipeConfig.from_args(...).validate_with_megatron_args``) on the demo's pipeline, so a config
    the training would refuse fails here, named by its [demo] keys, before anything starts."""
    pipeline = SimpleNamespace(pipeline_model_parallel_size=nproc, num_microbatches=cfg.microbatches,
                               num_layers=_NUM_LAYERS, virtual_pipeline_model_parallel_size=None)
    for name, flags, _ in runs:
        try:
            args = add_envpipe_args(_FlagParser(add_help=False)).parse_args(flags)
            EnvPipeConfig.from_args(args).validate_with_megatron_args(pipeline)
        except (EnvPipeError, ValueError) as exc:
            message, named = str(exc), []
            for key, flag in _TRAINING_FLAGS.items():
                message, count = re.subn(rf"{re.escape(flag)}(?![\w-])", f"[demo] {key}", message)
                if count:
                    named.append(f"{key} = {getattr(cfg, key)!r}")
            given = ", ".join(named) or "the config"
            raise DemoError(f"{where}: [demo] {given}: the demo's {name} training run would refuse it: "
                            f"{message}") from None


def _check_gpu(gpu: str | None, cfg: _DemoConfig) -> None:
    """--gpu names a device backend the demo can measure energy with (before anything is created);
    ``simulated:<profile>`` is opened for every stage, as the training's ranks will open it."""
    if gpu is None or gpu in ("auto", "nvml"):
        return
    source = model_profile(gpu)
    if source is not None:
        if source not in shipped_profiles() and not Path(source).is_file():
            raise DemoError(f"--gpu {gpu}: no such profile: give simulated:<profile>, one of "
                            f"{', '.join(shipped_profiles())} or a Perseus-format CSV")
        try:
            for stage in range(cfg.stages):  # a simulated run has one CPU process per stage
                open_gpu(gpu, stage=stage, num_stages=cfg.stages, cuda=False,
                         jitter=cfg.sim_jitter)
        except (EnvPipeError, OSError, UnicodeDecodeError) as exc:
            raise DemoError(f"--gpu {gpu}: {exc}") from None
        return
    if gpu == "none":
        raise DemoError("--gpu none measures no energy, which the demo compares: give auto, nvml, "
                        "simulated:<profile> or a GPU of configs/gpus.toml")
    try:
        get_gpu_spec(gpu)
    except GpuSpecError as exc:
        raise DemoError(f"--gpu {gpu}: {exc}; or give auto, nvml, simulated:<profile>") from None


def _gpus() -> int:
    try:
        import torch

        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except ImportError:
        return 0


def _train(cfg: _DemoConfig, out: Path, name: str, envpipe: list[str], iters: int, device: str,
           nproc: int) -> dict[str, Any]:
    """One torchrun of the tiny GPT; returns its --losses-out summary. Each rank's output also goes to
    ``<out>/<name>-ranks/.../<rank>/`` (torchrun's --log-dir/--tee), where a failure's cause is found."""
    result = out / f"{name}.json"
    log = out / f"{name}.log"
    ranks = out / f"{name}-ranks"
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
        "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
        "--log-dir", str(ranks), "--tee", "3",
        "-m", "megatron_envpipe.apps.train_tiny_gpt",
        "--pipeline-model-parallel-size", str(nproc), "--device", device,
        "--global-batch-size", str(cfg.microbatches * 2), "--micro-batch-size", "2",
        "--train-iters", str(iters), "--losses-out", str(result), "--envpipe-log-interval", "1",
        "--cache-dir", str(out / "cache"), *envpipe,
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    started = time.perf_counter()
    with open(log, "w") as fh:
        proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, env=env)
        try:
            code = proc.wait()
        except BaseException:  # Ctrl-C: torchrun stops its ranks on SIGTERM; none is left running
            _stop(proc)
            raise
    if code != 0:
        raise training_failure(name, code, log, ranks)
    data = json.loads(result.read_text())
    data["wall_s"] = time.perf_counter() - started
    data["log"] = str(log)
    return data


def _stop(proc: subprocess.Popen[bytes]) -> None:
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def _steady(run: dict[str, Any], after: int = 0) -> tuple[float, float, int, int]:
    """Median (time_s, energy_j) per iteration over the last _STEADY_ITERATIONS after the plan took over
    (skipping its first) and after iteration ``after``; also the first iteration counted."""
    env = run.get("envpipe_run", {})
    first = max((env.get("planned_at_iteration") or 0) + 1, after)
    reports = [e for e in env.get("energy", []) if e["iteration"] > first][-_STEADY_ITERATIONS:]
    if not reports:
        raise DemoError(f"no energy was measured after iteration {first} (log {run['log']})")
    return (statistics.median(e["time_s"] for e in reports),
            statistics.median(e["energy_j"] for e in reports), len(reports), reports[0]["iteration"] - 1)


def _stock_losses(run: dict[str, Any]) -> list[float]:
    """The losses of the run's stock-Megatron reference, checked to be Megatron's own schedule."""
    reference = run.get("stock_reference") or {}
    stock = "megatron.core.pipeline_parallel.schedules.forward_backward_pipelining_without_interleaving"
    ranks = reference.get("schedule") or [{}]
    if not all(r.get("functions") == [stock] and r.get("envpipe_installed") is False
               and r.get("executor_imported") is False for r in ranks):
        raise DemoError(f"the stock reference did not run Megatron's own schedule alone: {ranks} (log {run['log']})")
    return reference["losses"]


# What the training processes import (module, package to install); the planning core needs none of them.
_TRAINING_MODULES = (("torch", "torch"), ("megatron.core", "megatron-core"), ("sentencepiece", "sentencepiece"))


def _missing_training_packages(find_spec: Any = None) -> list[str]:
    """The packages the tiny GPT's training needs that are not installed (found without importing them)."""
    import importlib.util

    find_spec = find_spec or importlib.util.find_spec
    missing = []
    for module, package in _TRAINING_MODULES:
        try:
            found = find_spec(module) is not None
        except (ImportError, ValueError):  # a parent package absent (megatron), or a broken one
            found = False
        if not found:
            missing.append(package)
    return missing


def _check_training_packages() -> None:
    """A planning-core-only install (``pip install .``) cannot train: say which packages, in one line."""
    missing = _missing_training_packages()
    if missing:
        raise DemoError(f"envpipe demo trains a tiny GPT, which needs {', '.join(missing)}, not installed in this "
                        f"Python ({sys.executable}): run bash install.sh, or pip install -e '.[megatron]'; "
                        f"without them, envpipe plan/simulate show what EnvPipe plans (docs/planning.md)")


def run_demo(out: str | Path = "out/demo", config: str | Path | None = None, gpu: str | None = None) -> int:
    # Everything the user gave is checked before anything is created or started.
    _check_training_packages()
    cfg = _DemoConfig.load(config)
    _check_gpu(gpu, cfg)
    out = check_writable(out, "demo output directory", directory=True)
    gpus = _gpus()
    if gpu is None:
        gpu = "auto" if gpus >= 2 else f"simulated:{cfg.profile}"
    simulated = backend_traits(gpu).modelled
    device = "cpu" if simulated or gpus < 2 else "cuda"
    nproc = cfg.stages if device == "cpu" else min(cfg.stages, gpus)
    runs = _training_runs(cfg, gpu, out)
    _check_training_flags(cfg, config or "the demo config", runs, nproc)  # on this machine's GPUs and --gpu
    label = "simulated A40 GPUs (CPU, gloo)" if simulated else f"{nproc} GPUs ({gpu}, NCCL)"
    print(f"EnvPipe demo: a tiny GPT as a {nproc}-stage Megatron-core pipeline x {cfg.microbatches} "
          f"micro-batches on {label}.\n")

    # 1. What EnvPipe will do, planned on the profile of the simulated GPUs.
    profile = Profile.from_csv(shipped_profile(cfg.profile)).for_pipeline(nproc)
    gpu_key = cfg.profile.split("/")[0]
    pcfg = cfg.envpipe_config().planner_config(get_gpu_spec(gpu_key))
    plan = plan_envpipe(profile, cfg.microbatches, pcfg)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise DemoError(f"cannot create the demo output directory {out}: {exc.strerror or exc}") from None
    print("Schedule ('ours': extra warm-up forwards put the slack right after them):")
    print(plan.schedule)
    print(f"peak in-flight activations per stage {list(plan.schedule.peak_inflight())} "
          f"(1F1B {list(plan.baseline_plan.schedule.peak_inflight())})\n")
    print(f"Plan {cfg.plan_type}/{cfg.scheduling}/{cfg.reconfig} on {profile.source} "
          "(unit, SM clock MHz, receive wait ms; [critical path]):")
    print(format_envpipe(plan.plan, plan.timeline.recv_wait_ms_rows(), plan.timeline.critical_units()))
    print(f"predicted: energy -{100 * plan.energy_saving:.1f}% at {100 * plan.slowdown:+.2f}% iteration time\n")
    try:
        png = draw_timelines([("baseline: 1F1B, every unit at f_max", plan.baseline_plan, plan.baseline_timeline),
                              (f"EnvPipe: {cfg.plan_type}/{cfg.scheduling}/{cfg.reconfig}", plan.plan, plan.timeline)],
                             out / "timeline.png")
        print(f"timeline picture (baseline vs EnvPipe): {png}\n")
    except PlotUnavailableError as exc:  # matplotlib missing: the rest still runs
        print(f"(no timeline picture: {exc})\n")

    # 2. Train twice, measure (see _training_runs).
    (_, base_flags, base_iters), (_, env_flags, env_iters) = runs
    print("training in Megatron's 1F1B order at the maximum clock (after a stock-Megatron reference) ...",
          flush=True)
    base = _train(cfg, out, "baseline", ["--stock-reference-iters", str(base_iters), *base_flags],
                  base_iters, device, nproc)
    print(f"  done in {base['wall_s']:.0f} s (log {base['log']})")
    print("training with EnvPipe (start-up profiler on first run, then the plan) ...", flush=True)
    env = _train(cfg, out, "envpipe", env_flags, env_iters, device, nproc)
    print(f"  done in {env['wall_s']:.0f} s (log {env['log']})\n")

    # 3. Results.
    et, ee, en, since = _steady(env)
    # The same iterations of both runs: a GPU that warms up is compared at the same age.
    bt, be, bn, _ = _steady(base, after=since)
    stock = [x.hex() for x in _stock_losses(base)]
    same = stock == [x.hex() for x in base["losses"]] == [x.hex() for x in env["losses"][: len(stock)]]
    what = "simulated" if simulated else "measured"
    print(f"{'':12}{'iteration time':>16}{'energy / iteration':>20}   ({what}, median of {bn} / {en} iterations)")
    print(f"{'1F1B @ max':12}{bt:>14.3f} s{be:>18.1f} J")
    print(f"{'EnvPipe':12}{et:>14.3f} s{ee:>18.1f} J")
    # The plan the run used: planned on the run's own start-up profile (a few clocks), with its margin.
    used = env.get("envpipe_run", {}).get("plan") or {}
    planned = used.get("predicted_saving", plan.energy_saving)
    planned_slowdown = used.get("predicted_slowdown", plan.slowdown)
    print(f"\nenergy saving {100 * (1 - ee / be):.1f}%, iteration time {100 * (et / bt - 1):+.1f}%  "
          f"(planned by the run from its start-up profile: -{100 * planned:.1f}% at {100 * planned_slowdown:+.2f}%; "
          f"above, from the full profile: -{100 * plan.energy_saving:.1f}%)")
    print(f"losses identical to stock Megatron's 1F1B bit for bit: {'yes' if same else 'NO'}  "
          f"(both runs, {len(stock)} iterations; reference trained before EnvPipe was installed)")
    summary = {"baseline": {"time_s": bt, "energy_j": be}, "envpipe": {"time_s": et, "energy_j": ee},
               "saving": 1 - ee / be, "slowdown": et / bt - 1, "losses_identical": same, "simulated": simulated,
               "planned_saving": planned, "planned_slowdown": planned_slowdown,
               "planned_saving_full_profile": plan.energy_saving, "sim_jitter": cfg.sim_jitter}
    write_json_atomic(out / "summary.json", summary)
    print(f"summary: {out / 'summary.json'}")
    _print_demo_menu(profile, cfg.microbatches, gpu_key)
    return 0 if same else 1


def _print_demo_menu(profile: Profile, num_microbatches: int, gpu_key: str) -> None:
    """What each schedule would buy on this pipeline: `envpipe menu` on the demo's profile (planned, not trained)."""
    menu = build_menu(profile, num_microbatches, PlannerConfig(gpu=get_gpu_spec(gpu_key), switch_cost_j=None))
    print("\nA menu of time and energy for this pipeline (planned from the profile, not trained; envpipe menu, "
          "docs/menu.md):\n")
    print_menu(menu)
