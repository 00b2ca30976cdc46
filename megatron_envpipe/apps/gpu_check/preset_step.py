"""Step 8 of ``envpipe gpu-check``: calibrated-gpu.toml, the simulated GPU's dynamics from this GPU.

Clock-change latency and the lock call (step 3), the energy counter's period (step 2) and the
blocking power (step 4) replace ``configs/realistic-gpu.toml``'s published figures; power averaging
and heat are kept from it (gpu-check does not measure them), and the file says which is which. A
step that did not run leaves its figure at the published value, with the reason in the file. The
preset loads with ``--envpipe-sim-dynamics PATH`` (checked here before it is returned).
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

from megatron_envpipe.apps.gpu_check.step_api import StepContext, StepResult
from megatron_envpipe.core.calibration import calibration_from_figures, preset_text
from megatron_envpipe.core.device_dynamics import PRESETS, load_dynamics
from megatron_envpipe.core.resources import configs_dir

__all__ = ["run"]

_BASE_PRESET = "realistic"


def run(ctx: StepContext) -> StepResult:
    base = load_dynamics(_BASE_PRESET, configs_dir())
    calibration = calibration_from_figures(ctx.earlier, base, base_name=str(PRESETS[_BASE_PRESET]),
                                           date_utc=time.strftime("%Y-%m-%d", time.gmtime()))
    text = preset_text(calibration)
    with tempfile.TemporaryDirectory(prefix="envpipe-preset-") as tmp:  # the file must load as users will load it
        path = Path(tmp) / "calibrated-gpu.toml"
        path.write_text(text)
        loaded = load_dynamics(str(path), configs_dir())
    figures = {"measured": list(calibration.measured), "kept": list(calibration.kept),
               "clock_latency_s": loaded.clock_latency_s, "nvml_call_s": loaded.nvml_call_s,
               "counter_period_s": loaded.counter_period_s, "blocking_power_w": loaded.blocking_power_w,
               "simulated": calibration.simulated}
    lines = [f"measured: {', '.join(calibration.measured) or 'nothing (every figure is the published one)'}",
             f"kept from {PRESETS[_BASE_PRESET]}: {', '.join(calibration.kept)}",
             f"clock latency {1e3 * loaded.clock_latency_s:g} ms (call {1e3 * loaded.nvml_call_s:g} ms), counter "
             f"period {1e3 * loaded.counter_period_s:g} ms, blocking power "
             + ("table's" if loaded.blocking_power_w is None else f"{loaded.blocking_power_w:g} W"),
             "use: --envpipe-sim-dynamics <out>/calibrated-gpu.toml"]
    if calibration.simulated:
        lines.insert(0, "SIMULATED (--device cpu): not figures of a real GPU")
    return StepResult("ok", figures=figures, lines=tuple(lines), files={"calibrated-gpu.toml": text})
