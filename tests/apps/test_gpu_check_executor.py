"""Step 7 of gpu-check: the tiny GPT as 4 stages on one device, EnvPipe against stock Megatron.

The step itself runs here with ``ctx.device == "cpu"``: the same commands it runs on a GPU
(4 ranks over gloo, every P2P tensor staged through host memory, the simulated GPU for clocks
and energy; the EnvPipe run's ranks forked from one interpreter instead of torchrun's), so CI checks the one-GPU path end to end: losses bit for bit
equal to stock Megatron's (never installed), each side's schedule function, and the count
of host-staged transfers (a bypassed transport fails it).
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest

from megatron_envpipe.apps.gpu_check import executor_step
from megatron_envpipe.apps.gpu_check.step_api import StepContext, StepResult
from megatron_envpipe.megatron.localhost import free_port

NUM_MICROBATCHES = 8  # train_tiny_gpt's default: global batch 16 / micro-batch 2


def _ctx(tmp_path: Path, limit_s: float = 900.0) -> StepContext:
    # A generous limit: this checks behaviour, not this (shared, 2-core) host's speed.
    return StepContext(out_dir=tmp_path, device="cpu", device_index=0, limit_s=limit_s,
                       started_monotonic=time.monotonic())


def _forked_envpipe_run(real: Callable[..., list[str]]) -> Callable[..., list[str]]:
    """The step's commands, but the EnvPipe run's ranks forked from one interpreter that imported torch and
    megatron-core once (tests/launching.py; ~17 CPU-s less); the stock run stays the step's own
    ``torchrun --standalone`` command, so that command is still run as the step runs it."""

    def train_command(device: str, cache_dir: Path, losses_out: Path, extra: Sequence[str]) -> list[str]:
        cmd = real(device, cache_dir, losses_out, extra)
        if "--no-envpipe" in extra:
            return cmd
        at = cmd.index("torch.distributed.run")
        assert cmd[at + 1] == "--standalone", cmd  # the step's launch changed: adapt this stand-in
        return [*cmd[:at], "megatron_envpipe.testing.forked_ranks", "--master-port", str(free_port()),
                *cmd[at + 2:]]

    return train_command


@pytest.fixture(scope="module")
def step_result(tmp_path_factory: pytest.TempPathFactory) -> StepResult:
    pytest.importorskip("torch", reason="needs torch and megatron-core: pip install -e '.[megatron]'")
    pytest.importorskip("megatron.core", reason="needs torch and megatron-core: pip install -e '.[megatron]'")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(executor_step, "_train_command", _forked_envpipe_run(executor_step._train_command))
        return executor_step.run(_ctx(tmp_path_factory.mktemp("step7")))


def test_step7_on_cpu_trains_like_stock_megatron_bit_for_bit(step_result: StepResult) -> None:
    assert step_result.status == "ok", (step_result.reason, dict(step_result.figures))
    fig = step_result.figures
    assert fig["device"] == "cpu" and fig["losses_equal"] is True and fig["max_abs_loss_diff"] == 0.0
    assert fig["iterations"] == executor_step._ITERATIONS == len(fig["losses_stock"])
    assert [x.hex() for x in fig["losses_envpipe"]] == [x.hex() for x in fig["losses_stock"]]
    assert fig["loss_last"] < fig["loss_first"]  # it trained
    assert fig["schedule_functions_envpipe"] == [executor_step._EXECUTOR]
    assert fig["schedule_functions_stock"] == [executor_step.MEGATRON_1F1B]
    # The simulated GPU planned: the shipped profile's envelope plan saves energy.
    assert 0.05 < fig["predicted_saving"] < 0.5
    assert fig["simulated_saving_last_iteration"] == pytest.approx(fig["predicted_saving"], abs=1e-9)
    assert len(step_result.lines) == 3 and "equal bit for bit" in step_result.lines[0]
    assert not step_result.files  # step 7 writes nothing but figures


def test_step7_staged_every_pipeline_tensor_through_host_memory(step_result: StepResult) -> None:
    fig = step_result.figures
    # Stock 1F1B: every stage pair carries one activation and one gradient per micro-batch, each
    # counted once by its sender and once by its receiver: all of them, exactly, went through the host.
    pairs = executor_step.STAGES - 1
    assert fig["host_staged_p2p_messages_stock"] == 2 * 2 * pairs * NUM_MICROBATCHES * executor_step._ITERATIONS
    # EnvPipe: the same tensors plus channel warm-up and the simulated GPU's time stamps.
    assert fig["host_staged_p2p_messages_envpipe"] > fig["host_staged_p2p_messages_stock"]
    assert fig["host_staged_bytes_stock"] > 0 and fig["host_staged_bytes_envpipe"] > 0


# --------------------------------------------------------------------------- the verdict, from given runs


def _losses(functions: list[str], losses: list[float], staged: int = 10, installed: bool = False) -> dict:
    rank = {"functions": functions, "envpipe_installed": installed, "executor_imported": installed,
            "host_staged": {"sends": staged, "recvs": staged, "collectives": 0, "bytes": 40 * staged}}
    return {"losses": losses, "tokens": [100] * len(losses), "device": "cpu", "schedule": [rank] * 4,
            "envpipe_run": {"plan": {"predicted_saving": 0.1, "predicted_slowdown": 0.05},
                            "energy": [{"saving": None}, {"saving": 0.1}]}}


GOOD = [6.25, 6.19, 6.1, 6.02]


def _outcome(label: str, losses: dict | None, code: int | None = 0) -> executor_step._RunOutcome:
    return executor_step._RunOutcome(label, code, 12.5, "output", losses)


def _verdict(envpipe: dict | None, stock: dict | None, envpipe_code: int | None = 0,
             stock_code: int | None = 0) -> StepResult:
    return executor_step._compare_runs(_outcome("envpipe", envpipe, envpipe_code), _outcome("stock", stock, stock_code))


def test_verdict_ok_only_for_equal_losses_and_the_right_functions() -> None:
    stock = _losses([executor_step.MEGATRON_1F1B], GOOD)
    assert _verdict(_losses([executor_step._EXECUTOR], GOOD, installed=True), stock).status == "ok"
    # One ulp apart is a difference.
    off = [*GOOD[:-1], float.fromhex(GOOD[-1].hex()) + 2 ** -50]
    result = _verdict(_losses([executor_step._EXECUTOR], off, installed=True), stock)
    assert result.status == "failed" and "losses differ" in result.reason
    assert result.figures["losses_equal"] is False and result.figures["max_abs_loss_diff"] > 0
    # EnvPipe's executor not run, or stock Megatron not stock.
    result = _verdict(_losses([executor_step.MEGATRON_1F1B], GOOD), stock)
    assert result.status == "failed" and "not megatron_envpipe.megatron.executor" in result.reason
    result = _verdict(_losses([executor_step._EXECUTOR], GOOD, installed=True),
                      _losses([executor_step.MEGATRON_1F1B], GOOD, installed=True))
    assert result.status == "failed" and "installed EnvPipe" in result.reason


def test_verdict_fails_when_the_host_transport_was_bypassed() -> None:
    result = _verdict(_losses([executor_step._EXECUTOR], GOOD, installed=True),
                      _losses([executor_step.MEGATRON_1F1B], GOOD, staged=0))
    assert result.status == "failed" and "did not go through host memory" in result.reason


def test_verdict_names_a_run_that_crashed_or_ran_out_of_time() -> None:
    result = _verdict(None, _losses([executor_step.MEGATRON_1F1B], GOOD), envpipe_code=1)
    assert result.status == "failed" and result.reason.startswith("the envpipe run exited 1")
    result = _verdict(_losses([executor_step._EXECUTOR], GOOD, installed=True), None, stock_code=None)
    assert result.status == "failed" and "the stock run ran past its time limit" in result.reason


@pytest.mark.fast  # no time left: executor_step.run starts no torchrun
def test_no_time_left_means_no_runs(tmp_path: Path) -> None:
    result = executor_step.run(_ctx(tmp_path, limit_s=executor_step._MIN_RUN_S))
    assert result.status == "failed" and "left for step 7's runs" in result.reason


def test_a_run_past_the_deadline_is_stopped_with_its_children(tmp_path: Path) -> None:
    """The stand-in for torchrun starts a child of its own, as torchrun starts ranks: both are stopped."""
    pid_file = tmp_path / "child.pid"
    script = (f"import subprocess, sys, time, pathlib; p = subprocess.Popen([sys.executable, '-c', "
              f"'import time; time.sleep(120)']); pathlib.Path({str(pid_file)!r}).write_text(str(p.pid)); "
              f"time.sleep(120)")
    running = executor_step._Running.start("stock", [sys.executable, "-c", script], {}, tmp_path)
    while not pid_file.exists() or not pid_file.read_text():
        assert running.proc.poll() is None
        time.sleep(0.05)
    (outcome,) = executor_step._wait_all([running], deadline=time.monotonic())
    assert outcome.returncode is None and outcome.losses is None
    child = int(pid_file.read_text())
    # The grandchild was killed: it is gone, or a zombie awaiting its (dead) parent's reaper. ps appends
    # modifiers to the state letter (ZN under nice, Z+ in a foreground group): the letter is what counts.
    state = subprocess.run(["ps", "-o", "stat=", "-p", str(child)], capture_output=True, text=True).stdout.strip()
    assert state[:1] in ("", "Z"), state


def test_each_run_has_its_own_end_time(tmp_path: Path) -> None:
    """Both runs are polled: one finished early is timed as such, whichever order they are waited in."""
    slow = executor_step._Running.start("envpipe", [sys.executable, "-c", "import time; time.sleep(4)"], {},
                                        tmp_path)
    quick = executor_step._Running.start("stock", [sys.executable, "-c", "pass"], {}, tmp_path)
    slow_outcome, quick_outcome = executor_step._wait_all([slow, quick], deadline=time.monotonic() + 120)
    assert slow_outcome.returncode == quick_outcome.returncode == 0
    assert quick_outcome.wall_s < slow_outcome.wall_s - 1.0
