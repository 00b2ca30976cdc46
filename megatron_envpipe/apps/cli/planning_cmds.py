"""``envpipe plan``, ``envpipe frontier`` and ``envpipe show``: clock plans from a profile, and plan files."""

from __future__ import annotations

import argparse
import math
from typing import Any

from megatron_envpipe.apps.cli.common import (
    CliError,
    check_extra_warmup_flag,
    check_flags_apply,
    check_stages,
    given_flags,
    gpu_for,
    load_profile,
    note_warmup_clamp,
    p2p_power,
    plan_from_file,
    planner_config,
)
from megatron_envpipe.apps.cli.menu_cmd import check_deadline_flags, deadline_entry, deadline_for, deadline_text
from megatron_envpipe.apps.cli.outputs import check_outputs, json_text, write_outputs
from megatron_envpipe.apps.cli.plausibility import check_profile_on_gpu
from megatron_envpipe.apps.cli.render import print_json, print_result, result_to_dict
from megatron_envpipe.apps.cli.rows import plan_rows
from megatron_envpipe.apps.plot import frontier_image, image_format, timelines_image
from megatron_envpipe.core.file_numbers import one_line, short
from megatron_envpipe.core.kinds import plan_kind, scheduling_kind
from megatron_envpipe.core.plan import FrequencyPlan
from megatron_envpipe.core.profile import Profile
from megatron_envpipe.core.schedule import ScheduleError
from megatron_envpipe.core.sizes import check_plan_size
from megatron_envpipe.core.units import Unit
from megatron_envpipe.core.vocabulary import CommModel, PlanType, ReconfigPolicy, Scheduling
from megatron_envpipe.planning.basis import PlanResult
from megatron_envpipe.planning.compat_perseus import plan_envpipe_perseus
from megatron_envpipe.planning.deadline import DeadlineFrom, reword_warnings
from megatron_envpipe.planning.frontier import Frontier, compute_frontier
from megatron_envpipe.planning.planner import plan_envpipe

_PERSEUS = {"--type": PlanType.ENVELOPE.value, "--scheduling": Scheduling.ONE_F_ONE_B.value,
            "--reconfig": ReconfigPolicy.BALANCED.value}


def _check_plan_flags(args: argparse.Namespace) -> None:
    """Flag combinations that would be ignored or contradict each other: reported, not silently dropped."""
    check_deadline_flags(args)
    if args.max_slowdown is not None and args.target_time is not None:
        raise CliError("--target-time and --max-slowdown both set the deadline: give one of them")
    if not plan_kind(args.type).has_deadline:
        for flag, value in (("--max-slowdown", args.max_slowdown), ("--target-time", args.target_time)):
            if value is not None:
                raise CliError(f"{flag} needs --type optimal (--type {args.type} plans have no deadline): "
                               f"add --type optimal or drop {flag}")
    if args.compat == "perseus":
        # Perseus's EnvPipe is envelope/1f1b/balanced: flags left at their defaults take those values;
        # a flag given with another value is named (only flags the user wrote).
        given = given_flags(args)
        clash = [f"{flag} {getattr(args, flag[2:])}" for flag, value in _PERSEUS.items()
                 if flag in given and getattr(args, flag[2:]) != value]
        if clash:
            raise CliError(
                "--compat perseus reproduces Perseus's EnvPipe (--type envelope --scheduling 1f1b --reconfig "
                f"balanced), not {', '.join(clash)}: drop {'it' if len(clash) == 1 else 'them'} or give those values"
            )
        for flag, value in _PERSEUS.items():
            setattr(args, flag[2:], value)
        ignored = [flag for flag, given in (
            ("--max-inflight", args.max_inflight is not None), ("--reconfig-step", args.reconfig_step is not None),
            ("--switch-cost-j", args.switch_cost_j is not None),
            ("--max-clock-changes", args.max_clock_changes is not None),
            ("--timing-margin", args.timing_margin is not None),
            ("--p2p-latency", args.p2p_latency != 0.0), ("--comm paired", args.comm != CommModel.PER_DIRECTION),
            ("--virtual-stages", args.virtual_stages is not None),
        ) if given]
        if ignored:
            raise CliError(f"--compat perseus has no {', '.join(ignored)}: drop it")
    check_flags_apply(args)


def _plan_perseus(args: argparse.Namespace, profile: Profile, gpu, extra: dict[str, Any]) -> PlanResult:
    """--compat perseus: Perseus's EnvPipe re-implementation; what it reports goes into ``extra``."""
    check_plan_size(PlanType.ENVELOPE, profile.num_stages, args.microbatches)  # it reconfigures as EnvPipe does
    compat = plan_envpipe_perseus(
        profile,
        args.microbatches,
        p2p_power_w=p2p_power(args, gpu),
        p2p_power_scale=args.energy_scale / args.time_scale,
    )
    extra["perseus_reported"] = {
        "iteration_time_s": compat.reported_time_s,
        "energy_j": compat.reported_energy_j,
        "iterations": compat.iterations,
    }
    return compat.result


def cmd_plan(args: argparse.Namespace) -> int:
    check_outputs(args, "--out", "--plot")
    _check_plan_flags(args)
    profile = load_profile(args.profile, args.time_scale, args.energy_scale)
    check_extra_warmup_flag(args, check_stages(args, profile))
    gpu = gpu_for(args)
    check_profile_on_gpu(profile, gpu)
    extra: dict[str, Any] = {}
    deadline: DeadlineFrom | None = None
    if args.compat == "perseus":
        result = _plan_perseus(args, profile, gpu, extra)
    else:
        max_slowdown = args.max_slowdown if args.max_slowdown is not None else 0.0
        config = planner_config(args, gpu, args.type, args.reconfig, reconfig_step_mhz=args.reconfig_step,
                                max_slowdown=max_slowdown, target_time_s=args.target_time,
                                switch_cost_j=args.switch_cost_j, max_clock_changes=args.max_clock_changes)
        deadline = deadline_for(args, profile, config) if args.deadline_from is not None else None
        result = plan_envpipe(profile, args.microbatches, deadline.config if deadline else config,
                              num_stages=args.stages)
        note_warmup_clamp(args, profile.num_stages, args.microbatches, result.warmup_clamp)  # the planner's clamp
        if deadline is not None:
            reword_warnings(result)
            extra["deadline_from"] = deadline_entry(result, deadline)
    data = result_to_dict(result, profile, extra)
    picture = None
    if args.plot is not None:
        picture = timelines_image(
            [
                (f"baseline: {result.config.baseline_name}", result.baseline_plan, result.baseline_timeline),
                (f"plan: {result.config.plan_type}/{result.config.scheduling}/{result.config.reconfig}",
                 result.plan, result.timeline),
            ],
            image_format(args.plot),
        )
    write_outputs([(args.plot, picture), (args.out, json_text(data))])
    if args.json:
        print_json(data)
    else:
        print_result(result, profile, rows=args.rows)
        if deadline is not None:
            print(f"\n{deadline_text(result, deadline)}")
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


def _frontier_dict(fr: Frontier, profile: Profile, target_time: float | None, picked) -> dict[str, Any]:
    data: dict[str, Any] = {
        "profile": profile.source,
        "num_stages": fr.num_stages,
        "num_microbatches": fr.schedule.num_microbatches,
        "scheduling": fr.schedule.name,
        "extra_warmup": list(fr.schedule.extra_warmup),
        "peak_inflight_activations": list(fr.schedule.peak_inflight()),
        "p2p_power_w": fr.p2p_power_w,
        "switch_cost_j": fr.config.effective_switch_cost_j,
        "baseline": {"iteration_time_s": fr.baseline.iteration_time_s, "energy_j": fr.baseline.energy_j},
        "fastest_s": fr.fastest_s,
        "valley_s": fr.valley_s,
        "points": [
            {"time_s": pt.time_s, "energy_j": pt.energy_j, "switch_energy_j": pt.switch_energy_j,
             "saving": pt.saving, "slowdown": pt.slowdown}
            for pt in fr.points
        ],
        "planner_seconds": fr.planner_seconds,
        "warnings": fr.warnings,
    }
    if picked is not None:
        pt, e_at, base_at = picked
        data["target"] = {
            "time_s": target_time, "plan_time_s": pt.time_s, "energy_at_target_j": e_at,
            "baseline_energy_at_target_j": base_at, "saving_at_target": 1.0 - e_at / base_at,
            "frequencies": pt.plan.to_dict()["stages"],
        }
    return data


def _print_frontier(fr: Frontier, profile: Profile, target_time: float | None, picked) -> None:
    b = fr.baseline
    print(f"profile     {profile.source}")
    print(f"pipeline    {fr.num_stages} stages x {fr.schedule.num_microbatches} micro-batches; schedule {fr.schedule.name}"
          + (f", extra warm-up {list(fr.schedule.extra_warmup)}" if scheduling_kind(fr.schedule.name).extra_warmup else "")
          + f"; peak in-flight activations {list(fr.schedule.peak_inflight())}; P2P {fr.p2p_power_w:g} W")
    shown = "1F1B, all at f_max" if fr.config.virtual_stages == 1 else fr.config.baseline_name
    print(f"baseline    {b.iteration_time_s:.4f} s  {b.energy_j:.1f} J   ({shown})")
    print(f"frontier    {len(fr.points)} plans from {fr.fastest_s:.4f} s (fastest) to {fr.valley_s:.4f} s "
          f"(energy valley), {fr.planner_seconds:.2f} s to compute"
          + (f"; energies count {fr.config.effective_switch_cost_j:.3g} J per clock change kept"
             if fr.config.effective_switch_cost_j else "") + "\n")
    print(f"{'time s':>10}{'energy J':>12}{'saving':>9}{'slowdown':>10}")
    for pt in fr.points:
        print(f"{pt.time_s:>10.4f}{pt.energy_j:>12.1f}{100 * pt.saving:>8.2f}%{100 * pt.slowdown:>9.2f}%")
    if picked is not None:
        pt, e_at, base_at = picked
        print(f"\ntarget {target_time:.4f} s: run the {pt.time_s:.4f} s plan; {e_at:.1f} J vs the baseline's "
              f"{base_at:.1f} J (both blocking until the target): saving {100 * (1 - e_at / base_at):.2f} %")
    for w in fr.warnings:
        print(f"WARNING: {w}")


def cmd_frontier(args: argparse.Namespace) -> int:
    check_outputs(args, "--csv", "--plot")
    check_flags_apply(args)
    profile = load_profile(args.profile, args.time_scale, args.energy_scale)
    check_extra_warmup_flag(args, check_stages(args, profile))
    gpu = gpu_for(args)
    check_profile_on_gpu(profile, gpu)
    # Switch cost as 'envpipe plan --type optimal' (None: the derived default), so its points are worth the same.
    config = planner_config(args, gpu, PlanType.OPTIMAL, ReconfigPolicy.DEFAULT, switch_cost_j=args.switch_cost_j,
                            max_clock_changes=args.max_clock_changes)
    fr = compute_frontier(profile, args.microbatches, config, points=args.points, num_stages=args.stages)
    note_warmup_clamp(args, profile.num_stages, args.microbatches, fr.warmup_clamp)
    picked = fr.pick(args.target_time) if args.target_time is not None else None
    picture = None
    if args.plot is not None:
        # EnvPipe's own plan for comparison: the same pipeline, no --extra-warmup, no --comm.
        envpipe_config = planner_config(args, gpu, PlanType.ENVELOPE, ReconfigPolicy.BALANCED,
                                        extra_warmup=None, comm=CommModel.PER_DIRECTION)
        envpipe = plan_envpipe(profile, args.microbatches, envpipe_config)
        picture = frontier_image(fr, image_format(args.plot), args.target_time,
                                 others=[(f"EnvPipe envelope+balanced ({args.scheduling})",
                                          envpipe.score.iteration_time_s, envpipe.energy_j)])
    write_outputs([(args.plot, picture), (args.csv, fr.csv_text() if args.csv is not None else "")])
    data = _frontier_dict(fr, profile, args.target_time, picked)
    if args.json:
        print_json(data)
        return 0
    _print_frontier(fr, profile, args.target_time, picked)
    if args.csv:
        print(f"\nfrontier written to {args.csv}")
    if args.plot:
        print(f"frontier drawn to {args.plot}")
    return 0


def cmd_show(args: argparse.Namespace) -> int:
    data, plan = plan_from_file(args.plan)
    waits, critical = _stored_timeline(args.plan, data, plan)  # every check before the first line printed
    if args.json:
        print_json(data)
        return 0
    print(f"plan file   {args.plan}")
    if "baseline" in data and "plan" in data:
        b, p = data["baseline"], data["plan"]
        # The file's strings escaped: a newline in one must not print a line of its own.
        print(f"profile     {one_line(data.get('profile'))}")
        print(
            f"pipeline    {one_line(data.get('num_stages'))} stages x {one_line(data.get('num_microbatches'))} "
            f"micro-batches; plan {one_line(p.get('type'))}/{one_line(p.get('scheduling'))}/"
            f"{one_line(p.get('reconfig'))}"
        )
        print(f"baseline    {b['iteration_time_s']:.4f} s  {b['energy_j']:.1f} J")
        print(f"plan        {p['iteration_time_s']:.4f} s  {p['energy_j']:.1f} J")
        print(
            f"saving      {100 * data['energy_saving']:.2f} %   slowdown {100 * data['slowdown']:.2f} %"
        )
        for w in data.get("warnings", []):
            print(f"WARNING: {one_line(w)}")
    print(f"clock changes per stage per iteration {list(plan.clock_changes())}")
    if waits is None:
        print("receive waits: not in this file (a bare plan, or written before envpipe stored them): "
              f"'envpipe simulate --plan {args.plan} --profile ...' simulates them")
    print(plan_rows(plan, waits, critical, args.rows))
    return 0


def _stored_timeline(path: str, data: dict[str, Any], plan: FrequencyPlan) -> tuple[list[list[float]] | None, list]:
    """The receive waits (ms, per stage, per unit) and critical units 'envpipe plan --out' stored with the
    plan's clocks, checked against them; (None, []) for a file without them."""
    body = data.get("plan") if isinstance(data.get("plan"), dict) else data
    waits, path_units = body.get("recv_wait_ms"), body.get("critical_path", [])
    if waits is None:
        return None, []
    fix = f"{path}: recv_wait_ms must hold one list of finite waits >= 0 (ms) per stage, one per unit: " \
          "write the plan again with 'envpipe plan --out'"
    orders = plan.schedule.orders
    if not (isinstance(waits, list) and len(waits) == len(orders)
            and all(isinstance(row, list) and len(row) == len(order) for row, order in zip(waits, orders))
            and all(isinstance(w, int | float) and not isinstance(w, bool) and math.isfinite(w) and w >= 0
                    for row in waits for w in row)):
        raise CliError(fix)
    critical = []
    for cell in path_units if isinstance(path_units, list) else [None]:
        stage, _, unit = cell.partition(" ") if isinstance(cell, str) else ("", "", "")
        try:
            critical.append((int(stage.removeprefix("S")), Unit.parse(unit)))
        except (ValueError, ScheduleError):
            raise CliError(f"{path}: critical_path entry {short(cell)} is not like \"S0 F0\": "
                           "write the plan again with 'envpipe plan --out'") from None
    return waits, critical
