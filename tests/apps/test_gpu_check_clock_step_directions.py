"""gpu-check's clock step when raises and lowerings settle at different speeds: each direction's figure
is its own changes' (a real GPU raises in ~10 ms and may lower in ~40 ms, or the other way round).

The step runs in-process (``--device cpu``'s path) with the probe's measurement replaced by GPU-side
kernel traces synthesised here, whose clock lands ``RAISE_S`` after a raise request and ``LOWER_S``
after a lowering; the traces go through the real trace analysis and the step's figures."""

from __future__ import annotations

import signal
import time

import pytest

from megatron_envpipe.apps.gpu_check import clock_step
from megatron_envpipe.apps.gpu_check.clock_change_probe import TracedChange
from megatron_envpipe.apps.gpu_check.step_api import StepContext
from megatron_envpipe.core.clock_trace import TraceKernel, analyse_trace

RAISE_S, LOWER_S = 0.012, 0.045
KERNEL_S = 1e-4  # at the higher clock


def trace(f0: int, f1: int, request_s: float, land_s: float, end_s: float) -> list[TraceKernel]:
    """Back-to-back spin kernels of fixed cycles; the SMs run at f0 until ``land_s``, then at f1."""
    cycles = round(KERNEL_S * max(f0, f1) * 1e6)
    out, t = [], 0.0
    while t < end_s:
        start = t
        at_f0 = max(0.0, land_s - t) * f0 * 1e6  # cycles the kernel could run before the change
        if at_f0 >= cycles:
            t += cycles / (f0 * 1e6)
        else:
            t = max(t, land_s) + (cycles - at_f0) / (f1 * 1e6)
        out.append(TraceKernel(start, t, cycles))
    return out


def fake_changes(device, train, requester, pairs, step_mhz, **kw):
    changes = []
    for hi, lo in pairs:
        for f0, f1 in ((hi, lo), (lo, hi)):
            request_s = 0.01
            land_s = request_s + (RAISE_S if f1 > f0 else LOWER_S)
            kernels = trace(f0, f1, request_s, land_s, land_s + 0.01)
            change = analyse_trace(kernels, request_s, f0, f1, step_mhz)
            changes.append(TracedChange(change, tuple(kernels), request_s, 0.0, 1e-3, land_s - request_s))
    return changes, 0.0, ""


def test_raises_and_lowerings_are_reported_at_their_own_speeds(tmp_path, monkeypatch):
    monkeypatch.setattr(clock_step, "run_clock_changes", fake_changes)
    state = tmp_path / "state"
    ctx = StepContext(out_dir=tmp_path, device="cpu", device_index=0, limit_s=60.0,
                      started_monotonic=time.monotonic(), state_dir=str(state))
    handlers = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    result = clock_step.run(ctx)
    assert result.status == "ok", result.reason
    # its clock guard closed: the pytest process keeps no handlers of it
    assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == handlers
    fig = result.figures
    tol = 2 * KERNEL_S  # within a kernel or two of the synthesised landing
    assert fig["sm_settle_raise_s"] == pytest.approx(RAISE_S, abs=tol)
    assert fig["sm_settle_lower_s"] == pytest.approx(LOWER_S, abs=tol)
    assert fig["not_reached"] == 0 and fig["changes"] == len(fig["pairs"]) >= 2
    for pair in fig["pairs"]:
        want = RAISE_S if pair["direction"] == "raise" else LOWER_S
        assert (pair["direction"] == "raise") == (pair["to_mhz"] > pair["from_mhz"])
        assert pair["sm_settle_s"] == pytest.approx(want, abs=tol), pair
        assert pair["sm_settle_max_s"] == pytest.approx(want, abs=tol), pair
    assert {p["direction"] for p in fig["pairs"]} == {"raise", "lower"}
    (line,) = [ln for ln in result.lines if "SMs at it after" in ln]
    assert f"raise {1e3 * fig['sm_settle_raise_s']:.1f} ms, lower {1e3 * fig['sm_settle_lower_s']:.1f} ms" in line
    assert "SIMULATED" in line
