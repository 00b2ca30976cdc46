"""core/kinds.py: plan types and schedulings as registries of capabilities. A new plan type is one
registration in its own module: here a "fixed clock per stage" plan type (docs/design.md's example),
registered in the test, planned by the planner, accepted by both flag surfaces, and held to the
capabilities it declares by the flag table (config/flag_table.py)."""

from __future__ import annotations

import argparse
from collections.abc import Sequence

import pytest

from megatron_envpipe.apps.cli import build_parser
from megatron_envpipe.config import EnvPipeConfig, add_envpipe_args
from megatron_envpipe.core import kind_registry
from megatron_envpipe.core.interleaved import interleaved_schedule
from megatron_envpipe.core.kinds import (
    KindError,
    PlanTypeKind,
    SchedulingKind,
    build_schedule,
    plan_kind,
    register_plan_type,
    register_scheduling,
    scheduling_kind,
)
from megatron_envpipe.core.plan import FrequencyPlan
from megatron_envpipe.core.profile import Profile
from megatron_envpipe.core.resources import shipped_profile
from megatron_envpipe.core.schedule import Schedule, ScheduleError, envpipe_schedule, one_f_one_b
from megatron_envpipe.flag_types import EnvPipeConfigError
from megatron_envpipe.planning.basis import PlannerConfig
from megatron_envpipe.planning.planner import plan_envpipe

FIXED_MHZ = (1200, 1110, 1020, 930)


def fixed_per_stage(schedule: Schedule, f_max: int, inner_mhz: Sequence[int]) -> FrequencyPlan:
    """Every unit of stage s at FIXED_MHZ[s] (never above the GPU's maximum)."""
    return FrequencyPlan.constant(schedule, [min(f_max, FIXED_MHZ[s]) for s in range(schedule.num_stages)])


FIXED = PlanTypeKind("fixed", "each stage at its own fixed clock", fixed_per_stage)


@pytest.fixture
def fixed(monkeypatch):
    """The registration, undone after the test (the registry is process-wide)."""
    monkeypatch.setattr(kind_registry, "_PLAN_TYPES", dict(kind_registry._PLAN_TYPES))
    return register_plan_type(FIXED)


def test_builtin_capabilities_replace_name_comparisons():
    assert not plan_kind("baseline").sets_clocks and plan_kind("envelope").sets_clocks
    assert plan_kind("optimal").has_deadline and plan_kind("optimal").optimized
    assert plan_kind("optimal").per_iteration_plans and plan_kind("optimal").follows_stragglers
    assert not any(plan_kind(t).has_deadline for t in ("baseline", "uniform", "envelope"))
    assert scheduling_kind("ours").extra_warmup and not scheduling_kind("1f1b").extra_warmup
    assert scheduling_kind("interleaved").model_chunks and scheduling_kind("interleaved").own_baseline
    assert not any(scheduling_kind(s).model_chunks or scheduling_kind(s).own_baseline for s in ("1f1b", "ours"))
    assert scheduling_kind("interleaved").replaces == "forward_backward_pipelining_with_interleaving"
    assert scheduling_kind("1f1b").replaces == "forward_backward_pipelining_without_interleaving"


@pytest.mark.parametrize("name, r, chunks", [("1f1b", None, 1), ("ours", (2, 1, 1, 0), 1), ("interleaved", None, 2)])
def test_build_schedule_builds_the_registered_orders(name, r, chunks):
    direct = {"1f1b": lambda: one_f_one_b(4, 8), "ours": lambda: envpipe_schedule(4, 8, r),
              "interleaved": lambda: interleaved_schedule(4, 8, 2)}[name]()
    assert build_schedule(name, 4, 8, r, chunks) == direct


def test_build_schedule_asks_a_new_schedulings_capabilities(monkeypatch):
    monkeypatch.setattr(kind_registry, "_SCHEDULINGS", dict(kind_registry._SCHEDULINGS))
    register_scheduling(SchedulingKind("1f1b-again", "1F1B, registered again", lambda p, m, r, v, g: one_f_one_b(p, m),
                                       "forward_backward_pipelining_without_interleaving"))
    assert build_schedule("1f1b-again", 4, 8) == one_f_one_b(4, 8)
    with pytest.raises(ScheduleError, match="runs one model chunk per stage"):
        build_schedule("1f1b-again", 4, 8, num_chunks=2)
    with pytest.raises(ScheduleError, match="has no extra warm-up"):
        build_schedule("1f1b-again", 4, 8, (1, 0, 0, 0))
    with pytest.raises(ScheduleError, match="unknown scheduling 'zb'; choose one of 1f1b, ours, interleaved, 1f1b-again"):
        build_schedule("zb", 4, 8)


def test_unknown_names_and_conflicting_registrations_are_refused(fixed):
    with pytest.raises(KindError, match="unknown plan type 'fastest'"):
        plan_kind("fastest")
    register_plan_type(FIXED)  # the same kind again: idempotent
    with pytest.raises(KindError, match="registered already"):
        register_plan_type(PlanTypeKind("fixed", "other", fixed_per_stage, has_deadline=True))


def test_a_registered_plan_type_is_planned_from_its_initial_plan(fixed):
    profile = Profile.from_csv(shipped_profile("a40/gpt3-175b")).for_pipeline(4)
    result = plan_envpipe(profile, 8, PlannerConfig(plan_type="fixed", scheduling="1f1b", reconfig="default"))
    assert [set(row) for row in result.plan.freqs_mhz] == [{f} for f in FIXED_MHZ]
    assert result.energy_j < result.baseline.energy_j  # slower clocks than f_max: less energy


def test_both_flag_surfaces_accept_it_and_read_its_capabilities(fixed):
    parser = add_envpipe_args(argparse.ArgumentParser(prog="train"))
    config = EnvPipeConfig.from_args(parser.parse_args(["--envpipe-type", "fixed", "--envpipe-timing-margin", "0.02"]))
    assert config.plan_type == "fixed"  # sets clocks: the timing margin acts
    with pytest.raises(EnvPipeConfigError, match="deadlines need --envpipe-type optimal"):
        EnvPipeConfig.from_args(parser.parse_args(["--envpipe-type", "fixed", "--envpipe-max-slowdown", "0.05"]))
    args = build_parser().parse_args(["plan", "--profile", "a40/gpt3-175b", "-m", "8", "--type", "fixed"])
    assert args.type == "fixed"
