"""One table of EnvPipe's settings: every ``--envpipe-*`` field's flag, group, range and *when it can act*.

The rule "a flag that cannot act is refused, naming what would make it act" (issue 39) is read
from here by both flag surfaces: the training flags (``EnvPipeConfig.validate`` and, with the
launch's shape, ``validate_with_megatron_args``) and the ``envpipe`` command's twins
(``apps/cli/common.check_flags_apply``). Each :class:`Needs` is one condition the field needs to act
(plan type, schedule, GPU kind, time mode, data-parallel/pipeline sizes, iteration counts), with
the words that say why and what to add; facts that are not known yet (the launch's shape while the
flags alone are checked) pass and are checked again at start-up. A field with no condition says why
in ``always``. ``Needs.only_for`` names the values a condition is about: ``--no-envpipe-follow-stragglers``
and ``--envpipe-profile-cache off`` only turn off what is off and stay accepted; ``--envpipe-clock-lead off``
is refused where no clock changes (issue 39 lists it: it reads as a setting the run would honour).
Pure Python.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Iterable
from dataclasses import dataclass, fields
from typing import Any

from megatron_envpipe.core.device_backends import backend_traits
from megatron_envpipe.core.flag_ranges import FlagRange
from megatron_envpipe.core.kinds import KindError, plan_kind, plan_type_names, scheduling_kind, scheduling_names
from megatron_envpipe.core.memory import AUTO, show_budget
from megatron_envpipe.core.vocabulary import RECONFIG_NAMES, PlanType, ReconfigPolicy, Scheduling
from megatron_envpipe.flag_types import (
    TRAINING_NUMBERS,
    EnvPipeConfigError,
    fraction,
    int_list,
    max_inflight_arg,
    memory_model_arg,
    show,
    show_list,
    sim_straggler_arg,
)
from megatron_envpipe.planning.deadline import DEADLINE_FROM_NAMES
from megatron_envpipe.planning.switching import DEFAULT_SWITCH_LATENCY_S

__all__ = ["CLI_NAMES", "FIELDS", "Facts", "Needs", "SettingField", "inert_problem",
           "refuse_inert"]


@dataclass(frozen=True)
class Facts:
    """What decides whether a flag can act: the run's settings and, where known, the launch's shape
    (None: not known yet)."""

    plan_type: str = PlanType.BASELINE
    scheduling: str = Scheduling.ONE_F_ONE_B
    reconfig: str = ReconfigPolicy.DEFAULT
    gpu: str | None = None
    sim_time: str = "virtual"
    profile: str | None = None
    max_inflight: Any = AUTO
    deadline_from: str | None = None
    follow_stragglers: bool = True
    offline: bool = False  # the envpipe command: plans and simulates, runs nothing
    pipeline_size: int | None = None
    data_parallel_size: int | None = None
    train_iters: int | None = None
    variable_seq_lengths: bool | None = None

    @property
    def modelled_gpu(self) -> bool:  # --envpipe-gpu names a model of a GPU (the simulated one)
        return backend_traits(self.gpu).modelled

    @property
    def locks_clocks(self) -> bool:
        """The device may lock clocks (``--envpipe-gpu none`` never does)."""
        return backend_traits(self.gpu).can_lock_clocks

    def plan(self, capability: str) -> bool | None:
        """The plan type's capability (core/kinds.py), None for a name no plan type has (reported elsewhere)."""
        try:
            return getattr(plan_kind(self.plan_type), capability)
        except KindError:
            return None

    def order(self, capability: str) -> bool | None:
        """The scheduling's capability (core/kinds.py), None for an unknown name."""
        try:
            return getattr(scheduling_kind(self.scheduling), capability)
        except KindError:
            return None

    @property
    def sets_clocks(self) -> bool:
        """A plan or the online correction changes clocks (baseline + default keeps every unit at f_max)."""
        return self.plan("sets_clocks") is not False or self.reconfig != ReconfigPolicy.DEFAULT


# The flags a condition's words name, per surface: {type}, {scheduling}, ... in Needs.why / fix.
_TRAINING_NAMES = {"type": "--envpipe-type", "scheduling": "--envpipe-scheduling", "reconfig": "--envpipe-reconfig",
                  "gpu": "--envpipe-gpu", "sim_time": "--envpipe-sim-time", "profile": "--envpipe-profile",
                  "max_inflight": "--envpipe-max-inflight", "follow": "--envpipe-follow-stragglers"}
CLI_NAMES = {"type": "--type", "scheduling": "--scheduling", "reconfig": "--reconfig", "gpu": "--gpu",
             "sim_time": "--sim-time", "profile": "--profile", "max_inflight": "--max-inflight",
             "follow": "--follow-stragglers"}


@dataclass(frozen=True)
class Needs:
    """One condition a field needs to act.
    ``acts(facts, value)``: True, False, or None (not known yet: passes).
    ``why`` follows ``FLAG VALUE`` (or ``FLAG`` alone without ``show_value``), ``fix`` follows a colon;
    both may name the surface's flags ({type}, {scheduling}, ...), the facts ({plan_type}, ...) and the value.
    ``only_for(value)``: the values the condition is about (default: every value given)."""

    acts: Callable[[Facts, Any], bool | None]
    why: str
    fix: str
    show_value: bool = True
    only_for: Callable[[Any], bool] | None = None


@dataclass(frozen=True)
class SettingField:
    """One EnvPipeConfig field: its training flag (and the envpipe command's twin), its group, its range
    (core.flag_ranges, through flag_types.TRAINING_NUMBERS), and when it can act."""

    name: str
    flag: str
    group: str  # plan, schedule, device, profiler, simulated, stragglers, reporting, transport
    needs: tuple[Needs, ...] = ()
    always: str = ""  # why no condition: it acts in every pipelined run
    cli_flag: str | None = None  # the envpipe command's twin
    # The argparse spec of the flag (dest: envpipe_<name>; default: EnvPipeConfig's, or None with unset_default).
    help: str = ""  # the meaning, both surfaces' (apps/cli/twins.py maps the flag names it cites)
    default_help: str = ""  # the training flag's default clause, after help (the twin says its own)
    parse: Callable[[str], Any] | None = None  # argparse type
    choices: tuple[str, ...] | Callable[[], tuple[str, ...]] | None = None  # a callable: asked at parser build
    metavar: str | None = None
    action: Any = None
    unset_default: bool = False  # argparse default None: "not given", so a typed default counts as given

    def argparse_kwargs(self) -> dict[str, Any]:
        """``add_argument``'s keywords but the default (config/flags.py adds EnvPipeConfig's)."""
        choices = self.choices() if callable(self.choices) else self.choices
        spec = {"dest": f"envpipe_{self.name}", "help": self.help + self.default_help, "type": self.parse,
                "choices": choices, "metavar": self.metavar, "action": self.action}
        return {key: value for key, value in spec.items() if value is not None}

    @property
    def range(self) -> FlagRange | None:
        entry = TRAINING_NUMBERS.get(self.name)
        return entry[1] if entry else None


class _Once(argparse.Action):
    """``store``, but a second occurrence is an error: argparse keeps the last one and silently drops the first."""

    def __call__(self, parser, namespace, values, option_string=None):
        if getattr(namespace, f"{self.dest}_given", False):
            raise argparse.ArgumentError(self, f"given twice ({getattr(namespace, self.dest)} and {values}): one "
                                         "simulated straggler per run; give it once")
        setattr(namespace, self.dest, values)
        setattr(namespace, f"{self.dest}_given", True)


# -- the conditions ---------------------------------------------------------------------------------

def _unknown_or(value: Any, test: Callable[[Any], bool]) -> bool | None:
    return None if value is None else test(value)


OURS = Needs(lambda f, v: f.order("extra_warmup"), "only applies to {scheduling} ours",
             "add {scheduling} ours or drop {flag}")
_BUDGETED = Needs(
    lambda f, v: f.order("extra_warmup") or (f.order("model_chunks") and f.deadline_from is not None),
    "budgets the extra warm-up of {scheduling} ours, and {scheduling} {scheduling_value} has none, so it would be "
    "ignored", "add {scheduling} ours or drop it")
_NOT_BASELINE = Needs(lambda f, v: f.plan("sets_clocks"),
                     "does nothing with {type} baseline, which runs every unit at the maximum clock: no clock to "
                     "slow, merge or change, so it would be ignored", "drop it or choose another {type}")
_RECONFIGURING = Needs(lambda f, v: f.reconfig != ReconfigPolicy.DEFAULT,
                      "tunes online reconfiguration, and {reconfig} default turns reconfiguration off, so it "
                      "would be ignored",
                      "add {reconfig} balanced (or greedy) or drop it")
_OFFLINE_STEP = Needs(lambda f, v: not (f.offline and f.plan("optimized")),
                     "sets the step of offline reconfiguration, and {type} optimal plans without reconfiguration, "
                     "so it would be ignored", "drop it (or use {type} envelope/uniform with {reconfig} balanced "
                     "or greedy)")
_PROFILER = Needs(lambda f, v: f.profile is None,
                 "tunes the start-up measurement, which {profile} {profile_value} replaces, so it would be ignored",
                 "drop one of them")
# 'off' only turns off a cache that a given profile leaves unused: accepted (a script may always pass it).
_PROFILE_CACHE = Needs(_PROFILER.acts, _PROFILER.why, _PROFILER.fix, only_for=lambda v: str(v).strip().lower() != "off")
_DEADLINE = Needs(lambda f, v: f.plan("has_deadline"),
                 "sets an optimal plan's deadline, and deadlines need {type} optimal (this run has {type} "
                 "{plan_type}), so it would be ignored", "add {type} optimal or drop {flag}")
OPTIMAL = Needs(lambda f, v: f.plan("has_deadline"),
                "needs {type} optimal (this run has {type} {plan_type}), so it would be ignored",
                "add {type} optimal or drop {flag}")


def _simulated(why: str) -> Needs:
    return Needs(lambda f, v: f.modelled_gpu, why, "add {gpu} simulated:<profile> or drop {flag}")


_SIM_GPU = _simulated("shapes the simulated GPU only")
_WALL_TIME = Needs(lambda f, v: f.sim_time == "wall",
                  "scales wall time, and the simulated GPU runs in virtual time ({sim_time} virtual, the default: "
                  "host speed takes no GPU time), so it would do nothing", "add {sim_time} wall or drop {flag}")
_CLOCKS = Needs(lambda f, v: f.locks_clocks and f.sets_clocks,
               "leads clock changes, and this run changes none ({gpu} {gpu_value}, {type} {plan_type}, "
               "{reconfig} {reconfig_value}), so it would do nothing",
               "give a GPU and a plan that changes clocks ({type} uniform, envelope or optimal) or drop {flag}",
               only_for=lambda v: v == "off")
_DEVICE = Needs(lambda f, v: f.locks_clocks, "decides what happens without permission to lock clocks, and "
               "{gpu} none locks none, so it would do nothing", "give a GPU or drop {flag}")
_FOLLOWS = Needs(lambda f, v: f.plan("follows_stragglers") and f.locks_clocks,
                "tunes following a data-parallel straggler, which only {type} optimal on a GPU does (this run has "
                "{type} {plan_type}, {gpu} {gpu_value}), so it would be ignored", "add {type} optimal or drop {flag}")
_FOLLOWING = Needs(lambda f, v: f.follow_stragglers,
                  "decides when to follow a straggler, and --no-envpipe-follow-stragglers never follows, so it "
                  "would be ignored", "drop one of them")
_REPLICAS = Needs(lambda f, v: _unknown_or(f.data_parallel_size, lambda dp: dp >= 2),
                 "acts between data-parallel pipelines, and this run has {data_parallel_size} (no replica to "
                 "fall behind), so it would do nothing",
                 "run with data parallelism (world size = DP x PP x TP, DP >= 2) or drop {flag}")
_PER_ITERATION = Needs(lambda f, v: f.plan("per_iteration_plans"),
                      "plans clocks with {type} optimal's planner (this run has {type} {plan_type})",
                      "add {type} optimal or drop the flag", show_value=False, only_for=lambda v: v is True)
_VARIABLE = Needs(lambda f, v: _unknown_or(f.variable_seq_lengths, bool),
                 "plans per iteration for micro-batches of varying lengths, and this run's are all alike",
                 "add --variable-seq-lengths or drop the flag", show_value=False, only_for=lambda v: v is True)
_SIM_MEMORY = Needs(lambda f, v: f.order("extra_warmup") and f.max_inflight == AUTO,
                   "only applies to {max_inflight} auto with {scheduling} ours (this run has {max_inflight} "
                   "{max_inflight_value}, {scheduling} {scheduling_value})", "drop {flag} or use those",
                   show_value=False)
_BEFORE_END = Needs(lambda f, v: _unknown_or(f.train_iters, lambda iters: v < iters),
                   "measures the baseline before the plan starts, and --train-iters {train_iters} ends first, so "
                   "the plan would never run", "give fewer than {train_iters} (0: the planner's predicted baseline) "
                   "or train longer")
_STARTS_IN_TIME = Needs(lambda f, v: _unknown_or(f.train_iters, lambda iters: v.start_iteration < iters),
                       "starts at iteration {value.start_iteration}, and --train-iters {train_iters} ends before it, "
                       "so it would do nothing", "give a start below {train_iters} or drop it")

_PIPELINE = ("acts on Megatron's pipeline schedule, and --pipeline-model-parallel-size is {pipeline_size}, so "
             "Megatron runs none and it would do nothing")
_PIPELINE_FIX = "set --pipeline-model-parallel-size >= 2 or drop {flag}"

# Every field of EnvPipeConfig, in its order, with its argparse spec (config/flags.py generates the flags);
# tests/megatron/test_flag_table.py keeps them in step.
FIELDS: tuple[SettingField, ...] = (
    SettingField("plan_type", "--envpipe-type", "plan", always="selects the clock plan", cli_flag="--type",
                 choices=plan_type_names,  # the registered ones when the parser is built
                 help="initial clock plan: all at f_max (baseline), each stage at its energy-valley clock "
                      "(uniform), outer envelope at f_max and the rest at the valley (envelope), or the "
                      "minimum-energy plan meeting the baseline's iteration time (optimal; needs highspy or scipy)"),
    SettingField("scheduling", "--envpipe-scheduling", "schedule", always="selects the unit order", cli_flag="--scheduling",
                 choices=scheduling_names,
                 help="unit order: Megatron's 1F1B, or EnvPipe's extended warm-up (ours)"),
    SettingField("reconfig", "--envpipe-reconfig", "plan", always="selects the online correction", cli_flag="--reconfig",
                 choices=RECONFIG_NAMES,
                 help="online reconfiguration from measured critical paths"),
    SettingField("gpu", "--envpipe-gpu", "device", always="opens the device (energy is measured in every run)",
                 help="auto (default: NVML on CUDA devices, else none), none, nvml, "
                      "simulated:<profile> (a GPU model on CPU driven by a profile), or a GPU table "
                      "entry of configs/gpus.toml (NVML with that table's steps and P2P power)"),
    SettingField("profile", "--envpipe-profile", "profiler", always="plans from it, or predicts the baseline the energy lines compare with",
                 help="Perseus-format time/energy profile CSV; default: measure at start-up"),
    SettingField("max_inflight", "--envpipe-max-inflight", "schedule", (_BUDGETED,), cli_flag="--max-inflight",
                 parse=max_inflight_arg,
                 help="activation-memory budget for 'ours', in micro-batch activations: auto (default: from the "
                      "activation memory and free memory measured in the first 1F1B iterations on CUDA, or "
                      "--envpipe-sim-memory; no limit where neither exists), none, N for every stage, or one per "
                      "stage, e.g. 4,3,2,2"),
    SettingField("sim_memory", "--envpipe-sim-memory", "schedule", (_SIM_MEMORY,),
                 parse=memory_model_arg,
                 metavar="GIB_FREE,MIB_PER_MICROBATCH",
                 help="memory model for --envpipe-max-inflight auto in place of measuring the device (CPU, "
                      "simulated GPU): GiB free per stage at 1F1B's peak, MiB of activations per micro-batch",
                 unset_default=True),
    SettingField("extra_warmup", "--envpipe-extra-warmup", "schedule", (OURS,), cli_flag="--extra-warmup",
                 parse=int_list,
                 help="override EnvPipe's extra warm-up forwards per stage, e.g. 4,3,1,0 (clamped)",
                 unset_default=True),
    SettingField("p2p_power_w", "--envpipe-p2p-power", "plan", always="prices P2P waits in every plan and energy attribution", cli_flag="--p2p-power",
                 parse=float,
                 help="power of a GPU blocked in P2P, W (default: GPU table)"),
    SettingField("reconfig_step_mhz", "--envpipe-reconfig-step", "plan", (_RECONFIGURING, _OFFLINE_STEP), cli_flag="--reconfig-step",
                 parse=int,
                 help="MHz per reconfiguration step (default: GPU table)"),
    SettingField("finish_limit", "--envpipe-finish-limit", "plan", (_RECONFIGURING,),
                 parse=int,
                 help="stop reconfiguring after this many iterations without progress"),
    SettingField("threshold_scale", "--envpipe-threshold-scale", "plan", (_RECONFIGURING,),
                 parse=float,
                 help="critical-path receive-wait threshold (x min last-stage wait)"),
    SettingField("prefetch", "--envpipe-prefetch", "transport", always="the executor posts receives in every run",
                 cli_flag="--prefetch",
                 parse=int,
                 help="receives posted ahead of use per channel"),
    SettingField("comm_timeout_s", "--envpipe-comm-timeout", "transport", always="bounds every P2P transfer",
                 parse=float,
                 help="seconds before a stuck P2P transfer raises an error naming stage, instruction, peer"),
    SettingField("measure_iterations", "--envpipe-measure-iterations", "profiler", (_PROFILER,),
                 parse=int,
                 help="iterations timed before planning when no profile is given"),
    SettingField("on_no_permission", "--envpipe-on-no-permission", "device", (_DEVICE,),
                 choices=("fail", "monitor"),
                 help="without permission to lock clocks: fail at start-up (default) or only measure energy"),
    SettingField("profile_step_mhz", "--envpipe-profile-step", "profiler", (_PROFILER,),
                 parse=int,
                 help="start-up profiler: MHz between profiled clocks (default: GPU table, 90)",
                 unset_default=True),
    SettingField("profile_iterations", "--envpipe-profile-iterations", "profiler", (_PROFILER,),
                 parse=int,
                 help="start-up profiler: iterations per clock until two agree "
                      "(then one per clock, plus clocks near the valley); 1: one per clock, nothing more"),
    SettingField("profile_cache", "--envpipe-profile-cache", "profiler", (_PROFILE_CACHE,),
                 help="profile cache directory, or 'off' (default ~/.cache/megatron-envpipe/profiles)",
                 unset_default=True),
    SettingField("sim_time", "--envpipe-sim-time", "simulated", (_SIM_GPU,),
                 choices=("virtual", "wall"),
                 help="simulated GPU: virtual (default: each GPU's own clock, kept consistent by timestamps over "
                      "the pipeline; host speed takes no GPU time) or wall (scaled wall time)"),
    SettingField("sim_time_scale", "--envpipe-sim-time-scale", "simulated", (_SIM_GPU, _WALL_TIME),
                 parse=float,
                 help="simulated GPU with --envpipe-sim-time wall: wall seconds per simulated second (default 0.02)"),
    SettingField("sim_jitter", "--envpipe-sim-jitter", "simulated", (_simulated("adds noise to the simulated GPU only"),),
                 parse=fraction,
                 help="simulated GPU: unit-time noise as a fraction of the unit's time, e.g. 0.03 or 3%% "
                      "(normal, clipped at 3 sigma, seeded per stage; default 0)"),
    SettingField("sim_unit_scale", "--envpipe-sim-unit-scale", "simulated", (_simulated("scales the simulated GPU's units only"),),
                 parse=float,
                 help="simulated GPU: every unit's time and energy times this, its power unchanged: a faster GPU "
                      "than the profile's, e.g. 0.25 for H100-class units from the A40 profiles (default 1)"),
    SettingField("sim_dynamics", "--envpipe-sim-dynamics", "simulated", (_SIM_GPU,),
                 help="simulated GPU: exact (default: clocks change at once, exact energy counter, no heat), "
                      "realistic (configs/realistic-gpu.toml: published A100/H100-class figures) or a TOML file "
                      "with a [dynamics] table; see docs/simulated-gpu.md"),
    SettingField("sim_clock_latency_ms", "--envpipe-sim-clock-latency-ms", "simulated", (_SIM_GPU,),
                 parse=float,
                 help="simulated GPU: ms from a clock-lock request until the SMs run at the new clock",
                 unset_default=True),
    SettingField("sim_counter_period_ms", "--envpipe-sim-counter-period-ms", "simulated", (_SIM_GPU,),
                 parse=float,
                 help="simulated GPU: energy-counter update period, ms (0: exact at every read)",
                 unset_default=True),
    SettingField("sim_thermal_drift", "--envpipe-sim-thermal-drift", "simulated", (_SIM_GPU,),
                 parse=fraction,
                 help="simulated GPU: a cold GPU draws this fraction less power than a hot one, e.g. 0.03",
                 unset_default=True),
    SettingField("clock_lead", "--envpipe-clock-lead", "device", (_CLOCKS,),
                 choices=("on", "off"),
                 help="request a clock raise ahead of the unit boundary by the clock-change latency, so the "
                      "next unit starts at its clock (default on; off: every change at the boundary)"),
    SettingField("timing_margin", "--envpipe-timing-margin", "plan", (_NOT_BASELINE,), cli_flag="--timing-margin",
                 parse=fraction,
                 help="slack kept behind every unit planned below the maximum clock, as a fraction of its time, "
                      "so unit-time jitter does not slow the iteration",
                 default_help=" (default 0.01 = 1%%; 0: none)",
                 unset_default=True),
    SettingField("reconfig_window", "--envpipe-reconfig-window", "plan", (_RECONFIGURING,),
                 parse=int,
                 help="online reconfiguration: iterations whose median decides each raise or lowering "
                      "(default 3; 1: EnvPipe's one-iteration rule)"),
    SettingField("log_interval", "--envpipe-log-interval", "reporting", always="the energy line of every run",
                 parse=int,
                 help="print the EnvPipe energy line (means over the window) every N iterations "
                      "(default: Megatron's --log-interval)"),
    SettingField("baseline_iterations", "--envpipe-baseline-iterations", "reporting", (_BEFORE_END,),
                 parse=int,
                 help="1F1B iterations at the maximum clock measured before the plan, as the baseline the energy "
                      "lines compare with (those the profiler or memory measurement ran count; default 2; "
                      "0: compare with the planner's predicted baseline)"),
    SettingField("energy_csv", "--envpipe-energy-csv", "reporting", always="rows of the energy line of every run",
                 metavar="PATH",
                 help="append one row per GPU per energy line to this CSV (J/iter, W, per stage and rank)"),
    SettingField("verbose", "--envpipe-verbose", "reporting", always="prints the programs every run interprets",
                 action="store_true",
                 help="print each stage's instruction program"),
    SettingField("max_slowdown", "--envpipe-max-slowdown", "plan", (_DEADLINE,), cli_flag="--max-slowdown",
                 parse=fraction,
                 help="--envpipe-type optimal: allowed iteration-time increase over 1F1B at f_max, "
                      "e.g. 0.05 or 5%%"),
    SettingField("target_time_s", "--envpipe-target-time", "plan", (_DEADLINE,), cli_flag="--target-time",
                 parse=float,
                 help="--envpipe-type optimal: plan for iterations lasting this many seconds anyway (e.g. a "
                      "straggler sets the pace); the GPUs block at P2P power until then",
                 unset_default=True),
    SettingField("switch_cost_j", "--envpipe-switch-cost-j", "plan", (_NOT_BASELINE,), cli_flag="--switch-cost-j",
                 parse=float,
                 help="joules a clock change must save to be kept",
                 default_help=f" (default 0: off; envpipe plan's: {DEFAULT_SWITCH_LATENCY_S * 1000:g} ms x P2P power)",
                 unset_default=True),
    SettingField("max_clock_changes", "--envpipe-max-clock-changes", "plan", (_NOT_BASELINE,), cli_flag="--max-clock-changes",
                 parse=int,
                 help="at most this many clock changes per stage per iteration, where the deadline allows",
                 unset_default=True),
    SettingField("follow_stragglers", "--envpipe-follow-stragglers", "stragglers", always="on by default; --no-envpipe-follow-stragglers only turns following off",
                 action=argparse.BooleanOptionalAction,
                 help="with data parallelism, a pipeline faster than the slowest one runs the plan for the "
                      "slowest one's pace instead of waiting for it at the gradient sync (default on)"),
    SettingField("straggler_threshold", "--envpipe-straggler-threshold", "stragglers", (_FOLLOWS, _FOLLOWING, _REPLICAS),
                 parse=fraction,
                 help="follow when the slowest pipeline is more than this fraction slower (default 0.02 = 2%%; "
                      "back to the own plan within half of it)"),
    SettingField("straggler_window", "--envpipe-straggler-window", "stragglers", (_FOLLOWS, _REPLICAS),
                 parse=int,
                 help="data-parallel pipelines agree on the slowest pace once every N iterations, over the "
                      "mean of those N (default 3)"),
    SettingField("sim_straggler", "--envpipe-sim-straggler", "stragglers", (_simulated("slows the simulated GPU only"), _REPLICAS, _STARTS_IN_TIME),
                 parse=sim_straggler_arg,
                 action=_Once,
                 metavar="REPLICA:FACTOR[@ITER]",
                 help="simulated GPU: the GPUs of data-parallel replica REPLICA run every unit FACTOR times longer "
                      "(1..4, power unchanged) from iteration ITER on (default 0), e.g. 1:1.15",
                 unset_default=True),
    SettingField("per_iteration_plans", "--envpipe-per-iteration-plans", "plan", (_PER_ITERATION, _VARIABLE),
                 action=argparse.BooleanOptionalAction,
                 help="with variable sequence lengths: plan every iteration's clocks for its micro-batches' "
                      "sizes in the background, read one iteration ahead (default: on with --envpipe-type optimal)"),
    SettingField("deadline_from", "--envpipe-deadline-from", "plan", (OPTIMAL,), cli_flag="--deadline-from",
                 choices=DEADLINE_FROM_NAMES,
                 help="--envpipe-type optimal: plan to 1F1B's iteration time at the maximum clock, predicted from "
                      "the profile: interleaved, faster at f_max, spends the difference on lower clocks "
                      "(docs/menu.md)"),
)

BY_NAME = {f.name: f for f in FIELDS}


def _shown(name: str, value: Any) -> str:
    if name == "max_inflight":
        return show_budget(value)
    if isinstance(value, tuple | list):
        return show_list(value)
    if isinstance(value, str):
        return value
    if isinstance(value, bool | int | float):
        return show(value)
    return str(value)  # a parsed flag value (SimStraggler, MemoryModel) prints as it was typed


def _words(text: str, facts: Facts, names: dict[str, str], flag: str, value: Any = None) -> str:
    """``text`` with the surface's flag names ({scheduling}: the flag) and the facts ({scheduling_value},
    {plan_type}, {train_iters}, ...) filled in."""
    words = {f.name: getattr(facts, f.name) for f in fields(facts)}
    words.update({f"{key}_value": words[key] for key in ("scheduling", "reconfig", "profile")})
    words.update(names, flag=flag, value=value, gpu_value=facts.gpu or "auto",
                 max_inflight_value=show_budget(facts.max_inflight))
    return text.format(**words)


def inert_problem(field: SettingField, value: Any, facts: Facts, names: dict[str, str] = _TRAINING_NAMES,
                  flag: str | None = None) -> str | None:
    """Why ``field`` at ``value`` cannot act with ``facts`` (one line: what would make it act), or None."""
    flag = flag or field.flag
    head = f"{flag} {_shown(field.name, value)}"
    if facts.pipeline_size is not None and facts.pipeline_size < 2:
        return f"{head} {_words(_PIPELINE, facts, names, flag)}: {_words(_PIPELINE_FIX, facts, names, flag)}"
    for need in field.needs:
        if need.only_for is not None and not need.only_for(value):
            continue
        if need.acts(facts, value) is False:
            start = head if need.show_value else flag
            why, fix = (_words(text, facts, names, flag, value) for text in (need.why, need.fix))
            return f"{start} {why}: {fix}"
    return None


def refuse_inert(values: dict[str, Any], given: Iterable[str], facts: Facts,
                 names: dict[str, str] = _TRAINING_NAMES, flags: dict[str, str] | None = None,
                 error: type[Exception] = EnvPipeConfigError) -> None:
    """Raise ``error`` naming the first given field (in the table's order) that cannot act.

    ``values``: field name -> value; ``given``: the fields the user set; ``flags``: the surface's
    flag per field (default: the training flags)."""
    given = set(given)
    for field in FIELDS:
        if field.name not in given or field.name not in values:
            continue
        flag = (flags or {}).get(field.name)
        problem = inert_problem(field, values[field.name], facts, names, flag)
        if problem:
            raise error(problem)
