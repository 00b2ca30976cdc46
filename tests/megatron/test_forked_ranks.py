"""The tests' forked torchrun (megatron_envpipe/testing/forked_ranks.py): each rank runs the script as
``python script.py`` would, with torchrun's rank environment; the first failure stops the others.

Plain-Python ranks (nothing preloaded, no process group): what is checked is the launcher, cheaply.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap

from launching import child_env

RANK_SCRIPT = textwrap.dedent(r"""
    import atexit, os, sys, time
    env = {k: os.environ[k] for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                                      "MASTER_PORT")}
    say = lambda text: os.write(1, (text + "\n").encode())  # one write per line: ranks share the pipe
    atexit.register(say, f"atexit of rank {env['RANK']}")
    say(f"rank {env} {sys.argv[1:]} {__name__} {sys.path[0] == os.path.dirname(os.path.abspath(__file__))}")
    if sys.argv[1] == "fail" and env["RANK"] == "1":
        sys.exit(3)
    if sys.argv[1] in ("fail", "sleep"):
        time.sleep(600)  # a peer waiting for the failed rank (or the launcher's signal): it must be stopped
""")


def _launch(tmp_path, *args: str) -> subprocess.CompletedProcess:
    script = tmp_path / "rank.py"
    script.write_text(RANK_SCRIPT)
    return subprocess.run([sys.executable, "-m", "megatron_envpipe.testing.forked_ranks", "--nproc-per-node", "3",
                           "--master-port", "29999", "--preload", "", str(script), *args],
                          cwd=tmp_path, env=child_env(), capture_output=True, text=True, timeout=120)


def test_each_rank_runs_the_script_as_main_with_torchruns_environment(tmp_path):
    proc = _launch(tmp_path, "ok", "--flag", "1")
    assert proc.returncode == 0, proc.stderr
    lines = sorted(line for line in proc.stdout.splitlines() if line.startswith("rank "))
    assert lines == [f"rank {{'RANK': '{r}', 'LOCAL_RANK': '{r}', 'WORLD_SIZE': '3', 'LOCAL_WORLD_SIZE': '3', "
                     f"'MASTER_ADDR': '127.0.0.1', 'MASTER_PORT': '29999'}} ['ok', '--flag', '1'] __main__ True"
                     for r in range(3)], proc.stdout
    assert sorted(line for line in proc.stdout.splitlines() if line.startswith("atexit")) == [
        f"atexit of rank {r}" for r in range(3)]  # a normal interpreter exit in every rank


def test_the_first_failed_rank_stops_the_others_and_fails_the_launch(tmp_path):
    proc = _launch(tmp_path, "fail")
    assert proc.returncode == 1, (proc.stdout, proc.stderr)
    (line,) = [line for line in proc.stderr.splitlines() if line.startswith("forked_ranks:")]
    assert "3 rank(s) failed: rank 1 (pid " in line and ") exited with code 3" in line, line
    assert line.count("killed by SIGTERM") == 2, line  # its peers did not sleep their 600 s


def test_a_preloaded_module_runs_once_as_main_like_python_m(tmp_path):
    # python -m never imports the module under its own name first; a preloaded copy must not make
    # runpy warn and run it a second time.
    (tmp_path / "rank_mod.py").write_text("import os\nos.write(1, f'ran as {__name__}\\n'.encode())\n")
    env = child_env()
    env["PYTHONPATH"] = f"{tmp_path}:{env.get('PYTHONPATH', '')}"
    proc = subprocess.run([sys.executable, "-m", "megatron_envpipe.testing.forked_ranks", "--nproc-per-node", "2",
                           "--master-port", "29999", "--preload", "rank_mod", "-m", "rank_mod"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "found in sys.modules" not in proc.stderr, proc.stderr
    # once at preload (as rank_mod), once per rank as __main__
    assert sorted(proc.stdout.splitlines()) == ["ran as __main__", "ran as __main__", "ran as rank_mod"], proc.stdout


def test_a_launcher_stopped_by_sigterm_exits_128_plus_the_signal(tmp_path):
    script = tmp_path / "rank.py"
    script.write_text(RANK_SCRIPT)
    proc = subprocess.Popen([sys.executable, "-m", "megatron_envpipe.testing.forked_ranks", "--nproc-per-node", "2",
                             "--master-port", "29999", "--preload", "", str(script), "sleep"],
                            cwd=tmp_path, env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    seen = ""
    while seen.count("rank {") < 2:  # both ranks started (each writes its line first)
        seen += proc.stdout.readline()
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM, (seen + out, err)
