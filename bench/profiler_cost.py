#!/usr/bin/env python3
"""Start-up profiler cost against EnvPipe's, its accuracy, and what the plan loses (issue 13, item 3).

Goal: profiler iterations <= 1/3 of EnvPipe's (6 iterations per clock over the
same coarse clocks, envpipe.md §5) on the shipped A40 profiles and on a
synthetic profile whose valley is the lowest clock (no early stop), with the
profile as accurate as before. Each case profiles simulated GPUs (8 stages,
real time, energy from the counter poller) twice in the same run: with the
previous sweep (2 iterations per clock, no refinement) and with the current
one (the runtime's :func:`~megatron_envpipe.gpu.profiler.sweep.startup_sweep`), and
prints:

* iterations, EnvPipe's iterations on the same clocks, the ratio;
* accuracy: the largest relative error of the measured time and energy against
  the driving profile at every measured clock (every clock the planner may use);
* plan quality: ``envelope`` and ``optimal`` plans (ours, balanced, M = 12 and
  24) made from the measured profile, scored on the driving profile, against
  the plan made from the driving profile at all its clocks.

    python bench/profiler_cost.py [--time-scale 0.01] [--microbatches 4] [--cases gpt3,bloom,synthetic] [--repeat 1]
                                  [--dynamics realistic]

Then, per ``--dynamics`` (default ``realistic``: configs/realistic-gpu.toml, a 100 ms energy
counter, 15 ms clock latency, 3 % thermal drift; ``none`` skips it), the current sweep again on
simulated GPUs with those dynamics, on simulated time: iterations against EnvPipe's, the counter
period each monitor measured, the energy error against the driving profile with and without the
heat-drift correction (goal: within 1 %), the fitted drift, and the attribution's own uncertainty
(largest standard error relative to the row, and the share of rows whose error lies within 3 of them).

(``--cases three-stage --time-scale 0.02`` is the accuracy test's set-up in tests/gpu/test_sweep.py.)
"""

from __future__ import annotations

import argparse
import statistics
import sys

from megatron_envpipe.core.device_dynamics import load_dynamics
from megatron_envpipe.core.gpu_specs import get_gpu_spec
from megatron_envpipe.core.profile import Profile
from megatron_envpipe.core.resources import configs_dir, shipped_profile
from megatron_envpipe.gpu.profiler.sweep import _COST_SHARE_OF_ENVPIPE, ClockSweep, startup_sweep, sweep_candidates
from megatron_envpipe.testing.profiler_runs import (
    a40_three_stages,
    low_valley_profile,
    plan_check,
    profile_on_simulated_gpus,
    relative_errors,
)

CASES = {
    "gpt3": lambda: Profile.from_csv(shipped_profile("a40/gpt3-175b")),
    "bloom": lambda: Profile.from_csv(shipped_profile("a40/bloom-176b")),
    "synthetic": lambda: low_valley_profile(8),
    "three-stage": lambda: a40_three_stages(),
}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--time-scale", type=float, default=0.01, help="wall seconds per simulated second")
    ap.add_argument("--microbatches", type=int, default=4, help="micro-batches per profiling iteration")
    ap.add_argument("--cases", default="gpt3,bloom,synthetic", help="comma-separated: " + ",".join(CASES))
    ap.add_argument("--repeat", type=int, default=1,
                    help="profile each case this many times per sweep; errors are the median over them")
    ap.add_argument("--dynamics", default="realistic",
                    help="comma-separated simulated-GPU dynamics to rerun the current sweep with (exact, realistic, "
                         "a TOML file; none: skip)")
    args = ap.parse_args()
    if not (0 < args.time_scale <= 1) or args.microbatches < 1 or args.repeat < 1:
        ap.error("--time-scale must be in (0, 1], --microbatches and --repeat >= 1")
    names = [c.strip() for c in args.cases.split(",") if c.strip()]
    bad = [c for c in names if c not in CASES]
    if bad or not names:
        ap.error(f"--cases: unknown {bad}; choose from {', '.join(CASES)}")
    a40 = get_gpu_spec("a40")
    p2p = a40.known_p2p_power_w()
    ok = True
    for name in names:
        truth = CASES[name]()
        clocks = truth.common_frequencies()
        def previous(clocks):  # the sweep before issue 13: 2 iterations at every clock, nothing refined
            return ClockSweep(sweep_candidates(clocks, a40.profile_step_mhz), iterations_per_clock=2, adaptive=False)

        def current(clocks):  # what the runtime runs now
            return startup_sweep(clocks, a40.profile_step_mhz, a40.reconfig_step_mhz)

        print(f"\n== {name}: {truth.source}, {truth.num_stages} stages, {len(clocks)} clocks "
              f"{clocks[0]}..{clocks[-1]} MHz (simulated A40, time scale {args.time_scale})")
        print(f"{'sweep':<10}{'iterations':>11}{'EnvPipe':>9}{'ratio':>8}{'clocks':>8}{'refined':>9}"
              f"{'early stop':>12}{'max err time':>14}{'max err energy':>16}{'P2P W':>8}{'wall s':>8}")
        measured = {}
        for label, make in (("previous", previous), ("current", current)):
            errors = []
            for _ in range(args.repeat):
                sweep = make(clocks)
                wall = profile_on_simulated_gpus(truth, sweep, p2p_power_w=p2p, time_scale=args.time_scale,
                                                 microbatches=args.microbatches)
                errors.append(relative_errors(truth, sweep.rows()))
            err_t = statistics.median(e[0] for e in errors)
            err_e = statistics.median(e[1] for e in errors)
            measured[label] = sweep.profile()
            print(f"{label:<10}{sweep.iterations_used:>11}{sweep.envpipe_iterations():>9}{sweep.cost_share():>8.3f}"
                  f"{len(sweep.measured_clocks_mhz()):>8}{len(sweep.refined_clocks_mhz()):>9}"
                  f"{'yes' if sweep.stopped_early else 'no':>12}{100 * err_t:>13.3f}%{100 * err_e:>15.3f}%"
                  f"{sweep.p2p_power_w():>8.2f}{wall:>8.1f}")
        new = sweep
        print(f"current: {new.summary()}")
        if new.cost_share() > _COST_SHARE_OF_ENVPIPE + 1e-9:
            ok = False
            print(f"GOAL MISSED: {new.iterations_used} iterations > 1/3 of EnvPipe's {new.envpipe_iterations()}")
        print(f"{'plan':<10}{'M':>4}{'from truth':>12}{'previous':>10}{'current':>10}{'gap prev':>10}"
              f"{'gap cur':>9}{'slowdown cur':>14}  (energy saving on the driving profile, %; gap in points)")
        for plan_type in ("envelope", "optimal"):
            for m in (12, 24):
                prev = plan_check(measured["previous"], truth, m, plan_type, a40, p2p)
                cur = plan_check(measured["current"], truth, m, plan_type, a40, p2p)
                if not cur.clocks_measured_only:
                    ok = False
                    print("ERROR: the current plan uses a clock that was not measured")
                print(f"{plan_type:<10}{m:>4}{100 * cur.true_saving:>12.2f}{100 * prev.measured_saving:>10.2f}"
                      f"{100 * cur.measured_saving:>10.2f}{prev.gap_points:>10.2f}{cur.gap_points:>9.2f}"
                      f"{100 * cur.measured_slowdown:>+13.2f}%")
        for spec in [d.strip() for d in args.dynamics.split(",") if d.strip() and d.strip() != "none"]:
            ok &= dynamics_case(truth, spec, a40, args)
    print("\nall cases within 1/3 of EnvPipe's iterations" if ok else "\nsome case missed the goal")
    return 0 if ok else 1


def dynamics_case(truth, spec: str, gpu, args) -> bool:
    """The current sweep on GPUs with ``spec`` dynamics (simulated time); whether it met both goals."""
    dyn = load_dynamics(spec, configs_dir())
    sweep = startup_sweep(truth.common_frequencies(), gpu.profile_step_mhz, gpu.reconfig_step_mhz)
    periods: list[float | None] = []
    profile_on_simulated_gpus(truth, sweep, p2p_power_w=gpu.known_p2p_power_w(), time_scale=args.time_scale,
                              microbatches=args.microbatches, virtual_time=True, dynamics=dyn,
                              counter_periods_s=periods)
    _, err = relative_errors(truth, sweep.rows())
    _, raw = relative_errors(truth, [row for r in sweep.results for row in r.rows])
    se = sweep.row_uncertainties()
    rel_se = max(v / truth.energy_j(s, i, f) for (s, i, f, _), v in se.items())
    covered = sum(1 for row in sweep.rows() if abs(row.energy_j - truth.energy_j(row.stage, row.instruction,
                  row.freq_mhz)) <= 3 * se[(row.stage, row.instruction, row.freq_mhz, row.chunk)]) / len(se)
    drifts = [d for d in sweep.heat_drift() if d is not None]
    shown = ", ".join(f"{1000 * p:.1f}" if p is not None else "?" for p in periods)
    print(f"-- {spec} dynamics ({dyn.source}):\n   {sweep.iterations_used} iterations, EnvPipe {sweep.envpipe_iterations()}"
          f" ({100 * sweep.cost_share():.0f} %); counter period measured per stage: {shown} ms "
          f"(configured {1000 * dyn.counter_period_s:g} ms)\n   energy error {100 * err:.3f} % "
          f"(without the drift correction {100 * raw:.3f} %); drift fitted on {len(drifts)}/{truth.num_stages} stages"
          + (f" (cold start {100 * min(d.amplitude for d in drifts):+.2f} %, tau {drifts[0].tau_s:.0f} s)" if drifts
             else "")
          + f"\n   attribution uncertainty: up to {100 * rel_se:.3f} % of a row (1 SE); rows within 3 SE: "
          f"{100 * covered:.0f} %")
    good = err <= 0.01 and sweep.cost_share() <= _COST_SHARE_OF_ENVPIPE + 1e-9
    if not good:
        print("   GOAL MISSED: energy within 1 % at no more than 1/3 of EnvPipe's iterations")
    return good


if __name__ == "__main__":
    sys.exit(main())
