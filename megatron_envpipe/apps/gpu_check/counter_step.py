"""Step 2 of ``envpipe gpu-check``: the energy counter, idle and under load.

Reads ``nvmlDeviceGetTotalEnergyConsumption`` every ~1 ms (and the power reading every 50 ms),
first with the GPU idle, then under a steady bf16 matmul load on a side stream
(:mod:`megatron_envpipe.apps.gpu_check.counter_probe`), and derives
(:mod:`megatron_envpipe.core.counter_analysis`): the update period (fitted to the change
brackets; ``counter_period_s`` under load, ``counter_period_idle_s``) and its spread, the energy
per update, the read cost (mean and p99), and counter power against power readings (NVML power
is a 1 s average: readings in the first second of a phase are left out). ``counter.csv`` holds
the reads around every change and the power readings (a few thousand rows at most).

The phases share what ``ctx.left_s()`` leaves after a margin (40 % idle, 60 % load, after a
1 s warm-up of the load). With ``--device cpu`` the same code polls the simulated GPU (A40
profile, a 100 ms counter and 1 s power averaging) in virtual time: figures labelled simulated.
"""

from __future__ import annotations

from typing import Any

from megatron_envpipe.apps.gpu_check.counter_probe import MatmulLoad, SimulatedUnitLoad, poll_counter
from megatron_envpipe.apps.gpu_check.device import open_check_device
from megatron_envpipe.apps.gpu_check.step_api import StepContext, StepResult
from megatron_envpipe.core.counter_analysis import CounterAnalysisError, CounterFigures, analyze_counter, counter_csv
from megatron_envpipe.core.device_dynamics import DeviceDynamics
from megatron_envpipe.errors import EnvPipeError
from megatron_envpipe.gpu.devices.simulated import SimulatedGpu

__all__ = ["SIMULATED_DYNAMICS", "run"]

MARGIN_S = 6.0           # CUDA start-up of the load, the CSV, the child's exit
_WARMUP_S = 1.0           # the load reaches steady power before its phase is recorded
_IDLE_SHARE = 0.4         # of the polling time left after the margin and warm-up
_SIMULATED_POLL_S = 8.0   # virtual seconds polled in CI (each phase gets its share)
_MIN_PHASE_S = 1.0        # a phase shorter than this says nothing about a ~100 ms counter
_POWER_AVERAGE_S = 1.0    # NVML power readings are 1 s averages on Ampere and later (Zeus #45)
SIMULATED_DYNAMICS = DeviceDynamics(counter_period_s=0.1, power_average_s=_POWER_AVERAGE_S,
                                    source="gpu-check --device cpu: a 100 ms counter, 1 s power averages")


def run(ctx: StepContext) -> StepResult:
    try:
        opened = open_check_device(ctx, SIMULATED_DYNAMICS)
    except EnvPipeError as exc:
        return StepResult("failed", reason=f"cannot open the GPU: {_line(exc)}")
    device, clock, sleep = opened.device, opened.clock, opened.sleep
    load: Any = None
    try:
        if opened.modelled:
            assert isinstance(device, SimulatedGpu)
            load = SimulatedUnitLoad(device)
            total_s = _SIMULATED_POLL_S
        else:
            load = MatmulLoad(ctx.device_index)  # CUDA start-up here, before the idle phase
            total_s = ctx.left_s(MARGIN_S) - _WARMUP_S
        idle_s, load_s = _IDLE_SHARE * total_s, (1 - _IDLE_SHARE) * total_s
        if load_s < _MIN_PHASE_S:
            return StepResult("skipped", reason=f"only {ctx.left_s():.0f} s left: too little to poll the counter")
        timing = {"clock": clock, "sleep": sleep}
        idle_reads, idle_powers = poll_counter(device, idle_s, **timing)
        poll_counter(device, _WARMUP_S, feed=load.feed, power_every_s=_WARMUP_S, **timing)
        load_reads, load_powers = poll_counter(device, load_s, feed=load.feed, **timing)
        load.stop()
    except EnvPipeError as exc:
        return StepResult("failed", reason=_line(exc))
    finally:
        device.close()
    idle, idle_why = _analyze(idle_reads, idle_powers, "idle")
    loaded, load_why = _analyze(load_reads, load_powers, "under load")
    csv = counter_csv([("idle", idle_reads, idle_powers), ("load", load_reads, load_powers)])
    if loaded is None and idle is None:
        return StepResult("failed", reason=f"{load_why}; {idle_why}", files={"counter.csv": csv})
    figures = _figures(idle, loaded, opened.modelled, device.info().label())
    notes = [why for why in (idle_why, load_why) if why]
    if notes:
        figures["notes"] = notes
    return StepResult("ok", figures=figures, lines=_lines(idle, loaded, opened.modelled),
                      files={"counter.csv": csv})


def _analyze(reads: list, powers: list, phase: str) -> tuple[CounterFigures | None, str]:
    try:
        return analyze_counter(reads, powers, power_average_s=_POWER_AVERAGE_S, where=f"counter {phase}"), ""
    except CounterAnalysisError as exc:
        return None, _line(exc)


def _figures(idle: CounterFigures | None, loaded: CounterFigures | None, simulated: bool,
             label: str) -> dict[str, Any]:
    main = loaded or idle
    assert main is not None
    figures: dict[str, Any] = {
        "gpu": label,
        "simulated": simulated,
        "counter_period_s": loaded.counter_period_s if loaded else None,
        "counter_period_idle_s": idle.counter_period_s if idle else None,
        "counter_step_j": main.counter_step_j,
        "read_cost_s": main.read_cost_s,
        "read_cost_p99_s": main.read_cost_p99_s,
        "idle_power_w": idle.counter_power_w if idle else None,
        "load_power_w": loaded.counter_power_w if loaded else None,
        "power_agreement": loaded.power_agreement if loaded else (idle.power_agreement if idle else None),
    }
    if loaded is None and idle is not None:  # the preset still needs a period: say which phase gave it
        figures["counter_period_s"] = idle.counter_period_s
        figures["counter_period_from"] = "idle (no load figures)"
    for suffix, phase in (("_idle", idle), ("_load", loaded)):
        if phase is not None:
            figures.update(phase.to_json(suffix))
    return {k: float(f"{v:.6g}") if isinstance(v, float) else v for k, v in figures.items()}


def _lines(idle: CounterFigures | None, loaded: CounterFigures | None, simulated: bool) -> tuple[str, ...]:
    out = []
    tag = " (simulated)" if simulated else ""
    for name, phase in (("under load", loaded), ("idle", idle)):
        if phase is None:
            out.append(f"counter {name}: not measured")
            continue
        agree = "" if phase.power_agreement is None else \
            f", power readings {100 * phase.power_agreement:+.1f} % vs counter"
        out.append(f"counter {name}{tag}: updates every {1000 * phase.counter_period_s:.1f} ms "
                   f"(spread {1000 * phase.counter_period_spread_s:.1f} ms, {phase.changes} updates), "
                   f"{phase.counter_step_j:.2f} J per update, {phase.counter_power_w:.1f} W{agree}")
    main = loaded or idle
    if main is not None:
        out.append(f"counter read cost: {1e6 * main.read_cost_s:.0f} us mean, {1e6 * main.read_cost_p99_s:.0f} us p99")
    return tuple(out)


def _line(exc: BaseException) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__
