"""GPU safety: the clock worker, the clock guard, signals, and crash repair.

Subprocess tests lock clocks through the real NvmlGpu/ClockGuard/ClockController
code on the pynvml test double (tests/gpu/nvml_double.py), which persists the
"driver" state to a JSON file so the test sees what the child left behind.
"""

from __future__ import annotations

import json
import os
import selectors
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

pytest.importorskip("pynvml")  # nvidia-ml-py: installed by install.sh

from nvml_double import STATE_ENV, NvmlDouble, node  # noqa: E402

from megatron_envpipe.gpu.control import safety  # noqa: E402
from megatron_envpipe.gpu.control.clocks import ClockController  # noqa: E402
from megatron_envpipe.gpu.control.repair import reset_all_gpus, reset_clocks_from_state  # noqa: E402
from megatron_envpipe.gpu.control.safety import ClockGuard, _install_signal_handlers, resolve_state_dir  # noqa: E402
from megatron_envpipe.gpu.devices.base import GpuDevice, GpuError, GpuInfo, GpuPermissionError  # noqa: E402
from megatron_envpipe.gpu.devices.nvml import NvmlGpu  # noqa: E402

TESTS = Path(__file__).resolve().parent
REPO = TESTS.parents[1]


# ---------------------------------------------------------------------------
# a plain recording device for the controller (no NVML involved)
# ---------------------------------------------------------------------------


class RecordingGpu(GpuDevice):
    backend = "recording"

    def __init__(self, fail_with: BaseException | None = None, fail_at: int | None = None) -> None:
        self.history: list[int | None] = []
        self.locked: int | None = None
        self.fail_with = fail_with
        self.fail_at = fail_at
        self.threads: set[str] = set()

    def info(self) -> GpuInfo:
        return GpuInfo("recording GPU", "REC-0", "", "", self.backend)

    def supported_clocks_mhz(self):
        return (1740, 1500, 1200, 1000)

    def can_set_clocks(self):
        return True

    def set_locked_clocks(self, freq_mhz):
        self.threads.add(threading.current_thread().name)
        if self.fail_with is not None and (self.fail_at is None or len(self.history) == self.fail_at):
            raise self.fail_with
        self.locked = freq_mhz
        self.history.append(freq_mhz)

    def reset_locked_clocks(self):
        self.locked = None
        self.history.append(None)

    def locked_clock_mhz(self):
        return self.locked

    def energy_mj(self):
        return 0.0

    def power_w(self):
        return 0.0


class Gate:
    """Stands in for a CUDA event: synchronize() blocks until opened."""

    def __init__(self) -> None:
        self.opened = threading.Event()
        self.waited = threading.Event()

    def synchronize(self) -> None:
        self.waited.set()
        assert self.opened.wait(10), "gate never opened"


class BrokenEvent:
    def synchronize(self) -> None:
        raise RuntimeError("CUDA error: an illegal memory access was encountered")


@pytest.fixture
def guard(tmp_path):
    g = ClockGuard(tmp_path / "state", install_handlers=False)
    yield g
    g.close()


# ---------------------------------------------------------------------------
# ClockController
# ---------------------------------------------------------------------------


def test_requests_apply_in_order_on_one_worker_thread(guard):
    gpu = RecordingGpu()
    ctl = ClockController(gpu, guard)
    for f in (1200, 1000, 1500, 1200, 1740):
        assert ctl.request(f)
    ctl.flush()
    assert gpu.history == [1200, 1000, 1500, 1200, 1740]
    assert gpu.threads == {"envpipe-clocks"}
    assert ctl.applied == 5 and ctl.skipped == 0
    ctl.close()
    assert gpu.history[-1] is None and not ctl.worker_alive


def test_redundant_requests_are_skipped(guard):
    gpu = RecordingGpu()
    ctl = ClockController(gpu, guard)
    gate = Gate()
    assert ctl.request(1200, after=gate)
    assert not ctl.request(1200)  # same as the last queued one
    assert ctl.request(1000)
    assert ctl.request(1200)
    gate.opened.set()
    ctl.flush()
    assert not ctl.request(1200)  # same as the clock in place
    ctl.flush()
    assert gpu.history == [1200, 1000, 1200]
    assert (ctl.requested, ctl.applied, ctl.skipped) == (5, 3, 2)
    assert ctl.stats()["applied"] == 3
    ctl.close()


def test_worker_waits_for_the_after_event_and_keeps_order(guard):
    gpu = RecordingGpu()
    ctl = ClockController(gpu, guard)
    gate = Gate()
    ctl.request(1000, after=gate)
    ctl.request(1500)  # must not overtake the gated request
    assert gate.waited.wait(5)
    time.sleep(0.05)
    assert gpu.history == []
    with pytest.raises(GpuError, match="still pending"):
        ctl.flush(timeout=0.05)
    gate.opened.set()
    ctl.flush()
    assert gpu.history == [1000, 1500]
    assert ctl.wait_seconds > 0
    ctl.close()


def test_worker_errors_are_raised_in_the_training_thread(guard):
    gpu = RecordingGpu(fail_with=GpuPermissionError("lost CAP_SYS_ADMIN"), fail_at=1)
    ctl = ClockController(gpu, guard)
    gate = Gate()
    ctl.request(1200)
    ctl.request(1000, after=gate)  # fails
    ctl.request(1500)              # queued behind the failure: dropped, not applied out of order
    gate.opened.set()
    with pytest.raises(GpuPermissionError, match="lost CAP_SYS_ADMIN"):
        ctl.flush()
    assert gpu.history == [1200] and ctl.dropped == 1
    with pytest.raises(GpuError, match="stopped after an earlier error: lost CAP_SYS_ADMIN"):
        ctl.request(1740)
    ctl.close()  # still resets; the error was already reported
    assert gpu.history == [1200, None]


def test_failed_event_is_reported_and_close_still_resets(guard):
    gpu = RecordingGpu()
    ctl = ClockController(gpu, guard)
    ctl.request(1200)
    ctl.request(1000, after=BrokenEvent())
    time.sleep(0.1)
    with pytest.raises(RuntimeError, match="illegal memory access"):
        ctl.close()  # never reported before: raised, after the reset
    assert gpu.history == [1200, None] and gpu.locked is None
    assert guard.locked_devices() == []


def test_close_drains_then_resets_and_refuses_new_requests(guard):
    gpu = RecordingGpu()
    ctl = ClockController(gpu, guard)
    gate = Gate()
    ctl.request(1000, after=gate)
    threading.Timer(0.1, gate.opened.set).start()
    ctl.close()
    assert gpu.history == [1000, None]
    ctl.close()  # idempotent
    with pytest.raises(GpuError, match="closed"):
        ctl.request(1200)


def test_context_manager_resets_and_keeps_the_original_exception(guard):
    gpu = RecordingGpu()
    with pytest.raises(ZeroDivisionError):
        with ClockController(gpu, guard) as ctl:
            ctl.request(1200)
            ctl.flush()
            1 / 0  # noqa: B018 - the exception is the point
    assert gpu.history == [1200, None]


def test_released_guard_refuses_to_lock_again(guard):
    gpu = RecordingGpu()
    ctl = ClockController(gpu, guard)
    ctl.request(1200)
    ctl.flush()
    guard.release("SIGTERM")
    assert gpu.locked is None
    ctl.request(1000)
    ctl.flush()
    assert gpu.history == [1200, None] and ctl.refused == 1
    guard.rearm()
    ctl.request(1000)
    ctl.flush()
    assert gpu.history == [1200, None, 1000]
    ctl.close()


def test_signal_handlers_are_installed_from_the_main_thread_only():
    result = []
    t = threading.Thread(target=lambda: result.append(_install_signal_handlers()))
    t.start()
    t.join()
    assert result == [False]


# ---------------------------------------------------------------------------
# ClockGuard and state files, in-process on the double
# ---------------------------------------------------------------------------


@pytest.fixture
def double(tmp_path, monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.delenv("CUDA_DEVICE_ORDER", raising=False)
    d = NvmlDouble(node(3), state_file=tmp_path / "nvml.json")
    monkeypatch.setitem(sys.modules, "pynvml", d.module())
    return d


def test_first_lock_writes_the_state_file_and_reset_removes_it(tmp_path, double, guard):
    gpu = NvmlGpu.for_cuda_device(1)
    guard.lock(gpu, 1200)
    path = guard.state_dir / f"{gpu.uuid}.json"
    assert guard.state_path(gpu) == path and path.is_file()
    data = json.loads(path.read_text())
    assert data["uuid"] == gpu.uuid and data["pci_bus_id"] == "00000000:3B:00.0"
    assert data["pid"] == os.getpid() and data["hostname"] == socket.gethostname()
    assert data["locked_mhz"] == 1200 and data["time"] and "reset-clocks" in data["repair"]
    assert double.gpu(gpu.uuid).locked == [1200, 1200]
    guard.lock(gpu, 1000)
    assert json.loads(path.read_text())["locked_mhz"] == 1200  # written once, at the first lock
    guard.reset(gpu)
    assert not path.exists() and double.gpu(gpu.uuid).locked is None
    assert [p.name for p in guard.state_dir.iterdir()] == []  # no temporary files left
    gpu.close()


def test_state_file_is_written_before_the_clock_is_locked(tmp_path, double):
    blocked = tmp_path / "not-a-dir"
    blocked.write_text("")
    g = ClockGuard(blocked / "state", install_handlers=False)
    gpu = NvmlGpu.for_cuda_device(0)
    with pytest.raises(GpuError, match="cannot write the locked-clock state file .*ENVPIPE_STATE_DIR"):
        g.lock(gpu, 1200)
    assert not [c for c in double.calls if c[0] == "nvmlDeviceSetGpuLockedClocks"]
    assert double.gpu(gpu.uuid).locked is None and g.locked_devices() == []
    g.close()
    gpu.close()


def test_failed_first_lock_leaves_no_state_file(double, guard):
    double.update(permission=False)
    gpu = NvmlGpu.for_cuda_device(0)
    with pytest.raises(GpuPermissionError):
        guard.lock(gpu, 1200)
    assert list(guard.state_dir.glob("*.json")) == [] and guard.locked_devices() == []
    gpu.close()


def test_state_dir_from_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("ENVPIPE_STATE_DIR", str(tmp_path / "elsewhere"))
    assert resolve_state_dir() == tmp_path / "elsewhere"
    assert resolve_state_dir(tmp_path / "arg") == tmp_path / "arg"
    monkeypatch.delenv("ENVPIPE_STATE_DIR")
    assert str(resolve_state_dir()) == "/var/lib/megatron-envpipe/locked-clocks"


def test_only_the_nvml_backend_writes_state_files(guard):
    gpu = RecordingGpu()
    guard.lock(gpu, 1200)
    assert guard.state_path(gpu) is None and not guard.state_dir.exists()
    guard.reset(gpu)


def test_close_raises_when_a_reset_fails(double, tmp_path):
    g = ClockGuard(tmp_path / "s", install_handlers=False)
    gpu = NvmlGpu.for_cuda_device(0)
    g.lock(gpu, 1200)
    double.update(failures={"nvmlDeviceResetGpuLockedClocks": sys.modules["pynvml"].NVML_ERROR_GPU_IS_LOST})
    with pytest.raises(GpuError, match="could not reset GPU clocks.*envpipe reset-clocks"):
        g.close()
    assert (g.state_dir / f"{gpu.uuid}.json").exists()  # kept for the repair command
    double.update(failures={})
    g.reset_all()
    gpu.close()


# ---------------------------------------------------------------------------
# subprocesses: SIGTERM, SIGINT, chaining, normal exit, SIGKILL + repair
# ---------------------------------------------------------------------------

CHILD = textwrap.dedent(
    """
    import faulthandler, os, signal, sys, time
    # A training process as a user starts it from a terminal: Ctrl-C raises KeyboardInterrupt, whatever
    # the test process's own disposition and mask were when it started this one. A disposition of SIG_IGN
    # is inherited through exec, and the test process has it when the suite was started with `&` from a
    # script (the shell ignores SIGINT in asynchronous commands); the guard rightly leaves an ignored
    # signal ignored ("inherited" keeps it, to show that). Stacks on SIGUSR1: a stuck child says where it is.
    print(f"SIGINT at start: {{signal.getsignal(signal.SIGINT)!r}}, blocked: "
          f"{{sorted(signal.pthread_sigmask(signal.SIG_BLOCK, []))}}", file=sys.stderr, flush=True)
    if sys.argv[1] != "inherited":
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, [signal.SIGINT, signal.SIGTERM])
    faulthandler.register(signal.SIGUSR1)
    sys.path.insert(0, {tests!r})
    import nvml_double
    nvml_double.install_from_env()
    from megatron_envpipe.gpu.control.clocks import ClockController
    from megatron_envpipe.gpu.devices.nvml import NvmlGpu
    from megatron_envpipe.gpu.control.safety import ClockGuard

    mode, state_dir, marker = sys.argv[1:4]
    double = nvml_double.NvmlDouble.from_file(os.environ[nvml_double.STATE_ENV])

    def note(what):  # what the GPU looked like at this moment
        with open(marker, "w") as fh:
            fh.write(f"{{what}} locked={{double.reload().gpus[0].locked}}")

    if mode == "chain":
        def handler(signum, frame):
            note(f"chained {{signum}}")
            sys.exit(7)
        signal.signal(signal.SIGTERM, handler)
    gpu = NvmlGpu.for_cuda_device(0)
    ctl = ClockController(gpu, ClockGuard(state_dir))
    ctl.request(1200)
    ctl.request(1005)
    ctl.flush()
    if mode == "exit":
        print("LOCKED", flush=True)
        sys.exit(0)
    if mode == "raise":
        print("LOCKED", flush=True)
        raise RuntimeError("training blew up")
    if mode == "inherited":
        print(f"SIGINT with the guard: {{signal.getsignal(signal.SIGINT)!r}}", file=sys.stderr, flush=True)
    if mode == "fork":
        pid = os.fork()
        if pid == 0:
            sys.exit(0)  # the child runs atexit: it must not reset the parent's GPU
        os.waitpid(pid, 0)
    try:
        print("LOCKED", flush=True)
        while True:
            time.sleep(0.05)
    except KeyboardInterrupt:
        note("KeyboardInterrupt")
        raise
    """
)


class Child:
    def __init__(self, tmp_path: Path, double: NvmlDouble, mode: str, *, sigint_ignored: bool = False) -> None:
        self.state_dir = tmp_path / "state"
        self.marker = tmp_path / "marker"
        script = tmp_path / "child.py"
        script.write_text(CHILD.format(tests=str(TESTS)))
        env = dict(os.environ)
        env[STATE_ENV] = str(double.state_file)
        env.pop("CUDA_VISIBLE_DEVICES", None)
        # sigint_ignored: this process ignores SIGINT while it starts the child, as a suite run with `&`
        # from a script does; the child inherits that disposition
        old = signal.signal(signal.SIGINT, signal.SIG_IGN) if sigint_ignored else None
        try:
            self.proc = subprocess.Popen(
                [sys.executable, str(script), mode, str(self.state_dir), str(self.marker)],
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO, env=env,
            )
        finally:
            if old is not None:
                signal.signal(signal.SIGINT, old)

    def wait_locked(self, timeout: float = 30.0) -> None:
        sel = selectors.DefaultSelector()
        sel.register(self.proc.stdout, selectors.EVENT_READ)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if sel.select(timeout=0.1):
                line = self.proc.stdout.readline()
                if line.strip() == "LOCKED":
                    return
                if line == "":
                    break
        self.proc.kill()
        raise AssertionError(f"child never locked: {self.proc.stderr.read()}")

    def finish(self, timeout: float = 30.0) -> tuple[int, str]:
        try:
            _, err = self.proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.send_signal(signal.SIGUSR1)  # its stacks, then it goes
            time.sleep(1.0)
            self.proc.kill()
            _, err = self.proc.communicate()
            raise AssertionError(f"child still running {timeout:.0f} s after the signal; its stderr:\n{err}") from None
        return self.proc.returncode, err

    def state_files(self) -> list[Path]:
        return sorted(self.state_dir.glob("*.json")) if self.state_dir.exists() else []


@pytest.fixture
def persisted(tmp_path, monkeypatch):
    d = NvmlDouble(node(2), state_file=tmp_path / "nvml.json")
    monkeypatch.setitem(sys.modules, "pynvml", d.module())  # for the repair calls in this process
    return d


def _gpu0(double: NvmlDouble):
    return double.reload().gpus[0]


def test_sigterm_resets_clocks_and_dies_by_the_signal(tmp_path, persisted):
    child = Child(tmp_path, persisted, "plain")
    child.wait_locked()
    assert _gpu0(persisted).locked == [1005, 1005] and len(child.state_files()) == 1
    child.proc.send_signal(signal.SIGTERM)
    rc, err = child.finish()
    assert rc == -signal.SIGTERM, err
    assert _gpu0(persisted).locked is None and _gpu0(persisted).reset_count >= 1
    assert child.state_files() == []


@pytest.mark.parametrize("sigint_ignored", [False, True], ids=["suite-in-foreground", "suite-started-with-&"])
def test_sigint_resets_clocks_and_raises_keyboard_interrupt(tmp_path, persisted, sigint_ignored):
    # The second case is the whole-run hang of docs/testing.md's "Known flakes": a child that keeps the
    # ignored SIGINT it inherits never ends after the signal.
    child = Child(tmp_path, persisted, "plain", sigint_ignored=sigint_ignored)
    child.wait_locked()
    child.proc.send_signal(signal.SIGINT)
    rc, err = child.finish()
    assert "KeyboardInterrupt" in err
    assert rc == -signal.SIGINT, err  # Python re-raises SIGINT after an uncaught KeyboardInterrupt
    assert child.marker.read_text() == "KeyboardInterrupt locked=None"  # reset before the exception
    assert _gpu0(persisted).locked is None and child.state_files() == []


def test_an_inherited_ignored_sigint_stays_ignored_and_sigterm_still_resets(tmp_path, persisted):
    """A run started with SIGINT ignored (with `&` from a script, or by a launcher that ignores it) keeps it
    ignored: the guard does not turn a signal silenced on purpose into a Ctrl-C; SIGTERM still resets."""
    child = Child(tmp_path, persisted, "inherited", sigint_ignored=True)
    child.wait_locked()
    child.proc.send_signal(signal.SIGINT)  # discarded by the kernel: the disposition is SIG_IGN
    child.proc.send_signal(signal.SIGTERM)
    rc, err = child.finish()
    assert rc == -signal.SIGTERM, err
    assert "SIGINT at start: <Handlers.SIG_IGN: 1>" in err and "SIGINT with the guard: <Handlers.SIG_IGN: 1>" in err
    assert not child.marker.exists()  # no KeyboardInterrupt
    assert _gpu0(persisted).locked is None and child.state_files() == []


def test_existing_sigterm_handler_is_chained(tmp_path, persisted):
    child = Child(tmp_path, persisted, "chain")
    child.wait_locked()
    child.proc.send_signal(signal.SIGTERM)
    rc, err = child.finish()
    assert rc == 7, err
    assert child.marker.read_text() == f"chained {int(signal.SIGTERM)} locked=None"  # reset, then chained
    assert _gpu0(persisted).locked is None and child.state_files() == []


@pytest.mark.parametrize("mode, expected_rc", [("exit", 0), ("raise", 1)])
def test_normal_exit_and_uncaught_exception_reset_at_exit(tmp_path, persisted, mode, expected_rc):
    child = Child(tmp_path, persisted, mode)
    rc, err = child.finish()
    assert rc == expected_rc, err
    assert _gpu0(persisted).locked is None and child.state_files() == []


def test_forked_child_does_not_reset_the_parents_gpu(tmp_path, persisted):
    child = Child(tmp_path, persisted, "fork")
    child.wait_locked()  # printed after the forked child exited
    assert _gpu0(persisted).locked == [1005, 1005] and len(child.state_files()) == 1
    child.proc.send_signal(signal.SIGTERM)
    assert child.finish()[0] == -signal.SIGTERM
    assert _gpu0(persisted).locked is None


def test_sigkill_leaves_state_and_reset_clocks_repairs_it(tmp_path, persisted):
    child = Child(tmp_path, persisted, "plain")
    child.wait_locked()
    child.proc.send_signal(signal.SIGKILL)
    assert child.finish()[0] == -signal.SIGKILL
    (state,) = child.state_files()
    data = json.loads(state.read_text())
    assert data["pid"] == child.proc.pid and data["uuid"] == _gpu0(persisted).uuid
    assert _gpu0(persisted).locked == [1005, 1005]  # the crash left the GPU locked

    report = reset_clocks_from_state(child.state_dir)
    lines = report.lines
    assert len(lines) == 1 and "locked clocks reset" in lines[0] and "no longer running" in lines[0], lines
    assert report.ok and _gpu0(persisted).locked is None and child.state_files() == []
    assert persisted.init_count == 0  # the repair closed NVML again
    again = reset_clocks_from_state(child.state_dir)
    assert again.ok and "no state files" in again.lines[0]


def test_live_owner_is_left_alone_unless_forced(tmp_path, persisted):
    child = Child(tmp_path, persisted, "plain")
    child.wait_locked()
    try:
        report = reset_clocks_from_state(child.state_dir)
        (line,) = report.problems  # left locked: not a success
        assert "still running" in line and f"pid {child.proc.pid}" in line and "--force" in line
        assert _gpu0(persisted).locked == [1005, 1005] and len(child.state_files()) == 1
        report = reset_clocks_from_state(child.state_dir, force=True)
        assert report.ok and "reset forced" in report.lines[0]
        assert _gpu0(persisted).locked is None and child.state_files() == []
    finally:
        child.proc.send_signal(signal.SIGTERM)
        rc, err = child.finish()
    assert rc == -signal.SIGTERM, err  # its own reset found nothing left to do, and did not fail


def _state(directory: Path, uuid: str, **fields) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    data = {"uuid": uuid, "pid": 2**22 + 12345, "hostname": socket.gethostname(), "locked_mhz": 900,
            "name": "NVIDIA A40", "pci_bus_id": "00000000:1B:00.0", "time": "2025-01-01T00:00:00+0000"}
    data.update(fields)
    path = directory / f"{uuid}.json"
    path.write_text(json.dumps(data))
    return path


def test_repair_skips_other_hosts_and_unreadable_files(tmp_path, persisted):
    d = tmp_path / "state"
    uuid = persisted.gpus[0].uuid
    persisted.set_gpu(uuid, locked=[900, 900])
    other = _state(d, uuid, hostname="node-elsewhere")
    bad = d / "garbage.json"
    bad.write_text("{not json")
    report = reset_clocks_from_state(d)
    assert any("node-elsewhere" in ln and "skipped" in ln for ln in report.lines), report
    (problem,) = report.problems  # another host's file is that host's business; garbage is ours
    assert "unreadable" in problem and "garbage.json" in problem
    assert other.exists() and bad.exists() and persisted.gpu(uuid).locked == [900, 900]
    missing = reset_clocks_from_state(tmp_path / "missing")
    assert missing.ok and "no such directory" in missing.lines[0]


def test_repair_without_permission_fails_fast_with_the_fix(tmp_path, persisted):
    d = tmp_path / "state"
    path = _state(d, persisted.gpus[0].uuid)
    persisted.update(permission=False)
    report = reset_clocks_from_state(d)
    assert report.no_permission and len(report.problems) == 1 and "no permission" in report.problems[0]
    assert str(path) in report.problems[0] and path.exists()


def test_repair_of_a_gpu_that_is_gone_keeps_the_file(tmp_path, persisted):
    d = tmp_path / "state"
    path = _state(d, "GPU-deadbeef-0000-0000-0000-000000000000")
    report = reset_clocks_from_state(d)
    (line,) = report.problems
    assert "cannot open it" in line and path.exists() and not report.no_permission


def test_reset_all_gpus_resets_every_gpu_and_clears_this_hosts_state(tmp_path, persisted):
    gpus = persisted.gpus
    persisted.set_gpu(gpus[0].uuid, locked=[1005, 1005])
    persisted.set_gpu(gpus[1].uuid, mig_mode=1, lock_supported=False)
    d = tmp_path / "state"
    mine = _state(d, gpus[0].uuid)
    theirs = _state(d, gpus[1].uuid, hostname="node-elsewhere")
    report = reset_all_gpus(d)
    lines = report.lines
    assert report.ok  # a GPU that cannot lock clocks has nothing to reset
    assert persisted.gpu(gpus[0].uuid).locked is None
    assert any(gpus[0].uuid in ln and "locked clocks reset" in ln for ln in lines), lines
    assert any(gpus[1].uuid in ln and "not supported" in ln for ln in lines), lines
    assert not mine.exists() and theirs.exists()
    assert persisted.init_count == 0


@pytest.fixture
def fresh_signals(monkeypatch):
    """This process as a new one starts: Python's own SIGINT/SIGTERM handling and no guard yet (the
    guard registry is process-wide and earlier tests may have left guards in it); put back after."""
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    monkeypatch.setattr(safety, "_GUARDS", [])
    monkeypatch.setattr(safety, "_INSTALLED", set())
    monkeypatch.setattr(safety, "_PREVIOUS", {})
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    yield
    for sig, handler in saved.items():
        if handler is not None:
            signal.signal(sig, handler)


def _dispositions() -> tuple:
    return signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)


def test_closing_the_last_guard_puts_the_signal_handlers_back(tmp_path, fresh_signals):
    start = _dispositions()
    first, second = ClockGuard(tmp_path / "a"), ClockGuard(tmp_path / "b")
    installed = _dispositions()
    assert installed[0] is not start[0] and installed[1] is not start[1]
    first.close()
    assert _dispositions() == installed  # the other guard still needs them
    second.close()
    assert _dispositions() == start  # a test session or a long-lived process keeps no retired guard's handlers


def test_a_handler_set_over_the_guards_stays_when_it_closes(tmp_path, fresh_signals):
    g = ClockGuard(tmp_path / "a")
    guards = signal.getsignal(signal.SIGTERM)

    def framework(signum, frame):  # set later, chaining to what was there, as frameworks do
        return guards(signum, frame)

    signal.signal(signal.SIGTERM, framework)
    g.close()
    assert _dispositions() == (signal.default_int_handler, framework)


def test_a_new_guard_resets_then_chains_to_the_handler_in_place_when_it_was_made(tmp_path, fresh_signals):
    ClockGuard(tmp_path / "a").close()
    seen = []

    def own(signum, frame):  # the process's own Ctrl-C handling
        seen.append(signum)

    signal.signal(signal.SIGINT, own)
    g = ClockGuard(tmp_path / "b")
    gpu = RecordingGpu()
    g.lock(gpu, 1200)
    signal.raise_signal(signal.SIGINT)
    assert gpu.history == [1200, None] and seen == [signal.SIGINT]  # reset first, then the handler it found
    g.close()
    assert signal.getsignal(signal.SIGINT) is own  # that handler again, not Python's


def test_a_guard_without_handlers_leaves_signal_dispositions_alone(guard):
    before = (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT))
    ctl = ClockController(RecordingGpu(), guard)
    ctl.close()
    assert (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)) == before


def test_envpipe_reset_clocks_command_repairs_a_sigkilled_run(tmp_path, persisted, capsys):
    """The one-command repair, through the CLI users run: `envpipe reset-clocks`."""
    from megatron_envpipe.apps.cli import main

    child = Child(tmp_path, persisted, "plain")
    child.wait_locked()
    child.proc.send_signal(signal.SIGKILL)
    child.finish()
    assert _gpu0(persisted).locked == [1005, 1005] and len(child.state_files()) == 1
    assert main(["reset-clocks", "--state-dir", str(child.state_dir)]) == 0
    out = capsys.readouterr().out
    assert "locked clocks reset" in out
    assert _gpu0(persisted).locked is None and child.state_files() == []
