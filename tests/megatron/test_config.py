"""--envpipe-* flags and start-up validation."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from megatron_envpipe.config import EnvPipeConfig, EnvPipeConfigError, add_envpipe_args
from megatron_envpipe.core.gpu_specs import get_gpu_spec
from megatron_envpipe.core.vocabulary import CommModel, PlanType, ReconfigPolicy, Scheduling
from megatron_envpipe.planning.basis import PlannerConfig, PlannerError


def parse(argv):
    return EnvPipeConfig.from_args(add_envpipe_args(argparse.ArgumentParser()).parse_args(argv))


def test_defaults_are_stock_megatron():
    cfg = parse([])
    assert cfg.is_stock and cfg.plan_type == "baseline" and cfg.scheduling == "1f1b"


def test_the_headline_flags():
    cfg = parse(["--envpipe-type", "envelope", "--envpipe-scheduling", "ours", "--envpipe-reconfig", "balanced",
                 "--envpipe-gpu", "a40", "--envpipe-profile", "a40/gpt3-175b", "--envpipe-extra-warmup", "3,2,1,0"])
    assert (cfg.plan_type, cfg.scheduling, cfg.reconfig, cfg.gpu) == ("envelope", "ours", "balanced", "a40")
    assert cfg.extra_warmup == (3, 2, 1, 0) and not cfg.is_stock


@pytest.mark.parametrize(
    "argv,needle",
    [
        (["--envpipe-extra-warmup", "1,0"], "only applies to --envpipe-scheduling ours"),
        (["--envpipe-gpu", "b9000"], "unknown GPU 'b9000'"),
        (["--envpipe-profile", "/no/such.csv"], "no such file"),
        (["--envpipe-comm-timeout", "0"], "comm-timeout 0: must be > 0 seconds"),
        (["--envpipe-prefetch", "0"], "prefetch 0: must be >= 1"),
        (["--envpipe-sim-jitter", "3%"], "adds noise to the simulated GPU only: add --envpipe-gpu simulated"),
        (["--envpipe-gpu", "simulated:a40/gpt3-175b", "--envpipe-sim-jitter", "0.3"],
         r"--envpipe-sim-jitter 0.3: must be at most 0.25"),
        (["--envpipe-timing-margin", "0.6"], r"--envpipe-timing-margin 0.6: must be at most 0.5"),
        (["--envpipe-reconfig-window", "0"], r"--envpipe-reconfig-window 0: must be >= 1 iterations"),
    ],
)
def test_impossible_combinations_fail_at_start_up(argv, needle):
    with pytest.raises(EnvPipeConfigError, match=needle):
        parse(argv)


def test_robustness_flags():
    cfg = parse(["--envpipe-gpu", "simulated:a40/gpt3-175b", "--envpipe-sim-jitter", "3%", "--envpipe-type", "envelope",
                 "--envpipe-reconfig", "balanced", "--envpipe-timing-margin", "0", "--envpipe-reconfig-window", "5"])
    assert (cfg.sim_jitter, cfg.timing_margin, cfg.reconfig_window) == (0.03, 0.0, 5)
    assert parse([]).timing_margin == 0.01 and parse([]).reconfig_window == 3 and parse([]).sim_jitter == 0.0
    with pytest.raises(SystemExit):  # nan is refused by the flag's type already
        parse(["--envpipe-timing-margin", "nan"])


def test_megatron_args_checks():
    cfg = parse(["--envpipe-scheduling", "ours"])
    with pytest.raises(EnvPipeConfigError, match="no interleaved"):
        cfg.validate_with_megatron_args(argparse.Namespace(virtual_pipeline_model_parallel_size=2))
    with pytest.raises(EnvPipeConfigError, match="pipeline-model-parallel-size >= 2"):
        cfg.validate_with_megatron_args(argparse.Namespace(pipeline_model_parallel_size=1))
    parse([]).validate_with_megatron_args(argparse.Namespace(virtual_pipeline_model_parallel_size=2))


def test_bad_choice_is_argparse_error(capsys):
    with pytest.raises(SystemExit):
        parse(["--envpipe-type", "turbo"])
    err = capsys.readouterr().err
    assert "invalid choice: 'turbo' (choose from 'baseline', 'uniform', 'envelope', 'optimal')" in err


# -- the vocabulary's Enums in both configs ---------------------------------------------


def test_flags_become_vocabulary_members_equal_to_their_strings():
    cfg = parse(["--envpipe-type", "envelope", "--envpipe-scheduling", "ours", "--envpipe-reconfig", "greedy"])
    assert cfg.plan_type is PlanType.ENVELOPE and cfg.scheduling is Scheduling.OURS
    assert cfg.reconfig is ReconfigPolicy.GREEDY and cfg.reconfig == "greedy"
    defaults = parse([])
    assert (defaults.plan_type, defaults.scheduling, defaults.reconfig) == (
        PlanType.BASELINE, Scheduling.ONE_F_ONE_B, ReconfigPolicy.DEFAULT)
    # Megatron's own args namespace keeps plain strings (it prints and saves them).
    ns = add_envpipe_args(argparse.ArgumentParser()).parse_args([])
    assert type(ns.envpipe_plan_type) is str and type(ns.envpipe_scheduling) is str and type(ns.envpipe_reconfig) is str


def test_unknown_names_keep_their_messages():
    with pytest.raises(EnvPipeConfigError, match=r"--envpipe-type 'turbo': choose one of baseline, uniform, envelope"):
        EnvPipeConfig(plan_type="turbo").validate()
    with pytest.raises(EnvPipeConfigError, match=r"--envpipe-scheduling 'zb': choose one of 1f1b, ours"):
        EnvPipeConfig(scheduling="zb").validate()
    with pytest.raises(PlannerError, match=r"unknown plan type 'turbo'; choose one of baseline"):
        PlannerConfig("turbo").validate()
    with pytest.raises(PlannerError, match=r"unknown communication model 'x'; choose per-direction or paired"):
        PlannerConfig(comm="x").validate()


def test_planner_config_accepts_strings():
    cfg = PlannerConfig("optimal", "ours")
    assert cfg.plan_type is PlanType.OPTIMAL and cfg.scheduling is Scheduling.OURS
    assert cfg.reconfig is ReconfigPolicy.BALANCED and cfg.comm is CommModel.PER_DIRECTION
    assert cfg == PlannerConfig(PlanType.OPTIMAL, Scheduling.OURS) and cfg.plan_type == "optimal"
    assert PlannerConfig(comm="paired").comm is CommModel.PAIRED
    assert cfg.validate() is cfg


# -- EnvPipeConfig.planner_config: what the run-time plans with ------------------------


@pytest.mark.parametrize(
    "argv,expected",
    [
        ([], PlannerConfig("baseline", "1f1b", "default", gpu=get_gpu_spec("a40"))),
        (
            ["--envpipe-type", "envelope", "--envpipe-scheduling", "ours", "--envpipe-reconfig", "balanced",
             "--envpipe-p2p-power", "70", "--envpipe-reconfig-step", "60", "--envpipe-max-inflight", "6",
             "--envpipe-extra-warmup", "3,2,1,0"],
            PlannerConfig("envelope", "ours", "balanced", gpu=get_gpu_spec("a40"), p2p_power_w=70.0,
                          reconfig_step_mhz=60, max_inflight=6, extra_warmup=(3, 2, 1, 0)),
        ),
        (
            ["--envpipe-type", "optimal", "--envpipe-scheduling", "ours", "--envpipe-max-slowdown", "5%",
             "--envpipe-reconfig", "greedy"],
            PlannerConfig("optimal", "ours", "greedy", gpu=get_gpu_spec("a40"), max_slowdown=0.05),
        ),
        (
            ["--envpipe-type", "optimal", "--envpipe-target-time", "8.5"],
            PlannerConfig("optimal", "1f1b", "default", gpu=get_gpu_spec("a40"), target_time_s=8.5),
        ),
        (
            ["--envpipe-type", "uniform", "--envpipe-reconfig", "balanced", "--envpipe-finish-limit", "3",
             "--envpipe-prefetch", "4", "--envpipe-threshold-scale", "2"],  # run-time-only flags do not reach the planner
            PlannerConfig("uniform", "1f1b", "balanced", gpu=get_gpu_spec("a40")),
        ),
        (
            ["--envpipe-type", "envelope", "--envpipe-reconfig", "balanced", "--envpipe-timing-margin", "2.5%",
             "--envpipe-reconfig-window", "5"],
            PlannerConfig("envelope", "1f1b", "balanced", gpu=get_gpu_spec("a40"), timing_margin=0.025),
        ),
    ],
)
def test_planner_config_is_what_the_runtime_builds(argv, expected):
    cfg = parse(argv)
    if "--envpipe-timing-margin" not in argv:  # training plans keep the default margin; the planner's own is 0
        assert expected.timing_margin == 0.0 and cfg.timing_margin == 0.01
        expected = dataclasses.replace(expected, timing_margin=0.01)
    # What megatron/runtime.py built by hand, field by field (p2p from the flag when given).
    by_hand = PlannerConfig(
        plan_type=cfg.plan_type, scheduling=cfg.scheduling, reconfig=cfg.reconfig, gpu=get_gpu_spec("a40"),
        p2p_power_w=cfg.p2p_power_w, reconfig_step_mhz=cfg.reconfig_step_mhz, max_inflight=cfg.max_inflight,
        extra_warmup=cfg.extra_warmup, max_slowdown=cfg.max_slowdown, target_time_s=cfg.target_time_s,
        timing_margin=cfg.timing_margin,
    )
    got = cfg.planner_config(get_gpu_spec("a40"))
    assert got == expected == by_hand
    assert got.plan_type is PlanType(expected.plan_type) and got.validate() is got


def test_planner_config_overrides_and_no_gpu():
    cfg = parse(["--envpipe-type", "envelope", "--envpipe-scheduling", "ours"])
    # The run-time passes the profiler's P2P power when --envpipe-p2p-power is not given.
    assert cfg.planner_config(None, p2p_power_w=55.0) == PlannerConfig("envelope", "ours", "default", p2p_power_w=55.0,
                                                                                timing_margin=0.01)
    assert cfg.planner_config().gpu is None
    with pytest.raises(TypeError):
        cfg.planner_config(None, no_such_field=1)
