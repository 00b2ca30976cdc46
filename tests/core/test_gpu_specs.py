"""The GPU clock table in configs/gpus.toml."""

from __future__ import annotations

import pytest

from megatron_envpipe.core.gpu_specs import GpuSpecError, get_gpu_spec, load_gpu_table, spec_for_nvml_name


def test_table_has_every_gpu_with_its_true_max():
    table = load_gpu_table()
    assert set(table) >= {"v100", "rtx3090", "a100", "a6000", "a40", "h100", "h100-pcie", "h200", "b200"}
    assert table["a100"].max_clock_mhz == 1410  # not EnvPipe's `% 90` 1350
    assert table["a40"].p2p_power_w == pytest.approx(70.38)
    # The GPUs people buy now, with their published clocks (and sources); what is not published says so.
    assert (table["h100"].max_clock_mhz, table["h100-pcie"].max_clock_mhz, table["h200"].max_clock_mhz) == \
        (1980, 1755, 1980)
    assert table["h200"].min_clock_mhz == 345 and table["b200"].max_clock_mhz is None
    for key in ("h100", "h100-pcie", "h200", "b200"):
        assert table[key].p2p_power_w is None
        assert any("unknown until `envpipe gpu-check`" in s for s in table[key].sources), key
    for spec in table.values():
        if spec.max_clock_mhz is None or spec.min_clock_mhz is None:
            continue  # unknown range: test_an_unknown_clock_range_takes_the_clocks_it_is_given
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


def test_an_unknown_clock_range_takes_the_clocks_it_is_given():
    """B200: no published clock table. Plans use the clocks of a profile measured on it (or NVML's list);
    asking for the table's own grid says what to do."""
    b200 = get_gpu_spec("b200")
    assert b200.candidate_clocks([1965, 1500, 900, 120]) == (1965, 1500, 900, 120)
    assert b200.on_ladder([1234])
    with pytest.raises(GpuSpecError, match="unknown until `envpipe gpu-check`"):
        b200.candidate_clocks()
    h100 = get_gpu_spec("h100")  # a known top, an unknown bottom: capped above only
    assert h100.candidate_clocks([2100, 1980, 300]) == (1980, 300)
    assert not get_gpu_spec("a40").on_ladder([5000]) and get_gpu_spec("a40").on_ladder([1740])


def test_an_unknown_clock_is_only_the_word_unknown(tmp_path):
    path = tmp_path / "gpus.toml"
    entry = ('[x]\nnvml_names = ["X"]\nmax_clock_mhz = {}\nmin_clock_mhz = 210\nclock_step_mhz = 15\n'
             'profile_step_mhz = 90\nreconfig_step_mhz = 30\np2p_power_w = "unknown"\nsources = ["s"]\n')
    path.write_text(entry.format('"fast"'))
    with pytest.raises(GpuSpecError, match="max_clock_mhz = 'fast' has the wrong type: give an integer"):
        load_gpu_table(path)
    path.write_text(entry.format('"unknown"'))
    assert load_gpu_table(path)["x"].max_clock_mhz is None
