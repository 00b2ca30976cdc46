"""``envpipe gpu-check``'s runner (apps/gpu_check/runner.py): the plan, gating, time limits, clock resets,
the output folder.

Driven by the NVML test double (tests/gpu/nvml_double.py): in child processes through a
``sitecustomize.py`` that installs it from $ENVPIPE_NVML_DOUBLE_STATE, so the runner and its step
children share one fake driver whose state file shows what was locked and reset. Time is bounded
only from above (a step limit of a second or two stops a step that sleeps for minutes), never
measured as a result.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path.insert(0, str(REPO / "tests" / "gpu"))
from nvml_double import STATE_ENV, NvmlDouble, node  # noqa: E402

from megatron_envpipe.apps.cli import main as envpipe_main  # noqa: E402
from megatron_envpipe.apps.gpu_check.child import _run_entry  # noqa: E402
from megatron_envpipe.apps.gpu_check.gating import Machine, unmet_needs  # noqa: E402
from megatron_envpipe.apps.gpu_check.runner import CheckOptions, GpuCheckError, parse_steps, run_check  # noqa: E402
from megatron_envpipe.apps.gpu_check.step_api import OUTPUT_FILES, Step, StepContext, StepResult  # noqa: E402
from megatron_envpipe.apps.gpu_check.steps import _MAX_TOTAL_S, STEPS, _planned_total_s  # noqa: E402
from megatron_envpipe.apps.gpu_check.summary import _format_duration, plan_lines  # noqa: E402
from megatron_envpipe.gpu.control.safety import ClockGuard  # noqa: E402
from megatron_envpipe.gpu.devices.nvml import NvmlGpu  # noqa: E402

SITECUSTOMIZE = f"""
import os, sys
if os.environ.get({STATE_ENV!r}):
    sys.path.insert(0, {str(REPO / "tests" / "gpu")!r})
    import nvml_double
    nvml_double.install_from_env()
"""


@pytest.fixture
def fake_node(tmp_path, monkeypatch):
    """make(**gpu_changes, permission=..., no_driver=...) -> the double, shared by this process and its children."""
    boot = tmp_path / "boot"
    boot.mkdir()
    (boot / "sitecustomize.py").write_text(SITECUSTOMIZE)
    state = tmp_path / "state"
    state.mkdir(mode=0o700)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setenv("ENVPIPE_STATE_DIR", str(state))
    paths = [str(boot), str(HERE), str(REPO)]
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(paths + [p for p in os.environ.get("PYTHONPATH", "").split(
        os.pathsep) if p]))

    def make(permission: bool = True, no_driver: bool = False, **changes) -> NvmlDouble:
        gpus = node(1)
        for k, v in changes.items():
            setattr(gpus[0], k, v)
        double = NvmlDouble(gpus, state_file=tmp_path / "nvml.json", permission=permission, no_driver=no_driver)
        monkeypatch.setenv(STATE_ENV, str(double.state_file))
        monkeypatch.setitem(sys.modules, "pynvml", double.module())  # the runner in this process, too
        return double

    return make


def _check(out: Path, *args: str, timeout: float = 120) -> tuple[subprocess.CompletedProcess[str], float]:
    began = time.monotonic()
    proc = subprocess.run(["bash", str(REPO / "bench" / "gpu_check.sh"), "--out", str(out), *args],
                          capture_output=True, text=True, timeout=timeout, cwd=out.parent)
    return proc, time.monotonic() - began


def _results(out: Path) -> dict:
    return json.loads((out / "results.json").read_text())


def _only_output_files(out: Path) -> None:
    names = sorted(os.listdir(out))
    assert set(names) <= set(OUTPUT_FILES) and len(names) <= 8, names  # no temporary or foreign file


# -- the plan ---------------------------------------------------------------------------------------

def test_plan_is_eight_steps_under_eight_minutes_printed_first():
    assert [s.number for s in STEPS] == list(range(1, 9))
    assert _planned_total_s() == 455 <= _MAX_TOTAL_S
    lines = plan_lines(STEPS)
    assert lines[0] == "envpipe gpu-check: 8 steps, planned total 7 min 35 s (each step stopped at its limit)"
    assert all(f" {s.name} " in lines[s.number] and f"{s.planned_s:g} s" in lines[s.number] for s in STEPS)


def test_the_planned_total_is_of_the_steps_selected():
    """--steps 1,2: the total is theirs (issue 35: it said 7 min 35 s for two steps), the others marked."""
    selected = parse_steps("1,2")
    lines = plan_lines(STEPS, selected)
    total = sum(s.planned_s for s in STEPS if s.name in selected)
    assert lines[0] == (f"envpipe gpu-check: 2 of 8 steps (--steps), planned total {_format_duration(total)} "
                        "(each step stopped at its limit)")
    assert [s.number for s in STEPS if lines[s.number].endswith("(not selected)")] == [3, 4, 5, 6, 7, 8]


def test_steps_by_number_or_name_and_a_bad_one_is_one_clear_line():
    assert parse_steps("1,preset, 3") == {"facts", "preset", "clock_changes"}
    with pytest.raises(GpuCheckError, match="unknown step 'nine': use numbers 1-8 or names facts"):
        parse_steps("1,nine")


# -- without a GPU ----------------------------------------------------------------------------------

def test_without_a_gpu_every_step_is_skipped_no_gpu_in_seconds(fake_node, tmp_path):
    fake_node(no_driver=True)  # NVML cannot start: what a machine without the NVIDIA driver says
    out = tmp_path / "x"
    proc, took_s = _check(out)
    assert proc.returncode == 0, proc.stderr
    assert took_s < 30  # an upper bound (acceptance), not a measurement
    assert "planned total 7 min 35 s" in proc.stdout.splitlines()[0]
    summary = (out / "summary.md").read_text()
    for step in STEPS:
        assert f"| {step.number} | {step.name} | {step.planned_s:g} s | skipped |" in summary
    results = _results(out)
    assert results["state"] == "finished"
    assert [s["status"] for s in results["steps"]] == ["skipped"] * 8
    assert all(s["reason"].startswith("no GPU (NVML cannot start") for s in results["steps"])
    _only_output_files(out)


# -- a lock the driver refuses, or the SMs do not reach -------------------------------------------------

@pytest.mark.parametrize("changes, outcome", [
    ({"permission": False}, "refused"),                  # a VM or cloud image, even for root
    ({"sm_clock_range": [210, 600]}, "not_reached"),     # accepted, the SMs held elsewhere (power cap)
])
def test_a_lock_that_does_not_work_is_reported_by_step_1_and_clock_steps_are_skipped(fake_node, tmp_path, changes,
                                                                                     outcome):
    double = fake_node(**changes)
    out = tmp_path / "x"
    proc, took_s = _check(out, "--steps", "1,3,4,5,6,8")
    assert proc.returncode == 0, proc.stderr
    assert took_s < 60  # seconds, not the minutes the clock steps would have spent
    steps = {s["name"]: s for s in _results(out)["steps"]}
    facts = steps["facts"]
    assert facts["status"] == "ok" and facts["figures"]["lock"] == outcome
    assert f"lock: {outcome}" in (out / "summary.md").read_text()
    for name in ("clock_changes", "blocking_power", "profile", "replay"):
        assert steps[name]["status"] == "skipped"
        assert f"clock lock {outcome} in step 1" in steps[name]["reason"], steps[name]["reason"]
        assert steps[name]["exit_status"] is None  # never started
    assert steps["counter"]["reason"] == "not selected (--steps)"
    assert steps["preset"]["status"] == "ok"  # the preset is written from what there is
    gpu = double.reload().gpus[0]
    assert gpu.locked is None  # nothing left locked
    _only_output_files(out)


# -- a step that hangs; a check that is interrupted -----------------------------------------------------

def hang_locked(ctx: StepContext) -> StepResult:
    """A step that locks a clock through the guard, ignores SIGTERM and never returns (the runner must kill it,
    repair the state file it leaves and reset the clock)."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    device = NvmlGpu.for_cuda_device(ctx.device_index)
    guard = ClockGuard(ctx.state_dir, install_handlers=False)
    guard.lock(device, 1050)
    print("locked 1050 MHz, now hanging", flush=True)
    time.sleep(600)
    return StepResult("ok")


def peek(ctx: StepContext) -> StepResult:
    """A quick step that reports what the runner had written before it started."""
    summary = (ctx.out_dir / "summary.md").read_text()
    results = json.loads((ctx.out_dir / "results.json").read_text())
    me = [s for s in results["steps"] if s["name"] == "peek"][0]
    return StepResult("ok", figures={"summary_before": summary, "my_status_before": me["status"],
                                     "earlier": sorted(ctx.earlier)},
                      lines=("peeked",), files={"counter.csv": "time_s,energy_j\n0,0\n", "summary.md": "mine"})


def _steps(first: str, limit_s: float) -> list[Step]:
    mod = "test_gpu_check_runner"
    return [Step(1, "hang", "locks and hangs", limit_s, frozenset({"gpu"}), f"{mod}:{first}"),
            Step(2, "peek", "reads the record", 60, frozenset({"gpu"}), f"{mod}:peek"),
            Step(3, "counter", "never started", 60, frozenset({"gpu", "clock_control"}), f"{mod}:peek")]


def test_a_hanging_step_is_stopped_at_its_limit_its_clock_reset_and_the_next_step_runs(fake_node, tmp_path):
    double = fake_node()
    out = tmp_path / "x"
    status = run_check(CheckOptions(out_dir=out), steps=_steps("hang_locked", 3.0), grace_s=0.5,
                       out=open(os.devnull, "w"))
    assert status == 0
    steps = {s["name"]: s for s in _results(out)["steps"]}
    hang = steps["hang"]
    assert hang["status"] == "failed" and hang["reason"] == "stopped at its 3 s limit"
    assert hang["exit_status"] == -signal.SIGKILL  # it ignored SIGTERM: killed after the grace
    assert hang["clocks_after"].startswith("clocks reset")
    assert "locked clocks reset" in hang["clocks_after"]  # the state file the killed child left, repaired
    gpu = double.reload().gpus[0]
    assert gpu.lock_count == 1 and gpu.locked is None  # it did lock, and nothing is left locked
    assert not os.listdir(os.environ["ENVPIPE_STATE_DIR"])
    peeked = steps["peek"]
    assert peeked["status"] == "ok" and peeked["figures"]["my_status_before"] == "running"
    assert "| 1 | hang | 3 s | failed |" in peeked["figures"]["summary_before"]  # the record was rewritten first
    assert peeked["files"] == []  # counter.csv is not this step's file, summary.md never a step's
    assert "not written: counter.csv, summary.md" in (out / "summary.md").read_text()
    assert steps["counter"]["reason"] == "clock control not proven (step 1 facts not run)"
    assert "locked 1050 MHz, now hanging" in (out / "check.log").read_text()
    _only_output_files(out)


def test_sigterm_stops_the_step_resets_clocks_and_leaves_a_true_summary(fake_node, tmp_path):
    double = fake_node()
    out = tmp_path / "x"
    code = ("import sys; from pathlib import Path; import test_gpu_check_runner as t; "
            "from megatron_envpipe.apps.gpu_check.runner import CheckOptions, run_check; "
            "sys.exit(run_check(CheckOptions(out_dir=Path(sys.argv[1])), steps=t._steps('hang_locked', 60), "
            "grace_s=0.5))")
    proc = subprocess.Popen([sys.executable, "-c", code, str(out)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    deadline = time.monotonic() + 60
    while double.reload().gpus[0].lock_count == 0 and time.monotonic() < deadline:
        time.sleep(0.05)  # wait until the step has locked the clock
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGTERM, err
    results = _results(out)
    assert results["state"] == "interrupted"
    assert [(s["status"], s["reason"]) for s in results["steps"]] == [
        ("failed", "interrupted by SIGTERM"), ("skipped", "the check was interrupted by SIGTERM"),
        ("skipped", "the check was interrupted by SIGTERM")]
    assert results["clocks_at_exit"].startswith("clocks reset")
    assert double.reload().gpus[0].locked is None
    assert "state: **interrupted**" in (out / "summary.md").read_text()
    _only_output_files(out)


# -- the output folder --------------------------------------------------------------------------------

def test_out_holding_other_files_is_refused_an_earlier_checks_files_are_replaced(fake_node, tmp_path):
    fake_node(no_driver=True)
    out = tmp_path / "x"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    with pytest.raises(GpuCheckError, match=r"holds files gpu-check did not write \(notes.txt\): give a new or empty"):
        run_check(CheckOptions(out_dir=out), out=open(os.devnull, "w"))
    assert (out / "notes.txt").read_text() == "mine"
    (out / "notes.txt").unlink()
    (out / "profile.csv").write_text("stale")  # an earlier check's: must not feed this run's replay
    assert run_check(CheckOptions(out_dir=out), out=open(os.devnull, "w")) == 0
    assert not (out / "profile.csv").exists()
    assert envpipe_main(["gpu-check", "--out", str(tmp_path / "y"), "--steps", "0"]) == 2


# -- gating ---------------------------------------------------------------------------------------

def test_gating_names_every_unmet_need():
    machine = Machine("cuda", None, None, "megatron-core is not installed")
    profile = STEPS[4]
    facts = {"lock": "refused", "lock_detail": "the lock to 1050 MHz was refused", "cuda_available": False,
             "cuda_detail": "torch 2.x without CUDA"}
    why = unmet_needs(profile, machine, {"facts": facts}, {})
    assert why == ["clock lock refused in step 1: the lock to 1050 MHz was refused",
                   "torch without CUDA (torch 2.x without CUDA)", "megatron-core is not installed"]
    ok = {"lock": "ok", "cuda_available": True}
    assert unmet_needs(STEPS[2], machine, {"facts": ok}, {}) == []
    assert unmet_needs(STEPS[2], Machine("cuda", "no GPU (x)", None, None), {"facts": ok}, {}) == ["no GPU (x)"]
    assert unmet_needs(STEPS[6], Machine("cpu", None, None, None), {}, {}) == []  # CPU: simulated GPU, no lock


def test_a_step_that_raises_or_is_missing_is_a_failed_result_not_a_crash(tmp_path):
    ctx = StepContext(out_dir=tmp_path, device="cpu", device_index=0, limit_s=5, started_monotonic=time.monotonic())
    missing = _run_entry("megatron_envpipe.apps.gpu_check.no_such_step:run", ctx)
    assert missing.status == "failed" and missing.reason.startswith("ModuleNotFoundError: No module named")
    wrong = _run_entry("test_gpu_check_runner:not_a_result", ctx)
    assert (wrong.status, wrong.reason) == ("failed", "TypeError: test_gpu_check_runner:not_a_result returned dict, "
                                                      "not a StepResult")


def not_a_result(ctx: StepContext) -> dict:
    return {"status": "ok"}


@pytest.mark.parametrize("index", ["-1", "256", "1" + "0" * 30, "x"])
def test_a_device_index_no_node_has_is_one_line_before_the_check_starts(index, tmp_path, capsys):
    out = tmp_path / "never"
    with pytest.raises(SystemExit) as exit_:  # argparse's error: one line, exit 2
        envpipe_main(["gpu-check", "--out", str(out), "--device-index", index])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "device index" in err and "Traceback" not in err, err
    assert not out.exists()  # refused before anything was written
