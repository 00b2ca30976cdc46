"""The GPU clock table in configs/gpus.toml."""

from __future__ import annotations

import pytest

from megatron_envpipe.core.gpu_specs import GpuSpecError, get_gpu_spec, load_gpu_table, spec_for_nvml_name


def test_table_has_every_gpu_with_its_true_max():
    table = load_gpu_table()
    assert set(table) >= {"v100", "rtx3090", "a100", "a6000", "a40", "h100", "h200"}
    assert table["a100"].max_clock_mhz == 1410  # not EnvPipe's `% 90` 1350
    assert table["a40"].p2p_power_w == pytest.approx(70.38)
    for spec in table.values():
        grid = spec.candidate_clocks()
        assert grid[0] == spec.max_clock_mhz
        assert all(a > b for a, b in zip(grid, grid[1:]))


def test_candidates_from_a_profile_keep_the_max():
    a40 = get_gpu_spec("a40")
    assert a40.candidate_clocks([1740, 1725, 900, 100])[0] == 1740
    assert 100 not in a40.candidate_clocks([1740, 100])
    with pytest.raises(GpuSpecError, match="none of the available clocks"):
        a40.candidate_clocks([5000])


def test_lookup_by_name_and_errors():
    assert spec_for_nvml_name("NVIDIA A40").key == "a40"
    assert spec_for_nvml_name("NVIDIA H100 80GB HBM3").key == "h100"
    with pytest.raises(GpuSpecError, match="unknown GPU 'b9000'"):
        get_gpu_spec("b9000")


@pytest.mark.parametrize(
    "body,needle",
    [
        ("[x]\nmax_clock_mhz = 1\n", r"\[x\] lacks nvml_names"),
        ("[x\n", "not valid TOML"),
    ],
)
def test_bad_table_names_key_and_file(tmp_path, body, needle):
    path = tmp_path / "gpus.toml"
    path.write_text(body)
    with pytest.raises(GpuSpecError, match=needle) as info:
        load_gpu_table(path)
    assert str(path) in str(info.value)


def test_bad_value_names_key(tmp_path):
    good = (tmp_path / "ok.toml")
    text = open(__import__("megatron_envpipe.core.gpu_specs", fromlist=["x"]).default_table_path()).read()
    good.write_text(text.replace("reconfig_step_mhz = 30", "reconfig_step_mhz = -30", 1))
    with pytest.raises(GpuSpecError, match=r"\[v100\] reconfig_step_mhz must be positive"):
        load_gpu_table(good)


@pytest.mark.parametrize(
    "old,new,needle",
    [
        ('p2p_power_w = "unknown"', "p2p_power_w = nan", r"\[v100\] p2p_power_w = nan must be a finite number"),
        ("clock_step_mhz = 7.5", "clock_step_mhz = inf", r"\[v100\] clock_step_mhz = inf must be a finite"),
        ("clock_step_mhz = 7.5", "clock_step_mhz = 0.0001", "gives over 100000 clocks"),
        ("max_clock_mhz = 1530", "max_clock_mhz = 99999999", "max_clock_mhz <= 100000"),
        ('p2p_power_w = "unknown"', "p2p_power_w = 1e12", "p2p_power_w must be between 0 and 10000 W"),
        ("[v100]", "[V100]", r"\[V100\]: GPU names are lower case; rename it \[v100\]"),
        ("sources = [", "sources = [1, ", "sources must be a list of strings"),
    ],
)
def test_absurd_or_non_finite_table_values_name_key_and_file(tmp_path, old, new, needle):
    text = __import__("megatron_envpipe.core.gpu_specs", fromlist=["x"]).default_table_path().read_text()
    path = tmp_path / "gpus.toml"
    path.write_text(text.replace(old, new, 1))
    with pytest.raises(GpuSpecError, match=needle) as info:
        load_gpu_table(path)
    assert str(path) in str(info.value)


def test_undecodable_table_names_file_and_line(tmp_path):
    path = tmp_path / "gpus.toml"
    path.write_bytes(b"[a40]\nnvml_names = [\"\xff\"]\n")
    with pytest.raises(GpuSpecError, match=r"gpus.toml:2: not UTF-8 text"):
        load_gpu_table(path)


def test_table_from_the_environment_says_so(tmp_path, monkeypatch):
    monkeypatch.setenv("ENVPIPE_GPU_TABLE", str(tmp_path / "none.toml"))
    with pytest.raises(GpuSpecError, match="cannot read GPU table.*ENVPIPE_GPU_TABLE: fix it or unset the variable"):
        load_gpu_table()
