"""The NVML backend: device mapping, MIG refusal, errors, clock bookkeeping, energy.

Driven by tests/gpu/nvml_double.py, a stand-in for the driver that raises the real
nvidia-ml-py error classes; the last tests run the real pynvml (no driver here).
"""

from __future__ import annotations

import re
import sys
import types
from pathlib import Path

import pytest

pytest.importorskip("pynvml")  # nvidia-ml-py: installed by install.sh

import nvml_double  # noqa: E402  (tests/ is on sys.path under pytest's rootdir-relative import)
from nvml_double import FakeGpu, NvmlDouble, node  # noqa: E402

from megatron_envpipe.gpu.devices import nvml as nvml_mod  # noqa: E402
from megatron_envpipe.gpu.devices import nvml_library  # noqa: E402
from megatron_envpipe.gpu.devices.base import (  # noqa: E402
    PERMISSION_HINT,
    GpuError,
    GpuNotSupportedError,
    GpuPermissionError,
)
from megatron_envpipe.gpu.devices.none import NoGpu  # noqa: E402
from megatron_envpipe.gpu.devices.nvml import NvmlGpu, _normalize_pci_bus_id, _parse_cuda_visible_devices
from megatron_envpipe.gpu.devices.nvml_library import clock_permission

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def use(monkeypatch):
    """use(gpus, **kw) -> NvmlDouble installed as pynvml, with a clean CUDA environment."""
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.delenv("CUDA_DEVICE_ORDER", raising=False)

    def install(gpus: list[FakeGpu], **kw) -> NvmlDouble:
        double = NvmlDouble(gpus, **kw)
        monkeypatch.setitem(sys.modules, "pynvml", double.module())
        return double

    return install


def calls(double: NvmlDouble, name: str) -> list[tuple]:
    return [args for n, args in double.calls if n == name]


# ---------------------------------------------------------------------------
# which GPU: CUDA_VISIBLE_DEVICES, CUDA_DEVICE_ORDER, PCI bus ids
# ---------------------------------------------------------------------------


def test_parse_cuda_visible_devices_like_cuda():
    assert _parse_cuda_visible_devices(None) is None
    assert _parse_cuda_visible_devices("") == []
    assert _parse_cuda_visible_devices("2, 0") == [2, 0]
    assert _parse_cuda_visible_devices("gpu-abc,MIG-x") == ["GPU-abc", "MIG-x"]
    assert _parse_cuda_visible_devices("1,foo,2") == [1]  # CUDA stops at the first invalid entry
    assert _parse_cuda_visible_devices("1,-1,2") == [1]
    assert _parse_cuda_visible_devices("1,1,2") == [1]  # ... and at a repeated one


@pytest.mark.parametrize("text", ["0000:3b:00.0", "00000000:3B:00.0", "3b:00.0", "3B:00", " 0:3b:0.0 "])
def test_normalize_pci_bus_id(text):
    assert _normalize_pci_bus_id(text) == "00000000:3B:00.0"


def test_normalize_pci_bus_id_rejects_garbage():
    with pytest.raises(GpuError, match="not a PCI bus id"):
        _normalize_pci_bus_id("GPU-1234")


def test_without_cuda_visible_devices_index_is_pci_order(use):
    gpus = node(4)
    use(gpus)
    for i in range(4):
        gpu = NvmlGpu.for_cuda_device(i)
        assert gpu.uuid == gpus[i].uuid
        gpu.close()


def test_nvml_enumeration_order_is_not_trusted(use, monkeypatch):
    # NVML index 0 sits on bus 0x5B, index 1 on 0x1B: CUDA device 0 (PCI order) is NVML index 1.
    gpus = node(2, bus_ids=[0x5B, 0x1B])
    use(gpus)
    monkeypatch.setenv("CUDA_DEVICE_ORDER", "PCI_BUS_ID")
    gpu = NvmlGpu.for_cuda_device(0)
    assert gpu.uuid == gpus[1].uuid and gpu.pci_bus_id == "00000000:1B:00.0"
    assert "NVML 1" in gpu.origin
    gpu.close()


def test_cuda_visible_devices_indices(use, monkeypatch):
    gpus = node(4)
    use(gpus)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,0")
    a, b = NvmlGpu.for_cuda_device(0), NvmlGpu.for_cuda_device(1)
    assert (a.uuid, b.uuid) == (gpus[2].uuid, gpus[0].uuid)
    assert "CUDA_VISIBLE_DEVICES=2,0" in a.origin
    a.close()
    b.close()


def test_cuda_visible_devices_uuids_reordered_and_prefixes(use, monkeypatch):
    gpus = node(4)
    use(gpus)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", f"{gpus[3].uuid},{gpus[1].uuid[:12]}")
    a, b = NvmlGpu.for_cuda_device(0), NvmlGpu.for_cuda_device(1)
    assert (a.uuid, b.uuid) == (gpus[3].uuid, gpus[1].uuid)
    a.close()
    b.close()


def test_cuda_visible_devices_ambiguous_or_unknown_uuid(use, monkeypatch):
    use(node(4))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-0")
    with pytest.raises(GpuError, match="matches 4 GPUs"):
        NvmlGpu.for_cuda_device(0)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-ffff")
    with pytest.raises(GpuError, match="matches no GPU"):
        NvmlGpu.for_cuda_device(0)


def test_cuda_visible_devices_too_few_or_out_of_range(use, monkeypatch):
    double = use(node(2))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1,foo,0")
    with pytest.raises(GpuError, match="makes 1 GPU"):
        NvmlGpu.for_cuda_device(1)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    with pytest.raises(GpuError, match="makes 0 GPU"):
        NvmlGpu.for_cuda_device(0)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "5")
    with pytest.raises(GpuError, match="CUDA device 5 .* does not exist: NVML sees 2"):
        NvmlGpu.for_cuda_device(0)
    assert double.init_count == 0  # every failed constructor released NVML


def test_mixed_gpu_models_need_pci_order(use, monkeypatch):
    gpus = node(2)
    gpus[1].name = "NVIDIA A100-SXM4-80GB"
    use(gpus)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    with pytest.raises(GpuError, match="CUDA_DEVICE_ORDER=PCI_BUS_ID"):
        NvmlGpu.for_cuda_device(0)
    monkeypatch.setenv("CUDA_DEVICE_ORDER", "PCI_BUS_ID")
    gpu = NvmlGpu.for_cuda_device(0)
    assert gpu.uuid == gpus[1].uuid
    gpu.close()


@pytest.mark.parametrize("bus", ["0000:5b:00.0", "5B:00.0", "00000000:5B:00.0"])
def test_pci_bus_id_from_torch_wins_over_the_environment(use, monkeypatch, bus):
    gpus = node(4)  # buses 1B, 3B, 5B, 7B
    double = use(gpus)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    gpu = NvmlGpu.for_cuda_device(0, bus)
    assert gpu.uuid == gpus[2].uuid
    assert calls(double, "nvmlDeviceGetHandleByPciBusId") == [("00000000:5B:00.0",)]
    gpu.close()


def test_unknown_pci_bus_id_names_the_call(use):
    use(node(1))
    with pytest.raises(GpuError, match="nvmlDeviceGetHandleByPciBusId failed on PCI 00000000:99:00.0"):
        NvmlGpu.for_cuda_device(0, "99:00.0")


def test_uuid_from_cuda(use):
    gpus = node(2)
    use(gpus)
    bare = gpus[1].uuid[len("GPU-"):]
    gpu = NvmlGpu.for_cuda_device(0, uuid=bare)
    assert gpu.uuid == gpus[1].uuid
    gpu.close()


def test_for_torch_device_reads_the_pci_bus_id(use, monkeypatch):
    gpus = node(4)
    use(gpus)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,1")  # local 1 = physical 1 = bus 0x3B
    props = types.SimpleNamespace(pci_domain_id=0, pci_bus_id=0x3B, pci_device_id=0)
    cuda = types.SimpleNamespace(is_available=lambda: True, current_device=lambda: 1,
                                 get_device_properties=lambda i: props)
    monkeypatch.setitem(sys.modules, "torch", types.SimpleNamespace(cuda=cuda))
    gpu = NvmlGpu.for_torch_device()
    assert gpu.uuid == gpus[1].uuid and "PCI 00000000:3B:00.0" in gpu.origin
    gpu.close()


# ---------------------------------------------------------------------------
# MIG
# ---------------------------------------------------------------------------


def test_mig_enabled_gpu_is_refused(use):
    gpus = node(2)
    gpus[0].mig_mode = 1
    double = use(gpus)
    with pytest.raises(GpuNotSupportedError, match="NVML cannot set clocks or read the energy of a MIG slice"):
        NvmlGpu.for_cuda_device(0)
    assert double.init_count == 0
    NvmlGpu.for_cuda_device(1).close()


def test_mig_entries_and_uuids_are_refused(use, monkeypatch):
    gpus = node(1)
    gpus[0].mig_mode = 1
    gpus[0].mig_uuids = ["MIG-11111111-2222-3333-4444-555555555555"]
    double = use(gpus)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", gpus[0].mig_uuids[0])
    with pytest.raises(GpuNotSupportedError, match="MIG slice MIG-1111"):
        NvmlGpu.for_cuda_device(0)
    with pytest.raises(GpuNotSupportedError, match="MIG slice"):
        NvmlGpu.for_cuda_device(0, uuid=gpus[0].mig_uuids[0])
    with pytest.raises(GpuNotSupportedError, match="MIG slice"):
        NvmlGpu.for_uuid(gpus[0].mig_uuids[0])
    # a MIG device handle reached some other way is caught by nvmlDeviceIsMigDeviceHandle
    m = nvml_mod.nvml_acquire()
    handle = m.nvmlDeviceGetHandleByUUID(gpus[0].mig_uuids[0])
    with pytest.raises(GpuNotSupportedError, match="is a MIG slice"):
        NvmlGpu(m, handle)
    assert double.init_count == 0


def test_gpu_without_mig_support_is_fine(use):
    gpus = node(1)
    gpus[0].mig_mode = None  # pre-Ampere: nvmlDeviceGetMigMode is NOT_SUPPORTED
    use(gpus)
    NvmlGpu.for_cuda_device(0).close()


# ---------------------------------------------------------------------------
# clocks, permissions, errors
# ---------------------------------------------------------------------------


def test_supported_clocks_highest_memory_clock_sorted_descending(use):
    gpus = node(1)
    gpus[0].memory_clocks = [7251, 405, 5001]
    gpus[0].graphics_clocks = [1200, 1740, 210, 1740, 900]
    double = use(gpus)
    gpu = NvmlGpu.for_cuda_device(0)
    assert gpu.supported_clocks_mhz() == (1740, 1200, 900, 210)
    assert [a[1] for a in calls(double, "nvmlDeviceGetSupportedGraphicsClocks")] == [7251]
    gpu.supported_clocks_mhz()
    assert len(calls(double, "nvmlDeviceGetSupportedGraphicsClocks")) == 1  # cached
    gpu.close()


def test_lock_and_reset_bookkeeping(use):
    gpus = node(2)
    double = use(gpus)
    gpu = NvmlGpu.for_cuda_device(1)
    assert gpu.locked_clock_mhz() is None
    gpu.set_locked_clocks(1200)
    assert gpu.locked_clock_mhz() == 1200
    assert double.gpu(gpus[1].uuid).locked == [1200, 1200]  # min = max
    assert double.gpu(gpus[0].uuid).locked is None
    gpu.set_locked_clocks(900)
    assert double.gpu(gpus[1].uuid).locked == [900, 900]
    gpu.reset_locked_clocks()
    assert gpu.locked_clock_mhz() is None and double.gpu(gpus[1].uuid).locked is None
    gpu.close()


def test_lock_rejects_clocks_outside_the_supported_range(use):
    double = use(node(1))
    gpu = NvmlGpu.for_cuda_device(0)
    for bad in (5000, 100, 0, 1200.5):
        with pytest.raises(GpuError):
            gpu.set_locked_clocks(bad)
    assert calls(double, "nvmlDeviceSetGpuLockedClocks") == []
    assert gpu.locked_clock_mhz() is None
    gpu.close()


def test_no_permission_fails_with_the_fix(use):
    gpus = node(1)
    double = use(gpus, permission=False)
    gpu = NvmlGpu.for_cuda_device(0)
    with pytest.raises(GpuPermissionError) as info:
        gpu.set_locked_clocks(1200)
    message = str(info.value)
    assert "nvmlDeviceSetGpuLockedClocks" in message and gpus[0].uuid in message
    assert PERMISSION_HINT in message and "CAP_SYS_ADMIN" in message
    assert isinstance(info.value.__cause__, sys.modules["pynvml"].NVMLError_NoPermission)
    assert gpu.locked_clock_mhz() is None and double.gpu(gpus[0].uuid).locked is None
    with pytest.raises(GpuPermissionError):
        gpu.reset_locked_clocks()
    gpu.close()


def test_not_supported_calls(use):
    gpus = node(1)
    gpus[0].lock_supported = False
    gpus[0].energy_supported = False
    use(gpus)
    gpu = NvmlGpu.for_cuda_device(0)
    with pytest.raises(GpuNotSupportedError, match="nvmlDeviceSetGpuLockedClocks is not supported"):
        gpu.set_locked_clocks(1200)
    with pytest.raises(GpuNotSupportedError, match="Volta or newer"):
        gpu.energy_mj()
    gpu.close()


def test_other_nvml_errors_name_the_call_and_device(use):
    gpus = node(1)
    double = use(gpus)
    m = sys.modules["pynvml"]
    double.failures["nvmlDeviceSetGpuLockedClocks"] = m.NVML_ERROR_GPU_IS_LOST
    gpu = NvmlGpu.for_cuda_device(0)
    with pytest.raises(GpuError) as info:
        gpu.set_locked_clocks(1200)
    assert type(info.value) is GpuError
    assert "NVML nvmlDeviceSetGpuLockedClocks failed on GPU " + gpus[0].uuid in str(info.value)
    assert "GPU is lost" in str(info.value) and f"NVML error {m.NVML_ERROR_GPU_IS_LOST}" in str(info.value)
    gpu.close()


def test_energy_and_power(use):
    gpus = node(1)
    gpus[0].energy_mj = 123_456_789
    gpus[0].power_mw = 301_500
    use(gpus)
    gpu = NvmlGpu.for_cuda_device(0)
    assert gpu.energy_mj() == 123_456_789.0 and isinstance(gpu.energy_mj(), float)
    assert gpu.power_w() == pytest.approx(301.5)
    gpu.close()


def test_info(use):
    gpus = node(1)
    use(gpus, driver_version="555.42.06")
    gpu = NvmlGpu.for_cuda_device(0)
    info = gpu.info()
    assert (info.name, info.uuid, info.pci_bus_id, info.driver_version, info.backend, info.simulated) == (
        "NVIDIA A40", gpus[0].uuid, "00000000:1B:00.0", "555.42.06", "nvml", False)
    gpu.close()


def test_nvml_init_is_refcounted(use):
    double = use(node(2))
    a = NvmlGpu.for_cuda_device(0)
    b = NvmlGpu.for_cuda_device(1)
    assert len(calls(double, "nvmlInit")) == 1 and double.init_count == 1
    a.close()
    a.close()  # idempotent
    assert calls(double, "nvmlShutdown") == []
    assert b.energy_mj() > 0  # still usable
    b.close()
    assert len(calls(double, "nvmlShutdown")) == 1 and double.init_count == 0
    with pytest.raises(GpuError, match="closed"):
        b.energy_mj()


def test_reset_after_close_reopens_nvml(use):
    gpus = node(1)
    double = use(gpus)
    gpu = NvmlGpu.for_cuda_device(0)
    gpu.set_locked_clocks(1110)
    gpu.close()
    gpu.reset_locked_clocks()
    assert double.gpu(gpus[0].uuid).locked is None and double.init_count == 0


def test_no_driver_and_no_package(use, monkeypatch):
    use(node(1), no_driver=True)
    with pytest.raises(GpuNotSupportedError, match="NVML cannot start .*nvidia-smi"):
        NvmlGpu.for_cuda_device(0)
    monkeypatch.setitem(sys.modules, "pynvml", None)
    with pytest.raises(GpuNotSupportedError, match="pip install nvidia-ml-py"):
        NvmlGpu.for_cuda_device(0)


# ---------------------------------------------------------------------------
# permission check without changing anything
# ---------------------------------------------------------------------------


def _proc(tmp_path: Path, capeff: int, uid_map: str = "         0          0 4294967295\n") -> tuple[str, str]:
    status = tmp_path / "status"
    status.write_text(f"Name:\tpython\nCapInh:\t0000000000000000\nCapEff:\t{capeff:016x}\n")
    umap = tmp_path / "uid_map"
    umap.write_text(uid_map)
    return str(status), str(umap)


def test_clock_permission_reads_cap_sys_admin(tmp_path):
    ok, why = clock_permission(*_proc(tmp_path, 0x000001FFFFFFFFFF))
    assert ok, why
    ok, why = clock_permission(*_proc(tmp_path, 0x00000000A80425FB))  # docker's default set
    assert not ok and ("SYS_ADMIN" in why or "CAP_SYS_ADMIN" in why)
    ok, why = clock_permission(*_proc(tmp_path, 1 << 21, "0 1000 1\n"))
    assert not ok and "user namespace" in why


# (CapEff, uid_map) -> can_set_clocks() and the reason: CAP_SYS_ADMIN in the host's user namespace.
HOST_NS = "         0          0 4294967295\n"
PROC_STATES = [
    (0x000001FFFFFFFFFF, HOST_NS, True, r"^(root|CAP_SYS_ADMIN)$"),  # full root
    (1 << 21, HOST_NS, True, r"^(root|CAP_SYS_ADMIN)$"),  # only CAP_SYS_ADMIN
    (0x00000000A80425FB, HOST_NS, False, r"without CAP_SYS_ADMIN|neither root nor CAP_SYS_ADMIN"),  # docker default
    (1 << 21, "0 1000 1\n", False, r"only inside a user namespace"),  # rootless container
]


@pytest.mark.parametrize("driver_permission", [True, False])
@pytest.mark.parametrize("capeff,uid_map,expected,reason", PROC_STATES)
def test_can_set_clocks_reads_the_capabilities_and_changes_nothing(
        use, monkeypatch, tmp_path, driver_permission, capeff, uid_map, expected, reason):
    # The answer comes from /proc (files standing in for it here), never from trying a lock:
    # the double's own permission flag must not change it, and no clock call may be made.
    double = use(node(1), permission=driver_permission)
    monkeypatch.setattr(clock_permission, "__defaults__", _proc(tmp_path, capeff, uid_map))
    gpu = NvmlGpu.for_cuda_device(0)
    assert gpu.can_set_clocks() is expected
    assert re.search(reason, gpu.permission_reason()), gpu.permission_reason()
    assert calls(double, "nvmlDeviceSetGpuLockedClocks") == calls(double, "nvmlDeviceResetGpuLockedClocks") == []
    assert double.gpu(double.gpus[0].uuid).locked is None
    gpu.close()


# ---------------------------------------------------------------------------
# backend "none"
# ---------------------------------------------------------------------------


def test_no_gpu_backend():
    gpu = NoGpu()
    assert gpu.backend == "none" and gpu.info().backend == "none"
    assert gpu.supported_clocks_mhz() == () and gpu.can_set_clocks() is False
    gpu.set_locked_clocks(1200)
    assert gpu.locked_clock_mhz() is None
    gpu.reset_locked_clocks()
    assert gpu.energy_mj() == 0.0 and gpu.power_w() == 0.0
    gpu.close()


# ---------------------------------------------------------------------------
# the real pynvml (no driver on CI machines)
# ---------------------------------------------------------------------------


def _real_nvml_works() -> bool:
    import pynvml

    real = getattr(pynvml, "_real", pynvml)
    try:
        real.nvmlInit()
    except real.NVMLError:
        return False
    real.nvmlShutdown()
    return True


@pytest.mark.skipif(_real_nvml_works(), reason="a real NVIDIA driver is present")
def test_real_pynvml_without_a_driver_fails_clearly(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", nvml_double._real)
    with pytest.raises(GpuNotSupportedError, match="NVML cannot start"):
        NvmlGpu.for_cuda_device(0)
    assert nvml_library._nvml_refcount() == 0
