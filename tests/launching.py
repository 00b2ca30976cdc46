"""One way for tests to start torchrun: a free port, the whole log kept in a folder, a timeout, the log's
tail on failure. Tests import it (tests/ is on sys.path under pytest: tests/conftest.py lives there).
"""

from __future__ import annotations

import atexit
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from megatron_envpipe.megatron.localhost import free_port

REPO = Path(__file__).resolve().parents[1]


def child_env(**extra: str) -> dict[str, str]:
    """This environment with the repository importable and one thread per rank (2 cores, 4 ranks)."""
    path = os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=path, **extra)


@dataclass(frozen=True)
class TorchrunResult:
    returncode: int
    log: str  # torchrun's stdout then stderr (every rank's output, as torchrun forwards it)
    log_path: Path  # the whole log, kept


def torchrun(args: Sequence[object], *, cwd: Path, log_dir: Path, timeout_s: float, check: bool = True,
             env: dict[str, str] | None = None, forked: bool = False) -> TorchrunResult:
    """``torchrun <args>`` as a doc writes it (``["--nproc-per-node", 4, script, *flags]``), run as
    ``python -m torch.distributed.run`` on 127.0.0.1 and a free port; its whole log is kept in
    ``log_dir/torchrun.log`` (a failure shows only the tail).

    ``forked``: the same ranks (torchrun's rank environment, the script run as ``__main__`` with the same
    arguments) forked from one interpreter that imported torch and megatron-core once
    (megatron_envpipe/testing/forked_ranks.py): a 4-rank tiny-GPT launch costs about 6 CPU-s instead of 23.
    That interpreter is one per test session (ForkServer below): each launch after the first skips the imports.
    For tests of what the ranks train and print; a test whose subject is torchrun's own behaviour runs the
    real one.
    ``check``: fail the test (with the log's tail and where the whole log is) unless every rank exits 0.
    A run past ``timeout_s`` always fails the test, with what it printed so far.
    """
    launcher = ["megatron_envpipe.testing.forked_ranks"] if forked else ["torch.distributed.run"]
    argv = ["--master-addr", "127.0.0.1", "--master-port", str(free_port()), *map(str, args)]
    cmd = [sys.executable, "-m", *launcher, *argv]
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / "torchrun.log"
    env = env or child_env()
    if forked and _SERVER.serves(argv, env):
        return _SERVER.launch(argv, cwd=cwd, env=env, log_path=log_path, timeout_s=timeout_s, check=check)
    try:
        proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True,
                              timeout=timeout_s)
    except subprocess.TimeoutExpired as e:
        out = "".join(x.decode(errors="replace") if isinstance(x, bytes) else (x or "") for x in (e.stdout, e.stderr))
        log_path.write_text(out)
        raise AssertionError(f"{launcher[0]} ran past {timeout_s:.0f} s (whole log: {log_path})\n{out[-6000:]}") \
            from None
    result = TorchrunResult(proc.returncode, proc.stdout + proc.stderr, log_path)
    log_path.write_text(result.log)
    if check and proc.returncode != 0:
        raise AssertionError(f"{launcher[0]} exited {proc.returncode} (whole log: {log_path})\n{result.log[-6000:]}")
    return result


class ForkServer:
    """One ``forked_ranks --serve`` per test session: torch and megatron-core imported once for every
    forked launch instead of once per launch (~4 CPU-s each). Launches that would read another
    ``OMP_NUM_THREADS`` or ``PYTHONPATH`` at import, or preload something else, start their own launcher.
    ``ENVPIPE_TEST_FORK_SERVER=0`` turns it off. Waited for at exit, so that ``time`` counts its CPU."""

    def __init__(self, preload: str | None = None) -> None:
        self.preload = [] if preload is None else ["--preload", preload]  # None: the tiny GPT's
        self.proc: subprocess.Popen | None = None
        self.env: dict[str, str] = {}
        self.buffer = b""
        self.running: int | None = None  # the launcher of the launch in flight
        self.errors = tempfile.TemporaryFile()  # the server's own stderr (its preload's warnings; a crash)

    def serves(self, argv: list[str], env: dict[str, str]) -> bool:
        if os.environ.get("ENVPIPE_TEST_FORK_SERVER", "1") == "0":
            return False
        if "--preload" in argv and self.preload[1:] != argv[argv.index("--preload") + 1:][:1]:
            return False
        if self.proc is None or self.proc.poll() is not None:
            self.env = child_env()
            self.proc = subprocess.Popen([sys.executable, "-m", "megatron_envpipe.testing.forked_ranks", "--serve",
                                          *self.preload],
                                         cwd=REPO, env=self.env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                         stderr=self.errors, bufsize=0)
            self.buffer = b""
        return all(env.get(k) == self.env.get(k) for k in ("OMP_NUM_THREADS", "PYTHONPATH"))

    def _line(self, deadline: float | None) -> str | None:
        """The server's next line; None past the deadline."""
        assert self.proc is not None and self.proc.stdout is not None
        while b"\n" not in self.buffer:
            wait = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not select.select([self.proc.stdout], [], [], wait)[0]:
                return None
            chunk = os.read(self.proc.stdout.fileno(), 4096)
            if not chunk:
                self.errors.seek(0)
                raise AssertionError(f"forked_ranks --serve exited {self.proc.wait()} during a launch\n"
                                     f"{self.errors.read().decode(errors='replace')[-6000:]}")
            self.buffer += chunk
        line, self.buffer = self.buffer.split(b"\n", 1)
        return line.decode()

    def launch(self, argv: list[str], *, cwd: Path, env: dict[str, str], log_path: Path, timeout_s: float,
               check: bool) -> TorchrunResult:
        assert self.proc is not None and self.proc.stdin is not None
        log_path.parent.mkdir(parents=True, exist_ok=True)
        out, err = log_path.with_suffix(".stdout"), log_path.with_suffix(".stderr")
        request = {"argv": argv, "cwd": str(cwd), "env": env, "stdout": str(out), "stderr": str(err)}
        deadline = time.monotonic() + timeout_s
        self.proc.stdin.write((json.dumps(request) + "\n").encode())
        pid = self._line(deadline)
        if pid is None:  # still importing: a server stuck before forking is of no further use
            self.proc.kill()
            self.proc.wait()
            code = None
        else:
            self.running = int(pid)
            code = self._line(deadline)
            if code is None:  # as subprocess.run's timeout: kill the launcher (its ranks die with it)
                os.kill(self.running, signal.SIGKILL)
                self._line(None)
            self.running = None
        log = "".join(path.read_text(errors="replace") if path.exists() else "" for path in (out, err))
        log_path.write_text(log)
        out.unlink(missing_ok=True)
        err.unlink(missing_ok=True)
        if code is None:
            raise AssertionError(f"megatron_envpipe.testing.forked_ranks ran past {timeout_s:.0f} s "
                                 f"(whole log: {log_path})\n{log[-6000:]}")
        result = TorchrunResult(int(code), log, log_path)
        if check and result.returncode != 0:
            raise AssertionError(f"megatron_envpipe.testing.forked_ranks exited {result.returncode} "
                                 f"(whole log: {log_path})\n{log[-6000:]}")
        return result

    def close(self) -> None:
        if self.running is not None:  # interrupted during a launch: stop it rather than wait for it
            os.kill(self.running, signal.SIGKILL)
        if self.proc is not None and self.proc.poll() is None:
            assert self.proc.stdin is not None
            self.proc.stdin.close()
            self.proc.wait()


_SERVER = ForkServer()
atexit.register(_SERVER.close)
