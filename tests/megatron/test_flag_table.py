"""config/flag_table.py: every ``--envpipe-*`` flag that cannot act is refused, naming what would make it act
(issue 39, item 4), read from one table that the ``envpipe`` command's twins read too.

In-process: argparse + ``EnvPipeConfig.from_args`` (+ ``validate_with_megatron_args`` on a namespace standing
in for Megatron's flags), and the CLI's ``main`` (exit 2). The table-driven test keeps every field of
EnvPipeConfig in the table, with a condition (or a reason it always acts) and a refusal case here.
"""

from __future__ import annotations

import argparse
from dataclasses import fields

import pytest

from megatron_envpipe.apps.cli import main
from megatron_envpipe.config import EnvPipeConfig, add_envpipe_args
from megatron_envpipe.config.flag_table import FIELDS
from megatron_envpipe.flag_types import EnvPipeConfigError

SIM = ["--envpipe-gpu", "simulated:a40/gpt3-175b"]
ENVELOPE = ["--envpipe-type", "envelope"]
OPTIMAL = ["--envpipe-type", "optimal"]
PROFILE = ENVELOPE + ["--envpipe-profile", "a40/gpt3-175b"]
PP1 = {"pipeline_model_parallel_size": 1}
DP1 = {"pipeline_model_parallel_size": 4, "num_microbatches": 8, "data_parallel_size": 1}
NO_PIPE = "--pipeline-model-parallel-size is 1"


def check(argv: list[str], megatron: dict | None = None) -> EnvPipeConfig:
    args = add_envpipe_args(argparse.ArgumentParser(prog="train")).parse_args(argv)
    config = EnvPipeConfig.from_args(args)
    if megatron is not None:
        config.validate_with_megatron_args(argparse.Namespace(**megatron))
    return config


# field -> [(argv, Megatron's flags or None, what the one line must say)]; at least one per field.
REFUSALS: dict[str, list[tuple[list[str], dict | None, str]]] = {
    "plan_type": [(ENVELOPE, PP1, NO_PIPE)],
    "scheduling": [(["--envpipe-scheduling", "ours"], PP1, NO_PIPE)],
    "reconfig": [(["--envpipe-reconfig", "balanced"], PP1, NO_PIPE)],
    "gpu": [(["--envpipe-gpu", "none"], PP1, "--envpipe-gpu none acts on Megatron's pipeline schedule")],
    "profile": [(["--envpipe-profile", "a40/gpt3-175b"], PP1, NO_PIPE)],
    "max_inflight": [(ENVELOPE + ["--envpipe-max-inflight", "4"], None, "--envpipe-scheduling 1f1b has none")],
    "sim_memory": [(["--envpipe-sim-memory", "2,256"], None, "only applies to --envpipe-max-inflight auto")],
    "extra_warmup": [(["--envpipe-extra-warmup", "1,0"], None, "only applies to --envpipe-scheduling ours")],
    "p2p_power_w": [(["--envpipe-p2p-power", "70"], PP1, NO_PIPE)],
    "reconfig_step_mhz": [(ENVELOPE + ["--envpipe-reconfig-step", "60"], None, "--envpipe-reconfig default")],
    "finish_limit": [(ENVELOPE + ["--envpipe-finish-limit", "3"], None, "--envpipe-reconfig default")],
    "threshold_scale": [(ENVELOPE + ["--envpipe-threshold-scale", "2"], None, "--envpipe-reconfig default")],
    "prefetch": [(["--envpipe-prefetch", "4"], PP1, NO_PIPE)],
    "comm_timeout_s": [(["--envpipe-comm-timeout", "60"], PP1, NO_PIPE)],
    "measure_iterations": [(PROFILE + ["--envpipe-measure-iterations", "2"], None, "replaces")],
    "on_no_permission": [(["--envpipe-gpu", "none", "--envpipe-on-no-permission", "monitor"], None,
                          "--envpipe-gpu none locks none")],
    "profile_step_mhz": [(PROFILE + ["--envpipe-profile-step", "60"], None, "replaces")],
    "profile_iterations": [(PROFILE + ["--envpipe-profile-iterations", "3"], None, "replaces")],
    "profile_cache": [(PROFILE + ["--envpipe-profile-cache", "/tmp/profiles"], None, "replaces")],
    "sim_time": [(["--envpipe-sim-time", "wall"], None, "shapes the simulated GPU only")],
    "sim_time_scale": [(SIM + ["--envpipe-sim-time-scale", "0.3"], None, "runs in virtual time"),
                       (["--envpipe-sim-time-scale", "0.3"], None, "add --envpipe-gpu simulated")],
    "sim_jitter": [(["--envpipe-sim-jitter", "0.03"], None, "simulated GPU only")],
    "sim_unit_scale": [(["--envpipe-sim-unit-scale", "0.5"], None, "simulated GPU's units only")],
    "sim_dynamics": [(["--envpipe-sim-dynamics", "realistic"], None, "shapes the simulated GPU only")],
    "sim_clock_latency_ms": [(["--envpipe-sim-clock-latency-ms", "15"], None, "shapes the simulated GPU only")],
    "sim_counter_period_ms": [(["--envpipe-sim-counter-period-ms", "100"], None, "shapes the simulated GPU only")],
    "sim_thermal_drift": [(["--envpipe-sim-thermal-drift", "0.03"], None, "shapes the simulated GPU only")],
    "clock_lead": [(SIM + ["--envpipe-clock-lead", "off"], None, "this run changes none"),  # baseline
                   (ENVELOPE + ["--envpipe-gpu", "none", "--envpipe-clock-lead", "off"], None, "changes none")],
    "timing_margin": [(["--envpipe-timing-margin", "0.02"], None, "--envpipe-type baseline")],
    "reconfig_window": [(ENVELOPE + ["--envpipe-reconfig-window", "5"], None, "--envpipe-reconfig default")],
    "log_interval": [(["--envpipe-log-interval", "5"], PP1, NO_PIPE)],
    "baseline_iterations": [(["--envpipe-baseline-iterations", "1000"],
                             {"pipeline_model_parallel_size": 4, "num_microbatches": 8, "train_iters": 2},
                             "--train-iters 2 ends first, so the plan would never run")],
    "energy_csv": [(["--envpipe-energy-csv", "{tmp}/energy.csv"], PP1, NO_PIPE)],
    "verbose": [(["--envpipe-verbose"], PP1, NO_PIPE)],
    "max_slowdown": [(["--envpipe-max-slowdown", "0.05"], None, "deadlines need --envpipe-type optimal")],
    "target_time_s": [(ENVELOPE + ["--envpipe-target-time", "9"], None, "deadlines need --envpipe-type optimal")],
    "switch_cost_j": [(["--envpipe-switch-cost-j", "0.5"], None, "--envpipe-type baseline")],
    "max_clock_changes": [(["--envpipe-max-clock-changes", "5"], None, "--envpipe-type baseline")],
    "follow_stragglers": [(["--no-envpipe-follow-stragglers"], PP1, NO_PIPE)],
    "straggler_threshold": [
        (ENVELOPE + ["--envpipe-straggler-threshold", "0.05"], None, "only --envpipe-type optimal on a GPU"),
        (OPTIMAL + ["--no-envpipe-follow-stragglers", "--envpipe-straggler-threshold", "0.05"], None, "never follows"),
        (OPTIMAL + ["--envpipe-straggler-threshold", "0.05"], DP1, "no replica to fall behind")],
    "straggler_window": [(ENVELOPE + ["--envpipe-straggler-window", "5"], None, "only --envpipe-type optimal"),
                         (OPTIMAL + ["--envpipe-straggler-window", "5"], DP1, "this run has 1")],
    "sim_straggler": [(["--envpipe-sim-straggler", "1:1.15"], None, "slows the simulated GPU only"),
                      (SIM + ["--envpipe-sim-straggler", "1:1.15@5"], {**DP1, "data_parallel_size": 2, "train_iters": 5},
                       "--train-iters 5 ends before it"),
                      (SIM + ["--envpipe-sim-straggler", "1:1.15"], DP1, "no replica to fall behind")],
    "per_iteration_plans": [(["--envpipe-per-iteration-plans"], None, "optimal's planner"),
                            (OPTIMAL + ["--envpipe-per-iteration-plans"],
                             {"pipeline_model_parallel_size": 4, "num_microbatches": 8, "variable_seq_lengths": False},
                             "this run's are all alike")],
    "deadline_from": [(["--envpipe-deadline-from", "1f1b"], None, "needs --envpipe-type optimal")],
}
CASES = [pytest.param(name, argv, megatron, needle, id=f"{name}-{i}")
         for name, cases in REFUSALS.items() for i, (argv, megatron, needle) in enumerate(cases)]


def test_every_field_is_in_the_table_with_when_it_acts_and_a_refusal_case():
    assert [f.name for f in FIELDS] == [f.name for f in fields(EnvPipeConfig)]
    for field in FIELDS:
        assert bool(field.needs) != bool(field.always), f"{field.name}: conditions, or why it always acts"
        assert field.flag.startswith("--envpipe-")
    assert set(REFUSALS) == {f.name for f in FIELDS}, "every field needs a refusal case"
    # every condition of the table is exercised by a case that names its field's flag
    flags = {f.name: f.flag for f in FIELDS}
    for name, cases in REFUSALS.items():
        assert any(flags[name] in " ".join(argv) or name == "follow_stragglers" for argv, _, _ in cases), name


@pytest.mark.parametrize("name, argv, megatron, needle", CASES)
def test_a_flag_that_cannot_act_is_refused_naming_what_would(name, argv, megatron, needle, tmp_path):
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    with pytest.raises(EnvPipeConfigError) as info:
        check(argv, megatron)
    message = str(info.value)
    assert needle in message and "\n" not in message, message
    assert ": " in message and ("add " in message or "drop" in message or "give" in message or "set " in message
                                or "train longer" in message), message


@pytest.mark.parametrize("argv, megatron", [
    (SIM + ["--envpipe-sim-time", "wall", "--envpipe-sim-time-scale", "0.3"], None),
    (SIM + ENVELOPE + ["--envpipe-clock-lead", "off"], None),
    (SIM + OPTIMAL + ["--envpipe-straggler-threshold", "0.05", "--envpipe-straggler-window", "5",
                      "--envpipe-sim-straggler", "1:1.15@4"],
     {"pipeline_model_parallel_size": 4, "num_microbatches": 8, "data_parallel_size": 2, "train_iters": 5}),
    (["--envpipe-baseline-iterations", "1"], {"pipeline_model_parallel_size": 4, "num_microbatches": 8,
                                              "train_iters": 2}),
    (["--no-envpipe-follow-stragglers"], None),  # only turns off what is off: accepted
    (PROFILE + ["--envpipe-profile-cache", "off"], None),  # no cache with a given profile anyway: accepted
    (["--envpipe-sim-time-scale", "0.02", "--envpipe-clock-lead", "on"], None),  # defaults typed: accepted
])
def test_where_the_flag_acts_it_is_accepted(argv, megatron):
    check(argv, megatron)


def test_a_simulated_straggler_given_twice_is_refused(capsys):
    with pytest.raises(SystemExit) as info:
        check(SIM + ["--envpipe-sim-straggler", "1:1.15", "--envpipe-sim-straggler", "0:1.2"])
    assert info.value.code == 2
    assert "--envpipe-sim-straggler: given twice (1:1.15 and 0:1.2)" in capsys.readouterr().err


@pytest.mark.parametrize("argv, needle", [
    ("schedule --stages 4 -m 8 --extra-warmup 1,0,0,0", "--extra-warmup 1,0,0,0 only applies to --scheduling ours"),
    ("plan --profile a40/gpt3-175b -m 12 --type baseline --timing-margin 0.01",
     "--timing-margin 0.01 does nothing with --type baseline"),
    ("plan --profile a40/gpt3-175b -m 12 --reconfig default --reconfig-step 60",
     "--reconfig default turns reconfiguration off"),
])
def test_the_cli_twins_read_the_same_table(argv, needle, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    try:
        code = main(argv.split())
    except SystemExit as exc:
        code = exc.code
    err = capsys.readouterr().err
    assert code == 2 and needle in err and err.count("\n") == 1, err


@pytest.mark.parametrize("argv, needle", [
    (["--envpipe-baseline-iterations", "1000", "--train-iters", "2"], "so the plan would never run"),
    (["--envpipe-gpu", "simulated:a40/gpt3-175b", "--envpipe-sim-time-scale", "0.3"], "runs in virtual time"),
])
def test_the_tiny_gpt_entry_refuses_in_one_line_before_any_rank_starts(argv, needle, monkeypatch):
    """What a torchrun'd entry does with the refusal, before any process group starts (in-process)."""
    pytest.importorskip("megatron.core")
    from megatron_envpipe.apps import train_tiny_gpt

    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setattr("sys.argv", ["train_tiny_gpt.py"])
    with pytest.raises(SystemExit) as info:
        train_tiny_gpt.main(["--pipeline-model-parallel-size", "4", "--device", "cpu", *argv])
    message = str(info.value.code)  # SystemExit(message): the entry's one line (exit status 1)
    assert message.startswith("train_tiny_gpt.py: error: ") and needle in message and "\n" not in message
