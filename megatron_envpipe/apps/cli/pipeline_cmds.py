"""``envpipe simulate``, ``envpipe schedule`` and ``envpipe programs``: schedules and what they do."""

from __future__ import annotations

import argparse

from megatron_envpipe.apps.cli.common import CliError, gpu_for, load_profile, p2p_power, plan_from_file
from megatron_envpipe.apps.cli.render import print_json, recv_wait_ms, score_dict
from megatron_envpipe.apps.plot import draw_timelines
from megatron_envpipe.core.instructions import DeadlockError, build_programs, check_deadlock
from megatron_envpipe.core.plan import FrequencyPlan, format_envpipe
from megatron_envpipe.core.schedule import build_schedule, clamp_extra_warmup
from megatron_envpipe.core.timeline import PlanEvaluator
from megatron_envpipe.core.vocabulary import Scheduling


def cmd_simulate(args: argparse.Namespace) -> int:
    profile = load_profile(args.profile, args.time_scale, args.energy_scale)
    gpu = gpu_for(args)
    p2p = p2p_power(args, gpu)
    if args.plan:
        _, plan = plan_from_file(args.plan)
        schedule = plan.schedule
    else:
        if args.microbatches is None:
            raise CliError("simulate needs --plan PLAN.json, or --microbatches M (with --scheduling/--freq)")
        p = profile.num_stages
        r = None
        if args.scheduling == Scheduling.OURS:
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
        **score_dict(score),
        "stage_idle_s": timeline.idle_s(),
        "peak_inflight_activations": list(schedule.peak_inflight()),
        "critical_path": [f"S{s} {u}" for s, u in reversed(crit)],
    }
    if args.plot:
        draw_timelines([(f"simulated {schedule.name}", plan, timeline)], args.plot)
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
    print(format_envpipe(plan, recv_wait_ms(timeline), crit))
    if args.plot:
        print(f"timeline drawn to {args.plot}")
    return 0


def cmd_schedule(args: argparse.Namespace) -> int:
    r = None
    if args.scheduling == Scheduling.OURS:
        r = clamp_extra_warmup(args.stages, args.microbatches, args.extra_warmup or [0] * args.stages, args.max_inflight)
    schedule = build_schedule(args.scheduling, args.stages, args.microbatches, r).validate()
    print(str(schedule))
    print(f"# peak in-flight activations per stage: {list(schedule.peak_inflight())}")
    return 0


def cmd_programs(args: argparse.Namespace) -> int:
    r = None
    if args.scheduling == Scheduling.OURS:
        r = clamp_extra_warmup(args.stages, args.microbatches, args.extra_warmup or [0] * args.stages)
    schedule = build_schedule(args.scheduling, args.stages, args.microbatches, r).validate()
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
