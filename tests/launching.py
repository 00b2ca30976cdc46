"""One way for tests to start torchrun: a free port, the whole log kept in a folder, a timeout, the log's
tail on failure. Tests import it (tests/ is on sys.path under pytest: tests/conftest.py lives there).
"""

from __future__ import annotations

import os
import subprocess
import sys
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
    For tests of what the ranks train and print; a test whose subject is torchrun's own behaviour runs the
    real one.
    ``check``: fail the test (with the log's tail and where the whole log is) unless every rank exits 0.
    A run past ``timeout_s`` always fails the test, with what it printed so far.
    """
    launcher = ["megatron_envpipe.testing.forked_ranks"] if forked else ["torch.distributed.run"]
    cmd = [sys.executable, "-m", *launcher, "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
           *map(str, args)]
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / "torchrun.log"
    try:
        proc = subprocess.run(cmd, cwd=cwd, env=env or child_env(), capture_output=True, text=True,
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
