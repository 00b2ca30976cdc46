"""The ``envpipe`` command line: plan, frontier, show, simulate, schedule, gpus."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Sequence

from megatron_envpipe.config import int_list
from megatron_envpipe.core.atomic import write_json_atomic
from megatron_envpipe.core.gpu_specs import GpuSpecError, get_gpu_spec, load_gpu_table
from megatron_envpipe.core.plan import FrequencyPlan, format_envpipe
from megatron_envpipe.core.profile import Profile, ProfileError
from megatron_envpipe.core.resources import shipped_profile, shipped_profiles
from megatron_envpipe.core.schedule import ScheduleError, build_schedule, clamp_extra_warmup
from megatron_envpipe.core.timeline import PlanEvaluator, Timeline
from megatron_envpipe.core.vocabulary import PLAN_TYPES, RECONFIG_POLICIES, SCHEDULINGS
from megatron_envpipe.errors import UsageError
from megatron_envpipe.planning.basis import PlannerConfig, PlannerError, PlanResult
from megatron_envpipe.planning.planner import plan_envpipe

EXIT_USAGE = 2


class CliError(UsageError):
    """An error for the user: printed as one line, exit status 2."""


# -- helpers --------------------------------------------------------------------------
def _gpu_for(args: argparse.Namespace):
    """--gpu, or for a shipped profile the GPU it was measured on (``a40/...``)."""
    if args.gpu:
        return get_gpu_spec(args.gpu)
    if args.profile in shipped_profiles():
        return get_gpu_spec(args.profile.split("/")[0])
    return None


def _load_profile(name: str, time_scale: float = 1.0, energy_scale: float = 1.0) -> Profile:
    try:
        path = shipped_profile(name)
    except FileNotFoundError as exc:
        raise CliError(str(exc)) from None
    profile = Profile.from_csv(path)
    if time_scale != 1.0 or energy_scale != 1.0:
        profile = profile.scaled(time_scale, energy_scale)
    return profile


def _score_dict(score) -> dict[str, Any]:
    out = {
        "iteration_time_s": score.iteration_time_s,
        "energy_j": score.energy_j,
        "compute_energy_j": score.compute_energy_j,
        "blocking_energy_j": score.blocking_energy_j,
        "stage_busy_s": list(score.busy_s),
        "stage_energy_j": list(score.stage_energy_j),
    }
    return out


def _recv_wait_ms(timeline: Timeline) -> list[list[float]]:
    graph = timeline.graph
    rows: list[list[float]] = [[] for _ in range(graph.schedule.num_stages)]
    for v, (s, _) in enumerate(graph.nodes):
        rows[s].append(1000.0 * timeline.recv_wait_s(v))
    return rows


def result_to_dict(result: PlanResult, profile: Profile, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    cfg = result.config
    plan_dict = _score_dict(result.score)
    plan_dict.update(
        {
            "type": cfg.plan_type,
            "scheduling": cfg.scheduling,
            "reconfig": cfg.reconfig,
            "extra_warmup": list(result.schedule.extra_warmup),
            "peak_inflight_activations": list(result.schedule.peak_inflight()),
            "clock_changes_per_stage": list(result.plan.clock_changes()),
            "frequencies": result.plan.to_dict()["stages"],
        }
    )
    data: dict[str, Any] = {
        "profile": profile.source,
        "num_stages": result.schedule.num_stages,
        "num_microbatches": result.schedule.num_microbatches,
        "gpu": cfg.gpu.key if cfg.gpu else None,
        "p2p_power_w": cfg.effective_p2p_power_w,
        "f_max_mhz": result.f_max_mhz,
        "valley_mhz": list(result.valley_mhz),
        "baseline": {
            **_score_dict(result.baseline),
            "scheduling": "1f1b",
            "peak_inflight_activations": list(result.baseline_plan.schedule.peak_inflight()),
            "frequency_mhz": result.f_max_mhz,
        },
        "plan": plan_dict,
        "energy_saving": result.energy_saving,
        "slowdown": result.slowdown,
        "iterations": result.iterations,
        "converged": result.converged,
        "stop_reason": result.stop_reason,
        "planner_seconds": result.planner_seconds,
        "warnings": list(result.warnings),
    }
    if result.deadline_s is not None:  # plan type "optimal"
        data["deadline_s"] = result.deadline_s
        data["lower_bound_j"] = result.lower_bound_j
        data["optimal"] = dict(result.details)
    if extra:
        data.update(extra)
    return data


def _print_result(result: PlanResult, profile: Profile, out=None) -> None:
    out = out or sys.stdout
    b, p = result.baseline, result.score
    cfg = result.config
    print(f"profile     {profile.source}", file=out)
    print(
        f"pipeline    {result.schedule.num_stages} stages x {result.schedule.num_microbatches} micro-batches; "
        f"plan {cfg.plan_type}/{cfg.scheduling}/{cfg.reconfig}"
        + (f"; gpu {cfg.gpu.key}" if cfg.gpu else "")
        + f"; P2P blocking power {cfg.effective_p2p_power_w:g} W",
        file=out,
    )
    print(
        f"clocks      f_max {result.f_max_mhz} MHz; energy valley per stage {list(result.valley_mhz)} MHz",
        file=out,
    )
    if cfg.scheduling == "ours":
        print(
            f"warm-up     extra forwards per stage {list(result.schedule.extra_warmup)}; peak in-flight "
            f"activations {list(result.schedule.peak_inflight())} (1F1B: "
            f"{list(result.baseline_plan.schedule.peak_inflight())})",
            file=out,
        )
    print("", file=out)
    print(f"{'':10}{'iteration time':>16}{'energy':>16}", file=out)
    print(f"{'baseline':10}{b.iteration_time_s:>14.4f} s{b.energy_j:>14.1f} J   (1F1B, all at f_max)", file=out)
    print(f"{'plan':10}{p.iteration_time_s:>14.4f} s{p.energy_j:>14.1f} J", file=out)
    print(
        f"\nenergy saving {100 * result.energy_saving:.2f} %   slowdown {100 * result.slowdown:.2f} %   "
        f"({result.iterations} reconfiguration iterations, {result.planner_seconds:.3f} s to plan)",
        file=out,
    )
    print(f"stopped: {result.stop_reason}", file=out)
    if result.deadline_s is not None:
        d = result.details
        print(f"optimal     deadline {result.deadline_s:.4f} s; LP lower bound {result.lower_bound_j:.1f} J; "
              f"peak in-flight activations {list(result.schedule.peak_inflight())}", file=out)
        if d.get("padded_to_deadline"):
            print(f"at target   {d['energy_at_deadline_j']:.1f} J vs the baseline's {d['baseline_energy_at_deadline_j']:.1f} J "
                  f"(both blocking until {result.deadline_s:.4f} s): saving {100 * d['energy_saving_at_deadline']:.2f} %",
                  file=out)
    for w in result.warnings:
        print(f"WARNING: {w}", file=out)
    print("", file=out)
    print(
        format_envpipe(result.plan, _recv_wait_ms(result.timeline), result.timeline.critical_units()),
        file=out,
    )


# -- subcommands ----------------------------------------------------------------------
def cmd_plan(args: argparse.Namespace) -> int:
    profile = _load_profile(args.profile, args.time_scale, args.energy_scale)
    gpu = _gpu_for(args)
    extra: dict[str, Any] = {}
    if args.compat == "perseus":
        if args.type != "envelope" or args.scheduling != "1f1b" or args.reconfig != "balanced":
            raise CliError(
                "--compat perseus reproduces Perseus's EnvPipe (envelope, 1f1b, balanced); "
                "drop --type/--scheduling/--reconfig or set them to those values"
            )
        from megatron_envpipe.planning.compat_perseus import plan_envpipe_perseus

        p2p = args.p2p_power if args.p2p_power is not None else (gpu.p2p_power_w if gpu else 0.0)
        compat = plan_envpipe_perseus(
            profile,
            args.microbatches,
            p2p_power_w=p2p,
            p2p_power_scale=args.energy_scale / args.time_scale,
        )
        result = compat.result
        extra["perseus_reported"] = {
            "iteration_time_s": compat.reported_time_s,
            "energy_j": compat.reported_energy_j,
            "iterations": compat.iterations,
        }
    else:
        config = _planner_config(args, gpu, args.type, args.reconfig, reconfig_step_mhz=args.reconfig_step,
                                 max_slowdown=args.max_slowdown, target_time_s=args.target_time)
        result = plan_envpipe(profile, args.microbatches, config, num_stages=args.stages)
    if args.stages is not None and args.stages != result.schedule.num_stages:
        raise CliError(f"--stages {args.stages} does not match the profile's {result.schedule.num_stages} stages")
    data = result_to_dict(result, profile, extra)
    if args.out:
        write_json_atomic(args.out, data)
    if args.plot:
        from megatron_envpipe.apps.plot import draw_timelines

        draw_timelines(
            [
                ("baseline: 1F1B at f_max", result.baseline_plan, result.baseline_timeline),
                (f"plan: {result.config.plan_type}/{result.config.scheduling}/{result.config.reconfig}",
                 result.plan, result.timeline),
            ],
            args.plot,
        )
    if args.json:
        json.dump(data, sys.stdout, indent=1)
        print()
    else:
        _print_result(result, profile)
        if "perseus_reported" in extra:
            rep = extra["perseus_reported"]
            print(
                f"\nas Perseus reports it: iteration {rep['iteration_time_s']:.3f} s, "
                f"energy {rep['energy_j']:.3f} J ({rep['iterations']} iterations)"
            )
        if args.out:
            print(f"\nplan written to {args.out}")
        if args.plot:
            print(f"timeline drawn to {args.plot}")
    return 0


def _plan_from_file(path: str) -> tuple[dict[str, Any], FrequencyPlan]:
    try:
        data = json.loads(Path(path).read_text())
    except OSError as exc:
        raise CliError(f"{path}: cannot read plan: {exc.strerror or exc}") from None
    except json.JSONDecodeError as exc:
        raise CliError(f"{path}:{exc.lineno}: not valid JSON: {exc.msg}") from None
    try:
        body = data["plan"] if "plan" in data else data
        plan = FrequencyPlan.from_dict(
            {
                "stages": body["frequencies"] if "frequencies" in body else body["stages"],
                "schedule": body.get("scheduling", body.get("schedule", "custom")),
                "extra_warmup": body.get("extra_warmup", []),
            }
        )
    except (KeyError, TypeError, ScheduleError) as exc:
        raise CliError(f"{path}: not a plan written by 'envpipe plan --out': {exc}") from None
    return data, plan


def _planner_config(args: argparse.Namespace, gpu, plan_type: str, reconfig: str, **more: Any) -> PlannerConfig:
    """A planner config from the flags 'plan' and 'frontier' share (:func:`_add_pipeline_args`)."""
    return PlannerConfig(
        plan_type=plan_type,
        scheduling=args.scheduling,
        reconfig=reconfig,
        gpu=gpu,
        p2p_power_w=args.p2p_power,
        max_inflight=args.max_inflight,
        extra_warmup=tuple(args.extra_warmup) if args.extra_warmup else None,
        p2p_latency_s=args.p2p_latency,
        comm=args.comm,
        **more,
    )


def cmd_frontier(args: argparse.Namespace) -> int:
    from megatron_envpipe.planning.frontier import compute_frontier

    profile = _load_profile(args.profile, args.time_scale, args.energy_scale)
    gpu = _gpu_for(args)
    config = _planner_config(args, gpu, "optimal", "default")
    fr = compute_frontier(profile, args.microbatches, config, points=args.points, num_stages=args.stages)
    picked = fr.pick(args.target_time) if args.target_time is not None else None
    if args.csv:
        fr.to_csv(args.csv)
    if args.plot:
        envpipe = plan_envpipe(profile, args.microbatches,
                               PlannerConfig("envelope", args.scheduling, "balanced", gpu=gpu, p2p_power_w=args.p2p_power,
                                             max_inflight=args.max_inflight, p2p_latency_s=args.p2p_latency))
        fr.plot(args.plot, args.target_time,
                others=[(f"EnvPipe envelope+balanced ({args.scheduling})", envpipe.score.iteration_time_s,
                         envpipe.score.energy_j)])
    data: dict[str, Any] = {
        "profile": profile.source,
        "num_stages": fr.num_stages,
        "num_microbatches": fr.schedule.num_microbatches,
        "scheduling": fr.schedule.name,
        "extra_warmup": list(fr.schedule.extra_warmup),
        "peak_inflight_activations": list(fr.schedule.peak_inflight()),
        "p2p_power_w": fr.p2p_power_w,
        "baseline": {"iteration_time_s": fr.baseline.iteration_time_s, "energy_j": fr.baseline.energy_j},
        "fastest_s": fr.fastest_s,
        "valley_s": fr.valley_s,
        "points": [
            {"time_s": pt.time_s, "energy_j": pt.energy_j, "saving": pt.saving, "slowdown": pt.slowdown}
            for pt in fr.points
        ],
        "planner_seconds": fr.planner_seconds,
        "warnings": fr.warnings,
    }
    if picked is not None:
        pt, e_at, base_at = picked
        data["target"] = {
            "time_s": args.target_time, "plan_time_s": pt.time_s, "energy_at_target_j": e_at,
            "baseline_energy_at_target_j": base_at, "saving_at_target": 1.0 - e_at / base_at,
            "frequencies": pt.plan.to_dict()["stages"],
        }
    if args.json:
        json.dump(data, sys.stdout, indent=1)
        print()
        return 0
    b = fr.baseline
    print(f"profile     {profile.source}")
    print(f"pipeline    {fr.num_stages} stages x {fr.schedule.num_microbatches} micro-batches; schedule {fr.schedule.name}"
          + (f", extra warm-up {list(fr.schedule.extra_warmup)}" if fr.schedule.name == "ours" else "")
          + f"; peak in-flight activations {list(fr.schedule.peak_inflight())}; P2P {fr.p2p_power_w:g} W")
    print(f"baseline    {b.iteration_time_s:.4f} s  {b.energy_j:.1f} J   (1F1B, all at f_max)")
    print(f"frontier    {len(fr.points)} plans from {fr.fastest_s:.4f} s (fastest) to {fr.valley_s:.4f} s "
          f"(energy valley), {fr.planner_seconds:.2f} s to compute\n")
    print(f"{'time s':>10}{'energy J':>12}{'saving':>9}{'slowdown':>10}")
    for pt in fr.points:
        print(f"{pt.time_s:>10.4f}{pt.energy_j:>12.1f}{100 * pt.saving:>8.2f}%{100 * pt.slowdown:>9.2f}%")
    if picked is not None:
        pt, e_at, base_at = picked
        print(f"\ntarget {args.target_time:.4f} s: run the {pt.time_s:.4f} s plan; {e_at:.1f} J vs the baseline's "
              f"{base_at:.1f} J (both blocking until the target): saving {100 * (1 - e_at / base_at):.2f} %")
    for w in fr.warnings:
        print(f"WARNING: {w}")
    if args.csv:
        print(f"\nfrontier written to {args.csv}")
    if args.plot:
        print(f"frontier drawn to {args.plot}")
    return 0


def cmd_show(args: argparse.Namespace) -> int:
    data, plan = _plan_from_file(args.plan)
    if args.json:
        json.dump(data, sys.stdout, indent=1)
        print()
        return 0
    print(f"plan file   {args.plan}")
    if "baseline" in data and "plan" in data:
        b, p = data["baseline"], data["plan"]
        print(f"profile     {data.get('profile')}")
        print(
            f"pipeline    {data.get('num_stages')} stages x {data.get('num_microbatches')} micro-batches; "
            f"plan {p.get('type')}/{p.get('scheduling')}/{p.get('reconfig')}"
        )
        print(f"baseline    {b['iteration_time_s']:.4f} s  {b['energy_j']:.1f} J")
        print(f"plan        {p['iteration_time_s']:.4f} s  {p['energy_j']:.1f} J")
        print(
            f"saving      {100 * data['energy_saving']:.2f} %   slowdown {100 * data['slowdown']:.2f} %"
        )
        for w in data.get("warnings", []):
            print(f"WARNING: {w}")
    print(f"clock changes per stage per iteration {list(plan.clock_changes())}")
    print(format_envpipe(plan))
    return 0


def cmd_simulate(args: argparse.Namespace) -> int:
    profile = _load_profile(args.profile, args.time_scale, args.energy_scale)
    gpu = _gpu_for(args)
    p2p = args.p2p_power if args.p2p_power is not None else (gpu.p2p_power_w if gpu else 0.0)
    if args.plan:
        _, plan = _plan_from_file(args.plan)
        schedule = plan.schedule
    else:
        if args.microbatches is None:
            raise CliError("simulate needs --plan PLAN.json, or --microbatches M (with --scheduling/--freq)")
        p = profile.num_stages
        r = None
        if args.scheduling == "ours":
            if not args.extra_warmup:
                raise CliError("--scheduling ours needs --extra-warmup r0,r1,...")
            r = clamp_extra_warmup(p, args.microbatches, args.extra_warmup)
        schedule = build_schedule(args.scheduling, p, args.microbatches, r)
        freq = args.freq or profile.max_frequency()
        plan = FrequencyPlan.constant(schedule, [freq] * p)
    evaluator = PlanEvaluator(schedule, profile, p2p, args.p2p_latency)
    timeline = evaluator.simulate(plan.flat())
    score = evaluator.score(plan.flat(), timeline)
    crit = timeline.critical_units()
    data = {
        "profile": profile.source,
        "p2p_power_w": p2p,
        **_score_dict(score),
        "stage_idle_s": timeline.idle_s(),
        "peak_inflight_activations": list(schedule.peak_inflight()),
        "critical_path": [f"S{s} {u}" for s, u in reversed(crit)],
    }
    if args.plot:
        from megatron_envpipe.apps.plot import draw_timelines

        draw_timelines([(f"simulated {schedule.name}", plan, timeline)], args.plot)
    if args.json:
        json.dump(data, sys.stdout, indent=1)
        print()
        return 0
    print(str(schedule))
    print(f"\niteration time {score.iteration_time_s:.4f} s; energy {score.energy_j:.1f} J "
          f"(compute {score.compute_energy_j:.1f} J + blocking {score.blocking_energy_j:.1f} J at {p2p:g} W)")
    for s in range(schedule.num_stages):
        print(
            f"  stage {s}: busy {score.busy_s[s]:.4f} s, idle {timeline.idle_s()[s]:.4f} s, "
            f"energy {score.stage_energy_j[s]:.1f} J, peak in-flight {schedule.peak_inflight()[s]}"
        )
    print(f"critical path ({len(crit)} units): " + " -> ".join(data["critical_path"]))
    print()
    print(format_envpipe(plan, _recv_wait_ms(timeline), crit))
    if args.plot:
        print(f"timeline drawn to {args.plot}")
    return 0


def cmd_schedule(args: argparse.Namespace) -> int:
    r = None
    if args.scheduling == "ours":
        r = clamp_extra_warmup(args.stages, args.microbatches, args.extra_warmup or [0] * args.stages, args.max_inflight)
    schedule = build_schedule(args.scheduling, args.stages, args.microbatches, r).validate()
    print(str(schedule))
    print(f"# peak in-flight activations per stage: {list(schedule.peak_inflight())}")
    return 0


def cmd_programs(args: argparse.Namespace) -> int:
    from megatron_envpipe.core.instructions import DeadlockError, build_programs, check_deadlock

    r = None
    if args.scheduling == "ours":
        r = clamp_extra_warmup(args.stages, args.microbatches, args.extra_warmup or [0] * args.stages)
    schedule = build_schedule(args.scheduling, args.stages, args.microbatches, r).validate()
    programs = build_programs(schedule, prefetch=args.prefetch)
    for prog in programs:
        print(prog)
    try:
        steps = check_deadlock(programs, shared_pair_stream=args.shared_stream)
    except DeadlockError as exc:
        print(f"# DEADLOCK under strict rendezvous: {exc}")
        return 1
    model = "one shared stream per stage pair" if args.shared_stream else "one channel per direction"
    print(f"# deadlock-free under strict rendezvous ({model}, no buffering): {steps} instructions")
    return 0


def cmd_reset_clocks(args: argparse.Namespace) -> int:
    """Repair GPUs a crashed run (SIGKILL, node failure) left with locked clocks."""
    from megatron_envpipe.gpu.base import GpuError, GpuPermissionError
    from megatron_envpipe.gpu.safety import reset_all_gpus, reset_clocks_from_state

    try:
        if args.all:
            lines = reset_all_gpus(args.state_dir)
        else:
            lines = reset_clocks_from_state(args.state_dir, force=args.force)
    except GpuPermissionError as exc:
        print(f"envpipe reset-clocks: error: {exc}", file=sys.stderr)
        return 3
    except GpuError as exc:
        print(f"envpipe reset-clocks: error: {exc}", file=sys.stderr)
        return 2
    for line in lines or ["nothing to reset: no GPU clocks were left locked by megatron-envpipe on this host"]:
        print(line)
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from megatron_envpipe.apps.demo import DemoError, run_demo

    try:
        return run_demo(args.out, args.config, args.gpu)
    except DemoError as exc:
        raise CliError(str(exc)) from None


def cmd_gpus(args: argparse.Namespace) -> int:
    table = load_gpu_table()
    print(f"{'gpu':9}{'max MHz':>8}{'min MHz':>8}{'step':>6}{'profile':>8}{'reconfig':>9}{'P2P W':>7}  NVML names")
    for key, spec in sorted(table.items()):
        print(
            f"{key:9}{spec.max_clock_mhz:>8}{spec.min_clock_mhz:>8}{spec.clock_step_mhz:>6g}"
            f"{spec.profile_step_mhz:>8}{spec.reconfig_step_mhz:>9}{spec.p2p_power_w:>7g}  "
            + ", ".join(spec.nvml_names)
        )
    return 0


# -- parser ---------------------------------------------------------------------------
def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def _fraction(text: str) -> float:
    """``0.05`` or ``5%`` -> 0.05 (>= 0)."""
    try:
        value = float(text[:-1]) / 100 if text.endswith("%") else float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a fraction like 0.05 or a percentage like 5%, got {text!r}") from None
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def _add_profile_args(p: argparse.ArgumentParser) -> None:
    names = ", ".join(shipped_profiles())
    p.add_argument("--profile", required=True, help=f"Perseus-format CSV, or a shipped profile: {names}")
    p.add_argument(
        "--gpu",
        help="GPU table entry (configs/gpus.toml): clock range, steps, P2P power "
        "(default for a shipped profile: the GPU it was measured on)",
    )
    p.add_argument("--p2p-power", type=float, help="P2P blocking power in W (default: the GPU table's)")
    p.add_argument("--p2p-latency", type=float, default=0.0, help="latency of each P2P message in s (default 0)")
    p.add_argument("--time-scale", type=float, default=1.0, help="multiply profile times (Perseus emulation: 10)")
    p.add_argument("--energy-scale", type=float, default=1.0, help="multiply profile energies (emulation: 80)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    p.add_argument("--plot", metavar="PNG", help="draw a Gantt chart of the iteration")


def _add_pipeline_args(p: argparse.ArgumentParser) -> None:
    """The pipeline and schedule flags of 'plan' and 'frontier' (read by :func:`_planner_config`)."""
    p.add_argument("--microbatches", "-m", type=_positive_int, required=True, help="micro-batches per iteration")
    p.add_argument("--stages", type=_positive_int, help="pipeline stages (checked against the profile)")
    p.add_argument("--scheduling", choices=SCHEDULINGS, default="ours", help="unit order (default ours)")
    p.add_argument("--max-inflight", type=_positive_int, help="activation budget per stage, in micro-batches")
    p.add_argument("--extra-warmup", type=int_list,
                   help="override the extra warm-up r_s of ours, e.g. 4,3,1,0 (still clamped)")
    p.add_argument("--comm", choices=("per-direction", "paired"), default="per-direction",
                   help="communication plans are scored with: one channel per direction (what the executor "
                        "runs, no extra dependency) or EnvPipe's paired order (activations held until a gradient)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="envpipe",
        description="Energy-saving pipeline schedules and GPU clock plans (EnvPipe) for Megatron-core.",
    )
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("plan", help="plan per-unit SM clocks from a profile and compare with the baseline")
    _add_profile_args(p)
    _add_pipeline_args(p)
    p.add_argument("--type", choices=PLAN_TYPES, default="envelope", help="initial plan (default envelope)")
    p.add_argument("--reconfig", choices=RECONFIG_POLICIES, default="balanced", help="policy (default balanced)")
    p.add_argument("--reconfig-step", type=_positive_int, help="MHz per reconfiguration step (default: GPU table)")
    p.add_argument("--max-slowdown", type=_fraction, default=0.0,
                   help="--type optimal: allowed iteration-time increase over the baseline, e.g. 0.05 or 5%% (default 0)")
    p.add_argument("--target-time", type=_positive_float, metavar="S",
                   help="--type optimal: plan for iterations lasting S seconds anyway (e.g. a straggler's pace); "
                        "energy is counted until then")
    p.add_argument("--compat", choices=("perseus",), help="reproduce Perseus's EnvPipe re-implementation")
    p.add_argument("--out", metavar="PLAN.json", help="write the plan and its scores as JSON")
    p.set_defaults(func=cmd_plan)

    p = sub.add_parser("frontier", help="the iteration-time vs energy Pareto frontier of optimal plans")
    _add_profile_args(p)
    _add_pipeline_args(p)
    p.add_argument("--points", type=_positive_int, default=20, help="deadlines from fastest to valley (default 20)")
    p.add_argument("--csv", metavar="OUT.csv", help="write time_s,energy_j,saving,slowdown")
    p.add_argument("--target-time", type=_positive_float, metavar="S",
                   help="pick the plan to run when iterations last S seconds anyway (e.g. a straggler's pace)")
    p.set_defaults(func=cmd_frontier)

    p = sub.add_parser("show", help="print a plan written by 'envpipe plan --out'")
    p.add_argument("plan", help="PLAN.json")
    p.add_argument("--json", action="store_true", help="print the stored JSON")
    p.set_defaults(func=cmd_show)

    p = sub.add_parser("simulate", help="simulate one iteration of a plan or schedule on a profile")
    _add_profile_args(p)
    p.add_argument("--plan", metavar="PLAN.json", help="a plan from 'envpipe plan --out'")
    p.add_argument("--microbatches", "-m", type=_positive_int, help="micro-batches (without --plan)")
    p.add_argument("--scheduling", choices=SCHEDULINGS, default="1f1b", help="unit order (without --plan)")
    p.add_argument("--extra-warmup", type=int_list, help="r_s for --scheduling ours, e.g. 4,3,1,0")
    p.add_argument("--freq", type=_positive_int, help="one clock for every unit (default: the profile's max)")
    p.set_defaults(func=cmd_simulate)

    p = sub.add_parser("schedule", help="print a schedule's per-stage unit order")
    p.add_argument("--stages", type=_positive_int, required=True)
    p.add_argument("--microbatches", "-m", type=_positive_int, required=True)
    p.add_argument("--scheduling", choices=SCHEDULINGS, default="1f1b")
    p.add_argument("--extra-warmup", type=int_list, help="r_s for ours, e.g. 4,3,1,0 (clamped)")
    p.add_argument("--max-inflight", type=_positive_int, help="activation budget per stage")
    p.set_defaults(func=cmd_schedule)

    p = sub.add_parser("programs", help="print each stage's instruction program and prove it deadlock-free")
    p.add_argument("--stages", type=_positive_int, required=True)
    p.add_argument("--microbatches", "-m", type=_positive_int, required=True)
    p.add_argument("--scheduling", choices=SCHEDULINGS, default="1f1b")
    p.add_argument("--extra-warmup", type=int_list, help="r_s for ours, e.g. 4,3,1,0 (clamped)")
    p.add_argument("--prefetch", type=_positive_int, default=2, help="receives posted ahead per channel")
    p.add_argument("--shared-stream", action="store_true",
                   help="check against one shared stream per stage pair instead (shows why we avoid it)")
    p.set_defaults(func=cmd_programs)

    p = sub.add_parser("reset-clocks", help="reset GPU clocks a crashed run left locked (needs root or CAP_SYS_ADMIN)")
    p.add_argument("--state-dir", metavar="DIR",
                   help="where runs record locked clocks (default $ENVPIPE_STATE_DIR or /var/tmp/megatron-envpipe/locked-clocks)")
    p.add_argument("--force", action="store_true", help="also reset GPUs whose locking process is still running")
    p.add_argument("--all", action="store_true", help="reset every GPU on this node through NVML, state files or not")
    p.set_defaults(func=cmd_reset_clocks)

    p = sub.add_parser("demo", help="train a tiny GPT pipeline with and without EnvPipe and show the saving")
    p.add_argument("--out", default="out/demo", help="where logs, timeline.png and summary.json go")
    p.add_argument("--config", help="a demo config (default configs/demo.toml)")
    p.add_argument("--gpu", help="device backend (default: NVML with >= 2 GPUs, else simulated:<profile>)")
    p.set_defaults(func=cmd_demo)

    p = sub.add_parser("gpus", help="list the GPU clock table")
    p.set_defaults(func=cmd_gpus)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except (CliError, ProfileError, ScheduleError, PlannerError, GpuSpecError) as exc:
        print(f"envpipe {args.command}: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except BrokenPipeError:  # e.g. `envpipe plan ... | head`
        return 0


if __name__ == "__main__":
    sys.exit(main())
