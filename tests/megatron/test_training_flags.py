"""``--envpipe-*`` flags (issue 20): none silently ignored, no empty list entries, the CLI's ranges, and no
flag accepted at start-up that then kills every rank.

Through what an entry point runs (``add_envpipe_args`` + argparse, ``EnvPipeConfig.from_args``,
``validate_with_megatron_args`` with a Megatron-shaped namespace) and through the Python API
(``EnvPipeConfig(...).validate()``). Pure Python (the real torchrun run of a bad flag is tests/megatron/test_bad_flags.py's).
"""

from __future__ import annotations

import argparse
import datetime
import re
from pathlib import Path

import pytest

from megatron_envpipe.config import EnvPipeConfig, EnvPipeConfigError, add_envpipe_args
from megatron_envpipe.core.flag_ranges import RANGES
from megatron_envpipe.core.memory import MemoryModel
from megatron_envpipe.flag_types import TRAINING_NUMBERS

REPO = Path(__file__).resolve().parents[2]
OURS = ["--envpipe-scheduling", "ours"]
ENVELOPE = ["--envpipe-type", "envelope"]
BALANCED = ["--envpipe-reconfig", "balanced"]


def megatron(pp: int = 4, **kwargs) -> argparse.Namespace:
    values = dict(pipeline_model_parallel_size=pp, num_microbatches=8, virtual_pipeline_model_parallel_size=None,
                  num_layers_per_virtual_pipeline_stage=None, num_layers=16)
    values.update(kwargs)
    return argparse.Namespace(**values)


def check(argv: list[str], megatron_args: argparse.Namespace | None = None) -> EnvPipeConfig:
    args = add_envpipe_args(argparse.ArgumentParser(prog="train")).parse_args(argv)
    config = EnvPipeConfig.from_args(args)
    return config.validate_with_megatron_args(megatron_args) if megatron_args is not None else config


def one_line(info: pytest.ExceptionInfo, *needles: str) -> None:
    message = str(info.value)
    assert "\n" not in message
    for needle in needles:
        assert needle in message, message


def _chunked_csv(path: Path, stages: int, chunks: int) -> Path:
    rows = ["stage,instruction,frequency,time,energy,chunk"]
    for s in range(stages):
        for c in range(chunks):
            for f, slow in ((1740, 1.0), (1500, 1.2)):
                rows += [f"{s},forward,{f},{0.01 * slow},{3.0 / slow},{c}", f"{s},backward,{f},{0.02 * slow},{6.0 / slow},{c}"]
    path.write_text("\n".join(rows) + "\n")
    return path


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("flags")
    (d / "garbage.csv").write_text("stage,instruction,frequency,time,energy\n0,forward,1740,0.01,3\n0,forward,fast,1,2\n")
    (d / "binary.csv").write_bytes(b"\x89PNG\r\n\x1a\n\xff\xfe")
    _chunked_csv(d / "chunked2.csv", 4, 2)
    return d


# -- class 1: a flag that would do nothing is refused -------------------------------------
IGNORED = [
    (ENVELOPE + ["--envpipe-max-inflight", "4"], None, ["--envpipe-max-inflight 4", "--envpipe-scheduling 1f1b has none"]),
    (ENVELOPE + ["--envpipe-max-inflight", "none"], None, ["--envpipe-max-inflight none", "would be ignored"]),
    (["--envpipe-scheduling", "interleaved", "--envpipe-max-inflight", "none"],
     megatron(virtual_pipeline_model_parallel_size=2), ["--envpipe-max-inflight none", "interleaved has none"]),
    (["--envpipe-scheduling", "interleaved", "--envpipe-max-inflight", "4,4,4,4"],
     megatron(virtual_pipeline_model_parallel_size=2), ["--envpipe-max-inflight 4,4,4,4"]),
    (["--envpipe-switch-cost-j", "0.5"], None, ["--envpipe-switch-cost-j 0.5", "--envpipe-type baseline"]),
    (["--envpipe-switch-cost-j", "0"], None, ["--envpipe-switch-cost-j 0 ", "--envpipe-type baseline"]),  # typed
    (["--envpipe-max-clock-changes", "5"], None, ["--envpipe-max-clock-changes 5", "--envpipe-type baseline"]),
    (["--envpipe-timing-margin", "2%"], None, ["--envpipe-timing-margin 0.02", "--envpipe-type baseline"]),
    (["--envpipe-timing-margin", "0.01"], None, ["--envpipe-timing-margin 0.01", "ignored"]),  # typed default
    # found alongside: online reconfiguration's knobs with it off, the start-up profiler's with a profile
    (ENVELOPE + ["--envpipe-reconfig-step", "60"], None, ["--envpipe-reconfig-step 60", "--envpipe-reconfig default"]),
    (ENVELOPE + ["--envpipe-finish-limit", "3"], None, ["--envpipe-finish-limit 3", "reconfig default"]),
    (ENVELOPE + ["--envpipe-threshold-scale", "2"], None, ["--envpipe-threshold-scale 2", "reconfig default"]),
    (ENVELOPE + ["--envpipe-reconfig-window", "5"], None, ["--envpipe-reconfig-window 5", "reconfig default"]),
    (ENVELOPE + ["--envpipe-profile", "a40/gpt3-175b", "--envpipe-profile-step", "60"], None,
     ["--envpipe-profile-step 60", "--envpipe-profile a40/gpt3-175b replaces"]),
    (ENVELOPE + ["--envpipe-profile", "a40/gpt3-175b", "--envpipe-profile-iterations", "3"], None,
     ["--envpipe-profile-iterations 3"]),
    (ENVELOPE + ["--envpipe-profile", "a40/gpt3-175b", "--envpipe-measure-iterations", "2"], None,
     ["--envpipe-measure-iterations 2"]),
]


@pytest.mark.parametrize("argv,megatron_args,needles", IGNORED, ids=[" ".join(a) for a, _, _ in IGNORED])
def test_flag_that_would_do_nothing_is_refused(argv, megatron_args, needles):
    with pytest.raises(EnvPipeConfigError) as info:
        check(argv, megatron_args)
    one_line(info, *needles)


IGNORED_API = [
    (dict(plan_type="envelope", max_inflight=4), "--envpipe-max-inflight 4"),
    (dict(plan_type="envelope", max_inflight=None), "--envpipe-max-inflight none"),
    (dict(plan_type="envelope", scheduling="interleaved", max_inflight=(4, 4)), "--envpipe-max-inflight 4,4"),
    (dict(switch_cost_j=0.5), "--envpipe-switch-cost-j 0.5"),
    (dict(max_clock_changes=3), "--envpipe-max-clock-changes 3"),
    (dict(timing_margin=0.0), "--envpipe-timing-margin 0"),
    (dict(plan_type="envelope", finish_limit=3), "--envpipe-finish-limit 3"),
    (dict(plan_type="envelope", profile="a40/gpt3-175b", profile_iterations=3), "--envpipe-profile-iterations 3"),
]


@pytest.mark.parametrize("kwargs,needle", IGNORED_API, ids=[str(k) for k, _ in IGNORED_API])
def test_python_api_refuses_a_setting_that_would_do_nothing(kwargs, needle):
    with pytest.raises(EnvPipeConfigError) as info:
        EnvPipeConfig(**kwargs).validate()
    one_line(info, needle, "ignored")


@pytest.mark.parametrize("argv", [
    [],  # stock: no default triggers a refusal
    ["--envpipe-max-inflight", "auto"],  # auto is the default: it applies wherever there is a budget to derive
    # what examples/slurm/envpipe_common.sh always passes, at its defaults
    ["--envpipe-finish-limit", "10", "--envpipe-threshold-scale", "4.0", "--envpipe-prefetch", "2",
     "--envpipe-comm-timeout", "300", "--envpipe-sim-time-scale", "0.02", "--envpipe-profile-iterations", "2",
     "--envpipe-measure-iterations", "1", "--envpipe-log-interval", "1"],
    ENVELOPE + BALANCED + ["--envpipe-switch-cost-j", "0.5", "--envpipe-max-clock-changes", "5",
                           "--envpipe-timing-margin", "0", "--envpipe-reconfig-step", "60", "--envpipe-finish-limit", "3"],
    OURS + ["--envpipe-max-inflight", "none"],
])
def test_flags_that_apply_pass(argv):
    check(argv, megatron())


# -- class 2: empty list entries ------------------------------------------------------------
EMPTY = [
    (OURS + ["--envpipe-extra-warmup", "3,2,,0"], "--envpipe-extra-warmup", "entry 3 of '3,2,,0' is empty"),
    (OURS + ["--envpipe-extra-warmup", ",3,2,1"], "--envpipe-extra-warmup", "entry 1 of ',3,2,1' is empty"),
    (OURS + ["--envpipe-extra-warmup", "3,2,1,"], "--envpipe-extra-warmup", "entry 4 of '3,2,1,' is empty"),
    (OURS + ["--envpipe-max-inflight", "4,,4,4"], "--envpipe-max-inflight", "entry 2 of '4,,4,4' is empty"),
    (OURS + ["--envpipe-max-inflight", "4,4,4,"], "--envpipe-max-inflight", "entry 4"),
    (OURS + ["--envpipe-sim-memory", "2,"], "--envpipe-sim-memory", "entry 2 of '2,' is empty"),
    (OURS + ["--envpipe-sim-memory", ",256"], "--envpipe-sim-memory", "entry 1 of ',256' is empty"),
]


@pytest.mark.parametrize("argv,flag,needle", EMPTY, ids=[" ".join(a) for a, _, _ in EMPTY])
def test_empty_list_entry_is_refused_naming_flag_and_entry(argv, flag, needle, capsys):
    with pytest.raises(SystemExit) as info:
        check(argv)
    assert info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith(f"train: error: argument {flag}: ") and needle in err, err


def test_python_api_refuses_an_empty_list():
    with pytest.raises(EnvPipeConfigError, match="--envpipe-extra-warmup is empty"):
        EnvPipeConfig(scheduling="ours", extra_warmup=()).validate()
    with pytest.raises(EnvPipeConfigError, match="--envpipe-max-inflight is empty"):
        EnvPipeConfig(scheduling="ours", max_inflight=()).validate()


# -- class 3: the one range table -------------------------------------------------------------
def _needs(name: str) -> list[str]:
    """Flags that make ``name``'s flag apply (so its range, not its uselessness, is what is checked)."""
    simulated = ["--envpipe-gpu", "simulated:a40/gpt3-175b"]
    return {"sim_jitter": simulated, "sim_clock_latency_ms": simulated, "sim_counter_period_ms": simulated,
            "sim_thermal_drift": simulated, "sim_unit_scale": simulated,
            "max_slowdown": ["--envpipe-type", "optimal"], "target_time_s": ["--envpipe-type", "optimal"],
            "sim_time_scale": simulated + ["--envpipe-sim-time", "wall"],  # it scales wall time only
            "straggler_window": ["--envpipe-type", "optimal"],  # only optimal plans follow a straggler
            }.get(name, ENVELOPE + BALANCED)


def _above(name: str) -> str:
    limits = TRAINING_NUMBERS[name][1]
    return str(int(limits.high) + 1) if limits.kind == "int" else repr(limits.high * 1.5)


@pytest.mark.parametrize("name", sorted(TRAINING_NUMBERS))
def test_every_numeric_training_flag_has_an_upper_bound(name):
    flag, limits, _ = TRAINING_NUMBERS[name]
    with pytest.raises(EnvPipeConfigError) as info:
        check(_needs(name) + [flag, _above(name)])
    one_line(info, flag, "at most" if name != "max_slowdown" else "it is a fraction")
    top = str(int(limits.high)) if limits.kind == "int" else repr(limits.high)
    check(_needs(name) + [flag, top])  # the top of the range itself passes


@pytest.mark.parametrize("name", sorted(n for n, (_, r, _) in TRAINING_NUMBERS.items() if r.kind == "float"))
@pytest.mark.parametrize("text", ["inf", "-inf", "nan"])
def test_non_finite_values_are_refused(name, text):
    flag = TRAINING_NUMBERS[name][0]
    try:
        check(_needs(name) + [f"{flag}={text}"])
    except SystemExit:  # the fraction flags refuse it in their argparse type already
        return
    except EnvPipeConfigError as exc:
        assert "finite" in str(exc) and flag in str(exc), exc
        return
    pytest.fail(f"{flag} {text} was accepted")


def test_threshold_scale_inf_is_refused():
    """Issue 20 names it: found unchecked by removing the check once."""
    with pytest.raises(EnvPipeConfigError) as info:
        check(ENVELOPE + BALANCED + ["--envpipe-threshold-scale", "inf"])
    one_line(info, "--envpipe-threshold-scale inf: must be a finite number")
    with pytest.raises(EnvPipeConfigError, match="--envpipe-threshold-scale inf"):
        EnvPipeConfig(plan_type="envelope", reconfig="balanced", threshold_scale=float("inf")).validate()


# (training field, the CLI range it shares): the CLI test file checks the CLI side of each key
TWINS = {"p2p_power_w": "p2p_power_w", "reconfig_step_mhz": "clock_mhz", "max_slowdown": "max_slowdown",
         "target_time_s": "target_time_s", "switch_cost_j": "switch_cost_j", "max_clock_changes": "max_clock_changes",
         "timing_margin": "timing_margin", "prefetch": "prefetch"}


def test_training_flags_read_their_cli_twins_range():
    for name, key in TWINS.items():
        assert TRAINING_NUMBERS[name][1] is RANGES[key], name


@pytest.mark.parametrize("kwargs,needle", [
    (dict(comm_timeout_s=1e7), "--envpipe-comm-timeout 1e+07: must be at most 1e+06 s"),
    (dict(plan_type="optimal", target_time_s=2e6), "--envpipe-target-time 2e+06: must be at most 1e+06 s"),
    (dict(prefetch=10**5), "--envpipe-prefetch 100000: must be at most 10000 receives"),
    (dict(log_interval=10**7), "--envpipe-log-interval 10000000: must be at most"),
    (dict(plan_type="envelope", reconfig="balanced", threshold_scale=1e4), "--envpipe-threshold-scale 10000"),
    (dict(scheduling="ours", max_inflight=10**7), "--envpipe-max-inflight 10000000: must be at most 1e+06"),
    (dict(scheduling="ours", max_inflight=(4, 10**7)), "stage 1's entry 10000000 must be at most 1e+06"),
])
def test_python_api_applies_the_same_ranges(kwargs, needle):
    with pytest.raises(EnvPipeConfigError) as info:
        EnvPipeConfig(**kwargs).validate()
    one_line(info, needle)


def test_virtual_stages_beyond_the_planners_limit_are_refused_at_start_up():
    interleaved = ["--envpipe-scheduling", "interleaved", "--envpipe-type", "optimal"]
    with pytest.raises(EnvPipeConfigError) as info:
        check(interleaved, megatron(2, virtual_pipeline_model_parallel_size=65, num_microbatches=130))
    one_line(info, "65 model chunks per rank", "more than the 64")
    check(interleaved, megatron(2, virtual_pipeline_model_parallel_size=64, num_microbatches=64))  # 8,192 slots


# -- class 4: accepted at start-up, then every rank died ------------------------------------
def test_comm_timeout_is_bounded_below_what_a_timedelta_holds():
    with pytest.raises(EnvPipeConfigError) as info:
        check(["--envpipe-comm-timeout", "1e14"])
    one_line(info, "--envpipe-comm-timeout 1e+14: must be at most 1e+06 s")
    datetime.timedelta(seconds=RANGES["comm_timeout_s"].high)  # the channels build this: the top must fit


@pytest.mark.parametrize("text,needle", [("1e300,256", "free memory must be at most 1e+06 GiB"),
                                         ("2,1e300", "per micro-batch must be at most 1e+06 MiB")])
def test_sim_memory_is_bounded(text, needle, capsys):
    with pytest.raises(SystemExit):
        check(OURS + ["--envpipe-sim-memory", text])
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "argument --envpipe-sim-memory" in err and needle in err, err
    with pytest.raises(EnvPipeConfigError, match=re.escape(needle)):  # the Python API
        EnvPipeConfig(scheduling="ours", sim_memory=MemoryModel(*map(float, text.split(",")))).validate()
    top = MemoryModel(RANGES["sim_free_gib"].high, RANGES["sim_mib_per_microbatch"].high)
    top.stage_memory()  # what the run-time computes: the top of the range must not overflow


@pytest.mark.parametrize("gpu,pp,needles", [
    ("simulated:{d}/garbage.csv", 4, ["--envpipe-gpu simulated:", "garbage.csv:3: frequency 'fast' is not a number"]),
    ("simulated:{d}/binary.csv", 4, ["--envpipe-gpu simulated:", "binary.csv", "not UTF-8"]),
    ("simulated:a40/gpt3-175b", 16, ["--envpipe-gpu simulated:a40/gpt3-175b", "cannot emulate 16 stages",
                                     "--pipeline-model-parallel-size 16"]),
    ("simulated:{d}/chunked2.csv", 4, ["--envpipe-gpu simulated:", "profiled with 2 model chunks per stage but the "
                                                                    "pipeline has 1"]),
])
def test_simulated_gpu_profile_is_read_and_fitted_at_start_up(gpu, pp, needles, files):
    with pytest.raises(EnvPipeConfigError) as info:
        check(ENVELOPE + ["--envpipe-gpu", gpu.format(d=files)], megatron(pp))
    one_line(info, *needles)


@pytest.mark.parametrize("scheduling,vpp,needles", [
    ("1f1b", None, ["--envpipe-profile: ", "chunked2.csv: profiled with 2 model chunks per stage but the pipeline "
                    "has 1", "1 model chunk(s) per rank"]),
    ("interleaved", 4, ["profiled with 2 model chunks per stage but the pipeline has 4", "4 model chunk(s)"]),
])
def test_chunked_profile_must_match_the_virtual_pipeline(scheduling, vpp, needles, files):
    argv = ENVELOPE + ["--envpipe-scheduling", scheduling, "--envpipe-profile", str(files / "chunked2.csv")]
    with pytest.raises(EnvPipeConfigError) as info:
        check(argv, megatron(4, virtual_pipeline_model_parallel_size=vpp))
    one_line(info, *needles)


def test_matching_chunked_profiles_pass(files):
    chunked = str(files / "chunked2.csv")
    vpp2 = megatron(4, virtual_pipeline_model_parallel_size=2)
    check(ENVELOPE + ["--envpipe-scheduling", "interleaved", "--envpipe-profile", chunked], vpp2)
    check(ENVELOPE + ["--envpipe-scheduling", "interleaved", "--envpipe-gpu", f"simulated:{chunked}"], vpp2)
    check(ENVELOPE + ["--envpipe-gpu", "simulated:a40/gpt3-175b"], megatron(4))  # 8 stages emulate 4
    check(["--envpipe-profile", chunked], vpp2)  # stock: Megatron's own interleaving runs, EnvPipe stays out


def test_the_examples_start_up_stops_a_bad_flag_in_one_line(monkeypatch):
    """What each rank of the tiny GPT runs before any process group starts (before the fix each rank died in
    datetime.timedelta with a traceback), in-process. The real torchrun run of a bad flag, every rank's log one
    line, is tests/megatron/test_bad_flags.py's (the planted bugs 'comm-timeout-unbounded' and
    'rank-error-traceback' of bench/mutations.py are caught without the torchrun run this test replaced)."""
    pytest.importorskip("megatron.core")
    from megatron_envpipe.apps import train_tiny_gpt

    monkeypatch.setattr("sys.argv", ["train_tiny_gpt.py"])
    with pytest.raises(SystemExit) as exit_:
        train_tiny_gpt.main(["--pipeline-model-parallel-size", "2", "--device", "cpu", "--train-iters", "2",
                             "--envpipe-comm-timeout", "1e14"])
    assert exit_.value.code == ("train_tiny_gpt.py: error: --envpipe-comm-timeout 1e+14: must be at most 1e+06 "
                                "seconds (over 11 days for one transfer); give e.g. --envpipe-comm-timeout 300")
