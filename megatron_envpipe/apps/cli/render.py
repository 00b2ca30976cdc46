"""How the ``envpipe`` commands show results: JSON objects and the text report of a plan."""

from __future__ import annotations

import json
import sys
from typing import Any, TextIO

from megatron_envpipe.apps.cli.common import CliError
from megatron_envpipe.apps.cli.rows import plan_rows
from megatron_envpipe.core.kinds import scheduling_kind
from megatron_envpipe.core.memory import show_budget
from megatron_envpipe.core.profile import Profile
from megatron_envpipe.core.timeline import PlanScore, Timeline
from megatron_envpipe.planning.basis import PlanResult


def strict_json(data: Any) -> str:
    """``data`` as standard JSON, indent 1: a nan or infinity (which Python would write as ``NaN``/``Infinity``,
    JSON no reader but Python's accepts, 'envpipe show' included) is one CliError line, and nothing is written."""
    try:
        return json.dumps(data, indent=1, allow_nan=False)
    except ValueError:
        raise CliError("the result holds a number that is not finite (nan or infinity), which JSON cannot hold: "
                       "no output written; check the profile and the scale flags") from None


def print_json(data: dict[str, Any]) -> None:
    """One JSON object on stdout (``--json``), all checked before the first byte is printed."""
    print(strict_json(data))


def score_dict(score: PlanScore, switch_energy_j: float | None = None) -> dict[str, Any]:
    """A scored iteration; with ``switch_energy_j`` (a plan's), ``energy_j`` is what the plan is worth
    (simulated + clock changes, ``PlanResult.energy_j``) and both parts are listed."""
    switches = {} if switch_energy_j is None else {"simulated_energy_j": score.energy_j,
                                                   "switch_energy_j": switch_energy_j}
    return {
        "iteration_time_s": score.iteration_time_s,
        "energy_j": score.energy_j + (switch_energy_j or 0.0),
        **switches,
        "compute_energy_j": score.compute_energy_j,
        "blocking_energy_j": score.blocking_energy_j,
        "stage_busy_s": list(score.busy_s),
        "stage_energy_j": list(score.stage_energy_j),
    }


def recv_wait_ms(timeline: Timeline) -> list[list[float]]:
    """Per stage, per unit in order: how long it waited for its input, ms (EnvPipe's printout)."""
    return timeline.recv_wait_ms_rows()


def critical_path(timeline: Timeline) -> list[str]:
    """The critical units from first to last, ``["S0 F0", "S1 F0", ...]``."""
    return [f"S{s} {u}" for s, u in reversed(timeline.critical_units())]


def result_to_dict(result: PlanResult, profile: Profile, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """``envpipe plan --json`` / ``--out``: the plan, its baseline and how it was found."""
    cfg = result.config
    plan_dict = score_dict(result.score, result.switch_energy_j)
    plan_dict.update(
        {
            "type": cfg.plan_type,
            "scheduling": cfg.scheduling,
            "reconfig": cfg.reconfig,
            "extra_warmup": list(result.schedule.extra_warmup),
            "peak_inflight_activations": list(result.schedule.peak_inflight()),
            **_budget_entry(result),
            "clock_changes_per_stage": list(result.plan.clock_changes()),
            "charged_clock_changes_per_stage": list(result.charged_clock_changes),
            "frequencies": result.plan.to_dict()["stages"],
            # The simulated timeline's waits and critical path, for 'envpipe show' (the clocks alone lack them).
            "recv_wait_ms": recv_wait_ms(result.timeline),
            "critical_path": critical_path(result.timeline),
        }
    )
    data: dict[str, Any] = {
        "profile": profile.source,
        "num_stages": result.schedule.num_stages,
        "num_microbatches": result.schedule.num_microbatches,
        "gpu": cfg.gpu.key if cfg.gpu else None,
        "p2p_power_w": cfg.effective_p2p_power_w,
        "f_max_mhz": result.f_max_mhz,
        "valley_mhz": list(result.valley_mhz),
        "baseline": {
            **score_dict(result.baseline, result.baseline_switch_energy_j),
            "name": cfg.baseline_name,
            "scheduling": result.baseline_plan.schedule.name,
            "virtual_stages": cfg.virtual_stages,
            "peak_inflight_activations": list(result.baseline_plan.schedule.peak_inflight()),
            "frequency_mhz": result.f_max_mhz,
        },
        "plan": plan_dict,
        "switch_cost_j": result.switch_cost_j,  # J per clock change kept, in every energy above
        "energy_saving": result.energy_saving,
        "slowdown": result.slowdown,
        "clock_changes_per_rank_per_iteration": list(result.plan.clock_changes()),
        "clock_switching": result.details.get("clock_switching"),
        "iterations": result.iterations,
        "converged": result.converged,
        "stop_reason": result.stop_reason,
        "planner_seconds": result.planner_seconds,
        "warnings": list(result.warnings),
    }
    if result.deadline_s is not None:  # plan type "optimal"
        data["deadline_s"] = result.deadline_s
        data["lower_bound_j"] = result.lower_bound_j
        data["optimal"] = dict(result.details)
    if extra:
        data.update(extra)
    return data


def _budget_entry(result: PlanResult) -> dict[str, Any]:
    """``max_inflight``: the activation budget per stage (null: no limit on that stage), only when one was given."""
    budget = result.config.max_inflight
    if budget is None:
        return {}
    return {"max_inflight": [budget] * result.schedule.num_stages if isinstance(budget, int) else list(budget)}


def _in_flight_text(result: PlanResult) -> str:
    """``peak in-flight [...] (1F1B [...]; budget ...)``: activations per stage, the memory side of a saving."""
    budget = result.config.max_inflight
    return (f"peak in-flight {list(result.schedule.peak_inflight())} "
            f"(1F1B {list(result.baseline_plan.schedule.peak_inflight())}"
            + (f"; budget {show_budget(budget)}" if budget is not None else "") + ")")


def _clock_changes_text(result: PlanResult) -> str:
    """``clock changes per rank per iteration [...] (mean x; before the switch-cost pass [...])``, then what
    the changes kept cost in the plan's energy."""
    changes = result.plan.clock_changes()
    text = f"clock changes per rank per iteration {list(changes)} (mean {sum(changes) / len(changes):.1f}"
    sw = result.details.get("clock_switching")
    if sw:
        before = sw["clock_changes_before"]
        rules = ([f"changes saving less than {sw['switch_cost_j']:g} J merged"] if sw["switch_cost_j"] else []) + (
            [f"at most {sw['max_clock_changes']} per rank"] if sw["max_clock_changes"] else [])
        text += (f"; {sum(before) / len(before):.1f} before the switching pass ({', '.join(rules)}), "
                 f"which cost {sw['energy_given_up_j']:+.1f} J")
    text += ")"
    if result.switch_cost_j:
        text += (f"; {sum(result.charged_clock_changes)} per iteration when iterations repeat x "
                 f"{result.switch_cost_j:.3g} J = {result.switch_energy_j:.1f} J counted in the plan's energy")
    return text


def print_result(result: PlanResult, profile: Profile, out: TextIO | None = None, rows: str = "auto") -> None:
    """``envpipe plan``'s text report: sizes, clocks, baseline vs plan, then EnvPipe's printout (``rows``:
    see :func:`~megatron_envpipe.apps.cli.rows.plan_rows`)."""
    out = out or sys.stdout
    b, p = result.baseline, result.score
    cfg = result.config
    print(f"profile     {profile.source}", file=out)
    print(
        f"pipeline    {result.schedule.num_stages} stages x {result.schedule.num_microbatches} micro-batches; "
        f"plan {cfg.plan_type}/{cfg.scheduling}/{cfg.reconfig}"
        + (f"; gpu {cfg.gpu.key}" if cfg.gpu else "")
        + f"; P2P blocking power {cfg.effective_p2p_power_w:g} W",
        file=out,
    )
    print(
        f"clocks      f_max {result.f_max_mhz} MHz; energy valley per stage {list(result.valley_mhz)} MHz",
        file=out,
    )
    if scheduling_kind(cfg.scheduling).extra_warmup:
        print(
            f"warm-up     extra forwards per stage {list(result.schedule.extra_warmup)}; peak in-flight "
            f"activations {list(result.schedule.peak_inflight())} (1F1B: "
            f"{list(result.baseline_plan.schedule.peak_inflight())})",
            file=out,
        )
    print("", file=out)
    print(f"{'':10}{'iteration time':>16}{'energy':>16}", file=out)
    shown = "1F1B, all at f_max" if cfg.virtual_stages == 1 else cfg.baseline_name
    print(f"{'baseline':10}{b.iteration_time_s:>14.4f} s{result.baseline_energy_j:>14.1f} J   ({shown})", file=out)
    print(f"{'plan':10}{p.iteration_time_s:>14.4f} s{result.energy_j:>14.1f} J"
          + (f"   (of which clock changes {result.switch_energy_j:.1f} J)" if result.switch_cost_j else ""), file=out)
    print(
        f"\nenergy saving {100 * result.energy_saving:.2f} %   slowdown {100 * result.slowdown:.2f} %   "
        f"{_in_flight_text(result)}   ({result.iterations} reconfiguration iterations, "
        f"{result.planner_seconds:.3f} s to plan)",
        file=out,
    )
    print(f"clocks      {_clock_changes_text(result)}", file=out)
    print(f"stopped: {result.stop_reason}", file=out)
    if result.deadline_s is not None:
        d = result.details
        print(f"optimal     deadline {result.deadline_s:.4f} s; LP lower bound {result.lower_bound_j:.1f} J; "
              f"peak in-flight activations {list(result.schedule.peak_inflight())}", file=out)
        if d.get("padded_to_deadline"):
            print(f"at target   {d['energy_at_deadline_j']:.1f} J vs the baseline's {d['baseline_energy_at_deadline_j']:.1f} J "
                  f"(both blocking until {result.deadline_s:.4f} s): saving {100 * d['energy_saving_at_deadline']:.2f} %; "
                  f"{_in_flight_text(result)}",
                  file=out)
    for w in result.warnings:
        print(f"WARNING: {w}", file=out)
    print("", file=out)
    print(
        plan_rows(result.plan, recv_wait_ms(result.timeline), result.timeline.critical_units(), rows),
        file=out,
    )
