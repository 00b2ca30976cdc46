"""Step 1 of ``envpipe gpu-check`` (apps/gpu_check/facts_step.py): the GPU's facts and the lock proof,
against the NVML test double (in-process) and, with ``--device cpu``, the simulated GPU."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests" / "gpu"))
from nvml_double import NvmlDouble, node  # noqa: E402

from megatron_envpipe.apps.gpu_check import facts_step  # noqa: E402
from megatron_envpipe.apps.gpu_check.step_api import StepContext  # noqa: E402
from megatron_envpipe.core.clock_trace import clock_step  # noqa: E402


def _ctx(tmp_path: Path, device: str = "cuda") -> StepContext:
    return StepContext(out_dir=tmp_path / "out", device=device, device_index=0, limit_s=20,
                       started_monotonic=time.monotonic(), state_dir=str(tmp_path / "state"))


@pytest.fixture
def double(tmp_path, monkeypatch):
    """double(permission=..., **gpu_changes): one fake A40 as pynvml; CUDA reported absent."""
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setattr(facts_step, "_cuda_status", lambda index: (False, "torch without CUDA (test)"))
    (tmp_path / "state").mkdir(mode=0o700)

    def make(permission: bool = True, **changes) -> NvmlDouble:
        gpus = node(1)
        for k, v in changes.items():
            setattr(gpus[0], k, v)
        d = NvmlDouble(gpus, permission=permission)
        monkeypatch.setitem(sys.modules, "pynvml", d.module())
        return d

    return make


def test_facts_and_a_working_lock(double, tmp_path):
    d = double()
    result = facts_step.run(_ctx(tmp_path))
    f = result.figures
    assert result.status == "ok"
    assert f["gpu_name"] == "NVIDIA A40" and f["driver"] == "550.54.15" and f["pci_bus_id"] == "00000000:1B:00.0"
    assert f["supported_sm_clocks_mhz"][:2] == [1740, 1725] and f["max_sm_clock_mhz"] == 1740
    assert f["min_sm_clock_mhz"] == 210 and f["clock_step_mhz"] == 15
    assert f["memory_clocks_mhz"] == [7251, 405]
    assert f["persistence_mode"] is None  # the double has no such call: unknown, not a crash
    assert f["lock"] == "ok" and f["lock_requested_mhz"] == f["lock_readback_mhz"] == 1050
    assert f["clock_event_reasons"] == ["user_defined_clocks"]
    assert f["cuda_available"] is False
    gpu = d.gpus[0]
    assert gpu.lock_count == 1 and gpu.reset_count == 1 and gpu.locked is None
    assert any(line.startswith("lock: ok") for line in result.lines)


@pytest.mark.parametrize("permission, changes, outcome, words", [
    (False, {}, "refused", "was refused"),
    (True, {"lock_supported": False}, "refused", "not supported"),
    (True, {"sm_clock_range": [210, 600]}, "not_reached", "the SMs ran at 600 MHz"),
])
def test_a_lock_that_does_not_work_says_so(double, tmp_path, permission, changes, outcome, words):
    d = double(permission=permission, **changes)
    result = facts_step.run(_ctx(tmp_path))
    f = result.figures
    assert result.status == "ok" and f["lock"] == outcome and words in f["lock_detail"]
    assert d.gpus[0].locked is None
    if outcome == "not_reached":
        assert "sw_power_cap" in f["clock_event_reasons"]


def test_persistence_mode_is_read_where_nvml_has_it(double, tmp_path):
    d = double()
    module = sys.modules["pynvml"]
    module.nvmlDeviceGetPersistenceMode = lambda handle: 1
    assert facts_step.run(_ctx(tmp_path)).figures["persistence_mode"] == "enabled"
    assert d.gpus[0].locked is None


def test_on_cpu_the_simulated_gpu_proves_its_lock(tmp_path):
    result = facts_step.run(_ctx(tmp_path, "cpu"))
    f = result.figures
    assert result.status == "ok" and f["simulated"] is True and f["lock"] == "ok" and f["cuda_available"] is True
    assert f["gpu_name"].startswith("Simulated GPU") and f["max_sm_clock_mhz"] == 1740
    assert f["clock_step_mhz"] == 15


def test_typical_step_is_the_most_common_gap():
    # step 1 reports the same figure step 3 uses (one function), None without a gap
    assert clock_step((1980, 1965, 1950, 1935, 1900), default=None) == 15
    assert clock_step((1500,), default=None) is None
