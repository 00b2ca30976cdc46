"""``envpipe demo`` checks everything it can before it starts anything, and reports a failed
training process as one line: the failing rank, its own error, its log (issue 20).

Up-front checks run in-process (with torchrun made to fail the test if started);
the report is tested on hand-made torchrun logs and once on a real demo whose
rank 0 fails right at start-up (its tokenizer cache is a file).
"""

from __future__ import annotations

import shutil
import signal
import subprocess
from pathlib import Path

import pytest

from megatron_envpipe.apps import demo
from megatron_envpipe.apps.cli import main
from megatron_envpipe.apps.demo import _check_training_flags, _DemoConfig, _training_runs
from megatron_envpipe.apps.demo_errors import DemoError, training_failure
from megatron_envpipe.core.resources import configs_dir, shipped_profile

HEADER = "stage,instruction,frequency,time,energy"


def _config(tmp_path: Path, **changes: str) -> Path:
    text = (configs_dir() / "demo.toml").read_text()
    for old, new in changes.items():
        assert old in text
        text = text.replace(old, new, 1)
    path = tmp_path / "demo.toml"
    path.write_text(text)
    return path


@pytest.fixture
def no_torchrun(monkeypatch):
    """torchrun (and the GPU count, which imports torch) must not be reached by a refused demo."""
    def started(*args, **kwargs):
        raise AssertionError("the demo started a training process")

    monkeypatch.setattr(demo.subprocess, "Popen", started)
    monkeypatch.setattr(demo.subprocess, "run", started)
    monkeypatch.setattr(demo, "_gpus", lambda: 0)


def _demo(argv: list[str], capsys) -> tuple[int, str, str]:
    code = main(argv)
    out = capsys.readouterr()
    return code, out.out, out.err


# -- the config, through the training's own checks -----------------------------------------
def test_load_refuses_a_scheduling_the_demo_cannot_train(tmp_path):
    with pytest.raises(DemoError) as exc:
        _DemoConfig.load(_config(tmp_path, **{'scheduling = "ours"': 'scheduling = "interleaved"'}))
    assert "[demo] scheduling = 'interleaved'" in str(exc.value) and "--" not in str(exc.value)


@pytest.mark.parametrize("changes,key", [
    ({"scheduling": "interleaved"}, "scheduling"),  # what load() refuses itself; the training refuses it too
    ({"profile_step_mhz": 0}, "profile_step_mhz"),
    ({"plan_type": "fastest"}, "plan_type"),
    ({"sim_jitter": 0.5}, "sim_jitter"),  # above --envpipe-sim-jitter's range
])
def test_training_checks_name_the_demo_keys_not_training_flags(changes, key):
    cfg = _DemoConfig(**changes)
    with pytest.raises(DemoError) as exc:
        _check_training_flags(cfg, "x.toml", _training_runs(cfg, f"simulated:{cfg.profile}", Path("out")), cfg.stages)
    message = str(exc.value)
    assert message.startswith(f"x.toml: [demo] {key} = ") and "training run would refuse it" in message
    assert "--envpipe-" not in message, message


def test_the_shipped_config_passes_the_training_checks():
    cfg = _DemoConfig.load()
    _check_training_flags(cfg, "demo.toml", _training_runs(cfg, "simulated:a40/gpt3-175b", Path("out")), cfg.stages)


def test_cli_refuses_such_a_config_before_creating_anything(tmp_path, no_torchrun, capsys):
    config = _config(tmp_path, **{'scheduling = "ours"': 'scheduling = "interleaved"'})
    code, out, err = _demo(["demo", "--config", str(config), "--out", str(tmp_path / "out")], capsys)
    assert code == 2 and err.startswith("envpipe demo: error: ") and err.count("\n") == 1, err
    assert "[demo] scheduling" in err and "--envpipe" not in err and out == ""
    assert not (tmp_path / "out").exists()


# -- --gpu simulated:<csv>: loaded and validated up front ----------------------------------
ROWS = [f"{s},{ins},1740,0.01,3.0" for s in range(2) for ins in ("forward", "backward")]
GARBAGE = [
    ("text-time", "\n".join([HEADER, ROWS[0], "0,backward,1740,fast,3.0"]), "g.csv:3: time 'fast' is not a number"),
    ("binary", b"\x89PNG\r\n\x1a\n\x00\xff", "g.csv:1: not UTF-8 text"),
    ("header-only", HEADER + "\n", "g.csv: profile has a header but no rows"),
    ("too-few-stages", "\n".join([HEADER, *ROWS]) + "\n", "cannot emulate 4 stages with a 2-stage profile"),
    ("no-backward", "\n".join([HEADER, ROWS[0], ROWS[2], ROWS[3]]) + "\n", "stage 0 has no backward rows"),
]


@pytest.mark.parametrize("body,needle", [pytest.param(b, n, id=i) for i, b, n in GARBAGE])
def test_a_garbage_simulated_profile_fails_before_anything_starts(body, needle, tmp_path, no_torchrun, capsys):
    csv = tmp_path / "g.csv"
    csv.write_bytes(body if isinstance(body, bytes) else body.encode())
    code, out, err = _demo(["demo", "--gpu", f"simulated:{csv}", "--out", str(tmp_path / "out")], capsys)
    assert code == 2 and err.count("\n") == 1, err
    assert err.startswith(f"envpipe demo: error: --gpu simulated:{csv}: ") and needle in err, err
    assert "Traceback" not in err and out == ""
    assert not (tmp_path / "out").exists()


def test_a_good_simulated_profile_passes_the_check():
    cfg = _DemoConfig.load()
    demo._check_gpu(f"simulated:{shipped_profile('a40/gpt3-175b')}", cfg)


# -- a failed training process: one line, its cause ----------------------------------------
def _rank_log(ranks: Path, rank: int, text: str) -> Path:
    path = ranks / "none_abc" / "attempt_0" / str(rank) / "stderr.log"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    (path.parent / "stdout.log").write_text("")
    return path


TORCHRUN_SUMMARY = """
Traceback (most recent call last):
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
============================================================
megatron_envpipe.apps.train_tiny_gpt FAILED
------------------------------------------------------------
Root Cause (first observed failure):
[0]:
  time      : 2026-01-01_00:00:00
  host      : localhost
  rank      : {rank} (local_rank: {rank})
  exitcode  : {code} (pid: 1234)
  error_file: <N/A>
============================================================
"""
TRACEBACK = "Traceback (most recent call last):\n  File \"x.py\", line 1, in <module>\n"
LOST_PEER = "[rank2]: RuntimeError: [pair.cc:553] Connection closed by peer [127.0.0.1]:6031. GLHF!\n"


def test_the_rank_with_its_own_error_is_blamed_not_the_one_that_lost_its_peer(tmp_path):
    ranks = tmp_path / "baseline-ranks"
    log = tmp_path / "baseline.log"
    log.write_text("[default2]:junk\n" + TORCHRUN_SUMMARY.format(rank=2, code=1))
    own = _rank_log(ranks, 0, TRACEBACK + "[rank0]: FileExistsError: [Errno 17] File exists: 'out/cache'\n")
    _rank_log(ranks, 2, TRACEBACK + LOST_PEER)
    _rank_log(ranks, 3, "")
    error = training_failure("baseline", 1, log, ranks)
    assert str(error) == f"rank 0: FileExistsError: [Errno 17] File exists: 'out/cache' (log: {own})"


def test_torchruns_root_cause_is_taken_when_it_has_its_own_error(tmp_path):
    ranks = tmp_path / "r"
    log = tmp_path / "envpipe.log"
    log.write_text(TORCHRUN_SUMMARY.format(rank=3, code=1))
    _rank_log(ranks, 1, TRACEBACK + "ValueError: another\n")
    own = _rank_log(ranks, 3, TRACEBACK + "megatron_envpipe.config.EnvPipeConfigError: --envpipe-x bad\nmore\n")
    assert str(training_failure("envpipe", 1, log, ranks)) == (
        f"rank 3: megatron_envpipe.config.EnvPipeConfigError: --envpipe-x bad (log: {own})")


def test_without_rank_logs_the_prefixed_lines_of_the_combined_log_are_read(tmp_path):
    log = tmp_path / "baseline.log"
    log.write_text("[default1]:hello\n[default1]:train_tiny_gpt.py: error: --envpipe-comm-timeout: too big\n"
                   "[default0]:" + LOST_PEER + TORCHRUN_SUMMARY.format(rank=0, code=1))
    assert str(training_failure("baseline", 1, log, tmp_path / "none")) == (
        f"rank 1: train_tiny_gpt.py: error: --envpipe-comm-timeout: too big (log: {log})")


def test_a_rank_killed_without_a_message(tmp_path):
    log = tmp_path / "baseline.log"
    log.write_text(TORCHRUN_SUMMARY.format(rank=1, code=-9))
    _rank_log(tmp_path / "r", 1, "just output\n")
    assert str(training_failure("baseline", 137, log, tmp_path / "r")) == (
        f"the baseline run failed: rank 1 exited with code -9, with no error message (log: {log})")


def test_the_cause_is_one_printable_bounded_line(tmp_path):
    log = tmp_path / "baseline.log"
    log.write_text(TORCHRUN_SUMMARY.format(rank=0, code=1))
    _rank_log(tmp_path / "r", 0, "ValueError: a\x1b[31mred\x07 " + "x" * 1000 + "\n")
    message = str(training_failure("baseline", 1, log, tmp_path / "r"))
    assert "\x1b" not in message and "\x07" not in message and "\n" not in message
    assert "x" * 400 not in message and "..." in message


def test_ctrl_c_during_training_stops_torchrun(tmp_path, monkeypatch):
    sent = []

    class FakeTorchrun:
        def __init__(self, *args, **kwargs):
            self.waits = 0

        def wait(self, timeout=None):
            self.waits += 1
            if self.waits == 1:
                raise KeyboardInterrupt
            return -signal.SIGTERM

        def send_signal(self, sig):
            sent.append(sig)

    monkeypatch.setattr(demo.subprocess, "Popen", FakeTorchrun)
    with pytest.raises(KeyboardInterrupt):
        demo._train(_DemoConfig(), tmp_path, "baseline", [], 1, "cpu", 2)
    assert sent == [signal.SIGTERM]  # its ranks are stopped with it, none left running


def test_a_failing_rank_of_a_real_demo_is_one_line(tmp_path, capsys):
    """The real demo (2 stages, the smallest) whose rank 0 cannot create its tokenizer cache."""
    pytest.importorskip("torch")
    pytest.importorskip("megatron.core")
    config = _config(tmp_path, **{"stages = 4": "stages = 2", "microbatches = 8": "microbatches = 2",
                                  "iterations = 6": "iterations = 1"})
    out = tmp_path / "out"
    out.mkdir()
    (out / "cache").write_text("a file where the tokenizer cache folder goes")
    code = main(["demo", "--config", str(config), "--out", str(out), "--gpu", "simulated:a40/gpt3-175b"])
    err = capsys.readouterr().err
    assert code == 1 and err.count("\n") == 1, err
    assert err.startswith("envpipe demo: error: rank 0: FileExistsError: "), err
    log = err.rsplit("(log: ", 1)[1].rstrip(")\n")
    assert Path(log).is_file() and Path(log).parent.name == "0" and "FileExistsError" in Path(log).read_text()
    if shutil.which("pgrep"):  # no rank left running (their command lines name the output folder)
        assert subprocess.run(["pgrep", "-f", str(out)], capture_output=True).stdout == b""
