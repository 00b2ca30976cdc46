"""P2P blocking power in the GPU table: a cited measurement, or "unknown" and then never 0 W.

Perseus charges every idle GPU-second at the P2P blocking power, so a plan made
with 0 W for a GPU that really draws ~70 W picks clocks for the wrong trade-off.
The table gives a value only where a published measurement backs it (A40, A100:
the Perseus artifact); elsewhere it says "unknown", and planning from a profile
CSV on that GPU is an error naming the GPU and the two ways out (give
``--p2p-power``, or let the start-up profiler measure it), everywhere a plan is
made: the planner, the ``envpipe`` command, start-up validation, the run-time.
The run-time's own paths (start-up profiler, timing at one clock, stock runs)
need no table value and keep working.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from megatron_envpipe.apps.cli import main
from megatron_envpipe.config import EnvPipeConfig, EnvPipeConfigError
from megatron_envpipe.core.gpu_specs import (
    _P2P_UNKNOWN,
    GpuSpecError,
    P2PPowerUnknownError,
    default_table_path,
    get_gpu_spec,
    load_gpu_table,
)
from megatron_envpipe.core.profile import Profile
from megatron_envpipe.core.resources import shipped_profile
from megatron_envpipe.errors import UsageError
from megatron_envpipe.planning.basis import PlannerConfig
from megatron_envpipe.planning.planner import plan_envpipe

UNKNOWN = ("v100", "rtx3090", "a6000", "h100", "h100-pcie", "h200", "b200")
# Published (Perseus artifact, SOSP '24; see shared/reference/perseus.md §3): the values and their sources.
KNOWN = {"a40": 70.38, "a100": 83.64}


@pytest.fixture(scope="module")
def csv_profile(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A user's 4-stage profile CSV (A40 numbers, within every table GPU's clock range but V100's)."""
    path = tmp_path_factory.mktemp("p2p") / "profile.csv"
    Profile.from_csv(shipped_profile("a40/gpt3-175b")).for_pipeline(4).to_csv(path)
    return str(path)


def test_every_gpu_has_a_cited_value_or_says_unknown():
    table = load_gpu_table()
    assert set(table) == set(UNKNOWN) | set(KNOWN)
    for key, spec in table.items():
        if spec.p2p_power_w is None:
            assert key in UNKNOWN
            continue
        assert spec.p2p_power_w == pytest.approx(KNOWN[key]) and spec.p2p_power_w > 0
        cited = [s for s in spec.sources if f"{spec.p2p_power_w:g} W" in s]
        assert cited and all("Perseus" in s or "kronos" in s for s in cited), (key, spec.sources)
    text = default_table_path().read_text()
    assert text.count(f'p2p_power_w = "{_P2P_UNKNOWN}"') == len(UNKNOWN)
    assert "p2p_power_w = 0" not in text  # 0 W is never written for "not measured"


@pytest.mark.parametrize("key", UNKNOWN)
def test_unknown_power_is_an_error_naming_gpu_and_remedy(key):
    with pytest.raises(P2PPowerUnknownError) as info:
        get_gpu_spec(key).known_p2p_power_w()
    text = str(info.value)
    assert f"P2P blocking power of {key.upper()} is unknown" in text
    assert "--p2p-power W" in text and "start-up profiler" in text
    assert isinstance(info.value, UsageError)


def test_known_power_is_the_tables():
    assert get_gpu_spec("a40").known_p2p_power_w() == pytest.approx(70.38)
    assert get_gpu_spec("a100").known_p2p_power_w() == pytest.approx(83.64)


@pytest.mark.parametrize("value,needle", [
    ('"unkown"', 'p2p_power_w = "unkown": give a number (W) or "unknown"'),
    ("0.0", 'got 0.0 (write "unknown" where it has not been measured)'),
    ("true", 'give a number (W) or "unknown"'),
])
def test_table_accepts_numbers_and_unknown_only(tmp_path: Path, value: str, needle: str):
    path = tmp_path / "gpus.toml"
    path.write_text(default_table_path().read_text().replace('p2p_power_w = "unknown"', f"p2p_power_w = {value}", 1))
    with pytest.raises(GpuSpecError, match=r"\[v100\]") as info:
        load_gpu_table(path)
    assert needle in str(info.value)


# -- the planner -----------------------------------------------------------------------------

def test_planner_refuses_unknown_power_and_takes_a_given_one(csv_profile):
    profile = Profile.from_csv(csv_profile)
    h100 = get_gpu_spec("h100")
    with pytest.raises(P2PPowerUnknownError, match="P2P blocking power of H100 is unknown"):
        PlannerConfig(gpu=h100).effective_p2p_power_w  # noqa: B018 - the property raises
    with pytest.raises(P2PPowerUnknownError):
        plan_envpipe(profile, 8, PlannerConfig(gpu=h100))
    assert PlannerConfig(gpu=h100, p2p_power_w=90.0).effective_p2p_power_w == 90.0
    assert plan_envpipe(profile, 8, PlannerConfig(gpu=h100, p2p_power_w=90.0)).energy_saving > 0
    assert PlannerConfig().effective_p2p_power_w == 0.0  # no GPU named: the profile alone, as before
    assert PlannerConfig(gpu=get_gpu_spec("a40")).effective_p2p_power_w == pytest.approx(70.38)


# -- the envpipe command ---------------------------------------------------------------------

@pytest.mark.parametrize("command", [
    ["plan", "--microbatches", "8"],
    ["plan", "--microbatches", "8", "--compat", "perseus", "--scheduling", "1f1b"],
    ["frontier", "--microbatches", "8"],
    ["simulate", "--microbatches", "8"],
], ids=["plan", "plan-perseus", "frontier", "simulate"])
def test_cli_refuses_a_csv_on_a_gpu_without_known_power(capsys, csv_profile, command):
    assert main([*command, "--gpu", "h100", "--profile", csv_profile]) == 2
    err = capsys.readouterr().err
    assert "P2P blocking power of H100 is unknown" in err and "--p2p-power W" in err
    assert main([*command, "--gpu", "h100", "--profile", csv_profile, "--p2p-power", "90", "--json"]) == 0
    capsys.readouterr()


def test_cli_plans_the_shipped_a40_profile_with_its_table_power(capsys):
    assert main(["plan", "--profile", "a40/gpt3-175b", "--microbatches", "12", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["p2p_power_w"] == pytest.approx(70.38)


def test_cli_gpus_prints_unknown(capsys):
    assert main(["gpus"]) == 0
    rows = {line.split()[0]: line for line in capsys.readouterr().out.splitlines()[1:]}
    for key in UNKNOWN:
        assert " unknown " in rows[key]
    assert " 70.38 " in rows["a40"] and " 83.64 " in rows["a100"]


# -- training: start-up validation and the run-time ---------------------------------------------

def megatron(pp: int = 4) -> argparse.Namespace:
    return argparse.Namespace(pipeline_model_parallel_size=pp, micro_batch_size=1, global_batch_size=8,
                              data_parallel_size=1)


def test_start_up_refuses_a_profile_on_a_gpu_without_known_power(csv_profile):
    with pytest.raises(EnvPipeConfigError) as info:
        EnvPipeConfig(plan_type="envelope", gpu="h100", profile=csv_profile).validate_with_megatron_args(megatron())
    text = str(info.value)
    assert "P2P blocking power of H100 is unknown" in text
    assert "--envpipe-p2p-power W" in text and "drop --envpipe-profile" in text
    # Given power, a known GPU, or no table GPU (known at run time): accepted.
    for cfg in (EnvPipeConfig(plan_type="envelope", gpu="h100", profile=csv_profile, p2p_power_w=90.0),
                EnvPipeConfig(plan_type="envelope", gpu="a40", profile=csv_profile),
                EnvPipeConfig(plan_type="envelope", gpu="h100"),  # the start-up profiler measures it
                EnvPipeConfig(plan_type="envelope", profile=csv_profile)):
        cfg.validate_with_megatron_args(megatron())


def test_runtime_plans_without_a_table_value_where_none_is_needed(csv_profile):
    pytest.importorskip("torch", reason="the run-time's package imports torch")
    from megatron_envpipe.megatron.runtime import EnvPipeRuntime

    h100 = get_gpu_spec("h100")
    # A stock run (an H100 found by NVML, no profile): its profile has no energy, so no P2P power is needed.
    runtime = EnvPipeRuntime(EnvPipeConfig(), gpu=h100)
    assert runtime.prepare(4, 8).phase == "steady" and runtime.last_result.config.p2p_power_w == 0.0
    # The start-up profiler's measurement is used when the table has none.
    runtime = EnvPipeRuntime(EnvPipeConfig(plan_type="envelope", profile=csv_profile), gpu=h100)
    runtime.adopt_profile(runtime.profile, 75.0)
    assert runtime.prepare(4, 8).plan is not None and runtime.last_result.config.p2p_power_w == 75.0
    # A profile CSV, no measurement, no flag: the same error as the planner's, before any plan.
    with pytest.raises(P2PPowerUnknownError, match="P2P blocking power of H100 is unknown"):
        EnvPipeRuntime(EnvPipeConfig(plan_type="envelope", profile=csv_profile), gpu=h100).prepare(4, 8)
