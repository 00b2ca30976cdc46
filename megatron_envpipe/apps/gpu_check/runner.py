"""``envpipe gpu-check``: eight time-limited steps, each in a child process, clocks reset after each.

The runner never imports torch or CUDA: it judges what the machine offers (``gating.py``), prints
the plan, writes summary.md first (every step pending) and rewrites it, results.json and check.log
after every step, all atomically, so a run stopped at any moment leaves a true record. Each step
runs in ``python -m megatron_envpipe.apps.gpu_check.child`` with a hard limit (SIGTERM to its
process group, 5 s grace, SIGKILL); a step that fails or is stopped is a result and the next step
runs. After every step, at exit and on SIGTERM/SIGINT the GPU's locked clocks are reset through NVML
(state files a killed child left are repaired through ``gpu/control/repair.py`` first).

Exit status: 0 when the check ran to the end (failed steps are results), 2 on bad input,
128 + signal when interrupted.
"""

from __future__ import annotations

import atexit
import json
import os
import re
import signal
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

import megatron_envpipe
from megatron_envpipe.apps.gpu_check.gating import Machine, unmet_needs
from megatron_envpipe.apps.gpu_check.step_api import OUTPUT_FILES, STEP_FILES, Step, StepContext, StepResult
from megatron_envpipe.apps.gpu_check.steps import STEPS
from megatron_envpipe.apps.gpu_check.summary import (
    NOT_SELECTED,
    CheckRecord,
    StepRecord,
    plan_lines,
    results_json,
    summary_markdown,
)
from megatron_envpipe.core.atomic import check_writable, write_all_atomic
from megatron_envpipe.core.file_numbers import one_line
from megatron_envpipe.errors import EnvPipeError, UsageError
from megatron_envpipe.gpu.control.repair import reset_clocks_from_state
from megatron_envpipe.gpu.devices.base import GpuDevice, GpuPermissionError
from megatron_envpipe.gpu.devices.nvml import NvmlGpu

__all__ = ["CheckOptions", "GpuCheckError", "DEFAULT_OUT", "parse_steps", "run_check"]

DEFAULT_OUT = "out/gpu-check"
_GRACE_S = 5.0                  # SIGTERM -> SIGKILL for a step past its limit
_LOG_LIMIT_CHARS = 200_000      # per step in check.log (its tail): a chatty step cannot fill the disk
# Temporary names core/atomic.py leaves only if killed mid-write: ours to remove.
_STEP_FILES_ALL = frozenset(name for names in STEP_FILES.values() for name in names)
_OUR_TEMP = re.compile(r"^\.(" + "|".join(re.escape(n) for n in OUTPUT_FILES) + r")\.[0-9a-f]{8}\.(tmp|bak)$")


class GpuCheckError(UsageError):
    """Bad input to ``envpipe gpu-check`` (the message says what, where and what to do)."""


@dataclass(frozen=True)
class CheckOptions:
    out_dir: Path = Path(DEFAULT_OUT)
    device: str = "cuda"                      # "cuda": a real GPU; "cpu": CPU tensors and a simulated GPU
    device_index: int = 0
    selected: frozenset[str] | None = None    # step names to run (None: all)
    state_dir: str | None = None              # ClockGuard state files (None: $ENVPIPE_STATE_DIR or the default)


def parse_steps(text: str, steps: Sequence[Step] = STEPS) -> frozenset[str]:
    """``--steps 1,2,preset`` -> the names; numbers or names, comma-separated."""
    by_number = {str(s.number): s.name for s in steps}
    names = {s.name for s in steps}
    chosen = set()
    for item in (t.strip() for t in text.split(",")):
        if item in by_number:
            chosen.add(by_number[item])
        elif item in names:
            chosen.add(item)
        else:
            raise GpuCheckError(f"--steps: unknown step {item!r}: use numbers 1-{len(steps)} or names "
                                f"{', '.join(s.name for s in steps)}, comma-separated")
    return frozenset(chosen)


def _prepare_out(out_dir: Path, steps: Sequence[Step] = STEPS, selected: frozenset[str] | None = None) -> list[str]:
    """Refuse a folder holding anything but an earlier check's files (as regular files: a folder or a FIFO
    named ``summary.md`` is no file of ours), all checked before anything is removed. Then remove only the
    files of the steps this run runs (a stale profile.csv must not pass for this run's, even if its step
    fails); the runner's own files are replaced atomically and other steps' files are kept, saying so.
    Returns notes for the summary."""
    check_writable(out_dir, "--out", directory=True)
    if not out_dir.exists():
        return []
    entries = sorted(os.listdir(out_dir))
    other = [e for e in entries if e not in OUTPUT_FILES and not _OUR_TEMP.match(e)]
    if other:
        shown = ", ".join(one_line(e) for e in other[:5]) + (f" and {len(other) - 5} more" if len(other) > 5 else "")
        raise GpuCheckError(f"--out {out_dir}: holds files gpu-check did not write ({shown}): give a new or empty "
                            "folder (or one an earlier gpu-check wrote, whose files are replaced)")
    for e in entries:
        if (out_dir / e).is_symlink() or not stat.S_ISREG((out_dir / e).lstat().st_mode):
            raise GpuCheckError(f"--out {out_dir}: {e} is not a regular file (a folder, link or FIFO): gpu-check "
                                "writes a file there; remove it or give another folder")
    running = {name for s in steps if selected is None or s.name in selected for name in STEP_FILES.get(s.name, ())}
    stale = [e for e in entries if e in running or _OUR_TEMP.match(e)]
    kept = [e for e in entries if e in _STEP_FILES_ALL and e not in running]
    for e in stale:
        try:
            (out_dir / e).unlink()
        except OSError as exc:
            raise GpuCheckError(f"--out {out_dir}: cannot remove the earlier check's {e}: {exc.strerror or exc}; "
                                "remove it yourself or give another folder") from None
    notes = [f"replaced an earlier check's files in {out_dir}"] if entries else []
    if kept:
        notes.append(f"kept from an earlier check (their steps did not run now): {', '.join(kept)}")
    return notes


def _utc_now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime())


class _Interrupted(BaseException):
    """SIGTERM/SIGINT reached the runner: stop the step, reset, record, leave."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


class _Clocks:
    """The GPU whose clocks the runner resets (an NVML device in the runner process), and how."""

    def __init__(self, device: GpuDevice | None, state_dir: str | None, modelled: bool) -> None:
        self.device = device
        self.state_dir = state_dir
        self.modelled = modelled

    def reset(self) -> str:
        """Reset now; one phrase for the record (never raises: a failed reset is recorded, not fatal)."""
        if self.modelled:
            return "simulated GPU: nothing to reset"
        if self.device is None:
            return "no GPU: nothing to reset"
        notes = []
        try:
            report = reset_clocks_from_state(self.state_dir)  # files a killed child could not remove
            notes += [line for line in report.lines if "locked clocks reset" in line or line in report.problems]
        except (EnvPipeError, OSError) as exc:
            notes.append(f"state files not checked ({exc})")
        try:
            self.device.reset_locked_clocks()
            said = "clocks reset"
        except GpuPermissionError:  # NVML asks the same privilege to lock as to reset
            said = "clocks not reset: no permission, so none could have been locked by this process"
        except EnvPipeError as exc:
            said = f"clocks not reset: {' '.join(str(exc).split())[:200]}; run `envpipe reset-clocks --all` as root"
        return "; ".join([said, *notes])

    def follow(self, uuid: object) -> str | None:
        """Step 1 found the GPU by the PCI bus id torch reports; if that is another GPU than the runner
        opened from CUDA_VISIBLE_DEVICES, reset that one from now on. Returns a note, or None."""
        device = self.device
        if not isinstance(device, NvmlGpu) or not isinstance(uuid, str) or uuid == device.uuid:
            return None
        try:
            other = NvmlGpu.for_uuid(uuid)
        except EnvPipeError as exc:
            return f"step 1 measured {uuid}, which the runner cannot open to reset ({exc})"
        device.close()
        self.device = other
        return f"step 1 measured {uuid}, not {device.uuid}: the runner resets that GPU's clocks"

    def close(self) -> None:
        if self.device is not None:
            self.device.close()


def _open_clocks(options: CheckOptions) -> tuple[_Clocks, str, str | None]:
    """(clocks, device label, why there is no GPU or None)."""
    if options.device == "cpu":
        return _Clocks(None, options.state_dir, True), "simulated GPU (CPU tensors; --device cpu)", None
    try:
        device = NvmlGpu.for_cuda_device(options.device_index)
    except EnvPipeError as exc:
        text = " ".join(str(exc).split())
        # the steps say the first clause ("NVML cannot start (...)"); the device line says all of it
        return _Clocks(None, options.state_dir, False), f"no GPU: {text}", f"no GPU ({text.split(': ')[0]})"
    return _Clocks(device, options.state_dir, False), device.info().label(), None


class _Writer:
    """Writes the record, the log and the steps' files, all at once and atomically, after every change."""

    def __init__(self, out_dir: Path, check: CheckRecord) -> None:
        self.out_dir = out_dir
        self.check = check
        self.log: list[str] = []
        self.files: dict[str, str] = {}

    def write(self) -> None:
        texts = {"summary.md": summary_markdown(self.check),
                 "results.json": _json_text(results_json(self.check)),
                 "check.log": "".join(self.log), **self.files}
        write_all_atomic([(self.out_dir / name, texts[name]) for name in OUTPUT_FILES if name in texts])


def _json_text(data: Any) -> str:
    return json.dumps(data, indent=1, allow_nan=False) + "\n"


def _stop_group(proc: subprocess.Popen[bytes], grace_s: float) -> None:
    """SIGTERM to the child's process group (a step may have started processes of its own), SIGKILL after
    ``grace_s``."""
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 30.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            pass
        try:
            proc.wait(timeout=wait_s)
            return
        except subprocess.TimeoutExpired:
            continue


def _child_env() -> dict[str, str]:
    """The runner's environment, with this package importable in the child whatever its working folder."""
    env = dict(os.environ)
    root = str(Path(megatron_envpipe.__file__).resolve().parents[1])
    parts = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join([root, *[p for p in parts if p != root]])
    env["PYTHONUNBUFFERED"] = "1"
    return env


def _run_child(step: Step, ctx: StepContext, work: Path, python: str, grace_s: float,
               running: list[subprocess.Popen[bytes]]) -> tuple[StepResult, int | None, str]:
    """Run one step in a child; (result, exit status, its output)."""
    ctx_path, result_path, log_path = (work / f"{step.name}.{n}" for n in ("ctx.json", "result.json", "log"))
    data = ctx.to_json()
    with open(log_path, "wb") as log:
        started = time.monotonic()
        data["started_monotonic"] = started
        ctx_path.write_text(_json_text(data))
        proc = subprocess.Popen([python, "-m", "megatron_envpipe.apps.gpu_check.child", step.entry, str(ctx_path),
                                 str(result_path)], stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                env=_child_env(), start_new_session=True)
        running.append(proc)
        try:
            status: int | None = proc.wait(timeout=max(0.0, step.planned_s - (time.monotonic() - started)))
            stopped = False
        except subprocess.TimeoutExpired:
            _stop_group(proc, grace_s)
            status, stopped = proc.returncode, True
        finally:
            if proc.returncode is None:  # interrupted: the caller's handler stops it
                _stop_group(proc, grace_s)
            running.remove(proc)
    output = log_path.read_text(errors="replace")
    if stopped:
        return StepResult("failed", f"stopped at its {step.planned_s:g} s limit"), status, output
    try:
        return StepResult.from_json(json.loads(result_path.read_text())), status, output
    except (OSError, ValueError, KeyError, TypeError) as exc:
        how = f"killed by signal {-status}" if status is not None and status < 0 else f"exited with status {status}"
        return StepResult("failed", f"the step's process {how} without a result ({type(exc).__name__}; see "
                                    "check.log)"), status, output


def _apply(record: StepRecord, result: StepResult, writer: _Writer) -> None:
    """Take a child's result into the record; only the step's own files (STEP_FILES) are kept."""
    allowed = STEP_FILES.get(record.step.name, ())
    kept, refused = [], []
    for name, text in result.files.items():
        (kept if name in allowed else refused).append(name)
        if name in allowed:
            writer.files[name] = text
    record.status, record.reason = result.status, result.reason
    record.figures, record.lines, record.files = dict(result.figures), tuple(result.lines), tuple(kept)
    if refused:
        writer.check.notes.append(f"step {record.step.name} returned files not its own, not written: "
                                  f"{', '.join(refused)}")


def run_check(options: CheckOptions, *, steps: Sequence[Step] = STEPS, out: TextIO | None = None,
              python: str = sys.executable, grace_s: float = _GRACE_S,
              clocks_factory: Callable[[CheckOptions], tuple[_Clocks, str, str | None]] = _open_clocks) -> int:
    """Run the check (module docstring); returns the exit status."""
    say = out or sys.stdout
    if options.device not in ("cuda", "cpu"):
        raise GpuCheckError(f"--device {options.device}: use cuda (a real GPU) or cpu (CI: a simulated GPU)")
    if options.device_index < 0:
        raise GpuCheckError(f"--device-index {options.device_index}: must be a CUDA device index >= 0")
    out_dir = Path(options.out_dir)
    notes = _prepare_out(out_dir, steps, options.selected)
    for line in plan_lines(steps, options.selected):
        print(line, file=say, flush=True)
    clocks, label, no_gpu = clocks_factory(options)
    machine = Machine.probe(options.device, no_gpu)
    check = CheckRecord(options.device, options.device_index, label, _utc_now(), [StepRecord(s) for s in steps],
                        notes=notes)
    writer = _Writer(out_dir, check)
    writer.write()  # the summary first: the plan, every step pending
    print(f"device: {label}", file=say, flush=True)
    running: list[subprocess.Popen[bytes]] = []
    atexit.register(clocks.reset)
    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}

    def interrupt(signum: int, frame: Any) -> None:
        raise _Interrupted(signum)

    for sig in previous:
        signal.signal(sig, interrupt)
    try:
        with tempfile.TemporaryDirectory(prefix="envpipe-gpu-check-") as tmp:
            earlier: dict[str, dict[str, Any]] = {}
            not_ok: dict[str, str] = {}
            for record in check.steps:
                step = record.step
                if options.selected is not None and step.name not in options.selected:
                    record.status, record.reason = "skipped", NOT_SELECTED
                else:
                    why = unmet_needs(step, machine, earlier, not_ok)
                    if why:
                        record.status, record.reason = "skipped", "; ".join(why)
                    else:
                        _run_one(record, options, earlier, Path(tmp), python, grace_s, running, writer, clocks)
                if record.status == "ok":
                    earlier[step.name] = record.figures
                    if step.name == "facts" and (note := clocks.follow(record.figures.get("uuid"))):
                        check.notes.append(note)
                else:
                    not_ok[step.name] = f"{record.status}: {record.reason}"
                print(f"[{step.number}/{len(steps)}] {step.name}: {record.status}"
                      + (f" ({record.reason})" if record.reason else "")
                      + (f" in {record.time_s:.1f} s; {record.clocks}" if record.time_s is not None else ""),
                      file=say, flush=True)
                for line in record.lines:
                    print(f"    {line}", file=say, flush=True)
                writer.write()
        check.state = "finished"
        status = 0
    except _Interrupted as stop:
        for proc in list(running):
            _stop_group(proc, grace_s)
        name = signal.Signals(stop.signum).name
        for record in check.steps:
            if record.status == "running":
                record.status, record.reason = "failed", f"interrupted by {name}"
            elif record.status == "pending":
                record.status, record.reason = "skipped", f"the check was interrupted by {name}"
        check.state = "interrupted"
        status = 128 + stop.signum
        print(f"envpipe gpu-check: interrupted by {name}", file=sys.stderr, flush=True)
    finally:
        for sig in previous:  # a second Ctrl-C must not cut the last reset short
            signal.signal(sig, signal.SIG_IGN)
        try:
            check.clocks_at_exit = clocks.reset()
            check.finished_utc = _utc_now()
            writer.write()
            atexit.unregister(clocks.reset)
            clocks.close()
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
    print(f"clocks at exit: {check.clocks_at_exit}", file=say, flush=True)
    print(f"wrote {out_dir}/summary.md, results.json, check.log" + "".join(f", {n}" for n in sorted(writer.files)),
          file=say, flush=True)
    return status


def _run_one(record: StepRecord, options: CheckOptions, earlier: dict[str, dict[str, Any]], work: Path,
             python: str, grace_s: float, running: list[subprocess.Popen[bytes]], writer: _Writer,
             clocks: _Clocks) -> None:
    step = record.step
    record.status = "running"
    writer.write()
    ctx = StepContext(out_dir=options.out_dir, device=options.device, device_index=options.device_index,
                      limit_s=step.planned_s, started_monotonic=time.monotonic(), earlier=dict(earlier),
                      state_dir=options.state_dir)
    began = time.monotonic()
    try:
        result, record.exit_status, output = _run_child(step, ctx, work, python, grace_s, running)
    finally:
        record.time_s = round(time.monotonic() - began, 3)
        record.clocks = clocks.reset()
    if len(output) > _LOG_LIMIT_CHARS:
        output = f"[... {len(output) - _LOG_LIMIT_CHARS} characters cut ...]\n" + output[-_LOG_LIMIT_CHARS:]
    writer.log.append(f"===== step {step.number} {step.name} (limit {step.planned_s:g} s, exit status "
                      f"{record.exit_status}) =====\n{output}{'' if output.endswith(chr(10)) or not output else chr(10)}")
    _apply(record, result, writer)
