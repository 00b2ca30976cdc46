"""EnvPipe's settings by group: one typed, frozen settings object per group of the field table
(config/flag_table.py's ``group``), so a layer receives only the settings it reads
(``config.group(ProfilerSettings)``) instead of the whole :class:`~megatron_envpipe.config.settings.EnvPipeConfig`.

Each group holds exactly the table's fields of its group, under the same names and types
(tests/megatron/test_setting_groups.py: every field in exactly one group). A group is made from a
validated config, so it checks nothing itself. Pure Python.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from megatron_envpipe.core.device_dynamics import DeviceDynamics, load_dynamics
from megatron_envpipe.core.gpu_specs import GpuSpec
from megatron_envpipe.core.kinds import scheduling_kind
from megatron_envpipe.core.memory import MaxInflight, MemoryModel
from megatron_envpipe.core.resources import configs_dir
from megatron_envpipe.core.vocabulary import PlanType, ReconfigPolicy, Scheduling
from megatron_envpipe.flag_types import EnvPipeConfigError, SimStraggler
from megatron_envpipe.planning.basis import PlannerConfig

__all__ = ["DeviceSettings", "PlanSettings", "ProfilerSettings", "ReportSettings", "ScheduleSettings",
           "SimDeviceSettings", "StragglerSettings", "TransportSettings", "planner_config"]


@dataclass(frozen=True)
class PlanSettings:
    """The clock plan and its online correction (planner, reconfiguration, deadline)."""

    TABLE_GROUP: ClassVar[str] = "plan"  # the field table's group
    plan_type: PlanType
    reconfig: ReconfigPolicy
    p2p_power_w: float | None
    reconfig_step_mhz: int | None
    finish_limit: int
    threshold_scale: float
    timing_margin: float
    reconfig_window: int
    max_slowdown: float
    target_time_s: float | None
    switch_cost_j: float | None
    max_clock_changes: int | None
    per_iteration_plans: bool | None
    deadline_from: str | None


@dataclass(frozen=True)
class ScheduleSettings:
    """The unit order and the activation budget it keeps."""

    TABLE_GROUP: ClassVar[str] = "schedule"  # the field table's group
    scheduling: Scheduling
    max_inflight: MaxInflight
    sim_memory: MemoryModel | None
    extra_warmup: tuple[int, ...] | None


@dataclass(frozen=True)
class DeviceSettings:
    """Which device backend, and what it does about clocks."""

    TABLE_GROUP: ClassVar[str] = "device"  # the field table's group
    gpu: str | None
    on_no_permission: str
    clock_lead: str


@dataclass(frozen=True)
class ProfilerSettings:
    """Where the profile comes from: a file, the cache, or the start-up sweep."""

    TABLE_GROUP: ClassVar[str] = "profiler"  # the field table's group
    profile: str | None
    measure_iterations: int
    profile_step_mhz: int | None
    profile_iterations: int
    profile_cache: str | None


@dataclass(frozen=True)
class SimDeviceSettings:
    """The simulated GPU's time base, noise, unit scale and dynamics."""

    TABLE_GROUP: ClassVar[str] = "simulated"  # the field table's group
    sim_time: str
    sim_time_scale: float
    sim_jitter: float
    sim_unit_scale: float
    sim_dynamics: str
    sim_clock_latency_ms: float | None
    sim_counter_period_ms: float | None
    sim_thermal_drift: float | None

    def device_dynamics(self) -> DeviceDynamics:
        """``--envpipe-sim-dynamics`` (a preset or a TOML file, read here) with the single-figure flags over it."""
        return load_dynamics(self.sim_dynamics, configs_dir()).with_overrides(
            clock_latency_s=_ms_to_s(self.sim_clock_latency_ms), counter_period_s=_ms_to_s(self.sim_counter_period_ms),
            thermal_drift=self.sim_thermal_drift)


@dataclass(frozen=True)
class StragglerSettings:
    """Following a data-parallel straggler, and the simulated one."""

    TABLE_GROUP: ClassVar[str] = "stragglers"  # the field table's group
    follow_stragglers: bool
    straggler_threshold: float
    straggler_window: int
    sim_straggler: SimStraggler | None

    def check_replicas(self, data_parallel_size: int) -> None:
        """``--envpipe-sim-straggler``'s replica against the data-parallel size (at start-up, where it is known)."""
        sim = self.sim_straggler
        if sim is not None and data_parallel_size >= 2 and not sim.replica < data_parallel_size:
            raise EnvPipeConfigError(
                f"--envpipe-sim-straggler {sim}: replica {sim.replica} does not exist: the data-parallel size is "
                f"{data_parallel_size} (replicas 0..{data_parallel_size - 1}); give a replica in that range")


@dataclass(frozen=True)
class ReportSettings:
    """The energy lines and what else they are written to."""

    TABLE_GROUP: ClassVar[str] = "reporting"  # the field table's group
    log_interval: int | None
    baseline_iterations: int
    energy_csv: str | None
    verbose: bool

    @property
    def energy_log_interval(self) -> int:
        """Iterations per energy line: the flag's, Megatron's (resolved at argument parsing), else 1."""
        return self.log_interval or 1


@dataclass(frozen=True)
class TransportSettings:
    """The executor's P2P channels."""

    TABLE_GROUP: ClassVar[str] = "transport"  # the field table's group
    prefetch: int
    comm_timeout_s: float


def planner_config(plan: PlanSettings, schedule: ScheduleSettings, gpu: GpuSpec | None = None,
                   **overrides: Any) -> PlannerConfig:
    """The planner's config from the plan and schedule groups on ``gpu`` (what the run-time plans with;
    :meth:`EnvPipeConfig.planner_config <megatron_envpipe.config.settings.EnvPipeConfig.planner_config>`).

    Plan type, scheduling, reconfiguration policy, P2P power, reconfiguration
    step, activation budget, extra warm-up, maximum slowdown and target time
    carry over; everything else keeps the planner's default. ``overrides``
    replace single fields, e.g. ``p2p_power_w`` measured by the profiler when
    no ``--envpipe-p2p-power`` was given.
    """
    values: dict[str, Any] = {
        "plan_type": plan.plan_type,
        "scheduling": schedule.scheduling,
        "reconfig": plan.reconfig,
        "gpu": gpu,
        "p2p_power_w": plan.p2p_power_w,
        "reconfig_step_mhz": plan.reconfig_step_mhz,
        # Only ours plans within a budget (an interleaved run's is a start-up check).
        "max_inflight": schedule.max_inflight if scheduling_kind(schedule.scheduling).extra_warmup else None,
        "extra_warmup": schedule.extra_warmup,
        "max_slowdown": plan.max_slowdown,
        "target_time_s": plan.target_time_s,
        "switch_cost_j": plan.switch_cost_j,
        "max_clock_changes": plan.max_clock_changes,
        "timing_margin": plan.timing_margin,
    }
    values.update(overrides)
    return PlannerConfig(**values)


def _ms_to_s(value: float | None) -> float | None:
    return None if value is None else value / 1000.0
