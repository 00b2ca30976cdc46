"""Bad ``--envpipe-*`` flags fail at argument parsing, in one line naming the flag and value.

One table drives every case through what an entry point runs: ``add_envpipe_args``
+ argparse, ``EnvPipeConfig.from_args`` and, with a Megatron-shaped namespace,
``validate_with_megatron_args``. Then ``envpipe reset-clocks`` failures (a SLURM
epilog trusts its exit status) on the pynvml test double, and one end-to-end run
of the tiny GPT example under torchrun.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_envpipe.config import EnvPipeConfig, EnvPipeConfigError, add_envpipe_args, fraction

REPO = Path(__file__).resolve().parents[2]


def megatron(pp: int = 4, **kwargs) -> argparse.Namespace:
    """What Megatron's parser returns, as far as the start-up checks read it."""
    values = dict(pipeline_model_parallel_size=pp, virtual_pipeline_model_parallel_size=None,
                  num_layers_per_virtual_pipeline_stage=None, tensor_model_parallel_size=1,
                  context_parallel_size=1, micro_batch_size=None, global_batch_size=None, world_size=None)
    values.update(kwargs)
    return argparse.Namespace(**values)


def check(argv: list[str], megatron_args: argparse.Namespace | None = None) -> EnvPipeConfig:
    args = add_envpipe_args(argparse.ArgumentParser(prog="train")).parse_args(argv)
    config = EnvPipeConfig.from_args(args)
    return config.validate_with_megatron_args(megatron_args) if megatron_args is not None else config


@pytest.fixture(scope="module")
def bad_profiles(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("profiles")
    (d / "corrupt.csv").write_text("stage,instruction,frequency,time,energy\n0,forward,fast,1.0,2.0\n")
    (d / "latin1.csv").write_bytes("stage,instruction,frequency,time,energy\n0,forward,1500,1.0,2.0 \xe9\n"
                                  .encode("latin-1"))
    (d / "header-only.csv").write_text("stage,instruction,frequency,time,energy\n")
    (d / "a-file").write_text("not a directory\n")
    return d


OPTIMAL = ["--envpipe-type", "optimal"]
OURS = ["--envpipe-scheduling", "ours"]

# (argv, Megatron namespace or None, what the one message must name). {d}: the bad-profile dir.
CONFIG_ERRORS = [
    # -- numbers: nan, inf, out of range (EnvPipeConfig.validate) --
    (["--envpipe-p2p-power", "nan"], None, ["--envpipe-p2p-power nan", "finite"]),
    (["--envpipe-p2p-power", "inf"], None, ["--envpipe-p2p-power inf", "finite"]),
    (["--envpipe-p2p-power", "-1"], None, ["--envpipe-p2p-power -1", ">= 0 W"]),
    (["--envpipe-p2p-power", "70000"], None, ["--envpipe-p2p-power 70000", "at most 10000 W"]),
    (["--envpipe-threshold-scale", "nan"], None, ["--envpipe-threshold-scale nan", "finite"]),
    (["--envpipe-threshold-scale=-inf"], None, ["--envpipe-threshold-scale -inf", "finite"]),
    (["--envpipe-threshold-scale", "0"], None, ["--envpipe-threshold-scale 0", "> 0"]),
    (["--envpipe-comm-timeout", "nan"], None, ["--envpipe-comm-timeout nan", "finite", "seconds"]),
    (["--envpipe-comm-timeout", "inf"], None, ["--envpipe-comm-timeout inf", "finite"]),
    (["--envpipe-comm-timeout", "-5"], None, ["--envpipe-comm-timeout -5", "> 0 seconds"]),
    (OPTIMAL + ["--envpipe-target-time", "nan"], None, ["--envpipe-target-time nan", "finite"]),
    (OPTIMAL + ["--envpipe-target-time", "inf"], None, ["--envpipe-target-time inf", "finite"]),
    (OPTIMAL + ["--envpipe-target-time", "0"], None, ["--envpipe-target-time 0", "> 0 s"]),
    (["--envpipe-sim-time-scale", "nan"], None, ["--envpipe-sim-time-scale nan", "finite"]),
    (["--envpipe-sim-time-scale", "0"], None, ["--envpipe-sim-time-scale 0", "> 0"]),
    (["--envpipe-sim-time-scale", "11"], None, ["--envpipe-sim-time-scale 11", "at most 10"]),
    (OPTIMAL + ["--envpipe-max-slowdown", "5"], None, ["--envpipe-max-slowdown 5", "give 0.05 or 5%"]),
    (["--envpipe-max-inflight", "0"], None, ["--envpipe-max-inflight 0", ">= 1"]),
    (["--envpipe-reconfig-step", "0"], None, ["--envpipe-reconfig-step 0", ">= 1 MHz"]),
    (["--envpipe-profile-step", "-90"], None, ["--envpipe-profile-step -90", ">= 1 MHz"]),
    (["--envpipe-finish-limit", "-1"], None, ["--envpipe-finish-limit -1", ">= 0"]),
    (["--envpipe-prefetch", "0"], None, ["--envpipe-prefetch 0", ">= 1"]),
    (["--envpipe-measure-iterations", "0"], None, ["--envpipe-measure-iterations 0", ">= 1"]),
    (["--envpipe-profile-iterations", "0"], None, ["--envpipe-profile-iterations 0", ">= 1"]),
    (["--envpipe-log-interval", "0"], None, ["--envpipe-log-interval 0", ">= 1"]),
    # -- combinations and names --
    (OPTIMAL + ["--envpipe-max-slowdown", "5%", "--envpipe-target-time", "8"], None,
     ["--envpipe-max-slowdown 0.05", "--envpipe-target-time 8", "only one"]),
    (["--envpipe-max-slowdown", "0.05"], None, ["--envpipe-max-slowdown", "--envpipe-type optimal"]),
    (["--envpipe-target-time", "8"], None, ["--envpipe-target-time", "--envpipe-type optimal"]),
    (["--envpipe-extra-warmup", "1,0"], None, ["--envpipe-extra-warmup", "--envpipe-scheduling ours"]),
    (OURS + ["--envpipe-extra-warmup", "3,-1,0,0"], None, ["--envpipe-extra-warmup 3,-1,0,0", "stage 1", ">= 0"]),
    (OURS + ["--envpipe-extra-warmup", ","], None, ["--envpipe-extra-warmup is empty"]),
    (["--envpipe-gpu", "b9000"], None, ["--envpipe-gpu", "b9000"]),
    (["--envpipe-gpu", "simulated"], None, ["--envpipe-gpu simulated needs a profile"]),
    (["--envpipe-gpu", "simulated:/no/such.csv"], None, ["--envpipe-gpu simulated:/no/such.csv", "no such profile"]),
    (["--envpipe-profile", "/no/such.csv"], None, ["--envpipe-profile '/no/such.csv'", "no such file"]),
    (["--envpipe-profile-cache", "{d}/a-file"], None, ["--envpipe-profile-cache", "a-file", "not a directory"]),
    # -- start-up checks with Megatron's flags (validate_with_megatron_args) --
    (["--envpipe-type", "envelope", "--envpipe-profile", "a40/gpt3-175b"], megatron(4),
     ["--envpipe-profile a40/gpt3-175b has 8 stages", "--pipeline-model-parallel-size 4", "per pipeline"]),
    (["--envpipe-profile", "{d}/corrupt.csv"], megatron(4), ["--envpipe-profile", "corrupt.csv", "frequency"]),
    (["--envpipe-profile", "{d}/latin1.csv"], megatron(4), ["--envpipe-profile", "latin1.csv", "not UTF-8"]),
    (["--envpipe-profile", "{d}/header-only.csv"], megatron(4), ["--envpipe-profile", "header-only.csv", "no rows"]),
    (OURS + ["--envpipe-extra-warmup", "3,2,1"], megatron(4),
     ["--envpipe-extra-warmup 3,2,1 has 3 entries", "4 stages", "e.g. 3,2,1,0"]),
    (OURS + ["--envpipe-extra-warmup", "3,2,1,0,0"], megatron(4), ["--envpipe-extra-warmup 3,2,1,0,0 has 5 entries"]),
    (OURS + ["--envpipe-max-inflight", "2"], megatron(4),
     ["--envpipe-max-inflight 2", "below the 4", "at least 4"]),
    (OURS + ["--envpipe-max-inflight", "3"], megatron(4, micro_batch_size=2, global_batch_size=16, world_size=4),
     ["--envpipe-max-inflight 3", "at least 4"]),
    (OURS, megatron(1), ["--envpipe-scheduling ours", "--pipeline-model-parallel-size is 1"]),
    (OURS, megatron(4, virtual_pipeline_model_parallel_size=2), ["--virtual-pipeline-model-parallel-size 2"]),
    (["--envpipe-type", "envelope"], megatron(4, num_layers_per_virtual_pipeline_stage=2),
     ["--num-layers-per-virtual-pipeline-stage 2", "no interleaved"]),
]

# Refused by argparse itself (exit 2): the message names the flag and the value.
ARGPARSE_ERRORS = [
    (["--envpipe-type", "turbo"], ["--envpipe-type", "'turbo'"]),
    (["--envpipe-scheduling", "zb"], ["--envpipe-scheduling", "'zb'"]),
    (["--envpipe-reconfig", "fast"], ["--envpipe-reconfig", "'fast'"]),
    (["--envpipe-on-no-permission", "maybe"], ["--envpipe-on-no-permission", "'maybe'"]),
    (["--envpipe-max-inflight", "nan"], ["--envpipe-max-inflight", "'nan'"]),
    (["--envpipe-prefetch", "1.5"], ["--envpipe-prefetch", "'1.5'"]),
    (["--envpipe-p2p-power", "seventy"], ["--envpipe-p2p-power", "'seventy'"]),
    (["--envpipe-extra-warmup", "3,x,1"], ["--envpipe-extra-warmup", "'3,x,1'"]),
    (["--envpipe-max-slowdown", "five"], ["--envpipe-max-slowdown", "'five'"]),
    (["--envpipe-max-slowdown", "nan"], ["--envpipe-max-slowdown", "'nan'", "finite"]),
    (["--envpipe-max-slowdown", "inf%"], ["--envpipe-max-slowdown", "'inf%'", "finite"]),
    (["--envpipe-max-slowdown=-5%"], ["--envpipe-max-slowdown", "'-5%'", ">= 0"]),
]


def _ids(table):
    return [" ".join(row[0]) + (" +megatron" if len(row) > 2 and row[1] is not None else "") for row in table]


@pytest.mark.parametrize("argv,megatron_args,needles", CONFIG_ERRORS, ids=_ids(CONFIG_ERRORS))
def test_bad_flag_is_one_clear_config_error(argv, megatron_args, needles, bad_profiles):
    argv = [a.replace("{d}", str(bad_profiles)) for a in argv]
    with pytest.raises(EnvPipeConfigError) as info:
        check(argv, megatron_args)
    message = str(info.value)
    assert "\n" not in message
    for needle in needles:
        assert needle in message, message


@pytest.mark.parametrize("argv,needles", ARGPARSE_ERRORS, ids=_ids(ARGPARSE_ERRORS))
def test_unparsable_flag_is_an_argparse_error(argv, needles, capsys):
    with pytest.raises(SystemExit) as info:
        check(argv)
    assert info.value.code == 2
    err = capsys.readouterr().err.splitlines()[-1]
    assert err.startswith("train: error: argument ")
    for needle in needles:
        assert needle in err, err


def test_the_table_is_big_enough():
    assert len(CONFIG_ERRORS) + len(ARGPARSE_ERRORS) >= 30


@pytest.mark.parametrize(
    "argv,megatron_args",
    [
        (["--envpipe-type", "optimal", "--envpipe-max-slowdown", "5%"], None),  # the CLI's form
        (["--envpipe-type", "optimal", "--envpipe-max-slowdown", " 0.05 "], None),
        (["--envpipe-type", "envelope", "--envpipe-profile", "a40/gpt3-175b"], megatron(8)),
        (OURS + ["--envpipe-extra-warmup", "3,2,1,0", "--envpipe-max-inflight", "4"], megatron(4)),
        # M = 16 / (2 x 4) = 2 micro-batches: 1F1B holds only 2 activations on stage 0.
        (OURS + ["--envpipe-max-inflight", "2"], megatron(4, micro_batch_size=2, global_batch_size=16, world_size=16)),
        (OURS + ["--envpipe-max-inflight", "2"], argparse.Namespace(pipeline_model_parallel_size=4, num_microbatches=2)),
        # (--envpipe-profile without a pipeline: refused since issue 39, tests/config/test_flag_table.py)
    ],
)
def test_good_flags_pass(argv, megatron_args):
    check(argv, megatron_args)


def test_max_slowdown_takes_the_cli_forms():
    assert check(OPTIMAL + ["--envpipe-max-slowdown", "5%"]).max_slowdown == pytest.approx(0.05)
    assert fraction("12.5%") == pytest.approx(0.125) and fraction("0") == 0.0
    for text in ("nan", "inf", "-0.1", "1e400", "%", ""):
        with pytest.raises(argparse.ArgumentTypeError):
            fraction(text)


def test_runtime_checks_the_pipeline_before_any_unit_runs():
    """A caller that skipped validate_with_megatron_args gets the same message at the first call."""
    from megatron_envpipe.megatron.runtime import EnvPipeRuntime

    rt = EnvPipeRuntime(EnvPipeConfig(scheduling="ours", extra_warmup=(1, 0), max_inflight=2))
    with pytest.raises(EnvPipeConfigError, match=r"--envpipe-extra-warmup 1,0 has 2 entries but the pipeline has 4"):
        rt.prepare(4, 8)
    rt = EnvPipeRuntime(EnvPipeConfig(scheduling="ours", max_inflight=2))
    with pytest.raises(EnvPipeConfigError, match=r"--envpipe-max-inflight 2 is below the 4"):
        rt.prepare(4, 8)
    assert rt.prepare(4, 2).schedule.name == "1f1b"  # M = 2: two activations are all 1F1B holds


def test_corrupt_profile_fails_at_install_time(bad_profiles):
    from megatron_envpipe.megatron.runtime import EnvPipeRuntime

    cfg = EnvPipeConfig(plan_type="envelope", profile=str(bad_profiles / "latin1.csv"))
    with pytest.raises(EnvPipeConfigError, match=r"--envpipe-profile.*latin1.csv.*not UTF-8"):
        EnvPipeRuntime(cfg)


# ---------------------------------------------------------------------------------------
# envpipe reset-clocks: anything recorded and not reset is a non-zero exit
# ---------------------------------------------------------------------------------------

def nvml_double():
    """tests/gpu/nvml_double.py, the pynvml test double (it raises nvidia-ml-py's real errors)."""
    pytest.importorskip("pynvml")
    if str(REPO / "tests" / "gpu") not in sys.path:
        sys.path.insert(0, str(REPO / "tests" / "gpu"))
    import nvml_double as module

    return module


def double(**kwargs):
    module = nvml_double()
    return module.NvmlDouble(module.node(kwargs.pop("gpus", 2)), **kwargs)


def _state(directory: Path, uuid: str, **fields) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    data = {"uuid": uuid, "pid": 2**22 + 12345, "hostname": socket.gethostname(), "locked_mhz": 900,
            "name": "NVIDIA A40", "pci_bus_id": "00000000:1B:00.0", "time": "2025-01-01T00:00:00+0000"}
    data.update(fields)
    path = directory / f"{uuid}.json"
    path.write_text(json.dumps(data))
    return path


def reset_clocks(capsys, *argv: str) -> tuple[int, str, str]:
    from megatron_envpipe.apps.cli import main

    code = main(["reset-clocks", *argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.fixture
def nvml(monkeypatch):
    d = double()
    monkeypatch.setitem(sys.modules, "pynvml", d.module())
    return d


def test_reset_clocks_state_dir_is_a_file(tmp_path, nvml, capsys):
    f = tmp_path / "state"
    f.write_text("")
    code, out, err = reset_clocks(capsys, "--state-dir", str(f))
    assert code == 4  # the state folder is refused, nothing read
    assert f"clock state folder {f}: is a regular file, not a folder" in err and "--state-dir" in err
    assert "--all" in err


@pytest.mark.parametrize(
    "content,why",
    [(b"{not json", "not JSON"), (b"\xff\xfe\x00garbage", "not UTF-8"),
     (b'["a", "list"]', "expected a JSON object"), (b'{"pid": 1}', "no 'uuid'")],
)
def test_reset_clocks_unreadable_state_file(tmp_path, nvml, capsys, content, why):
    d = tmp_path / "state"
    d.mkdir()
    bad = d / "GPU-broken.json"
    bad.write_bytes(content)
    code, out, err = reset_clocks(capsys, "--state-dir", str(d))
    assert code == 2
    assert f"{bad}: unreadable state file" in err and why in err and "--all" in err
    assert bad.exists()


def test_reset_clocks_state_file_without_read_permission(tmp_path, nvml, capsys, monkeypatch):
    d = tmp_path / "state"
    path = _state(d, nvml.gpus[0].uuid)
    from megatron_envpipe.gpu.control import state_store

    real = os.open

    def fake_open(name, flags, *args, **kwargs):  # root opens any file: fake the EACCES a user gets
        if name == path.name:
            raise PermissionError(13, "Permission denied", name)
        return real(name, flags, *args, **kwargs)

    monkeypatch.setattr(state_store.os, "open", fake_open)
    code, out, err = reset_clocks(capsys, "--state-dir", str(d))
    assert code == 3
    assert f"{path}: unreadable state file (cannot open it: Permission denied)" in err and "sudo" in err


def test_reset_clocks_without_a_driver(tmp_path, monkeypatch, capsys):
    nvml = double(gpus=1, no_driver=True)
    monkeypatch.setitem(sys.modules, "pynvml", nvml.module())
    d = tmp_path / "state"
    path = _state(d, nvml.gpus[0].uuid)
    code, out, err = reset_clocks(capsys, "--state-dir", str(d))
    assert code == 2
    assert nvml.gpus[0].uuid in err and "cannot open it" in err and "NVML cannot start" in err
    assert f"state file {path} kept" in err and path.exists()
    code, out, err = reset_clocks(capsys, "--all", "--state-dir", str(d))
    assert code == 2 and "NVML cannot start" in err


def test_reset_clocks_without_permission(tmp_path, capsys, monkeypatch):
    nvml = double(permission=False)
    monkeypatch.setitem(sys.modules, "pynvml", nvml.module())
    d = tmp_path / "state"
    paths = [_state(d, gpu.uuid) for gpu in nvml.gpus]
    code, out, err = reset_clocks(capsys, "--state-dir", str(d))
    assert code == 3
    assert all(gpu.uuid in err for gpu in nvml.gpus) and "sudo envpipe reset-clocks" in err
    assert all(p.exists() for p in paths)


def test_reset_clocks_owner_still_running(tmp_path, nvml, capsys):
    d = tmp_path / "state"
    path = _state(d, nvml.gpus[0].uuid, pid=os.getpid())
    nvml.set_gpu(nvml.gpus[0].uuid, locked=[900, 900])
    code, out, err = reset_clocks(capsys, "--state-dir", str(d))
    assert code == 2 and "still running" in err and "--force" in err and path.exists()
    code, out, err = reset_clocks(capsys, "--state-dir", str(d), "--force")
    assert code == 0 and "locked clocks reset" in out and not path.exists()
    assert nvml.gpu(nvml.gpus[0].uuid).locked is None


def test_reset_clocks_partial_success_still_fails(tmp_path, nvml, capsys):
    d = tmp_path / "state"
    good = _state(d, nvml.gpus[0].uuid)
    (d / "zz-garbage.json").write_text("{")
    code, out, err = reset_clocks(capsys, "--state-dir", str(d))
    assert code == 2 and "locked clocks reset" in out and "1 recorded GPU(s) or state file(s) not reset" in err
    assert not good.exists()


@pytest.mark.parametrize("setup", ["missing", "empty", "other-host"])
def test_reset_clocks_with_nothing_to_reset_here_exits_0(tmp_path, nvml, capsys, setup):
    d = tmp_path / "state"
    if setup == "empty":
        d.mkdir()
    elif setup == "other-host":
        _state(d, nvml.gpus[0].uuid, hostname="node-elsewhere")
    code, out, err = reset_clocks(capsys, "--state-dir", str(d))
    assert code == 0 and err == ""
    assert {"missing": "no such directory", "empty": "no state files", "other-host": "skipped"}[setup] in out


# ---------------------------------------------------------------------------------------
# end to end: the tiny GPT example under torchrun
# ---------------------------------------------------------------------------------------


def test_tiny_gpt_with_a_bad_flag_fails_at_start_up_without_a_traceback(tmp_path):
    pytest.importorskip("megatron.core")
    torchrun = shutil.which("torchrun")
    if torchrun is None:
        pytest.skip("torchrun is not on PATH")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(
        [str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])]))
    logs = tmp_path / "logs"
    proc = subprocess.run(
        [torchrun, "--nproc-per-node", "4", "--log-dir", str(logs), "--redirects", "3",
         "examples/train_tiny_gpt.py", "--pipeline-model-parallel-size", "4", "--device", "cpu",
         "--envpipe-scheduling", "ours", "--envpipe-extra-warmup", "1,0", "--train-iters", "1"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode != 0
    rank_logs = sorted(logs.rglob("stderr.log"))
    assert rank_logs, proc.stderr
    said = []
    for log in rank_logs:
        lines = [line for line in log.read_text().splitlines() if line.strip()]
        assert len(lines) <= 1 and "Traceback" not in log.read_text(), (log, lines)
        said += lines
    assert said and all(
        line == "train_tiny_gpt.py: error: --envpipe-extra-warmup 1,0 has 2 entries but the pipeline has 4 "
                "stages (--pipeline-model-parallel-size 4): give exactly one per stage, first stage first, "
                "e.g. 3,2,1,0" for line in said
    ), said
