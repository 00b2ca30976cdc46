"""Issue 24, run time: a simulated straggler, detection over the data-parallel group, following its pace.

Flags are checked at the edge; the simulated GPU of a straggling replica runs every unit FACTOR times
longer at unchanged power; the run-time runs a straggler's pace plan on every stage when told to, and
goes back; two replicas over real gloo detect the slower one once per window, the faster one follows
(every stage of its pipeline, the same plan), the slower keeps its own plan, and the follower goes back
when the straggler recovers (two windows later: the gather is read a window after it is launched).
"""

from __future__ import annotations

import argparse

import pytest

from megatron_envpipe.config import EnvPipeConfig, add_envpipe_args
from megatron_envpipe.core import instructions as ins
from megatron_envpipe.core.profile import Profile
from megatron_envpipe.core.resources import shipped_profile
from megatron_envpipe.core.virtual_clock import VirtualClock
from megatron_envpipe.flag_types import EnvPipeConfigError, SimStraggler
from megatron_envpipe.gpu.devices.simulated import SimulatedGpu
from megatron_envpipe.megatron.runtime import EnvPipeRuntime
from megatron_envpipe.planning.straggler import _compute_frontier_plans
from megatron_envpipe.testing.straggler_runs import follow_run


def _parse(*argv: str) -> EnvPipeConfig:
    return EnvPipeConfig.from_args(add_envpipe_args(argparse.ArgumentParser()).parse_args(list(argv)))


def test_flags_parse_with_defaults_on():
    cfg = _parse("--envpipe-gpu", "simulated:a40/gpt3-175b", "--envpipe-sim-straggler", "1:1.15@10")
    assert cfg.sim_straggler == SimStraggler(1, 1.15, 10)
    assert cfg.follow_stragglers is True and cfg.straggler_threshold == 0.02
    assert _parse("--no-envpipe-follow-stragglers").follow_stragglers is False
    # (the threshold acts where following does: an optimal plan; refusals in tests/megatron/test_flag_table.py)
    five = _parse("--envpipe-type", "optimal", "--envpipe-straggler-threshold", "5%")
    assert five.straggler_threshold == pytest.approx(0.05)


@pytest.mark.parametrize("text, says", [
    ("1:5", "factor 5 must be in [1, 4]"),
    ("1:0.9", "factor 0.9 must be in [1, 4]"),
    ("1", "is not REPLICA:FACTOR[@ITER]"),
    ("a:1.1", "is not REPLICA:FACTOR[@ITER]"),
    ("1:1.1@x", "is not REPLICA:FACTOR[@ITER]"),
])
def test_bad_straggler_flag_is_one_clear_line(text, says, capsys):
    with pytest.raises(SystemExit):
        add_envpipe_args(argparse.ArgumentParser()).parse_args(["--envpipe-sim-straggler", text])
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert says in err and "e.g. 1:1.15" in err


def test_config_refuses_what_cannot_work():
    with pytest.raises(EnvPipeConfigError, match="slows the simulated GPU only: add --envpipe-gpu simulated"):
        EnvPipeConfig(sim_straggler=SimStraggler(1, 1.1)).validate()
    with pytest.raises(EnvPipeConfigError, match="--envpipe-straggler-threshold 1.5: must be a fraction in"):
        EnvPipeConfig(straggler_threshold=1.5).validate()
    cfg = EnvPipeConfig(gpu="simulated:a40/gpt3-175b", sim_straggler=SimStraggler(2, 1.1)).validate()
    cfg.check_replicas(3)
    with pytest.raises(EnvPipeConfigError, match=r"replica 2 does not exist: the data-parallel size is 2 "
                                                 r"\(replicas 0..1\)"):
        cfg.check_replicas(2)
    # Megatron's own parsed flags carry the data-parallel size: refused at argument parsing.
    args = argparse.Namespace(pipeline_model_parallel_size=2, data_parallel_size=2, num_microbatches=8)
    with pytest.raises(EnvPipeConfigError, match="replica 2 does not exist"):
        cfg.validate_with_megatron_args(args)


def test_a_straggling_gpu_takes_factor_times_longer_at_the_same_power():
    profile = Profile.from_csv(shipped_profile("a40/gpt3-175b"))

    def unit(slowdown: float) -> tuple[float, float]:
        vc = VirtualClock()
        gpu = SimulatedGpu(profile, 0, clock=vc.now, sleep=vc.sleep, p2p_power_w=70.0)
        gpu.slowdown = slowdown
        t0, e0 = vc.now(), gpu.energy_mj()
        gpu.unit_begin(0, "F")
        gpu.unit_end(0, "F")
        return vc.now() - t0, gpu.energy_mj() - e0

    (t1, e1), (t2, e2) = unit(1.0), unit(1.15)
    assert t2 == pytest.approx(1.15 * t1) and e2 == pytest.approx(1.15 * e1)
    assert e2 / t2 == pytest.approx(e1 / t1)  # power unchanged


def test_the_run_time_runs_the_pace_plan_on_every_stage_and_goes_back():
    profile = Profile.from_csv(shipped_profile("a40/gpt3-175b")).for_pipeline(4)
    rt = EnvPipeRuntime(EnvPipeConfig(plan_type="optimal", scheduling="ours", p2p_power_w=70.0))
    rt.adopt_profile(profile, rt.profile_p2p_power_w)
    own = rt.prepare(4, 8)
    assert rt.planned_with is not None and own.phase == "steady"
    prof, m, pcfg = rt.planned_with
    pace = _compute_frontier_plans(prof, m, pcfg).plan_for(rt.last_result.score.iteration_time_s * 1.15)
    assert pace.plan != own.plan
    following = rt.prepare(4, 8, pace_plan=pace.plan)  # the straggler follower's (megatron/training_run.py)
    assert following.phase == "following a straggler" and following.plan == pace.plan
    for s, program in enumerate(following.programs):  # every stage's program sets the pace plan's clocks
        clocks = [i.freq_mhz for i in program.instructions if isinstance(i, ins.SetFrequency)]
        assert set(clocks) <= set(pace.plan.freqs_mhz[s]) and clocks
    assert following.unit_times_s is not None and following.unit_times_s != own.unit_times_s
    back = rt.prepare(4, 8, pace_plan=None)
    assert back.plan == own.plan and back.phase == "steady"


def test_two_replicas_over_gloo_detect_follow_and_release(tmp_path):
    # Replica 1 is 15 % slower until iteration 9; windows of 3 iterations (--envpipe-reconfig-window).
    fast, slow = follow_run(tmp_path, factor=1.15, recover_at=9, iterations=16)
    following = [r["iteration"] for r in fast if r["following"]]
    # Window 1 (iterations 0-2) launches the gather, window 2 reads it: iterations 6.. follow.
    # Replica 1's recovery (9..) is in window 4's gather, read at window 5's end (iteration 14).
    assert following == list(range(5, 14)), fast
    assert not any(r["following"] for r in slow)  # the straggler keeps its own plan
    note = fast[5]["note"]
    assert note.startswith("following replica 1's pace ") and "(+15.0 %)" in note and "J/iter vs not following" in note
    own = fast[0]["own_time_s"]
    assert own < fast[5]["pace_time_s"] <= 1.15 * own  # slower, never slower than the straggler
    assert fast[-1]["note"] is None and fast[-1]["pace_time_s"] is None


def test_following_off_never_switches(tmp_path):
    fast, slow = follow_run(tmp_path, factor=1.15, iterations=9, follow=False)
    assert not any(r["following"] for r in fast + slow)
