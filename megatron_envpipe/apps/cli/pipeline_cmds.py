"""``envpipe simulate``, ``envpipe schedule`` and ``envpipe programs``: schedules and what they do."""

from __future__ import annotations

import argparse
from typing import Any

from megatron_envpipe.apps.cli.common import (
    CliError,
    check_extra_warmup_flag,
    check_flags_apply,
    gpu_for,
    load_profile,
    note_warmup_clamp,
    p2p_power,
    plan_from_file,
)
from megatron_envpipe.apps.cli.outputs import check_outputs, write_outputs
from megatron_envpipe.apps.cli.plausibility import check_profile_on_gpu
from megatron_envpipe.apps.cli.render import critical_path, print_json, recv_wait_ms, score_dict
from megatron_envpipe.apps.cli.rows import plan_rows
from megatron_envpipe.apps.plot import image_format, timelines_image
from megatron_envpipe.core.deadlock import check_deadlock
from megatron_envpipe.core.instructions import DeadlockError, build_programs
from megatron_envpipe.core.kinds import build_schedule, scheduling_kind
from megatron_envpipe.core.plan import FrequencyPlan
from megatron_envpipe.core.profile import ProfileError
from megatron_envpipe.core.schedule import Schedule, ScheduleError, clamp_extra_warmup_explained
from megatron_envpipe.core.sizes import MAX_SIMULATED_SIZE, check_schedule_size
from megatron_envpipe.core.timeline import PlanEvaluator
from megatron_envpipe.core.vocabulary import Scheduling


def _check_simulate_flags(args: argparse.Namespace) -> None:
    """--plan brings its own schedule and clocks: the flags that would set them are reported, not ignored."""
    if args.plan is None:
        if args.microbatches is None:
            raise CliError("simulate needs --plan PLAN.json, or --microbatches M (with --scheduling/--freq)")
        return
    given = [flag for flag, value in (("--microbatches", args.microbatches), ("--scheduling", args.scheduling),
                                      ("--extra-warmup", args.extra_warmup), ("--freq", args.freq),
                                      ("--virtual-stages", args.virtual_stages))
             if value is not None]
    if given:
        raise CliError(f"--plan brings its own schedule and clocks: drop {', '.join(given)} "
                       "(or drop --plan to simulate a schedule at one clock)")


def cmd_simulate(args: argparse.Namespace) -> int:
    check_outputs(args, "--plot")
    _check_simulate_flags(args)
    plan = plan_from_file(args.plan)[1] if args.plan is not None else None
    profile = load_profile(args.profile, args.time_scale, args.energy_scale)
    gpu = gpu_for(args)
    check_profile_on_gpu(profile, gpu, args.freq)
    p2p = p2p_power(args, gpu)
    if plan is not None:
        schedule = plan.schedule
        if schedule.num_stages != profile.num_stages:
            raise CliError(f"--plan {args.plan} has {schedule.num_stages} stages, the profile {profile.num_stages} "
                           f"({profile.source}): simulate it on the profile it was planned for")
        profile = _chunk_profile(profile, schedule.num_chunks)
    else:
        p = profile.num_stages
        scheduling = args.scheduling or Scheduling.ONE_F_ONE_B.value
        check_extra_warmup_flag(args, p, scheduling)
        clamp = None
        if scheduling_kind(scheduling).extra_warmup:
            if not args.extra_warmup:
                raise CliError("--scheduling ours needs --extra-warmup r0,r1,...")
            clamp = clamp_extra_warmup_explained(p, args.microbatches, args.extra_warmup)
        check_schedule_size(p, args.microbatches, args.virtual_stages or 1, MAX_SIMULATED_SIZE, "a simulation")
        schedule = _build(scheduling, p, args.microbatches, clamp and clamp.clamped, args.virtual_stages)
        note_warmup_clamp(args, p, args.microbatches, clamp=clamp)
        profile = _chunk_profile(profile, schedule.num_chunks)
        freq = args.freq or profile.max_frequency()
        plan = FrequencyPlan.constant(schedule, [freq] * p)
    evaluator = PlanEvaluator(schedule, profile, p2p, args.p2p_latency)
    timeline = evaluator.simulate(plan.flat())
    score = evaluator.score(plan.flat(), timeline)
    crit = timeline.critical_units()
    data = {
        "profile": profile.source,
        "p2p_power_w": p2p,
        **score_dict(score),
        "stage_idle_s": timeline.idle_s(),
        "peak_inflight_activations": list(schedule.peak_inflight()),
        "critical_path": critical_path(timeline),
    }
    if args.plot is not None:
        write_outputs([(args.plot, timelines_image([(f"simulated {schedule.name}", plan, timeline)],
                                                   image_format(args.plot)))])
    if args.json:
        print_json(data)
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
    print(plan_rows(plan, recv_wait_ms(timeline), crit, args.rows))
    if args.plot:
        print(f"timeline drawn to {args.plot}")
    return 0


def _schedule_from_flags(args: argparse.Namespace, max_inflight: Any = None) -> Schedule:
    """The validated schedule 'schedule' and 'programs' print: --scheduling, --extra-warmup (clamped)."""
    check_extra_warmup_flag(args, args.stages)
    clamp = None
    if scheduling_kind(args.scheduling).extra_warmup:
        clamp = clamp_extra_warmup_explained(args.stages, args.microbatches, args.extra_warmup or [0] * args.stages,
                                             max_inflight)
    schedule = _build(args.scheduling, args.stages, args.microbatches, clamp and clamp.clamped,
                      args.virtual_stages).validate()
    note_warmup_clamp(args, args.stages, args.microbatches, clamp=clamp)  # once the schedule is sure to run
    return schedule


def _build(scheduling: str, num_stages: int, num_microbatches: int, r, virtual_stages: int | None) -> Schedule:
    """The schedule of the flags; --virtual-stages V (>= 2) only with --scheduling interleaved, which needs it."""
    v = virtual_stages or 1
    if scheduling_kind(scheduling).model_chunks != (v > 1):
        raise CliError("--scheduling interleaved needs --virtual-stages V >= 2" if v == 1 else
                       f"--virtual-stages {v} needs --scheduling interleaved (1f1b and ours run one chunk per rank)")
    try:
        return build_schedule(scheduling, num_stages, num_microbatches, r, num_chunks=v)
    except ScheduleError as exc:
        raise CliError(f"--scheduling {scheduling} --virtual-stages {v}: {exc}") from None


def _chunk_profile(profile, num_chunks: int):
    """The profile's costs per model chunk (split evenly without a chunk column)."""
    if num_chunks == 1:
        return profile
    try:
        return profile.for_chunks(num_chunks)
    except ProfileError as exc:
        raise CliError(str(exc)) from None


def cmd_schedule(args: argparse.Namespace) -> int:
    check_flags_apply(args)
    schedule = _schedule_from_flags(args, args.max_inflight)
    print(str(schedule))
    print(f"# peak in-flight activations per stage: {list(schedule.peak_inflight())}")
    return 0


def cmd_programs(args: argparse.Namespace) -> int:
    schedule = _schedule_from_flags(args)
    programs = build_programs(schedule, prefetch=args.prefetch)
    for prog in programs:
        print(prog)
    try:
        steps = check_deadlock(programs, shared_pair_stream=args.shared_stream)
    except DeadlockError as exc:  # the answer to the question asked, not an error of the command
        print(f"# DEADLOCK under strict rendezvous: {exc}")
        return 1
    model = "one shared stream per stage pair" if args.shared_stream else "one channel per direction"
    print(f"# deadlock-free under strict rendezvous ({model}, no buffering): {steps} instructions")
    return 0
