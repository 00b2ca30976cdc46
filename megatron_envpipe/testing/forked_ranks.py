"""Single-node torchrun for tests, with the imports paid once: ranks forked from one interpreter.

    python -m megatron_envpipe.testing.forked_ranks --nproc-per-node 4 --master-port P script.py ARGS...
    python -m megatron_envpipe.testing.forked_ranks --nproc-per-node 4 --master-port P -m MODULE ARGS...

Every rank of a torchrun launch imports torch and megatron-core on its own (about 5 CPU-seconds each,
plus 2 for torchrun's agent), which is most of what a short test training costs. Here one interpreter
imports them (``--preload``: no computation, no thread, checked), then forks one process per rank.
Each rank gets torchrun's rank environment (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``,
``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``, ...; rank 0 hosts the rendezvous store, as
without torchrun's agent) and runs the script (or ``-m`` module) as ``__main__`` with its arguments, as
``python script.py`` would: the same code path from its first line, exit code, ``atexit`` handlers
and interpreter shutdown. Like torchrun, the first rank that fails stops the others (SIGTERM, then
SIGKILL) and the launcher exits 1 naming the ranks that failed; a launcher that dies takes its ranks
with it (``PR_SET_PDEATHSIG``).

Tests whose subject is the launch itself (torchrun's own failure report, its start-up) run real
torchrun; this is for tests of what the ranks train and print (tests/launching.py). It is a launcher
for CPU ranks: ranks of a dead launcher are killed outright (no clock reset on a real GPU), and CUDA
must not be initialised before a fork; on GPUs use torchrun. Left out of torchrun's environment: the
``TORCHELASTIC_*`` variables of its agent (nothing here reads them).

    python -m megatron_envpipe.testing.forked_ranks --serve [--preload MODULES]

imports once for many launches (a test session's): each JSON line on stdin (``argv``: the launcher's
arguments as above, ``cwd``, ``env``: the whole environment, ``stdout``/``stderr``: files) forks a launcher
that runs them in that folder and environment, writing to those files, as ``python -m ...forked_ranks ARGV``
would; the server answers the launcher's pid, then its exit code, one line each, and exits at the end of
stdin. What the preload read from the environment is the server's: a caller sends only launches whose
``OMP_NUM_THREADS`` and ``PYTHONPATH`` are the server's (tests/launching.py).
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import runpy
import signal
import sys
import time
from collections.abc import Sequence
from importlib import import_module

__all__ = ["TINY_GPT_PRELOAD", "main"]

# What a tiny-GPT rank imports anyway: the example's module first (its warning filters then hold for
# Megatron's import, as in a rank), then the Megatron-core modules it builds and trains with.
TINY_GPT_PRELOAD = (
    "megatron_envpipe.apps.train_tiny_gpt",
    "megatron.core.parallel_state",
    "megatron.core.pipeline_parallel.schedules",
    "megatron.core.models.gpt",
    "megatron.core.models.gpt.gpt_layer_specs",
    "megatron.core.transformer",
    "sentencepiece",
)
_GRACE_S = 10.0  # after the first failure, the others get this long between SIGTERM and SIGKILL
_PR_SET_PDEATHSIG = 1


def _parse(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="forked_ranks", description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("--nproc-per-node", type=int, required=True)
    parser.add_argument("--master-addr", default="127.0.0.1")
    parser.add_argument("--master-port", type=int, required=True)
    parser.add_argument("--preload", default=",".join(TINY_GPT_PRELOAD),
                        help="comma-separated modules imported once before forking ('' for none)")
    parser.add_argument("-m", dest="module", action="store_true", help="run a module, as python -m does")
    parser.add_argument("target", help="the script (or, with -m, the module) every rank runs")
    parser.add_argument("args", nargs=argparse.REMAINDER)
    ns = parser.parse_args(argv)
    if ns.nproc_per_node < 1:
        parser.error(f"--nproc-per-node {ns.nproc_per_node}: at least 1")
    return ns


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


def _preload(modules: Sequence[str]) -> None:
    for name in modules:
        import_module(name)
    if _threads() != 1:  # forking a threaded process can deadlock a child; refuse instead
        raise SystemExit(f"forked_ranks: {_threads()} threads after importing {', '.join(modules)}; "
                         "a rank must be forked from a single-threaded process (preload less)")


def _run_rank(ns: argparse.Namespace, rank: int, parent: int) -> None:
    """In the child: become rank ``rank`` and run the target as ``__main__``; never returns normally."""
    _die_with_parent(parent)  # a launcher that dies takes its ranks with it
    size = ns.nproc_per_node
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), GROUP_RANK="0", ROLE_RANK=str(rank),
                      ROLE_NAME="default", WORLD_SIZE=str(size), LOCAL_WORLD_SIZE=str(size), GROUP_WORLD_SIZE="1",
                      ROLE_WORLD_SIZE=str(size), MASTER_ADDR=ns.master_addr, MASTER_PORT=str(ns.master_port))
    if ns.module:
        sys.argv = [ns.target, *ns.args]  # run_module puts the module's file in argv[0], as python -m does
        # python -m runs the module once, as __main__, never imported under its own name first: a preloaded
        # copy goes (its imports stay preloaded).
        sys.modules.pop(ns.target, None)
        runpy.run_module(ns.target, run_name="__main__", alter_sys=True)
    else:
        script = os.path.abspath(ns.target)
        sys.argv = [ns.target, *ns.args]
        sys.path[0] = os.path.dirname(script)  # python script.py: the script's folder first
        runpy.run_path(script, run_name="__main__")
    sys.exit(0)  # the script ran to its end: exit 0 through the interpreter's shutdown (atexit)


def _describe(status: int) -> str:
    if os.WIFSIGNALED(status):
        return f"killed by {signal.Signals(os.WTERMSIG(status)).name}"
    return f"exited with code {os.waitstatus_to_exitcode(status)}"


def _signal_all(ranks: dict[int, int], signum: int) -> None:
    for pid in list(ranks):
        try:
            os.kill(pid, signum)
        except ProcessLookupError:  # exited, not yet reaped
            pass


def _wait(ranks: dict[int, int]) -> int:
    """Wait for every rank (pid -> rank); after the first failure stop the rest. 0 if every rank exited 0."""
    failed: list[str] = []
    deadline: float | None = None
    while ranks:
        if deadline is None:
            pid, status = os.waitpid(-1, 0)
        else:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                if time.monotonic() >= deadline:
                    _signal_all(ranks, signal.SIGKILL)
                time.sleep(0.05)
                continue
        rank = ranks.pop(pid, None)
        if rank is None:
            continue
        if status != 0:
            failed.append(f"rank {rank} (pid {pid}) {_describe(status)}")
            if deadline is None:
                deadline = time.monotonic() + _GRACE_S
                _signal_all(ranks, signal.SIGTERM)
    if failed:
        print(f"forked_ranks: {len(failed)} rank(s) failed: " + "; ".join(failed), file=sys.stderr, flush=True)
        return 1
    return 0


def _die_with_parent(parent: int) -> None:
    prctl = getattr(ctypes.CDLL(None, use_errno=True), "prctl", None)  # Linux; elsewhere we may outlive it
    if prctl is not None:
        prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent:  # the parent died before prctl took effect
        os._exit(1)


def _launch(request: dict, server: int) -> None:
    """In a child of the server: ``python -m ...forked_ranks ARGV`` in the request's folder, environment and
    output files; never returns in the launcher (a rank it forks returns as ranks do: through SystemExit)."""
    _die_with_parent(server)
    launcher = os.getpid()
    for fd, path, flags in ((0, os.devnull, os.O_RDONLY), (1, request["stdout"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC),
                            (2, request["stderr"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC)):
        opened = os.open(path, flags, 0o644)
        os.dup2(opened, fd)
        os.close(opened)
    os.chdir(request["cwd"])
    sys.path[0] = os.getcwd()  # python -m: the folder it started in
    os.environ.clear()
    os.environ.update(request["env"])
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    sys.argv = [sys.argv[0], *request["argv"]]
    try:
        code: object = main(request["argv"])
    except SystemExit as exc:
        if os.getpid() != launcher:
            raise  # a rank's normal exit: through the interpreter's shutdown, as in a fresh launcher
        code = exc.code
    except BaseException:
        if os.getpid() != launcher:
            raise
        import traceback

        traceback.print_exc()
        code = 1
    if code is not None and not isinstance(code, int):  # as the interpreter exits on SystemExit("text")
        print(code, file=sys.stderr)
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code or 0)


def _serve(argv: Sequence[str]) -> int:
    """``--serve``: preload once, then one launch per JSON line on stdin (module docstring)."""
    parser = argparse.ArgumentParser(prog="forked_ranks --serve", allow_abbrev=False)
    parser.add_argument("--preload", default=",".join(TINY_GPT_PRELOAD))
    ns = parser.parse_args(argv)
    _die_with_parent(os.getppid())
    _preload([name for name in ns.preload.split(",") if name])
    gc.freeze()
    server = os.getpid()
    for line in sys.stdin:
        request = json.loads(line)
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            _launch(request, server)  # a rank's SystemExit (or error) comes up here: out of the loop
        print(pid, flush=True)
        _, status = os.waitpid(pid, 0)
        print(os.waitstatus_to_exitcode(status), flush=True)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--serve"]:
        return _serve(argv[1:])
    ns = _parse(argv)
    if ns.nproc_per_node > 1:  # as torchrun: one OpenMP thread per rank unless the caller says otherwise
        os.environ.setdefault("OMP_NUM_THREADS", "1")
    _preload([name for name in ns.preload.split(",") if name])
    # What the preload made lives as long as every rank: keep the ranks' garbage collector off it, so that
    # they do not copy every page of it on their first collection (copy-on-write).
    gc.freeze()
    parent = os.getpid()
    ranks: dict[int, int] = {}
    for rank in range(ns.nproc_per_node):
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            _run_rank(ns, rank, parent)  # raises SystemExit (or the rank's error) up to the interpreter
        ranks[pid] = rank

    received: list[int] = []

    def forward(signum: int, frame: object) -> None:
        received.append(signum)
        _signal_all(ranks, signum)

    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, forward)
    rc = _wait(ranks)
    return 128 + received[0] if received else rc  # stopped by a signal: say so, as torchrun does


if __name__ == "__main__":
    sys.exit(main())
