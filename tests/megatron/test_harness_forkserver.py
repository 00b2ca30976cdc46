"""The harness's forkserver is stopped and waited for when the process that started it exits, so that the
CPU time of the ranks it forked counts in that process's children (``/usr/bin/time pytest`` sees them).

In-process, with stand-ins for the forkserver and the rank start: the real one is measured in
/work/notes (test_3d_parallel: 6.6 CPU-s seen without the wait, 23.5 with it).
"""

from __future__ import annotations

import os

import pytest

pytest.importorskip("torch", reason="needs torch")

from megatron_envpipe.testing import harness  # noqa: E402


class FakeServer:
    def __init__(self, pid: int | None) -> None:
        self._forkserver_pid = pid
        self.stopped = 0

    def _stop(self) -> None:
        self.stopped += 1
        self._forkserver_pid = None


def _noop(rank: int) -> None:
    raise AssertionError("never started")


@pytest.fixture
def started(monkeypatch: pytest.MonkeyPatch) -> tuple[list, FakeServer]:
    """start_ranks called twice, with the exit handlers it registers captured instead of registered."""
    handlers: list = []

    def unregister(fn) -> None:
        handlers[:] = [h for h in handlers if h[0] is not fn]

    monkeypatch.setattr(harness.atexit, "register", lambda fn, *args: handlers.append((fn, args)))
    monkeypatch.setattr(harness.atexit, "unregister", unregister)
    monkeypatch.setattr(harness.mp, "start_processes", lambda *a, **k: None)
    server = FakeServer(pid=12345)
    monkeypatch.setattr(harness.forkserver, "_forkserver", server)
    harness.start_ranks(_noop, (), 2)
    harness.start_ranks(_noop, (), 2)
    return handlers, server


def test_the_process_that_starts_ranks_waits_for_its_forkserver_once_at_exit(started) -> None:
    handlers, server = started
    assert len(handlers) == 1, handlers  # once, however many launches
    fn, args = handlers[0]
    fn(*args)  # the interpreter exits
    assert server.stopped == 1 and server._forkserver_pid is None
    fn(*args)
    assert server.stopped == 1  # nothing left to stop


def test_a_forked_copy_of_that_process_leaves_the_forkserver_alone(started, monkeypatch) -> None:
    handlers, server = started
    fn, args = handlers[0]
    child_pid = os.getpid() + 1
    monkeypatch.setattr(harness.os, "getpid", lambda: child_pid)  # as in a child os.fork() made
    fn(*args)
    assert server.stopped == 0
