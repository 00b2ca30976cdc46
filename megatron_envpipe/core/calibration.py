"""A simulated-GPU dynamics preset from what ``envpipe gpu-check`` measured on a real GPU.

:func:`calibration_from_figures` reads the earlier steps' figures (step 1 facts, step 2 counter,
step 3 clock changes, step 4 blocking power; any may be missing) and :func:`preset_text` writes a
TOML file in the format of ``configs/realistic-gpu.toml`` that
:func:`~megatron_envpipe.core.device_dynamics.load_dynamics` reads (``--envpipe-sim-dynamics
PATH``): the measured figures where there are usable ones, the base preset's figures for the rest
(power averaging and heat, which the check does not measure), each line saying which. Pure Python.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from megatron_envpipe.core.device_dynamics import MAX_LATENCY_S, DeviceDynamics, DeviceDynamicsError

__all__ = ["Calibration", "CalibratedFigure", "calibration_from_figures", "preset_text"]

# field -> (TOML key, factor from the field's unit to the key's, where gpu-check measures it)
_KEYS = {
    "clock_latency_s": ("clock_latency_ms", 1e3, "step 3 clock_changes: sm_settle_s, lock request -> SMs at the "
                                                 "new clock (median)"),
    "nvml_call_s": ("nvml_call_ms", 1e3, "step 3 clock_changes: nvml_call_s, the lock call itself (median)"),
    "counter_period_s": ("counter_period_ms", 1e3, "step 2 counter: counter_period_s, update period under load"),
    "power_average_s": ("power_average_ms", 1e3, ""),
    "thermal_drift": ("thermal_drift", 1.0, ""),
    "thermal_tau_s": ("thermal_tau_s", 1.0, ""),
    "blocking_power_w": ("blocking_power_w", 1.0, "step 4 blocking_power: blocking_power_w, a GPU spinning on a "
                                                  "flag at the maximum locked clock"),
}
# (step name, figure) -> field
_SOURCES = {
    ("clock_changes", "sm_settle_s"): "clock_latency_s",
    ("clock_changes", "nvml_call_s"): "nvml_call_s",
    ("counter", "counter_period_s"): "counter_period_s",
    ("blocking_power", "blocking_power_w"): "blocking_power_w",
}


@dataclass(frozen=True)
class CalibratedFigure:
    field: str
    value: float | None       # in the field's unit (seconds, W); None: not in the preset (blocking power)
    measured: bool
    note: str                 # where it comes from, or why the measurement was not used


@dataclass(frozen=True)
class Calibration:
    """What the preset will say, figure by figure, and about which GPU."""

    gpu: str
    driver: str
    date_utc: str
    simulated: bool           # the figures came from --device cpu (a simulated GPU), not a real one
    figures: tuple[CalibratedFigure, ...]
    base_name: str

    @property
    def measured(self) -> tuple[str, ...]:
        return tuple(f.field for f in self.figures if f.measured)

    @property
    def kept(self) -> tuple[str, ...]:
        return tuple(f.field for f in self.figures if not f.measured and f.value is not None)

    def dynamics(self) -> DeviceDynamics:
        values = {f.field: f.value for f in self.figures if f.value is not None}
        return DeviceDynamics(**values, source=self.source)

    @property
    def source(self) -> str:
        what = "SIMULATED" if self.simulated else "measured"
        return (f"calibrated-gpu.toml: {what} by envpipe gpu-check on {self.gpu}, driver {self.driver}, "
                f"{self.date_utc} ({', '.join(self.measured) or 'nothing measured'}; rest from {self.base_name})")


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        return None
    return float(value)


def calibration_from_figures(earlier: Mapping[str, Mapping[str, Any]], base: DeviceDynamics, *, base_name: str,
                             date_utc: str) -> Calibration:
    """The preset's figures: each measured one that is a usable number in range, else ``base``'s (saying why)."""
    facts = earlier.get("facts", {})
    chosen: dict[str, CalibratedFigure] = {}
    for name in _KEYS:
        if name == "blocking_power_w" and base.blocking_power_w is None:
            chosen[name] = CalibratedFigure(name, None, False, "not measured: the GPU table's P2P power stays")
        else:
            chosen[name] = CalibratedFigure(name, getattr(base, name), False, f"kept from {base_name}")
    for (step, key), name in _SOURCES.items():
        figures = earlier.get(step)
        if figures is None:
            chosen[name] = replace(chosen[name], note=f"{chosen[name].note} (step {step} did not run or failed)")
            continue
        value = _number(figures.get(key))
        if value is None:
            chosen[name] = replace(chosen[name], note=f"{chosen[name].note} (step {step} gave no {key})")
            continue
        try:  # the same ranges the loader enforces: a unit mistake is kept out of the preset
            probe = {name: value, "clock_latency_s": MAX_LATENCY_S} if name == "nvml_call_s" else {name: value}
            DeviceDynamics(**probe, source=f"step {step} {key}")
        except DeviceDynamicsError as exc:
            chosen[name] = replace(chosen[name], note=f"{chosen[name].note} (measured {value:g} out of range: {exc})")
            continue
        chosen[name] = CalibratedFigure(name, value, True, f"measured: {_KEYS[name][2]}")
    latency, call = chosen["clock_latency_s"], chosen["nvml_call_s"]
    if latency.value is not None and call.value is not None and call.value > latency.value:
        # The SMs can reach the clock before the call returns; the call is part of the latency by definition.
        chosen["nvml_call_s"] = replace(call, value=latency.value,
                                        note=f"{call.note}; capped at clock_latency ({call.value:g} s > "
                                             f"{latency.value:g} s: the SMs got there before the call returned)")
    calibration = Calibration(gpu=str(facts.get("gpu_name", "an unknown GPU (step 1 did not run)")),
                              driver=str(facts.get("driver", "unknown")), date_utc=date_utc,
                              simulated=bool(facts.get("simulated", False)),
                              figures=tuple(chosen[n] for n in _KEYS), base_name=base_name)
    calibration.dynamics()  # raises DeviceDynamicsError now rather than in the user's run
    return calibration


def _comment(text: str) -> str:
    return " ".join(str(text).split())


def preset_text(calibration: Calibration) -> str:
    """The TOML text (``[dynamics]``, the loader's keys and units), with a header saying what was measured."""
    c = calibration
    head = [
        "# calibrated-gpu.toml: the simulated GPU's dynamics, written by `envpipe gpu-check` (step 8).",
        f"# GPU: {_comment(c.gpu)}; driver {_comment(c.driver)}; {c.date_utc} UTC",
    ]
    if c.simulated:
        head.append("# SIMULATED: these figures come from --device cpu (a simulated GPU), not a real one.")
    head += [
        f"# measured here: {', '.join(_KEYS[n][0] for n in c.measured) or 'nothing'}",
        f"# kept from {c.base_name} (not measured by gpu-check): "
        f"{', '.join(_KEYS[n][0] for n in c.kept) or 'nothing'}",
        "# use: --envpipe-sim-dynamics PATH (training) with --envpipe-gpu simulated:<profile>",
        "[dynamics]",
    ]
    body = []
    for f in c.figures:
        key, factor, _ = _KEYS[f.field]
        if f.value is None:
            body.append(f"# {key}: {_comment(f.note)}")
            continue
        body.append(f"{key} = {_toml_number(f.value * factor)}  # {_comment(f.note)}")
    body.append(f"source = {json.dumps(c.source)}")
    return "\n".join(head + body) + "\n"


def _toml_number(value: float) -> str:
    text = f"{value:.6g}"
    return text if any(ch in text for ch in ".en") else f"{text}.0"
