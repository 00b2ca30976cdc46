"""The tests' fork server (``forked_ranks --serve``, tests/launching.py ForkServer): a launch it serves is the
launch ``python -m megatron_envpipe.testing.forked_ranks ARGV`` would be (ranks, environment, folder, exit
codes, output), many launches share one interpreter's imports, a launch past its timeout is killed and the
next one still runs. Plain-Python ranks, nothing preloaded: what is checked is the server, cheaply.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
from launching import ForkServer, child_env

pytestmark = [pytest.mark.dist]  # starts a server and its ranks (test tiers: docs/testing.md)

RANK_SCRIPT = textwrap.dedent(r"""
    import atexit, os, sys, time
    rank = os.environ["RANK"]
    say = lambda text: os.write(1, (text + "\n").encode())  # one write per line: ranks share the file
    atexit.register(say, f"atexit of rank {rank}")
    say(f"rank {rank}/{os.environ['WORLD_SIZE']} {sys.argv[1:]} {__name__} {os.getcwd()} "
        f"{os.environ.get('EXTRA')} {sys.path[0] == os.path.dirname(os.path.abspath(__file__))}")
    if sys.argv[1] == "fail" and rank == "1":
        sys.exit(3)
    if sys.argv[1] in ("fail", "sleep"):
        time.sleep(600)
""")


@pytest.fixture
def server():
    served = ForkServer(preload="")
    yield served
    served.close()
    assert served.proc is not None and served.proc.returncode == 0  # exits at the end of its input, waited for


def _argv(tmp_path, *args: str) -> list[str]:
    script = tmp_path / "rank.py"
    script.write_text(RANK_SCRIPT)
    return ["--master-addr", "127.0.0.1", "--master-port", "29998", "--nproc-per-node", "3", "--preload", "",
            str(script), *args]


def test_a_served_launch_is_the_launch_a_fresh_launcher_makes(server, tmp_path):
    argv = _argv(tmp_path, "ok", "--flag", "1")
    work = tmp_path / "work"
    work.mkdir()
    env = child_env(EXTRA="from-the-test")
    fresh = subprocess.run([sys.executable, "-m", "megatron_envpipe.testing.forked_ranks", *argv], cwd=work, env=env,
                           capture_output=True, text=True, timeout=120)
    assert server.serves(argv, env) and not ForkServer().serves(argv, env)  # (nor another preload)
    served = [server.launch(argv, cwd=work, env=env, log_path=tmp_path / f"log{i}" / "torchrun.log", timeout_s=120,
                            check=True) for i in range(2)]  # one server, several launches
    expected = sorted(f"rank {r}/3 ['ok', '--flag', '1'] __main__ {work} from-the-test True" for r in range(3))
    assert sorted(line for line in fresh.stdout.splitlines() if line.startswith("rank ")) == expected, fresh.stderr
    for result in served:
        assert result.returncode == 0
        assert sorted(line for line in result.log.splitlines() if line.startswith("rank ")) == expected, result.log
        assert sorted(line for line in result.log.splitlines() if line.startswith("atexit")) == [
            f"atexit of rank {r}" for r in range(3)]  # every rank's interpreter exits normally
        assert result.log_path.read_text() == result.log and sorted(os.listdir(result.log_path.parent)) == [
            "torchrun.log"]


def test_a_failed_rank_fails_the_served_launch_as_it_fails_a_fresh_one(server, tmp_path):
    argv = _argv(tmp_path, "fail")
    assert server.serves(argv, child_env())
    result = server.launch(argv, cwd=tmp_path, env=child_env(), log_path=tmp_path / "log" / "torchrun.log",
                           timeout_s=120, check=False)
    assert result.returncode == 1, result.log
    (line,) = [line for line in result.log.splitlines() if line.startswith("forked_ranks:")]
    assert "3 rank(s) failed: rank 1 (pid " in line and ") exited with code 3" in line and line.count("SIGTERM") == 2
    with pytest.raises(AssertionError, match="forked_ranks exited 1 .*whole log"):
        server.launch(argv, cwd=tmp_path, env=child_env(), log_path=tmp_path / "log2" / "torchrun.log", timeout_s=120,
                      check=True)
    bad = server.launch(["--master-port", "1", "--nproc-per-node", "0", "x.py"], cwd=tmp_path, env=child_env(),
                        log_path=tmp_path / "log3" / "torchrun.log", timeout_s=120, check=False)
    assert bad.returncode == 2 and "at least 1" in bad.log  # the launcher's own usage error, exit 2


def test_a_launch_past_its_timeout_is_killed_and_the_server_serves_the_next(server, tmp_path):
    argv = _argv(tmp_path, "sleep")
    assert server.serves(argv, child_env())
    with pytest.raises(AssertionError, match="ran past 3 s"):
        server.launch(argv, cwd=tmp_path, env=child_env(), log_path=tmp_path / "log" / "torchrun.log", timeout_s=3,
                      check=True)
    ok = server.launch(_argv(tmp_path, "ok"), cwd=tmp_path, env=child_env(), log_path=tmp_path / "ok" / "torchrun.log",
                       timeout_s=120, check=True)
    assert sum(line.startswith("rank ") for line in ok.log.splitlines()) == 3


def test_a_launch_with_another_import_time_environment_is_not_served(server):
    env = child_env()
    assert server.serves([], env)
    assert not server.serves([], dict(env, OMP_NUM_THREADS="2"))
    assert not server.serves([], dict(env, PYTHONPATH="/elsewhere"))
