"""Issue 20: sizes the flags allow but no planner or command can serve are refused up front.

Every case asserts the refusal comes before any work: the schedule builders, planners and
simulations it would start are replaced by functions that fail the test if called.
"""

from __future__ import annotations

import argparse

import pytest

import megatron_envpipe.core.interleaved as interleaved_mod
import megatron_envpipe.core.schedule as schedule_mod
import megatron_envpipe.planning.frontier as frontier_mod
import megatron_envpipe.planning.optimal.entry as entry_mod
import megatron_envpipe.planning.planner as planner_mod
from megatron_envpipe.apps.cli import main
from megatron_envpipe.config import EnvPipeConfig, EnvPipeConfigError
from megatron_envpipe.core.gpu_specs import get_gpu_spec
from megatron_envpipe.core.kinds import build_schedule
from megatron_envpipe.core.profile import Profile
from megatron_envpipe.core.sizes import (
    _MAX_FRONTIER_WORK,
    _MAX_OPTIMAL_SIZE,
    _MAX_RECONFIGURED_SIZE,
    _MAX_RECONFIGURED_STAGE_WORK,
    _MAX_RECONFIGURED_TURN_WORK,
    _MAX_SCHEDULE_SIZE,
    MAX_SIMULATED_SIZE,
    SizeLimitError,
    check_frontier_size,
    check_plan_size,
    check_schedule_size,
)
from megatron_envpipe.core.vocabulary import INSTRUCTIONS
from megatron_envpipe.errors import UsageError
from megatron_envpipe.planning.basis import PlannerConfig
from megatron_envpipe.planning.frontier import compute_frontier
from megatron_envpipe.planning.planner import plan_envpipe
from megatron_envpipe.testing.synthetic import deepened

A40 = get_gpu_spec("a40")


def _never(*_args, **_kwargs):
    raise AssertionError("work started before the size check")


@pytest.fixture
def no_work(monkeypatch):
    """Every builder and planner a too-large request would reach fails the test."""
    for module, name in ((schedule_mod, "_stage_order"), (interleaved_mod, "_interleaved_order"),
                         (planner_mod, "planning_profile"), (planner_mod, "plan_optimal"),
                         (planner_mod, "plan_reconfigured"), (entry_mod, "planning_basis"),
                         (frontier_mod, "optimal_setup"), (frontier_mod, "planning_profile")):
        monkeypatch.setattr(module, name, _never)


@pytest.fixture(scope="module")
def deep_profile(gpt3_profile):
    """1,000 stages (synthetic.deepened), two clocks each: quick to write and to parse again."""
    deep = deepened(gpt3_profile, 1000)
    return Profile({key: [deep.points(*key)[0], deep.points(*key)[-1]] for key in
                    ((s, ins) for s in range(1000) for ins in INSTRUCTIONS)}, source="1000 stages")


# -- the limits themselves -----------------------------------------------------------------
def test_the_readme_scale_goal_stays_allowed_and_one_more_is_refused():
    check_plan_size("optimal", 32, 256)  # bench/plan_speed.py --scale: P = 32, M = 256
    assert 32 * 256 == _MAX_OPTIMAL_SIZE
    with pytest.raises(SizeLimitError):
        check_plan_size("optimal", 64, 129)  # M < 8 P: no long-steady-state allowance
    check_plan_size("optimal", 32, 256, 2)  # issue 24: interleaved V = 2 at the scale goal (M >= 8 P)
    with pytest.raises(SizeLimitError):
        check_plan_size("optimal", 32, 513)
    check_plan_size("envelope", 8, 10_000)  # the largest --microbatches on the shipped 8-stage profiles
    check_frontier_size(8, 512, 1, 20)  # the largest frontier measured (47.7 s on a loaded 2-core machine)
    check_plan_size("optimal", 8, 2048)  # one long plan may use the long-steady-state allowance ...
    with pytest.raises(SizeLimitError, match="per point"):
        check_frontier_size(8, 2048, 1, 5)  # ... a frontier of them may not (5 plans of ~15 s each)
    check_schedule_size(8, 10_000)


@pytest.mark.parametrize("plan_type,p,m,v,needle", [
    ("optimal", 8, 10_000, 1, f"at most {_MAX_OPTIMAL_SIZE:,} slots"),
    ("optimal", 8, 64, 32, "8 x 64 x 32 = 16,384"),
    ("envelope", 8, 20_000, 1, f"at most {_MAX_RECONFIGURED_SIZE:,} slots"),
    ("uniform", 1000, 16, 1, f"at most {_MAX_RECONFIGURED_STAGE_WORK:,} slots x stages"),
    ("envelope", 100, 100, 1, f"at most {_MAX_RECONFIGURED_TURN_WORK:,} slots x min(stages, micro-batches)"),
    ("baseline", 1000, 1000, 1, f"at most {MAX_SIMULATED_SIZE:,} slots"),
])
def test_check_plan_size_names_the_limit_and_the_way_out(plan_type, p, m, v, needle):
    with pytest.raises(SizeLimitError, match="use ") as err:
        check_plan_size(plan_type, p, m, v)
    assert needle in str(err.value) and "\n" not in str(err.value)
    assert isinstance(err.value, UsageError)


def test_unknown_microbatches_are_not_checked():
    check_plan_size("optimal", 1000, None, 64)  # training with a batch-size ramp-up: M not known yet


# -- Python API -----------------------------------------------------------------------------
@pytest.mark.parametrize("config,m", [
    (PlannerConfig("optimal", "ours", "default", gpu=A40), 10_000),
    (PlannerConfig("optimal", "interleaved", "default", gpu=A40, virtual_stages=32), 64),
    (PlannerConfig("envelope", "ours", "balanced", gpu=A40), 20_000),
])
def test_plan_envpipe_refuses_before_any_work(gpt3_profile, no_work, config, m):
    with pytest.raises(SizeLimitError, match="at most"):
        plan_envpipe(gpt3_profile, m, config)


@pytest.mark.parametrize("plan_type,m", [("optimal", 16), ("envelope", 16), ("baseline", 1000)])
def test_a_1000_stage_profile_is_refused_after_loading(deep_profile, no_work, plan_type, m):
    with pytest.raises(SizeLimitError, match="1000 x"):
        plan_envpipe(deep_profile, m, PlannerConfig(plan_type, "1f1b" if plan_type == "baseline" else "ours",
                                                    "default", gpu=A40))


def test_optimal_setup_refuses_on_its_own(gpt3_profile, no_work):
    with pytest.raises(SizeLimitError):
        entry_mod.optimal_setup(gpt3_profile, 10_000, PlannerConfig("optimal", "ours", "default", gpu=A40))


@pytest.mark.parametrize("m,points,needle", [(10_000, 20, "plan type 'optimal'"),
                                              (1024, 20, f"at most {_MAX_FRONTIER_WORK:,} slots x points")])
def test_compute_frontier_refuses_before_any_work(gpt3_profile, no_work, m, points, needle):
    with pytest.raises(SizeLimitError) as err:
        compute_frontier(gpt3_profile, m, PlannerConfig("optimal", "ours", "default", gpu=A40), points=points)
    assert needle in str(err.value)


@pytest.mark.parametrize("scheduling,p,m,v", [("1f1b", 1000, 10_000, 1), ("ours", 1000, 10_000, 1),
                                              ("interleaved", 1000, 10_000, 32)])
def test_schedule_builders_refuse_before_building(no_work, scheduling, p, m, v):
    with pytest.raises(SizeLimitError, match=f"at most {_MAX_SCHEDULE_SIZE:,} slots"):
        build_schedule(scheduling, p, m, [0] * p if scheduling == "ours" else None, num_chunks=v)


# -- training flags ---------------------------------------------------------------------------
def megatron(pp: int, m: int, vpp: int | None = None) -> argparse.Namespace:
    return argparse.Namespace(pipeline_model_parallel_size=pp, virtual_pipeline_model_parallel_size=vpp,
                              num_layers_per_virtual_pipeline_stage=None, num_microbatches=m)


@pytest.mark.parametrize("settings,pp,m,vpp,needle", [
    (dict(plan_type="optimal"), 8, 10_000, None, "plan type 'optimal' plans at most"),
    (dict(plan_type="optimal", scheduling="interleaved"), 8, 64, 32, "8 x 64 x 32"),
    (dict(plan_type="envelope", scheduling="ours", reconfig="balanced"), 100, 1000, None, "plan type 'envelope'"),
])
def test_training_flags_refuse_at_start_up(no_work, settings, pp, m, vpp, needle):
    with pytest.raises(EnvPipeConfigError, match=needle):
        EnvPipeConfig(**settings).validate_with_megatron_args(megatron(pp, m, vpp))


# -- CLI ------------------------------------------------------------------------------------
PLAN = "plan --profile a40/gpt3-175b"


@pytest.fixture(scope="module")
def deep_csv(deep_profile, tmp_path_factory):
    path = tmp_path_factory.mktemp("deep") / "p1000.csv"
    deep_profile.to_csv(path)
    return path


@pytest.mark.parametrize("argv,needle", [
    (f"{PLAN} -m 10000 --type optimal --out {{tmp}}/p.json", "plan type 'optimal' plans at most 8,192 slots"),
    (f"{PLAN} -m 64 --type optimal --scheduling interleaved --virtual-stages 32 --plot {{tmp}}/p.png",
     "8 x 64 x 32 = 16,384"),
    (f"{PLAN} -m 10000 --type optimal --scheduling 1f1b --max-slowdown 0.1", "8 x 10000 x 1 = 80,000"),
    ("plan --profile {deep} -m 16 --out {tmp}/p.json", "1000 x 16 x 1"),
    ("plan --profile {deep} -m 9 --type optimal", "1000 x 9 x 1"),
    ("plan --profile {deep} -m 16 --compat perseus --scheduling 1f1b", "1000 x 16 x 1"),
    ("frontier --profile a40/gpt3-175b -m 1024 --csv {tmp}/f.csv", "slots x points"),
    ("schedule --stages 1000 -m 10000", "a schedule holds at most"),
    ("programs --stages 1000 -m 10000 --scheduling 1f1b", "a schedule holds at most"),
    ("simulate --profile {deep} -m 1000", "a simulation holds at most"),
])
def test_cli_refuses_in_one_line_and_writes_nothing(argv, needle, deep_csv, no_work, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    words = [w.format(tmp=tmp_path, deep=deep_csv) for w in argv.split()]
    assert main(words) == 2
    out = capsys.readouterr()
    assert out.err.startswith(f"envpipe {words[0]}: error: ") and out.err.count("\n") == 1, out.err
    assert needle in out.err and "Traceback" not in out.err and out.out == ""
    assert list(tmp_path.iterdir()) == []
