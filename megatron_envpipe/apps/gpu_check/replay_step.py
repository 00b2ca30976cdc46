"""Step 6: the shipped-style plans replayed on this GPU from step 5's profile, predicted vs measured.

Plans envelope/optimal x 1f1b/ours at P = 4 identical stages (stage 0 of profile.csv, M = 8
micro-batches) and their baselines (1F1B at the maximum clock) are replayed stage by stage by
:func:`megatron_envpipe.apps.gpu_check.replay.replay_plan`: real kernels at the planned clocks, waits spinning
on a flag (``FlagSpin``, as on NCCL) at the locked clock, counter-aligned energy windows. The
prediction charges each wait the blocking power AT ITS CLOCK (step 4's figures interpolated; step
5's idle power per clock when step 4 did not run), the same table the comparison is read against.
A plan matches when |measured/predicted - 1| is within its tolerance, derived from the measurement
(the windows' counter bound and the profile rows' uncertainty), not a fixed 1 %. A control replay,
the optimal:ours plan run at the maximum clock everywhere, must come out as a mismatch: it proves
the comparison can see a wrong clock on this GPU.
"""

from __future__ import annotations

import csv
import io
import math
import time
from collections.abc import Callable
from typing import Any

from megatron_envpipe.apps.gpu_check.replay import PlanReplay, ReplaySetup, interpolated_power, replay_plan
from megatron_envpipe.apps.gpu_check.spin_wait import FlagSpin
from megatron_envpipe.apps.gpu_check.stage_bench import (
    CPU_SPEC,
    GPU_SPEC,
    Bench,
    blocking_by_clock,
    counter_figures,
    open_bench,
    window_s,
)
from megatron_envpipe.apps.gpu_check.stage_profile import identical_stages
from megatron_envpipe.apps.gpu_check.step_api import StepContext, StepResult
from megatron_envpipe.core.profile import Profile, ProfileError
from megatron_envpipe.gpu.hooks import GpuHooks
from megatron_envpipe.megatron.stage_model import open_stage
from megatron_envpipe.planning.basis import PlannerConfig
from megatron_envpipe.planning.planner import plan_envpipe

__all__ = ["MICROBATCHES", "STAGES", "run"]

_PLANS = ("envelope:1f1b", "envelope:ours", "optimal:1f1b", "optimal:ours")
_CONTROL = "optimal:ours"  # replayed once more with every unit at the maximum clock: must mismatch
STAGES = 4
MICROBATCHES = 8
MARGIN_S = 6.0
CSV_COLUMNS = ("plan", "replay_clocks", "stage", "predicted_j", "measured_j", "uncertainty_j", "error",
               "tolerance", "ok", "predicted_time_s", "measured_time_s", "late_s", "iterations",
               "planner_predicted_j", "predicted_saving", "measured_saving")


def _power_tables(ctx: StepContext) -> tuple[Callable[[int], float], Callable[[int], float], str]:
    """(blocking power at a clock, idle power at a clock, where the blocking figures came from)."""
    idle_table = ctx.earlier.get("profile", {}).get("idle_power_w_by_clock")
    idle = None
    if isinstance(idle_table, dict) and idle_table:
        idle = interpolated_power({int(f): float(w) for f, w in idle_table.items()})
    blocking = blocking_by_clock(ctx)
    if blocking is not None:
        return interpolated_power(blocking), idle or interpolated_power(blocking), "step 4 (spinning on a flag)"
    if idle is not None:
        return idle, idle, "step 5's idle power per clock (step 4 gave no blocking power)"
    raise ProfileError("no blocking power: neither step 4 nor step 5 measured power at a locked clock")


def _wait_fn(bench: Bench, ctx: StepContext) -> tuple[Callable[[float, int], None], str]:
    """How the replay waits: a GPU spinning on a flag at the locked clock (CUDA), the simulated GPU
    idling at its clock-dependent blocking power (CPU)."""
    if not bench.cuda:
        sleep = bench.sleep
        return (lambda seconds, freq_mhz: sleep(seconds)), "simulated GPU waiting at the locked clock"
    spin = FlagSpin(ctx.device_index)
    return spin.spin, f"FlagSpin ({spin.spin_kind})"


def _replay_plans(ctx: StepContext, profile: Profile, setup: ReplaySetup, blocking_w_at: Callable[[int], float],
                 profile_unc: float, *, plans: tuple[str, ...] = _PLANS, replay_clocks: str = "planned",
                 control: bool = True) -> tuple[list[dict[str, Any]], list[dict[str, Any]], str | None]:
    """(one summary per plan, one CSV row per plan and stage, why it stopped early or None)."""
    f_max = profile.max_frequency()
    pipeline = identical_stages(profile, STAGES)
    wrong = {"planned": int, "max": lambda f: f_max}[replay_clocks]
    baselines: dict[str, PlanReplay] = {}
    summaries: list[dict[str, Any]] = []
    rows: list[dict[str, Any]] = []
    runs = [(p, replay_clocks) for p in plans] + ([(_CONTROL, "max")] if control else [])
    last_s = 0.0  # host seconds the previous plan took: the next one needs about as long
    for name, how in runs:
        if ctx.left_s(MARGIN_S) <= last_s:
            return summaries, rows, f"stopped before {name} ({how}): {ctx.left_s():.0f} s left of the step's time"
        began = time.monotonic()
        plan_type, scheduling = name.split(":")
        cfg = PlannerConfig(plan_type=plan_type, scheduling=scheduling, p2p_power_w=blocking_w_at(f_max))
        res = plan_envpipe(pipeline, MICROBATCHES, cfg, STAGES)
        key = repr(res.baseline_plan.freqs_mhz) + repr(res.baseline_plan.schedule.orders)
        if key not in baselines:
            baselines[key] = replay_plan(setup, res.baseline_plan, res.baseline_timeline, pipeline, blocking_w_at)
        base = baselines[key]
        clocks = wrong if how == replay_clocks else (lambda f: f_max)
        rep = replay_plan(setup, res.plan, res.timeline, pipeline, blocking_w_at, clocks=clocks)
        tol = math.hypot(rep.rel_uncertainty, base.rel_uncertainty, profile_unc)
        ok = abs(rep.error) <= tol and abs(base.error) <= tol
        summary = {
            "plan": name, "replay_clocks": how, "predicted_j": rep.predicted_j, "measured_j": rep.measured_j,
            "error": rep.error, "tolerance": tol, "ok": ok, "baseline_error": base.error,
            "planner_predicted_j": res.score.energy_j,
            "predicted_saving": 1.0 - rep.predicted_j / base.predicted_j,
            "measured_saving": 1.0 - rep.measured_j / base.measured_j,
            "predicted_time_s": rep.predicted_time_s, "measured_time_s": rep.measured_time_s,
            "time_error": rep.time_error, "switch_excess_ms": 1e3 * rep.switch_excess_s,
        }
        summaries.append(summary)
        for s in rep.stages:
            rows.append({"plan": name, "replay_clocks": how, "stage": s.stage, "predicted_j": s.predicted_j,
                         "measured_j": s.energy_j, "uncertainty_j": s.uncertainty_j,
                         "error": s.energy_j / s.predicted_j - 1.0, "predicted_time_s": rep.predicted_time_s,
                         "measured_time_s": s.wall_s, "late_s": s.late_s, "iterations": s.iterations})
        rows.append({**{k: summary[k] for k in ("plan", "replay_clocks", "predicted_j", "measured_j", "error",
                                                "tolerance", "ok", "predicted_time_s", "measured_time_s",
                                                "planner_predicted_j", "predicted_saving", "measured_saving")},
                     "stage": "all", "uncertainty_j": rep.uncertainty_j})
        last_s = time.monotonic() - began
    return summaries, rows, None


def _csv_text(rows: list[dict[str, Any]]) -> str:
    out = io.StringIO()
    writer = csv.DictWriter(out, CSV_COLUMNS, lineterminator="\n")
    writer.writeheader()
    for row in rows:
        writer.writerow({k: (f"{v:.6g}" if isinstance(v, float) else v) for k, v in row.items()})
    return out.getvalue()


def run(ctx: StepContext, *, replay_clocks: str = "planned") -> StepResult:
    """``replay_clocks="max"`` replays every plan at the maximum clock: a deliberately wrong replay (tests)."""
    path = ctx.out_dir / "profile.csv"
    if not path.is_file():
        return StepResult("skipped", f"no {path.name} in {ctx.out_dir} (step 5 did not write one)")
    try:
        profile = Profile.from_csv(path)
    except ProfileError as exc:
        return StepResult("failed", f"step 5's {path.name} cannot be read: {exc}")
    if len(profile.frequencies(0, "forward")) < 2:
        return StepResult("skipped", f"{path.name} has fewer than 2 clocks: nothing to plan")
    try:
        blocking_w_at, idle_w_at, blocking_from = _power_tables(ctx)
    except ProfileError as exc:
        return StepResult("skipped", str(exc))
    unc = ctx.earlier.get("profile", {}).get("energy_rel_unc_max")
    profile_unc = float(unc) if isinstance(unc, int | float) and not isinstance(unc, bool) else 0.0
    period_s, read_cost_s, period_from = counter_figures(ctx)
    win_s = window_s(period_s, read_cost_s)
    with open_bench(ctx, period_s) as bench:
        clocks = set(bench.device.supported_clocks_mhz())
        missing = [f for f in profile.frequencies(0, "forward") if f not in clocks]
        if missing:
            return StepResult("failed", f"{path.name} has clocks this device does not support: {missing} MHz")
        wait, wait_kind = _wait_fn(bench, ctx)
        hooks = GpuHooks(bench.device, control=True, cuda=bench.cuda, guard=bench.guard, poll_interval_s=0.05,
                         virtual_clock=bench.virtual_clock)
        try:
            with open_stage(GPU_SPEC if bench.cuda else CPU_SPEC,
                            f"cuda:{ctx.device_index}" if bench.cuda else "cpu") as stage:
                setup = ReplaySetup(hooks, stage, wait, period_s, win_s, idle_w_at, bench.clock, bench.sleep)
                summaries, rows, stopped = _replay_plans(ctx, profile, setup, blocking_w_at, profile_unc,
                                                        replay_clocks=replay_clocks)
            lost = hooks.clock_control_lost
        finally:
            hooks.close()
    figures = {"plans": summaries, "stages": STAGES, "microbatches": MICROBATCHES, "wait": wait_kind,
               "blocking_power_from": blocking_from, "counter_period_s": period_s,
               "counter_period_from": period_from, "window_s": win_s, "profile_energy_rel_unc": profile_unc,
               "simulated": bench.device.capabilities().modelled, "replay_clocks": replay_clocks}
    control = [s for s in summaries if s["replay_clocks"] == "max" and replay_clocks == "planned"]
    figures["control_mismatch_detected"] = (not control[0]["ok"]) if control else None
    planned = [s for s in summaries if s["replay_clocks"] == replay_clocks]
    figures["all_within_tolerance"] = bool(planned) and all(s["ok"] for s in planned)
    lines = [f"{s['plan']:14s} {s['replay_clocks']:7s} predicted {s['predicted_j']:.4g} J measured "
             f"{s['measured_j']:.4g} J ({100 * s['error']:+.2f} %, tolerance {100 * s['tolerance']:.2f} %) saving "
             f"{100 * s['predicted_saving']:.1f} % vs {100 * s['measured_saving']:.1f} % "
             f"{'OK' if s['ok'] else 'MISMATCH'}" for s in summaries]
    lines.append(f"P={STAGES}, M={MICROBATCHES}; waits: {wait_kind}; blocking power per clock from {blocking_from}; "
                 f"control (every unit at the maximum clock) "
                 f"{ {True: 'detected as a mismatch', False: 'NOT detected', None: 'not run'}[figures['control_mismatch_detected']] }")
    files = {"replay.csv": _csv_text(rows)} if rows else {}
    if lost is not None:
        return StepResult("failed", f"clock control was lost during the replay: {lost}", figures=figures,
                          lines=tuple(lines), files=files)
    if stopped is not None:
        return StepResult("failed", stopped, figures=figures, lines=tuple(lines), files=files)
    return StepResult("ok", figures=figures, lines=tuple(lines), files=files)
