"""EnvPipe's settings by group (config/groups.py): the groups partition EnvPipeConfig's fields as the field
table's ``group`` says, and the layers that read one group receive only that group."""

from __future__ import annotations

import dataclasses
import datetime
import functools
from types import SimpleNamespace

import pytest

pytest.importorskip("torch")

from megatron_envpipe.config import EnvPipeConfig, groups  # noqa: E402
from megatron_envpipe.config.flag_table import FIELDS  # noqa: E402
from megatron_envpipe.flag_types import EnvPipeConfigError, SimStraggler  # noqa: E402
from megatron_envpipe.core.gpu_specs import get_gpu_spec  # noqa: E402
from megatron_envpipe.gpu import stage_gpu  # noqa: E402
from megatron_envpipe.megatron import (  # noqa: E402
    channels,
    device_time,
    iteration_plans,
    memory,
    profile_store,
    reporting,
    stragglers,
)

GROUPS = [getattr(groups, name) for name in groups.__all__ if name.endswith("Settings")]


def test_the_groups_partition_the_fields_as_the_table_says():
    by_group: dict[str, list[str]] = {}
    for field in FIELDS:
        by_group.setdefault(field.group, []).append(field.name)
    assert {kind.TABLE_GROUP for kind in GROUPS} == set(by_group), "a table group without settings, or one more"
    seen: list[str] = []
    config_types = {f.name: f.type for f in dataclasses.fields(EnvPipeConfig)}
    for kind in GROUPS:
        names = [f.name for f in dataclasses.fields(kind)]
        assert names == by_group[kind.TABLE_GROUP], kind.__name__  # the table's fields, in its order
        for f in dataclasses.fields(kind):
            assert f.type == config_types[f.name], f"{kind.__name__}.{f.name}: {f.type} != {config_types[f.name]}"
        seen += names
    assert sorted(seen) == sorted(config_types), "every field in exactly one group"
    assert len(seen) == len(set(seen))


def test_a_group_is_the_configs_values_and_frozen():
    config = EnvPipeConfig(plan_type="optimal", gpu="simulated:a40/gpt3-175b", sim_jitter=0.03,
                           profile_iterations=3, straggler_window=5, prefetch=4, max_slowdown=0.05).validate()
    for kind in GROUPS:
        settings = config.group(kind)
        assert all(getattr(settings, f.name) == getattr(config, f.name) for f in dataclasses.fields(kind))
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(settings, dataclasses.fields(kind)[0].name, None)
    assert config.group(groups.ProfilerSettings).profile_iterations == 3
    assert config.group(groups.SimDeviceSettings).device_dynamics() == config.device_dynamics


# (module, function (dotted: a method), parameter, the group it receives)
CONSUMERS = [
    (profile_store, "cached_profile", "config", groups.ProfilerSettings),
    (profile_store, "store_profile", "config", groups.ProfilerSettings),
    (stragglers, "_apply_sim_straggler", "config", groups.StragglerSettings),
    (reporting, "log_interval", "config", groups.ReportSettings),
    (memory, "memory_source", "config", groups.ScheduleSettings),
    (iteration_plans, "_plans_wanted", "config", groups.PlanSettings),
    (groups, "planner_config", "plan", groups.PlanSettings),  # the planner's entry from the megatron edge
    (groups, "planner_config", "schedule", groups.ScheduleSettings),
    (stage_gpu, "open_stage_gpu", "device", groups.DeviceSettings),  # this rank's GPU, opened at set-up
    (stage_gpu, "open_stage_gpu", "sim", groups.SimDeviceSettings),
    (channels, "P2PTransfers.__init__", "transport", groups.TransportSettings),  # the executor's P2P messages
    (device_time, "DeviceTimeLink.create", "transport", groups.TransportSettings),  # virtual time's stamps
]


@pytest.mark.parametrize("module,name,param,kind", CONSUMERS, ids=[f"{c[1]}-{c[2]}" for c in CONSUMERS])
def test_a_consumer_is_declared_to_take_only_its_group(module, name, param, kind):
    function = functools.reduce(getattr, name.split("."), module)
    assert function.__annotations__[param] == kind.__name__
    whole = [p for p, a in function.__annotations__.items() if "EnvPipeConfig" in str(a)]
    assert not whole, f"{name} also takes the whole config ({whole}), not only its groups"


def _only(kind, **values):
    """The group with the defaults' values but ``values``: nothing else to read."""
    return EnvPipeConfig(**values).group(kind)


def test_the_consumers_run_on_their_group_alone(tmp_path):
    assert profile_store.cached_profile(_only(groups.ProfilerSettings, profile_cache="off"), {"k": 1}) is None
    assert profile_store.cached_profile(_only(groups.ProfilerSettings, profile_cache=str(tmp_path)), {"k": 1}) is None
    assert reporting.log_interval(_only(groups.ReportSettings, log_interval=7)) == 7
    assert iteration_plans._plans_wanted(_only(groups.PlanSettings, plan_type="optimal"))
    assert not iteration_plans._plans_wanted(_only(groups.PlanSettings, plan_type="envelope"))
    assert memory.memory_source(None, None, _only(groups.ScheduleSettings, max_inflight=None)) is None


class _Device:
    slowdown = 1.0

    def capabilities(self):
        return SimpleNamespace(modelled=True)


def test_the_simulated_straggler_reads_its_group_alone():
    device = _Device()
    hooks = SimpleNamespace(device=device)
    settings = _only(groups.StragglerSettings, sim_straggler=SimStraggler(0, 1.2, 3))
    stage = SimpleNamespace(replicas=None, stage=0)  # one replica: replica 0
    stragglers._apply_sim_straggler(settings, hooks, stage, 2)
    assert device.slowdown == 1.0  # before its start iteration
    stragglers._apply_sim_straggler(settings, hooks, stage, 3)
    assert device.slowdown == 1.2
    too_far = _only(groups.StragglerSettings, sim_straggler=SimStraggler(2, 1.2))
    with pytest.raises(EnvPipeConfigError, match="replica 2 does not exist: the data-parallel size is 2"):
        too_far.check_replicas(2)


def test_the_planner_entry_reads_the_plan_and_schedule_groups_alone():
    plan = _only(groups.PlanSettings, plan_type="optimal", max_slowdown=0.05, p2p_power_w=70.0, switch_cost_j=0.5)
    ours = _only(groups.ScheduleSettings, scheduling="ours", max_inflight=6, extra_warmup=(1, 0))
    got = groups.planner_config(plan, ours, get_gpu_spec("a40"), timing_margin=0.02)
    assert (got.plan_type, got.scheduling, got.max_slowdown, got.p2p_power_w, got.switch_cost_j) == (
        "optimal", "ours", 0.05, 70.0, 0.5)
    assert (got.max_inflight, got.extra_warmup, got.gpu.key, got.timing_margin) == (6, (1, 0), "a40", 0.02)
    # Only ours plans within the activation budget (an interleaved run's is a start-up check).
    interleaved = _only(groups.ScheduleSettings, scheduling="interleaved", max_inflight=6)
    assert groups.planner_config(plan, interleaved).max_inflight is None
    config = EnvPipeConfig(plan_type="optimal", max_slowdown=0.05, p2p_power_w=70.0).validate()
    assert config.planner_config(None, p2p_power_w=55.0) == groups.planner_config(
        config.group(groups.PlanSettings), config.group(groups.ScheduleSettings), None, p2p_power_w=55.0)


def _open(sets_clocks=False, **values):
    config = EnvPipeConfig(gpu="simulated:a40/gpt3-175b", **values)
    return stage_gpu.open_stage_gpu(config.group(groups.DeviceSettings), config.group(groups.SimDeviceSettings),
                                    sets_clocks=sets_clocks, p2p_power_w=None, local_rank=None, stage=1,
                                    num_stages=4, cuda=False)


def test_the_stage_gpu_opens_from_the_device_and_simulated_groups_alone():
    virtual = _open(sets_clocks=True, sim_dynamics="realistic")
    assert virtual.virtual_clock is not None and virtual.hooks_time_scale == 1.0
    assert virtual.capabilities == virtual.device.capabilities() and virtual.capabilities.time_base == "virtual"
    dynamics = EnvPipeConfig(sim_dynamics="realistic").device_dynamics
    assert virtual.device.dynamics == dynamics and virtual.capabilities.clock_latency_s == dynamics.clock_latency_s
    assert virtual.decision.control and virtual.decision.proof is not None  # the trial lock, on virtual time
    wall = _open(sim_time="wall", sim_time_scale=0.01, sim_unit_scale=0.5)
    assert wall.virtual_clock is None and wall.hooks_time_scale == 0.01 and wall.capabilities.time_base == "wall"
    assert wall.device.time_scale == 0.01 and "unit times x0.5" in wall.device.info().name
    assert not wall.decision.control and wall.decision.proof is None  # a plan that sets no clock tries nothing
    none = stage_gpu.open_stage_gpu(_only(groups.DeviceSettings, gpu="none"), _only(groups.SimDeviceSettings),
                                    sets_clocks=True, p2p_power_w=None, local_rank=None, stage=0, num_stages=2,
                                    cuda=False)
    assert none.device.backend == "none" and none.virtual_clock is None and not none.decision.control


class _Channels:
    ranks = (0, 1)

    def warm_up(self, device, timeout):
        self.timeout = timeout


def test_the_p2p_transfers_wait_as_long_as_the_transport_group_says():
    chans = _Channels()
    transport = _only(groups.TransportSettings, comm_timeout_s=42.0)
    transfers = channels.P2PTransfers(chans, 0, 2, transport=transport, recv_shape=(2,), send_shape=(2,),
                                      dtype=None, device="cpu")
    assert transfers.timeout == chans.timeout == datetime.timedelta(seconds=42.0)
