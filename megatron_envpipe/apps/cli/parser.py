"""The ``envpipe`` argument parser: the flag groups commands share, one sub-parser per command.

A flag that twins a training flag (``--type``, ``--max-slowdown``, ...) is generated from the one field
table by ``twins.add_twin`` (its help, choices and range are the table's); the command's own flags are
written here."""

from __future__ import annotations

import argparse

from megatron_envpipe.apps.cli.arg_types import menu_schedules, ranged
from megatron_envpipe.apps.cli.demo_cmd import cmd_demo
from megatron_envpipe.apps.cli.gpu_cmds import cmd_gpus, cmd_reset_clocks
from megatron_envpipe.apps.cli.menu_cmd import cmd_menu
from megatron_envpipe.apps.cli.pipeline_cmds import cmd_programs, cmd_schedule, cmd_simulate
from megatron_envpipe.apps.cli.planning_cmds import cmd_frontier, cmd_plan, cmd_show
from megatron_envpipe.apps.cli.rows import ROW_LIMIT_CHARS, ROWS_CHOICES
from megatron_envpipe.apps.cli.twins import add_switching_args, add_twin
from megatron_envpipe.apps.gpu_check.cli import add_gpu_check_args, cmd_gpu_check
from megatron_envpipe.core.resources import shipped_profiles
from megatron_envpipe.core.vocabulary import (
    COMM_NAMES,
    CommModel,
    PlanType,
    ReconfigPolicy,
    Scheduling,
)
from megatron_envpipe.planning.menu import MENU_SCHEDULES


class _Given(argparse.Action):
    """Stores the value like ``store`` and records the flag in ``namespace.given_flags``: a flag left at its
    default is then told apart from one the user gave (an error names only flags on the command line)."""

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, values)
        given = getattr(namespace, "given_flags", None)
        namespace.given_flags = (given or frozenset()) | {self.option_strings[0]}


def _add_rows_arg(p: argparse.ArgumentParser) -> None:
    """--rows of 'plan', 'simulate' and 'show': every unit of every stage, or a summary of long rows."""
    p.add_argument("--rows", choices=ROWS_CHOICES, default="auto",
                   help="per-stage rows: full (every unit, clock and receive wait), summary (clock runs such as "
                        f"1740x1 1230x159, total wait), auto (default: full up to {ROW_LIMIT_CHARS} characters a "
                        "row, else summary); --json always has every unit")


class _EnvpipeArgumentParser(argparse.ArgumentParser):
    """argparse, with a bad flag reported on one line like every other envpipe error (no usage block),
    by the command it belongs to (``envpipe plan: error: ...``, also for an unknown flag)."""

    command_parsers: dict[str, argparse.ArgumentParser] | None = None  # set by build_parser

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see '{self.prog} --help')\n")

    def parse_args(self, args=None, namespace=None):
        namespace, extra = self.parse_known_args(args, namespace)
        if extra:
            owner = (self.command_parsers or {}).get(getattr(namespace, "command", None), self)
            owner.error(f"unrecognized arguments: {' '.join(extra)}")
        return namespace


# -- flag groups ----------------------------------------------------------------------
def _add_profile_args(p: argparse.ArgumentParser) -> None:
    """The profile and GPU flags of 'plan', 'frontier' and 'simulate' (read by ``common.gpu_for``)."""
    names = ", ".join(shipped_profiles())
    p.add_argument("--profile", required=True, help=f"Perseus-format CSV, or a shipped profile: {names}")
    p.add_argument(
        "--gpu",
        help="GPU table entry (configs/gpus.toml): clock range, steps, P2P power "
        "(default for a shipped profile: the GPU it was measured on)",
    )
    add_twin(p, "p2p_power_w")
    p.add_argument("--p2p-latency", type=ranged("p2p_latency_s"), default=0.0,
                   help="latency of each P2P message in s (default 0)")
    p.add_argument("--time-scale", type=ranged("profile_scale"), default=1.0,
                   help="multiply profile times (Perseus emulation: 10)")
    p.add_argument("--energy-scale", type=ranged("profile_scale"), default=1.0,
                   help="multiply profile energies (emulation: 80)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    p.add_argument("--plot", metavar="PNG", help="draw a Gantt chart of the iteration (.png, .pdf, .svg, ...)")


def _add_pipeline_args(p: argparse.ArgumentParser) -> None:
    """The pipeline and schedule flags of 'plan' and 'frontier' (read by ``common.planner_config``)."""
    p.add_argument("--microbatches", "-m", type=ranged("microbatches"), required=True,
                   help="micro-batches per iteration")
    p.add_argument("--stages", type=ranged("stages"), help="pipeline stages (checked against the profile)")
    add_twin(p, "scheduling", "; default ours (1f1b with --compat perseus); interleaved: Megatron's "
             "virtual pipeline, with --virtual-stages", default=Scheduling.OURS.value, action=_Given)
    _add_virtual_stages(p)
    add_twin(p, "max_inflight", "; default none")
    add_twin(p, "extra_warmup")
    p.add_argument("--comm", choices=COMM_NAMES, default=CommModel.PER_DIRECTION.value,
                   help="communication plans are scored with: one channel per direction (what the executor "
                        "runs, no extra dependency) or EnvPipe's paired order (activations held until a gradient)")


def _add_virtual_stages(p: argparse.ArgumentParser) -> None:
    p.add_argument("--virtual-stages", type=ranged("virtual_stages"), metavar="V",
                   help="model chunks per rank of --scheduling interleaved (Megatron's "
                        "--virtual-pipeline-model-parallel-size), V >= 2")


def _add_schedule_args(p: argparse.ArgumentParser) -> None:
    """The sizes and unit order of 'schedule' and 'programs'."""
    p.add_argument("--stages", type=ranged("stages"), required=True)
    p.add_argument("--microbatches", "-m", type=ranged("microbatches"), required=True)
    add_twin(p, "scheduling", "; default 1f1b", default=Scheduling.ONE_F_ONE_B.value)
    _add_virtual_stages(p)
    add_twin(p, "extra_warmup")


def _add_menu_args(p: argparse.ArgumentParser) -> None:
    """The flags of 'menu': the profile and GPU flags of 'plan' (no --plot), M, the budget, the switching flags."""
    names = ", ".join(shipped_profiles())
    p.add_argument("--profile", required=True, help=f"Perseus-format CSV, or a shipped profile: {names}")
    p.add_argument("--gpu", help="GPU table entry (configs/gpus.toml; default for a shipped profile: its GPU)")
    add_twin(p, "p2p_power_w")
    p.add_argument("--p2p-latency", type=ranged("p2p_latency_s"), default=0.0, help="latency of each P2P message in s")
    p.add_argument("--time-scale", type=ranged("profile_scale"), default=1.0, help="multiply profile times")
    p.add_argument("--energy-scale", type=ranged("profile_scale"), default=1.0, help="multiply profile energies")
    p.add_argument("--microbatches", "-m", type=ranged("microbatches"), required=True, help="micro-batches per iteration")
    p.add_argument("--stages", type=ranged("stages"), help="pipeline stages (checked against the profile)")
    add_twin(p, "max_inflight", "; ours plans within it, interleaved must fit it (an error if not); default none")
    p.add_argument("--schedules", type=menu_schedules, default=MENU_SCHEDULES, metavar="1f1b,ours,interleaved",
                   help="the schedules to plan (default all; interleaved only where Megatron allows M)")
    p.add_argument("--virtual-stages", type=ranged("virtual_stages"), default=2, metavar="V",
                   help="model chunks per rank of the interleaved rows (default 2)")
    add_switching_args(p, "")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    p.add_argument("--out", metavar="MENU.json", help="write the menu as JSON")
    # What planner_config reads from plan's flags: the budget reaches ours through scheduling "ours".
    p.set_defaults(scheduling=Scheduling.OURS.value, extra_warmup=None, comm=CommModel.PER_DIRECTION.value)


# -- the parser -----------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    parser = _EnvpipeArgumentParser(
        prog="envpipe",
        description="Energy-saving pipeline schedules and GPU clock plans (EnvPipe) for Megatron-core.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    parser.command_parsers = sub.choices

    p = sub.add_parser("plan", help="plan per-unit SM clocks from a profile and compare with the baseline")
    _add_profile_args(p)
    _add_pipeline_args(p)
    add_twin(p, "plan_type", "; default envelope", default=PlanType.ENVELOPE.value, action=_Given)
    add_twin(p, "reconfig", " (default balanced)", default=ReconfigPolicy.BALANCED.value, action=_Given)
    add_twin(p, "reconfig_step_mhz")
    add_twin(p, "max_slowdown", " (default 0)")
    add_twin(p, "target_time_s")
    add_twin(p, "deadline_from", "; the saving against 1F1B at f_max and the activations this needs are printed")
    add_switching_args(p, "for --type optimal: ")
    add_twin(p, "timing_margin", " (default 0 here; training's --envpipe-timing-margin defaults to 0.01)")
    p.add_argument("--compat", choices=("perseus",),
                   help="reproduce Perseus's EnvPipe re-implementation (envelope, 1f1b, balanced)")
    p.add_argument("--out", metavar="PLAN.json", help="write the plan and its scores as JSON")
    _add_rows_arg(p)
    p.set_defaults(func=cmd_plan)

    p = sub.add_parser("frontier", help="the iteration-time vs energy Pareto frontier of optimal plans")
    _add_profile_args(p)
    _add_pipeline_args(p)
    p.add_argument("--points", type=ranged("points"), default=20,
                   help="deadlines from fastest to valley (default 20)")
    add_switching_args(p, "")
    p.add_argument("--csv", metavar="OUT.csv", help="write time_s,energy_j,saving,slowdown")
    # The same value as plan's, another use: it picks a point of the frontier.
    add_twin(p, "target_time_s", help="pick the plan to run when iterations last S seconds anyway (e.g. a "
             "straggler's pace)")
    p.set_defaults(func=cmd_frontier)

    p = sub.add_parser("menu", help="every schedule at 1F1B's iteration time and at its own fastest: time, "
                       "energy, saving against 1F1B at f_max, activations (optimal clocks)")
    _add_menu_args(p)
    p.set_defaults(func=cmd_menu)

    p = sub.add_parser("show", help="print a plan written by 'envpipe plan --out'")
    p.add_argument("plan", help="PLAN.json")
    p.add_argument("--json", action="store_true", help="print the stored JSON")
    _add_rows_arg(p)
    p.set_defaults(func=cmd_show)

    p = sub.add_parser("simulate", help="simulate one iteration of a plan or schedule on a profile")
    _add_profile_args(p)
    p.add_argument("--plan", metavar="PLAN.json", help="a plan from 'envpipe plan --out'")
    p.add_argument("--microbatches", "-m", type=ranged("microbatches"), help="micro-batches (without --plan)")
    # No default: given with --plan it would be ignored, which is reported instead (see cmd_simulate).
    add_twin(p, "scheduling", "; without --plan, default 1f1b")
    _add_virtual_stages(p)
    add_twin(p, "extra_warmup")
    p.add_argument("--freq", type=ranged("clock_mhz"),
                   help="one clock for every unit (default: the profile's max)")
    _add_rows_arg(p)
    p.set_defaults(func=cmd_simulate)

    p = sub.add_parser("schedule", help="print a schedule's per-stage unit order")
    _add_schedule_args(p)
    add_twin(p, "max_inflight", "; default none")
    p.set_defaults(func=cmd_schedule)

    p = sub.add_parser("programs", help="print each stage's instruction program and prove it deadlock-free")
    _add_schedule_args(p)
    add_twin(p, "prefetch", " (default 2)", default=2)
    p.add_argument("--shared-stream", action="store_true",
                   help="check against one shared stream per stage pair instead (shows why we avoid it)")
    p.set_defaults(func=cmd_programs)

    p = sub.add_parser("reset-clocks", help="reset GPU clocks a crashed run left locked (needs root or CAP_SYS_ADMIN)")
    p.add_argument("--state-dir", metavar="DIR",
                   help="where runs record locked clocks (default $ENVPIPE_STATE_DIR or /var/lib/megatron-envpipe/locked-clocks)")
    p.add_argument("--force", action="store_true", help="also reset GPUs whose locking process is still running")
    p.add_argument("--all", action="store_true", help="reset every GPU on this node through NVML, state files or not")
    p.set_defaults(func=cmd_reset_clocks)

    p = sub.add_parser("demo", help="train a tiny GPT pipeline with and without EnvPipe and show the saving")
    p.add_argument("--out", default="out/demo", help="where logs, timeline.png and summary.json go")
    p.add_argument("--config", help="a demo config (default configs/demo.toml)")
    p.add_argument("--gpu", help="device backend (default: NVML with >= 2 GPUs, else simulated:<profile>)")
    p.set_defaults(func=cmd_demo)

    p = sub.add_parser("gpu-check", help="one command, under 8 minutes: what only a GPU can tell (clocks, energy "
                       "counter, clock changes, blocking power, profile, replay, executor, a calibrated preset)")
    add_gpu_check_args(p)
    p.set_defaults(func=cmd_gpu_check)

    p = sub.add_parser("gpus", help="list the GPU clock table")
    p.set_defaults(func=cmd_gpus)

    # `envpipe torchrun ...` is dispatched before this parser runs (its arguments are torchrun's own);
    # listed here for --help.
    sub.add_parser("torchrun", add_help=False,
                   help="torchrun, after checking once per node what EnvPipe's Megatron-LM entry needs "
                        "(one line and exit 2 on a node that cannot run it; torchrun's own arguments)")
    return parser
