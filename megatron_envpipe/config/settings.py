"""EnvPipe's run-time settings: :class:`EnvPipeConfig`, checked alone and against Megatron's flags.

``EnvPipeConfig.from_args(args)`` turns the ``--envpipe-*`` flags
(:mod:`~megatron_envpipe.config.flags`) into a validated config (every number
finite and in range, names known, combinations possible);
``validate_with_megatron_args(args)`` adds what needs Megatron's flags (pipeline
size, micro-batches: the profile's stage count, the extra warm-up's length, the
activation budget; the log interval it follows), so that every entry point fails
at argument parsing with one :class:`EnvPipeConfigError` line instead of at the
first iteration; ``EnvPipeConfig.planner_config(gpu)`` is the planner's view of
it. Each value alone is checked in :mod:`.value_checks`, the profiles and GPU-table
entries the flags name are read in :mod:`.profiles`. Pure Python.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, TypeVar

from megatron_envpipe.config.deadline_flags import check_deadline_from, check_interleaved_budget
from megatron_envpipe.config.flag_table import Facts, refuse_inert
from megatron_envpipe.config.groups import (
    PlanSettings,
    ReportSettings,
    ScheduleSettings,
    SimDeviceSettings,
    StragglerSettings,
    planner_config,
)
from megatron_envpipe.config.launch_checks import check_launch, check_output_files
from megatron_envpipe.config.profiles import fit_profile, load_profile, table_gpu
from megatron_envpipe.config.value_checks import check_max_inflight, check_numbers, check_stragglers
from megatron_envpipe.core.device_backends import model_profile, named_backend
from megatron_envpipe.core.device_dynamics import DeviceDynamics, DeviceDynamicsError
from megatron_envpipe.core.flag_ranges import RANGES
from megatron_envpipe.core.gpu_specs import GpuSpec, GpuSpecError, get_gpu_spec
from megatron_envpipe.core.interleaved import check_interleaved_sizes
from megatron_envpipe.core.kinds import plan_type_names, scheduling_kind, scheduling_names
from megatron_envpipe.core.memory import (
    AUTO,
    MaxInflight,
    MemoryModel,
    budget_problem,
)
from megatron_envpipe.core.profile import Profile
from megatron_envpipe.core.resources import shipped_profiles
from megatron_envpipe.core.schedule import ScheduleError
from megatron_envpipe.core.sizes import check_plan_size
from megatron_envpipe.core.vocabulary import (
    RECONFIG_POLICIES,
    PlanType,
    ReconfigPolicy,
    Scheduling,
    coerce_enum,
)
from megatron_envpipe.flag_types import (
    VIRTUAL_PIPELINE_ARGS,
    EnvPipeConfigError,
    SimStraggler,
    data_parallel_size_of,
    is_whole,
    num_microbatches_of,
    show,
    show_list,
    virtual_stages_of,
)
from megatron_envpipe.planning.basis import PlannerConfig

__all__ = ["EnvPipeConfig"]

_Group = TypeVar("_Group")


@dataclass(frozen=True)
class EnvPipeConfig:
    plan_type: PlanType = PlanType.BASELINE
    scheduling: Scheduling = Scheduling.ONE_F_ONE_B
    reconfig: ReconfigPolicy = ReconfigPolicy.DEFAULT
    # "auto" (NVML when this rank drives a CUDA device, else none), "none", "nvml",
    # "simulated:<profile>" (a GPU model on CPU), or a GPU table key (NVML + that table).
    gpu: str | None = None
    profile: str | None = None  # Perseus CSV; None: measure at start-up
    # Activation budget per stage for "ours" (core.memory): "auto" (derived from measured memory),
    # None (no limit), one number for every stage, or one per stage.
    max_inflight: MaxInflight = AUTO
    sim_memory: MemoryModel | None = None  # stands in for the device's memory in "auto" (CPU, simulated GPU)
    extra_warmup: tuple[int, ...] | None = None
    p2p_power_w: float | None = None
    reconfig_step_mhz: int | None = None
    finish_limit: int = 10
    threshold_scale: float = 4.0
    prefetch: int = 2  # receives posted ahead per channel
    comm_timeout_s: float = 300.0  # a stuck P2P raises instead of hanging
    measure_iterations: int = 1  # iterations measured before the plan is fixed (no profile, no clock control)
    on_no_permission: str = "fail"  # or "monitor": measure energy, never touch clocks
    profile_step_mhz: int | None = None  # start-up profiler clock spacing (default: GPU table)
    profile_iterations: int = 2  # profiled iterations per clock until two agree (gpu/profiler/sweep.py); 1: always one
    profile_cache: str | None = None  # cache dir ("off" disables); default ~/.cache/megatron-envpipe
    sim_time: str = "virtual"  # simulated GPU: its own virtual clock (megatron/device_time.py) or scaled wall time
    sim_time_scale: float = 0.02  # simulated GPU, wall time: wall seconds per simulated second
    sim_jitter: float = 0.0  # simulated GPU: unit-time noise, a fraction of the unit's time (seeded per stage)
    sim_unit_scale: float = 1.0  # simulated GPU: every unit's time and energy x this (a faster GPU: < 1)
    # Simulated GPU's departures from an ideal one (core.device_dynamics): a preset or TOML file, and
    # single figures over it (None: the preset's).
    sim_dynamics: str = "exact"
    sim_clock_latency_ms: float | None = None
    sim_counter_period_ms: float | None = None
    sim_thermal_drift: float | None = None
    clock_lead: str = "on"  # request raises ahead of the unit boundary by the clock latency (gpu/hooks.py)
    # Slack kept behind every unit planned below f_max (fraction of its time). 1 % held measured = planned
    # within 0.2 points at 3-5 % unit jitter on GPT-3/Bloom at P = 4 and 8 (bench/robust_plans.py).
    timing_margin: float = 0.01
    reconfig_window: int = 3  # online correction: median of this many iterations decides a step
    log_interval: int | None = None  # energy lines every N iterations; None: Megatron's --log-interval
    # Measured 1F1B iterations at the maximum clock before the plan (pre-plan ones at f_max count): the
    # baseline each energy line compares with; 0: the planner's predicted baseline.
    baseline_iterations: int = 2
    energy_csv: str | None = None  # one row per GPU per logged window (megatron/energy_csv.py)
    verbose: bool = False
    max_slowdown: float = 0.0  # --envpipe-type optimal: allowed iteration-time increase (fraction)
    target_time_s: float | None = None  # --envpipe-type optimal: plan for iterations lasting this long
    switch_cost_j: float | None = 0.0  # planning/switching.py (0: off; None: the default for optimal plans)
    max_clock_changes: int | None = None  # per rank per iteration; None: no budget
    # Data-parallel stragglers (megatron/stragglers.py): follow the slowest pipeline's pace when it is
    # more than straggler_threshold slower; the simulated GPU can make one replica slower.
    follow_stragglers: bool = True
    straggler_threshold: float = 0.02
    straggler_window: int = 3  # iterations per pace agreement (its own flag: works with --envpipe-reconfig default)
    sim_straggler: SimStraggler | None = None
    # Variable-length micro-batches (megatron/iteration_plans.py): plan each iteration's clocks from its
    # micro-batches' sizes in the background; None: on with --envpipe-type optimal.
    per_iteration_plans: bool | None = None
    # --envpipe-type optimal: plan to this schedule's iteration time at f_max ("1f1b"; planning/deadline.py),
    # predicted from the profile; None: the run's own baseline (max_slowdown / target_time_s).
    deadline_from: str | None = None

    def __post_init__(self) -> None:
        # Flag strings become the vocabulary's members (equal to them); unknown names stay for validate().
        for name, enum in (("plan_type", PlanType), ("scheduling", Scheduling), ("reconfig", ReconfigPolicy)):
            object.__setattr__(self, name, coerce_enum(enum, getattr(self, name)))

    def validate(self, given: frozenset[str] | None = None) -> "EnvPipeConfig":
        """Every check that needs no Megatron flag: names, numbers (finite, in range), combinations.

        ``given``: the fields the user set (``from_args`` knows); None: those that differ from the default.
        """

        def bad(msg: str) -> None:
            raise EnvPipeConfigError(msg)

        if str(self.plan_type) not in plan_type_names():  # the registered ones (core/kinds.py)
            bad(f"--envpipe-type {self.plan_type!r}: choose one of {', '.join(plan_type_names())}")
        if str(self.scheduling) not in scheduling_names():
            bad(f"--envpipe-scheduling {self.scheduling!r}: choose one of {', '.join(scheduling_names())}")
        if self.reconfig not in RECONFIG_POLICIES:
            bad(f"--envpipe-reconfig {self.reconfig!r}: choose one of {', '.join(RECONFIG_POLICIES)}")
        check_numbers(self)  # config/value_checks.py: each value alone
        check_max_inflight(self)
        check_stragglers(self)  # the values themselves, before whether they act
        # A flag that cannot act here is refused (config/flag_table.py: when each one acts).
        refuse_inert(self._values(), self._given() if given is None else given, self.facts())
        if self.extra_warmup is not None:
            shown = show_list(self.extra_warmup)
            if not self.extra_warmup:
                bad("--envpipe-extra-warmup is empty: give one whole number per pipeline stage, e.g. 3,2,1,0")
            for s, r in enumerate(self.extra_warmup):
                if not is_whole(r) or r < 0:
                    bad(f"--envpipe-extra-warmup {shown}: stage {s}'s entry {show(r)} must be a whole number "
                        ">= 0 (extra warm-up forwards of that stage), e.g. 3,2,1,0")
        self._validate_dynamics()
        for flag, value, choices in (("--envpipe-clock-lead", self.clock_lead, ("on", "off")),
                                     ("--envpipe-sim-time", self.sim_time, ("virtual", "wall"))):
            if value not in choices:
                bad(f"{flag} {value!r}: choose {' or '.join(choices)}")
        if self.gpu is not None:
            source = model_profile(self.gpu)  # None: the backend takes no profile
            if source is not None:
                if not source:
                    bad("--envpipe-gpu simulated needs a profile: simulated:<profile.csv or a40/gpt3-175b>")
                if source not in shipped_profiles() and not Path(source).is_file():
                    bad(f"--envpipe-gpu {self.gpu}: no such profile (give a Perseus-format CSV or a shipped name)")
            elif named_backend(self.gpu) is None:  # not a backend: a GPU-table key
                try:
                    get_gpu_spec(self.gpu)
                except GpuSpecError as exc:
                    bad(f"--envpipe-gpu: {exc}; or use auto, none, nvml, simulated:<profile>")
        if self.profile is not None and not Path(self.profile).is_file():
            if self.profile not in shipped_profiles():
                bad(f"--envpipe-profile {self.profile!r}: no such file (give a Perseus-format CSV, "
                    f"a shipped profile ({', '.join(shipped_profiles())}), or drop the flag to measure at start-up)")
        if self.profile_cache is not None and self.profile_cache != "off":
            if not self.profile_cache or Path(self.profile_cache).exists() and not Path(self.profile_cache).is_dir():
                bad(f"--envpipe-profile-cache {self.profile_cache!r} is not a directory: give a directory "
                    "(created on first use) or 'off'")
        check_output_files(self)  # --envpipe-energy-csv: at start-up, not at the first energy line
        if self.on_no_permission not in ("fail", "monitor"):
            bad(f"--envpipe-on-no-permission {self.on_no_permission!r}: choose fail or monitor")
        if self.max_slowdown and self.target_time_s is not None:
            bad(f"--envpipe-max-slowdown {show(self.max_slowdown)} and --envpipe-target-time "
                f"{show(self.target_time_s)} both set the optimal plan's deadline: give only one")
        if self.per_iteration_plans and self.target_time_s is not None:
            bad(f"--envpipe-per-iteration-plans plans each iteration for the stock run's time at its sizes, "
                f"--envpipe-target-time {show(self.target_time_s)} for one fixed time: drop one of them "
                "(or add --no-envpipe-per-iteration-plans)")
        check_deadline_from(self)
        return self

    def _given(self) -> frozenset[str]:
        """The fields whose value differs from the default (what a Python caller evidently set)."""
        default = EnvPipeConfig()
        return frozenset(f.name for f in fields(self) if getattr(self, f.name) != getattr(default, f.name)
                         and not (f.name == "gpu" and self.gpu == "auto"))  # None means auto: the default typed

    def _values(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def given_fields(self) -> frozenset[str]:
        """The fields the user set: those ``from_args`` saw typed (a flag typed at its default counts where
        its default is "not given"), else those that differ from the default."""
        return self.__dict__.get("typed_fields") or self._given()

    def facts(self, args: Any = None, pipeline_size: int | None = None) -> Facts:
        """What decides whether each flag can act (config/flag_table.py): these settings and, with Megatron's
        ``args``, the launch's shape (pipeline and data-parallel sizes, iterations, variable lengths)."""
        dp = data_parallel_size_of(args, pipeline_size) if args is not None and is_whole(pipeline_size) else None
        iters = getattr(args, "train_iters", None)
        return Facts(plan_type=self.plan_type, scheduling=self.scheduling, reconfig=self.reconfig, gpu=self.gpu,
                     sim_time=self.sim_time, profile=self.profile, max_inflight=self.max_inflight,
                     deadline_from=self.deadline_from, follow_stragglers=self.follow_stragglers,
                     pipeline_size=pipeline_size if is_whole(pipeline_size) else None, data_parallel_size=dp,
                     train_iters=iters if is_whole(iters) else None,
                     variable_seq_lengths=getattr(args, "variable_seq_lengths", None))

    def group(self, kind: type[_Group]) -> _Group:
        """These settings of one group (config/groups.py: ``ProfilerSettings``, ...), what a layer that reads
        only them receives."""
        return kind(**{f.name: getattr(self, f.name) for f in fields(kind)})

    def check_replicas(self, data_parallel_size: int) -> None:
        """``--envpipe-sim-straggler``'s replica against the data-parallel size (at start-up, where it is known)."""
        self.group(StragglerSettings).check_replicas(data_parallel_size)

    def _validate_dynamics(self) -> None:
        """The simulated GPU's dynamics load and hold (simulated GPUs only; read again by :attr:`device_dynamics`)."""
        try:
            self.device_dynamics  # noqa: B018 (loads the file, checks the figures)
        except DeviceDynamicsError as exc:
            raise EnvPipeConfigError(f"--envpipe-sim-dynamics {self.sim_dynamics}: {exc}") from None

    @functools.cached_property
    def device_dynamics(self) -> DeviceDynamics:
        """``--envpipe-sim-dynamics`` with the single-figure flags over it (file read once, by validate())."""
        return self.group(SimDeviceSettings).device_dynamics()

    def validate_with_megatron_args(self, args: Any) -> "EnvPipeConfig":
        """Every check that needs Megatron's own flags, run once at argument parsing.

        A setting other than Megatron's own (baseline/1f1b/default) with a virtual
        pipeline or without pipelining (Megatron then never calls the schedule
        EnvPipe replaces, so it would silently do nothing); a profile on a GPU whose
        P2P blocking power is unknown, without ``--envpipe-p2p-power``; the
        profile (read once here: readable, parses, one stage per pipeline stage);
        ``--envpipe-extra-warmup`` (one entry per stage); and the activation budget
        ``--envpipe-max-inflight`` (at least what 1F1B itself holds on stage 0).
        ``args`` is Megatron's namespace (or any object with its attribute names);
        attributes it lacks are not checked.
        """
        given = self.given_fields()
        self.validate(given)
        resolved = self._follow_log_interval(args)
        stock = "--envpipe-type baseline --envpipe-scheduling 1f1b --envpipe-reconfig default"
        settings = " ".join(f"{flag} {value}" for flag, value, default in (
            ("--envpipe-type", self.plan_type, PlanType.BASELINE),
            ("--envpipe-scheduling", self.scheduling, Scheduling.ONE_F_ONE_B),
            ("--envpipe-reconfig", self.reconfig, ReconfigPolicy.DEFAULT)) if value != default)
        vpp_flags = [f"--{name.replace('_', '-')} {getattr(args, name)}" for name in VIRTUAL_PIPELINE_ARGS
                     if getattr(args, name, None) is not None]
        chunked = scheduling_kind(self.scheduling).model_chunks
        virtual = virtual_stages_of(args) if chunked else 1
        if chunked and virtual < 2:
            raise EnvPipeConfigError(
                "--envpipe-scheduling interleaved needs model chunks: add --virtual-pipeline-model-parallel-size V "
                "(V >= 2) or --num-layers-per-virtual-pipeline-stage, or use --envpipe-scheduling 1f1b / ours")
        if vpp_flags and not chunked and not self.is_stock:
            raise EnvPipeConfigError(
                f"--envpipe-scheduling {self.scheduling} has no interleaved (virtual-pipeline) order "
                f"({', '.join(vpp_flags)}), so {settings} would not run: add --envpipe-scheduling interleaved, "
                f"drop the virtual-pipeline flags, or run {stock}")
        if (self.deadline_from is not None and getattr(args, "variable_seq_lengths", None)
                and self.per_iteration_plans is not False):
            raise EnvPipeConfigError(
                f"--envpipe-deadline-from {self.deadline_from} plans one deadline for the run, and with "
                "--variable-seq-lengths --envpipe-type optimal plans every iteration for its own sizes: add "
                "--no-envpipe-per-iteration-plans or drop --envpipe-deadline-from")
        spec = table_gpu(self.gpu)
        if self.profile is not None and self.p2p_power_w is None and spec is not None and spec.p2p_power_w is None:
            raise EnvPipeConfigError(
                f"--envpipe-profile {self.profile} on --envpipe-gpu {self.gpu}: the P2P blocking power of "
                f"{spec.key.upper()} is unknown (configs/gpus.toml has no published measurement): give "
                "--envpipe-p2p-power W (measure it with Zeus's examples/pipeline_frequency_optimizer/profile_p2p.py), "
                "or drop --envpipe-profile and let the start-up profiler measure it"
            )
        if virtual > (most := RANGES["virtual_stages"].high):
            raise EnvPipeConfigError(f"--envpipe-scheduling interleaved: {virtual} model chunks per rank (Megatron's "
                                     f"virtual-pipeline flags) is more than the {most:g} EnvPipe plans; use fewer")
        # The simulated GPU's profile, read once here: every rank would otherwise die reading it.
        source = model_profile(self.gpu)
        simulated = load_profile(source, f"--envpipe-gpu {self.gpu}", "give another profile") if source else None
        pp = getattr(args, "pipeline_model_parallel_size", None)
        if is_whole(pp) and pp < 2 and not self.is_stock:
            raise EnvPipeConfigError(
                f"EnvPipe needs pipeline parallelism: --pipeline-model-parallel-size is {pp}, so Megatron runs no "
                f"pipeline schedule and {settings} would do nothing: set --pipeline-model-parallel-size >= 2, "
                f"or run {stock}"
            )
        # Each given flag against the launch's shape: sizes, iterations, variable lengths (config/flag_table.py).
        refuse_inert(self._values(), given, self.facts(args, pp))
        if not is_whole(pp):
            return resolved
        check_launch(self, args, pp, simulated, source)  # replicas from the world size, lengths, iterations
        if pp >= 2:
            profile = load_profile(self.profile) if self.profile is not None else None
            self.check_pipeline(pp, num_microbatches_of(args, pp), profile, virtual)
            check_plan_size(self.plan_type, pp, num_microbatches_of(args, pp), virtual, EnvPipeConfigError)
            check_interleaved_budget(self, pp, num_microbatches_of(args, pp), virtual, args)
            if not (vpp_flags and not chunked):  # else Megatron's own schedule runs
                for flag, given in (("--envpipe-profile", profile), (f"--envpipe-gpu {self.gpu}", simulated)):
                    if given is not None:
                        fit_profile(flag, given, pp, virtual)
        return resolved

    def _follow_log_interval(self, args: Any) -> "EnvPipeConfig":
        """This config with Megatron's ``--log-interval`` as the energy log's interval, unless
        ``--envpipe-log-interval`` was given (or ``args`` has none)."""
        megatron_interval = getattr(args, "log_interval", None)
        if self.log_interval is not None or not is_whole(megatron_interval) or megatron_interval < 1:
            return self
        return dataclasses.replace(self, log_interval=int(megatron_interval))

    @property
    def energy_log_interval(self) -> int:
        """Iterations per energy line: the flag's, Megatron's (resolved at argument parsing), else 1."""
        return self.group(ReportSettings).energy_log_interval

    def check_pipeline(self, num_stages: int, num_microbatches: int | None = None,
                       profile: Profile | None = None, virtual_stages: int = 1) -> None:
        """What the pipeline's size decides: the profile's stage count, the length of
        ``--envpipe-extra-warmup``, the activation budget. Shared by the start-up check and
        the run-time (its first call per pipeline, before any rank runs the iteration).
        ``num_microbatches`` None: unknown, so the budget must cover a full pipeline."""
        pipeline = f"the pipeline has {num_stages} stages (--pipeline-model-parallel-size {num_stages})"
        if profile is not None and profile.num_stages != num_stages:
            raise EnvPipeConfigError(
                f"--envpipe-profile {self.profile} has {profile.num_stages} stages but {pipeline}: the profile "
                "is per pipeline, one set of rows per stage, so it must have exactly P stages; profile this "
                "model and parallel layout (drop --envpipe-profile to measure at start-up)"
            )
        order = scheduling_kind(self.scheduling)
        if order.model_chunks and num_microbatches is not None:
            try:  # Megatron's own constraints on M for its interleaved schedule
                check_interleaved_sizes(num_stages, num_microbatches, virtual_stages)
            except ScheduleError as exc:
                raise EnvPipeConfigError(f"--envpipe-scheduling interleaved: {exc}") from None
        if not order.extra_warmup:
            return
        if self.extra_warmup is not None and len(self.extra_warmup) != num_stages:
            example = ",".join(str(max(0, num_stages - 1 - s)) for s in range(num_stages))
            raise EnvPipeConfigError(
                f"--envpipe-extra-warmup {show_list(self.extra_warmup)} has {len(self.extra_warmup)} "
                f"entries but {pipeline}: give exactly one per stage, first stage first, e.g. {example}"
            )
        if self.max_inflight == AUTO:
            return  # derived from memory, never below what 1F1B holds
        if isinstance(self.max_inflight, int):
            need = num_stages if num_microbatches is None else min(num_stages, num_microbatches)
            if self.max_inflight < need:
                raise EnvPipeConfigError(
                    f"--envpipe-max-inflight {self.max_inflight} is below the {need} micro-batch activations "
                    f"that 1F1B itself keeps in flight on stage 0, as {pipeline}: give at least {need} "
                    "(more allows extra warm-up), auto, or none for no limit"
                )
        problem = budget_problem(num_stages, num_microbatches, self.max_inflight)
        if problem:
            raise EnvPipeConfigError(f"--envpipe-max-inflight {problem} (--pipeline-model-parallel-size {num_stages})")

    @property
    def is_stock(self) -> bool:
        """baseline + 1f1b + default: exactly what Megatron does on its own."""
        return (
            self.plan_type == PlanType.BASELINE
            and self.scheduling == Scheduling.ONE_F_ONE_B
            and self.reconfig == ReconfigPolicy.DEFAULT
        )

    def planner_config(self, gpu: GpuSpec | None = None, **overrides: Any) -> PlannerConfig:
        """The planner's config for these flags on ``gpu`` (what the run-time plans with): made from the
        plan and schedule groups alone (:func:`~megatron_envpipe.config.groups.planner_config`);
        ``overrides`` replace single fields."""
        return planner_config(self.group(PlanSettings), self.group(ScheduleSettings), gpu, **overrides)

    @classmethod
    def from_args(cls, args: Any) -> "EnvPipeConfig":
        values = {}
        for f in fields(cls):
            key = f"envpipe_{f.name}"
            if hasattr(args, key):
                values[f.name] = getattr(args, key)
        # These flags' argparse default is None: "not given", so that only a value the user typed
        # (even the default's) is refused where it would be ignored; unset, the field keeps its default.
        typed = frozenset(name for name in _NONE_IS_UNSET if values.get(name) is not None)
        for name in _NONE_IS_UNSET:
            if values.get(name, 0) is None:
                del values[name]
        if values.get("extra_warmup") is not None:
            values["extra_warmup"] = tuple(values["extra_warmup"])
        if isinstance(values.get("max_inflight"), list):
            values["max_inflight"] = tuple(values["max_inflight"])
        config = cls(**values)
        given = config._given() | typed
        object.__setattr__(config, "typed_fields", given)  # read by given_fields(): not a setting
        return config.validate(given)


_NONE_IS_UNSET = ("switch_cost_j", "max_clock_changes", "timing_margin")

