"""``envpipe menu``: every schedule we run at 1F1B's iteration time and at its own fastest, in one table;
and what ``envpipe plan --deadline-from 1f1b`` adds to a plan (planning/menu.py, planning/deadline.py)."""

from __future__ import annotations

import argparse
from typing import Any

from megatron_envpipe.apps.cli.common import CliError, check_stages, gpu_for, load_profile, planner_config
from megatron_envpipe.apps.cli.outputs import check_outputs, json_text, write_outputs
from megatron_envpipe.apps.cli.plausibility import check_profile_on_gpu
from megatron_envpipe.apps.cli.render import print_json
from megatron_envpipe.apps.menu_table import menu_dict, print_menu
from megatron_envpipe.core.kinds import plan_kind, scheduling_kind
from megatron_envpipe.core.profile import Profile
from megatron_envpipe.core.vocabulary import PlanType, ReconfigPolicy
from megatron_envpipe.planning.basis import PlannerConfig, PlanResult
from megatron_envpipe.planning.deadline import (
    DeadlineFrom,
    deadline_from_1f1b,
    deadline_summary,
    interleaved_budget_problem,
    peak_ratio,
    saving_against,
    stage_equivalents,
)
from megatron_envpipe.planning.menu import build_menu


def cmd_menu(args: argparse.Namespace) -> int:
    check_outputs(args, "--out")
    profile = load_profile(args.profile, args.time_scale, args.energy_scale)
    check_stages(args, profile)
    gpu = gpu_for(args)
    check_profile_on_gpu(profile, gpu)
    # What every row shares, as 'envpipe plan --type optimal' builds it from the same flags.
    config = planner_config(args, gpu, PlanType.OPTIMAL, ReconfigPolicy.DEFAULT, switch_cost_j=args.switch_cost_j,
                            max_clock_changes=args.max_clock_changes, virtual_stages=1)
    menu = build_menu(profile, args.microbatches, config, args.stages, args.schedules, args.virtual_stages)
    data = menu_dict(menu, args.max_inflight)
    write_outputs([(args.out, json_text(data) if args.out else "")])
    if args.json:
        print_json(data)
    else:
        print_menu(menu)
        if args.out:
            print(f"\nmenu written to {args.out}")
    return 0


# -- envpipe plan --deadline-from 1f1b ---------------------------------------------------
def check_deadline_flags(args: argparse.Namespace) -> None:
    """--deadline-from 1f1b: an optimal plan, no other deadline, not Perseus's re-implementation."""
    if args.deadline_from is None:
        return
    flag = f"--deadline-from {args.deadline_from}"
    if args.compat is not None:
        raise CliError(f"{flag} plans with --type optimal, and --compat perseus reproduces Perseus's EnvPipe: drop one")
    if not plan_kind(args.type).has_deadline:
        raise CliError(f"{flag} plans to 1F1B's iteration time, which needs --type optimal (the minimum-energy "
                       f"plan for a deadline), not --type {args.type}: add --type optimal")
    for other, given in (("--max-slowdown", args.max_slowdown is not None), ("--target-time", args.target_time is not None)):
        if given:
            raise CliError(f"{flag} and {other} both set the deadline: drop one")


def deadline_entry(result: PlanResult, deadline: DeadlineFrom) -> dict[str, Any]:
    """The plan against 1F1B at f_max: the JSON's ``deadline_from``."""
    ref = deadline.reference
    peaks = stage_equivalents(result.schedule)
    return {"schedule": "1f1b", "deadline_s": ref.iteration_time_s, "own_fastest_s": deadline.own_fastest_s,
            "max_slowdown": deadline.config.max_slowdown,
            "reference": {"iteration_time_s": ref.iteration_time_s, "energy_j": ref.energy_j,
                          "peak_inflight_activations": list(ref.peak_inflight)},
            "energy_saving_vs_1f1b": saving_against(result, ref),
            "peak_inflight_stage_equivalents": list(peaks), "peak_vs_1f1b": peak_ratio(peaks, ref)}


def deadline_text(result: PlanResult, deadline: DeadlineFrom) -> str:
    return deadline_summary(result, deadline)


def deadline_for(args: argparse.Namespace, profile: Profile, config: PlannerConfig) -> DeadlineFrom:
    """--deadline-from 1f1b: the config planned to 1F1B's f_max time; an interleaved run checked against
    --max-inflight (its order is Megatron's, so its activations are known before planning)."""
    if scheduling_kind(args.scheduling).model_chunks and args.max_inflight is not None:
        problem = interleaved_budget_problem(profile.num_stages, args.microbatches, config.virtual_stages,
                                             args.max_inflight)
        if problem:
            raise CliError(f"--max-inflight {problem}")
    return deadline_from_1f1b(profile, args.microbatches, config, num_stages=args.stages)
