"""Every bad input to ``envpipe`` and its files: exit 2, one line naming what and where, no traceback, no output.

One table of cases across the commands (plan, frontier, show, simulate,
schedule, programs, gpus, demo; reset-clocks is tested with the run-time
flags), the files they read (profile, plan, GPU table, demo config: empty,
truncated, binary, wrong types, missing keys, nan/inf, negative, absurdly
large) and the paths they write (parent is a file, a directory, /proc, an
unknown image format). Each case runs in-process through ``main(argv)`` in a
fresh directory and checks: exit status 2, one stderr line
``envpipe <cmd>: error: ...`` naming the offending value or file, no
traceback, nothing on stdout, and not one file or folder left behind. A few
run through a real interpreter to show no traceback reaches the terminal.
Tests run as root, so "cannot write" cases are ones that hold for root too.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

import pytest

from megatron_envpipe.apps.cli import main, outputs
from megatron_envpipe.apps.cli.render import result_to_dict
from megatron_envpipe.core.atomic import write_all_atomic
from megatron_envpipe.core.gpu_specs import default_table_path, get_gpu_spec
from megatron_envpipe.core.plan import FrequencyPlan
from megatron_envpipe.core.profile import Profile
from megatron_envpipe.core.resources import configs_dir, shipped_profile
from megatron_envpipe.core.schedule import one_f_one_b
from megatron_envpipe.planning.basis import PlannerConfig, PlannerError
from megatron_envpipe.planning.planner import plan_envpipe

ROOT = Path(__file__).resolve().parents[2]
PLAN = "plan --profile a40/gpt3-175b -m 12"
FRONTIER = "frontier --profile a40/gpt3-175b -m 12 --points 3"
SIMULATE = "simulate --profile a40/gpt3-175b -m 12"
BINARY = b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR\xff\xfe\x00"

# -- file contents ----------------------------------------------------------------------
HEADER = "stage,instruction,frequency,time,energy"
ROWS = [f"{s},{ins},{f},{t * (1740 / f):.4f},{e * (f / 1740):.3f}"
        for s in range(2) for ins, t, e in (("forward", 0.01, 3.0), ("backward", 0.02, 6.0)) for f in (1740, 1500)]


def profile(*rows: str, header: str = HEADER) -> str:
    """A 2-stage profile: the good rows, then ``rows`` (a bad one is on line 10)."""
    return "\n".join([header, *ROWS, *rows]) + "\n"


@lru_cache(maxsize=1)
def full_plan() -> dict[str, Any]:
    """What 'envpipe plan --out' writes for the shipped GPT-3 profile."""
    prof = Profile.from_csv(shipped_profile("a40/gpt3-175b"))
    return result_to_dict(plan_envpipe(prof, 12, PlannerConfig(gpu=get_gpu_spec("a40"))), prof)


def plan_json(edit=None, text: bool = True) -> Any:
    """A full plan file, changed by ``edit(data)``; deferred until a test needs it."""

    def make() -> str:
        data = json.loads(json.dumps(full_plan()))
        if edit:
            edit(data)
        return json.dumps(data, indent=1)

    return make


def bare_plan(stages: int) -> str:
    return json.dumps(FrequencyPlan.constant(one_f_one_b(stages, 8), [1740] * stages).to_dict())


def gpu_table(old: str = "", new: str = "", extra: str = "") -> Any:
    """The shipped GPU table with ``old`` replaced by ``new`` once (in [v100], its first entry)."""
    def make() -> str:
        text = default_table_path().read_text()
        assert old in text
        return text.replace(old, new, 1) + extra
    return make


def demo_config(old: str = "", new: str = "") -> Any:
    def make() -> str:
        text = (configs_dir() / "demo.toml").read_text()
        assert old in text
        return text.replace(old, new, 1)
    return make


def setitem(path: str, value: Any):
    """An edit that sets data[a][b]... (``path`` "a.b") to ``value``; DELETE removes it."""
    def edit(data: dict[str, Any]) -> None:
        *parents, last = path.split(".")
        for key in parents:
            data = data[key]
        if value is DELETE:
            del data[last]
        else:
            data[last] = value
    return edit


DELETE = object()


# -- the table --------------------------------------------------------------------------
@dataclass(frozen=True)
class Case:
    id: str
    argv: str  # shell words; {tmp} is the case's directory
    needle: str  # must appear in the error line ({tmp} too)
    files: dict[str, Any] = field(default_factory=dict)  # name -> str, bytes or a callable giving one
    env: dict[str, str] = field(default_factory=dict)
    also: str = ""  # a second text the error line must hold


def C(id: str, argv: str, needle: str, files: dict[str, Any] | None = None, also: str = "", **env: str) -> Any:  # noqa: N802
    return pytest.param(Case(id, argv, needle, files or {}, env, also), id=id)


GPU_ENV = {"ENVPIPE_GPU_TABLE": "{tmp}/gpus.toml"}
DEMO = "demo --config {tmp}/demo.toml --out {tmp}/out"

CASES = [
    # --extra-warmup: count, sign and kind, for every command that takes it
    C("plan-warmup-short", f"{PLAN} --extra-warmup 3,2,1", "--extra-warmup 3,2,1: extra warm-up has 3 value(s)"),
    C("plan-warmup-long", f"{PLAN} --extra-warmup 1,1,1,1,1,1,1,0,0", "has 9 value(s) [1, 1, 1, 1, 1, 1, 1, 0, 0] for 8"),
    C("plan-warmup-negative", f"{PLAN} --extra-warmup=-1,0,0,0,0,0,0,0", "--extra-warmup: extra warm-up values must be >= 0"),
    C("plan-warmup-float", f"{PLAN} --extra-warmup 1.5,0", "--extra-warmup: expected comma-separated integers, got '1.5,0'"),
    C("plan-warmup-empty", f"{PLAN} --extra-warmup ,", "--extra-warmup: expected whole numbers, one per stage"),
    C("plan-warmup-with-1f1b", f"{PLAN} --scheduling 1f1b --extra-warmup 1,0,0,0,0,0,0,0",
      "--extra-warmup 1,0,0,0,0,0,0,0 only applies to --scheduling ours"),
    C("frontier-warmup-short", f"{FRONTIER} --extra-warmup 3,2,1", "--extra-warmup 3,2,1: extra warm-up has 3 value(s)"),
    C("frontier-warmup-with-1f1b", f"{FRONTIER} --scheduling 1f1b --extra-warmup 0,0,0,0,0,0,0,0",
      "only applies to --scheduling ours"),
    C("simulate-warmup-short", f"{SIMULATE} --scheduling ours --extra-warmup 3,2,1", "--extra-warmup 3,2,1: extra warm-up has 3"),
    C("simulate-warmup-with-1f1b", f"{SIMULATE} --extra-warmup 1,0,0,0,0,0,0,0", "only applies to --scheduling ours"),
    C("simulate-ours-without-warmup", f"{SIMULATE} --scheduling ours", "--scheduling ours needs --extra-warmup"),
    C("schedule-warmup-short", "schedule --stages 4 -m 8 --scheduling ours --extra-warmup 3,2,1",
      "--extra-warmup 3,2,1: extra warm-up has 3 value(s) [3, 2, 1] for 4 stages"),
    C("schedule-warmup-with-1f1b", "schedule --stages 4 -m 8 --extra-warmup 1,0,0,0", "only applies to --scheduling ours"),
    C("programs-warmup-long", "programs --stages 4 -m 8 --scheduling ours --extra-warmup 3,2,1,0,0",
      "--extra-warmup 3,2,1,0,0: extra warm-up has 5 value(s)"),
    # numbers: nan, inf, negative, zero, absurdly large
    C("plan-p2p-power-nan", f"{PLAN} --p2p-power nan", "--p2p-power: must be a finite number >= 0 and <= 10000 W, got nan"),
    C("plan-p2p-power-negative", f"{PLAN} --p2p-power=-5", "--p2p-power: must be a finite number >= 0"),
    C("simulate-p2p-power-inf", f"{SIMULATE} --p2p-power inf", "--p2p-power: must be a finite number >= 0 and <= 10000 W, got inf"),
    C("plan-p2p-latency-nan", f"{PLAN} --p2p-latency nan", "--p2p-latency: must be a finite number >= 0 and <= 3600 s, got nan"),
    C("simulate-p2p-latency-negative", f"{SIMULATE} --p2p-latency=-0.1", "--p2p-latency: must be a finite number >= 0"),
    C("plan-time-scale-nan", f"{PLAN} --time-scale nan", "--time-scale: must be a finite number > 0 and <= 1e+06, got nan"),
    C("plan-time-scale-zero", f"{PLAN} --time-scale 0", "--time-scale: must be a finite number > 0"),
    C("frontier-energy-scale-inf", f"{FRONTIER} --energy-scale inf", "--energy-scale: must be a finite number > 0 and <= 1e+06, got inf"),
    C("simulate-energy-scale-huge", f"{SIMULATE} --energy-scale 1e300", "--energy-scale: must be a finite number > 0 and <= 1e+06, got 1e300"),
    C("plan-max-slowdown-inf", f"{PLAN} --type optimal --max-slowdown inf", "--max-slowdown: must be a finite fraction >= 0"),
    C("plan-max-slowdown-nan-percent", f"{PLAN} --type optimal --max-slowdown nan%", "--max-slowdown: must be a finite fraction >= 0"),
    C("plan-max-slowdown-negative", f"{PLAN} --type optimal --max-slowdown=-5%", "got '-5%'"),
    C("plan-max-slowdown-text", f"{PLAN} --type optimal --max-slowdown lots", "expected a fraction like 0.05 or a percentage like 5%, got 'lots'"),
    C("plan-target-time-inf", f"{PLAN} --type optimal --target-time inf", "--target-time: must be a finite number > 0 and <= 1e+06 s, got inf"),
    C("plan-target-time-zero", f"{PLAN} --type optimal --target-time 0", "--target-time: must be a finite number > 0"),
    C("frontier-target-time-nan", f"{FRONTIER} --target-time nan", "--target-time: must be a finite number > 0 and <= 1e+06 s, got nan"),
    C("plan-microbatches-zero", "plan --profile a40/gpt3-175b -m 0", "--microbatches/-m: must be between 1 and 10000, got 0"),
    C("plan-microbatches-absurd", "plan --profile a40/gpt3-175b -m 1000000000000", "must be between 1 and 10000, got 1000000000000"),
    C("schedule-stages-text", "schedule --stages four -m 8", "--stages: expected a whole number, got 'four'"),
    C("schedule-stages-absurd", "schedule --stages 99999999 -m 8", "--stages: must be between 1 and 1000"),
    C("frontier-points-one", "frontier --profile a40/gpt3-175b -m 12 --points 1", "--points: must be between 2 and 1000, got 1"),
    C("simulate-freq-absurd", f"{SIMULATE} --freq 10000000", "--freq: must be between 1 and 100000"),
    C("simulate-freq-not-profiled", f"{SIMULATE} --freq 5", "was not profiled at 5 MHz"),
    C("plan-stages-mismatch", f"{PLAN} --stages 4", "--stages 4 does not match the profile's 8 stages"),
    # flag combinations that would be ignored or contradict each other
    C("plan-target-and-slowdown", f"{PLAN} --type optimal --target-time 9 --max-slowdown 5%",
      "--target-time and --max-slowdown both set the deadline: give one of them"),
    C("plan-slowdown-without-optimal", f"{PLAN} --max-slowdown 5%", "--max-slowdown needs --type optimal"),
    C("plan-perseus-max-inflight", f"{PLAN} --compat perseus --scheduling 1f1b --max-inflight 4",
      "--compat perseus has no --max-inflight"),
    C("simulate-plan-and-microbatches", "simulate --profile a40/gpt3-175b --plan {tmp}/p.json -m 12",
      "--plan brings its own schedule and clocks: drop --microbatches", {"p.json": bare_plan(8)}),
    C("simulate-neither-plan-nor-m", "simulate --profile a40/gpt3-175b", "simulate needs --plan PLAN.json"),
    C("plan-unknown-gpu", f"{PLAN} --gpu b9000", "unknown GPU 'b9000'"),
    # profiles (a CSV given to --profile)
    C("profile-missing", "plan --profile {tmp}/none.csv -m 4", "no profile '{tmp}/none.csv'"),
    C("profile-unknown-shipped", "plan --profile a40/nope -m 4", "no profile 'a40/nope'"),
    C("profile-empty", "plan --profile {tmp}/p.csv -m 4", "{tmp}/p.csv: empty profile", {"p.csv": ""}),
    C("profile-header-only", "plan --profile {tmp}/p.csv -m 4", "{tmp}/p.csv: profile has a header but no rows",
      {"p.csv": HEADER + "\n"}),
    C("profile-binary", "plan --profile {tmp}/p.csv -m 4", "{tmp}/p.csv:1: not UTF-8 text", {"p.csv": BINARY}),
    C("profile-latin1-line-3", "simulate --profile {tmp}/p.csv -m 4", "{tmp}/p.csv:3: not UTF-8 text",
      {"p.csv": (HEADER + "\n" + ROWS[0] + "\n0,forward,1500,0.01,3 \xe9t\xe9\n").encode("latin-1")}),
    C("profile-truncated-row", "plan --profile {tmp}/p.csv -m 4", "{tmp}/p.csv:10: 3 fields where the header",
      {"p.csv": profile("1,forward,1400")}),
    C("profile-no-header", "plan --profile {tmp}/p.csv -m 4", "{tmp}/p.csv:1: header lacks column(s)",
      {"p.csv": "\n".join(ROWS)}),
    C("profile-time-nan", "plan --profile {tmp}/p.csv -m 4", "{tmp}/p.csv:10: time 'nan' is not finite",
      {"p.csv": profile("1,forward,1400,nan,3.0")}),
    C("profile-energy-inf", "frontier --profile {tmp}/p.csv -m 4", "{tmp}/p.csv:10: energy 'inf' is not finite",
      {"p.csv": profile("1,forward,1400,0.01,inf")}),
    C("profile-time-negative", "plan --profile {tmp}/p.csv -m 4", "{tmp}/p.csv:10: time must be > 0 seconds, got -0.01",
      {"p.csv": profile("1,forward,1400,-0.01,3.0")}),
    C("profile-energy-negative", "plan --profile {tmp}/p.csv -m 4", "{tmp}/p.csv:10: energy must be >= 0 joules",
      {"p.csv": profile("1,forward,1400,0.01,-3.0")}),
    C("profile-time-absurd", "plan --profile {tmp}/p.csv -m 4", "{tmp}/p.csv:10: time 1e300 s / energy 3.0 J is beyond",
      {"p.csv": profile("1,forward,1400,1e300,3.0")}),
    C("profile-stage-absurd", "plan --profile {tmp}/p.csv -m 4", "{tmp}/p.csv:10: stage 1e9 is not a stage id",
      {"p.csv": profile("1e9,forward,1400,0.01,3.0")}),
    C("profile-frequency-absurd", "plan --profile {tmp}/p.csv -m 4", "{tmp}/p.csv:10: frequency must be a positive MHz",
      {"p.csv": profile("1,forward,999999999,0.01,3.0")}),
    C("profile-time-text", "plan --profile {tmp}/p.csv -m 4", "{tmp}/p.csv:10: time 'fast' is not a number",
      {"p.csv": profile("1,forward,1400,fast,3.0")}),
    C("profile-instruction", "plan --profile {tmp}/p.csv -m 4", "{tmp}/p.csv:10: instruction 'sideways'",
      {"p.csv": profile("1,sideways,1400,0.01,3.0")}),
    C("profile-stage-gap", "plan --profile {tmp}/p.csv -m 4", "{tmp}/p.csv: stage(s) [2] missing",
      {"p.csv": profile("3,forward,1740,0.01,3.0", "3,backward,1740,0.02,6.0")}),
    C("profile-no-backward", "plan --profile {tmp}/p.csv -m 4", "{tmp}/p.csv: stage 2 has no backward rows",
      {"p.csv": profile("2,forward,1740,0.01,3.0")}),
    C("profile-duplicate-row", "plan --profile {tmp}/p.csv -m 4", "{tmp}/p.csv:10: duplicate row for stage 0",
      {"p.csv": profile(ROWS[0])}),
    C("profile-huge-field", "plan --profile {tmp}/p.csv -m 4", "{tmp}/p.csv:10: not a CSV profile row",
      {"p.csv": profile("1,forward," + "9" * 200_000 + ",0.01,3.0")}),
    # plan files (show, simulate --plan)
    C("show-missing", "show {tmp}/none.json", "{tmp}/none.json: cannot read plan: No such file or directory"),
    C("show-directory", "show {tmp}", "{tmp}: is a directory, not a plan file"),
    C("show-empty", "show {tmp}/p.json", "{tmp}/p.json:1: not valid JSON", {"p.json": ""}),
    C("show-truncated", "show {tmp}/p.json", "{tmp}/p.json:", {"p.json": lambda: plan_json()()[:2000]},
      also="not valid JSON: "),
    C("show-binary", "show {tmp}/p.json", "{tmp}/p.json:1: not UTF-8 text", {"p.json": BINARY}),
    C("show-array", "show {tmp}/p.json", "{tmp}/p.json: expected a JSON object", {"p.json": "[1, 2]"}),
    C("show-missing-key", "show {tmp}/p.json", "{tmp}/p.json: baseline.energy_j is missing",
      {"p.json": plan_json(setitem("baseline.energy_j", DELETE))}),
    C("show-nan", "show {tmp}/p.json", "{tmp}/p.json: NaN is not a finite number",
      {"p.json": plan_json(setitem("plan.energy_j", float("nan")))}),
    C("show-huge-number", "show {tmp}/p.json", "{tmp}/p.json: slowdown = inf: must be a finite number",
      {"p.json": lambda: plan_json()().replace('"slowdown": ', '"slowdown": 1e999, "x": ', 1)}),
    C("show-wrong-type", "show {tmp}/p.json", "{tmp}/p.json: energy_saving is '5%', not a finite number",
      {"p.json": plan_json(setitem("energy_saving", "5%"))}),
    C("show-no-frequencies", "show {tmp}/p.json", '{tmp}/p.json: no "frequencies"',
      {"p.json": plan_json(setitem("plan.frequencies", DELETE))}),
    C("show-clock-fraction", "show {tmp}/p.json", "{tmp}/p.json: not a valid plan: stage 0, unit F0: clock 1740.5",
      {"p.json": plan_json(lambda d: d["plan"]["frequencies"][0][0].__setitem__(1, 1740.5))}),
    C("show-clock-bool", "show {tmp}/p.json", "clock True is not a whole number of MHz",
      {"p.json": plan_json(lambda d: d["plan"]["frequencies"][3][2].__setitem__(1, True))}),
    C("show-bad-unit", "show {tmp}/p.json", "{tmp}/p.json: not a valid plan: stage 2: cannot parse unit 'X0'",
      {"p.json": plan_json(lambda d: d["plan"]["frequencies"][2][0].__setitem__(0, "X0"))}),
    C("show-warmup-negative", "show {tmp}/p.json", "extra warm-up of stage 1 is negative (-2)",
      {"p.json": plan_json(setitem("plan.extra_warmup", [3, -2, 0, 0, 0, 0, 0, 0]))}),
    C("show-warmup-short", "show {tmp}/p.json", "extra warm-up has 2 value(s) [1, 0] for 8 stages",
      {"p.json": plan_json(setitem("plan.extra_warmup", [1, 0]))}),
    C("show-stage-count", "show {tmp}/p.json", "{tmp}/p.json: num_stages is 4 but the plan's clocks are for 8",
      {"p.json": plan_json(setitem("num_stages", 4))}),
    C("show-warnings-type", "show {tmp}/p.json", "{tmp}/p.json: warnings must be a list of strings",
      {"p.json": plan_json(setitem("warnings", 7))}),
    C("show-deep-json", "show {tmp}/p.json", "{tmp}/p.json: JSON nested too deeply", {"p.json": "[" * 100_000}),
    C("simulate-plan-stage-count", "simulate --profile a40/gpt3-175b --plan {tmp}/p.json",
      "--plan {tmp}/p.json has 4 stages, the profile 8", {"p.json": bare_plan(4)}),
    C("simulate-plan-missing-key", "simulate --profile a40/gpt3-175b --plan {tmp}/p.json",
      "{tmp}/p.json: plan.iteration_time_s is missing", {"p.json": plan_json(setitem("plan.iteration_time_s", DELETE))}),
    # the GPU table (ENVPIPE_GPU_TABLE): 'envpipe gpus', and --gpu / a shipped profile's GPU
    C("gpus-missing-table", "gpus", "{tmp}/gpus.toml: cannot read GPU table", **GPU_ENV),
    C("gpus-empty", "gpus", "{tmp}/gpus.toml: GPU table is empty", {"gpus.toml": ""}, **GPU_ENV),
    C("gpus-truncated", "gpus", "{tmp}/gpus.toml: not valid TOML",
      {"gpus.toml": lambda: default_table_path().read_text()[:1000]}, **GPU_ENV),
    C("gpus-binary", "gpus", "{tmp}/gpus.toml:1: not UTF-8 text", {"gpus.toml": BINARY}, **GPU_ENV),
    C("gpus-nan-power", "gpus", "[v100] p2p_power_w = nan must be a finite number",
      {"gpus.toml": gpu_table('p2p_power_w = "unknown"', "p2p_power_w = nan")}, **GPU_ENV),
    C("gpus-inf-step", "gpus", "[v100] clock_step_mhz = inf must be a finite number",
      {"gpus.toml": gpu_table("clock_step_mhz = 7.5", "clock_step_mhz = inf")}, **GPU_ENV),
    C("gpus-missing-key", "gpus", "[v100] lacks reconfig_step_mhz",
      {"gpus.toml": gpu_table("reconfig_step_mhz = 30\n", "")}, **GPU_ENV),
    C("gpus-wrong-type", "gpus", "[v100] max_clock_mhz = '1530' has the wrong type: give an integer",
      {"gpus.toml": gpu_table("max_clock_mhz = 1530", 'max_clock_mhz = "1530"')}, **GPU_ENV),
    C("gpus-negative-step", "gpus", "[v100] reconfig_step_mhz must be positive",
      {"gpus.toml": gpu_table("reconfig_step_mhz = 30", "reconfig_step_mhz = -30")}, **GPU_ENV),
    C("gpus-absurd-clock", "gpus", "[v100] needs 0 < min_clock_mhz < max_clock_mhz <= 100000",
      {"gpus.toml": gpu_table("max_clock_mhz = 1530", "max_clock_mhz = 1530000000")}, **GPU_ENV),
    C("gpus-tiny-step", "gpus", "[v100] clock_step_mhz = 1e-09 gives over 100000 clocks",
      {"gpus.toml": gpu_table("clock_step_mhz = 7.5", "clock_step_mhz = 1e-9")}, **GPU_ENV),
    C("gpus-absurd-power", "gpus", "[v100] p2p_power_w must be between 0 and 10000 W, got 1e+20",
      {"gpus.toml": gpu_table('p2p_power_w = "unknown"', "p2p_power_w = 1e20")}, **GPU_ENV),
    C("gpus-upper-case", "gpus", "[V100]: GPU names are lower case", {"gpus.toml": gpu_table("[v100]", "[V100]")},
      **GPU_ENV),
    C("gpus-names-not-strings", "gpus", "[v100] nvml_names must be a list of strings",
      {"gpus.toml": gpu_table('nvml_names = ["Tesla V100-SXM2-16GB"', "nvml_names = [1")}, **GPU_ENV),
    C("plan-gpu-table-bad", f"{PLAN} --gpu a40", "(the table named by ENVPIPE_GPU_TABLE: fix it or unset the variable)",
      {"gpus.toml": gpu_table("[v100]", "[v100")}, **GPU_ENV),
    # demo: its config and --out, before anything is created
    C("demo-config-missing", DEMO, "{tmp}/demo.toml: cannot read demo config"),
    C("demo-config-directory", "demo --config {tmp} --out {tmp}/out", "{tmp}: is a directory, not a demo config file"),
    C("demo-config-empty", DEMO, "{tmp}/demo.toml: a demo config is one [demo] table (found nothing)", {"demo.toml": ""}),
    C("demo-config-truncated", DEMO, "{tmp}/demo.toml: [demo] lacks profile_step_mhz",
      {"demo.toml": lambda: (configs_dir() / "demo.toml").read_text().split("profile_step_mhz")[0]}),
    C("demo-config-inert-key", DEMO, "[demo] sim_time_scale = 0.3: the demo's simulated GPUs run in virtual time",
      {"demo.toml": lambda: (configs_dir() / "demo.toml").read_text() + "sim_time_scale = 0.3\n"}),
    C("demo-config-binary", DEMO, "{tmp}/demo.toml:1: not UTF-8 text", {"demo.toml": BINARY}),
    C("demo-config-wrong-type", DEMO, "[demo] stages = 'four' should be a int",
      {"demo.toml": demo_config("stages = 4", 'stages = "four"')}),
    C("demo-config-nan", DEMO, "[demo] sim_jitter = nan: must be a finite number",
      {"demo.toml": demo_config("sim_jitter = 0.0", "sim_jitter = nan")}),
    C("demo-config-inf", DEMO, "[demo] sim_jitter = inf: must be a finite number",
      {"demo.toml": demo_config("sim_jitter = 0.0", "sim_jitter = inf")}),
    C("demo-config-negative", DEMO, "[demo] iterations = -6: needs iterations >= 1",
      {"demo.toml": demo_config("iterations = 6", "iterations = -6")}),
    C("demo-config-absurd", DEMO, "[demo] stages = 100000: needs stages >= 2 and <= 64",
      {"demo.toml": demo_config("stages = 4", "stages = 100000")}),
    C("demo-config-more-stages-than-profile", DEMO, "[demo] stages = 16: the profile a40/gpt3-175b has only 8",
      {"demo.toml": lambda: demo_config("stages = 4", "stages = 16")().replace("microbatches = 8", "microbatches = 16")}),
    C("demo-config-unknown-profile", DEMO, "[demo] profile = 'a40/nope' is not a shipped profile",
      {"demo.toml": demo_config('profile = "a40/gpt3-175b"', 'profile = "a40/nope"')}),
    C("demo-config-unknown-plan-type", DEMO, "[demo] plan_type = 'fastest': choose one of",
      {"demo.toml": demo_config('plan_type = "envelope"', 'plan_type = "fastest"')}),
    C("demo-config-unknown-key", DEMO, "[demo] has unknown key 'stagez'",
      {"demo.toml": demo_config("stages = 4", "stagez = 4")}),
    C("demo-config-microbatches-below-stages", DEMO, "[demo] needs microbatches >= stages, got 2 < 4",
      {"demo.toml": demo_config("microbatches = 8", "microbatches = 2")}),
    C("demo-gpu-none", "demo --out {tmp}/out --gpu none", "--gpu none measures no energy"),
    C("demo-gpu-unknown-profile", "demo --out {tmp}/out --gpu simulated:a40/nope", "--gpu simulated:a40/nope: no such profile"),
    C("demo-out-is-file", "demo --out {tmp}/f", "--out {tmp}/f: is a file, not a directory", {"f": "x"}),
    C("demo-out-under-file", "demo --out {tmp}/f/out", "--out {tmp}/f/out: {tmp}/f is a file, not a directory", {"f": "x"}),
    C("demo-out-proc", "demo --out /proc/envpipe-test/out", "--out /proc/envpipe-test/out: cannot write in /proc"),
    # output paths: checked before any work; a failure leaves no file at all
    C("plan-out-under-file", f"{PLAN} --out {{tmp}}/f/plan.json", "--out {tmp}/f/plan.json: {tmp}/f is a file", {"f": "x"}),
    C("plan-out-is-directory", f"{PLAN} --out {{tmp}}", "--out {tmp}: is a directory: give a file name"),
    C("plan-out-proc", f"{PLAN} --out /proc/envpipe-test.json", "--out /proc/envpipe-test.json: cannot write in /proc"),
    C("plan-out-device", f"{PLAN} --out /dev/null", "--out /dev/null: is not a regular file"),
    C("plan-out-empty", f"{PLAN} --out ''", "--out: empty file name"),
    C("plan-out-name-too-long", f"{PLAN} --out {{tmp}}/{'x' * 300}.json", "file name longer than 255 bytes"),
    C("plan-plot-unknown-format", f"{PLAN} --out {{tmp}}/a.json --plot {{tmp}}/t.xyz",
      "--plot {tmp}/t.xyz: unknown image format '.xyz': end the name with one of .png"),
    C("plan-plot-no-suffix", f"{PLAN} --plot {{tmp}}/timeline", "--plot {tmp}/timeline: no image format suffix"),
    C("plan-plot-under-file", f"{PLAN} --out {{tmp}}/a.json --plot {{tmp}}/f/t.png", "--plot {tmp}/f/t.png: {tmp}/f is a file",
      {"f": "x"}),
    C("plan-out-and-plot-same-file", f"{PLAN} --out {{tmp}}/t.png --plot {{tmp}}/t.png",
      "--out and --plot both name {tmp}/t.png"),
    C("frontier-csv-under-file", f"{FRONTIER} --csv {{tmp}}/f/x.csv", "--csv {tmp}/f/x.csv: {tmp}/f is a file", {"f": "x"}),
    C("frontier-csv-and-bad-plot", f"{FRONTIER} --csv {{tmp}}/a.csv --plot {{tmp}}/f.xyz", "--plot {tmp}/f.xyz: unknown image format"),
    C("frontier-csv-is-directory", f"{FRONTIER} --csv {{tmp}}", "--csv {tmp}: is a directory"),
    C("simulate-plot-proc", f"{SIMULATE} --plot /proc/envpipe-test.png", "--plot /proc/envpipe-test.png: cannot write in /proc"),
    C("simulate-plot-gif", f"{SIMULATE} --plot {{tmp}}/t.gif", "--plot {tmp}/t.gif: unknown image format '.gif'"),
    # argparse's own errors: one line too
    C("plan-unknown-flag", f"{PLAN} --colour red", "unrecognized arguments: --colour red"),
    C("plan-bad-choice", f"{PLAN} --type fastest", "argument --type: invalid choice: 'fastest'"),
]


def _tree(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*")}


def run(argv: list[str], capsys) -> tuple[int, str, str]:
    try:
        code = main(argv)
    except SystemExit as exc:  # argparse's errors
        code = exc.code
    out = capsys.readouterr()
    return code, out.out, out.err


def test_the_table_is_broad():
    commands = {case.values[0].argv.split()[0] for case in CASES}
    assert commands == {"plan", "frontier", "show", "simulate", "schedule", "programs", "gpus", "demo"}
    assert len(CASES) >= 70


@pytest.mark.parametrize("case", CASES)
def test_bad_input_exits_2_with_one_line_and_leaves_nothing(case: Case, tmp_path, monkeypatch, capsys):
    tmp = str(tmp_path)
    for name, content in case.files.items():
        content = content() if callable(content) else content
        (tmp_path / name).write_bytes(content if isinstance(content, bytes) else content.encode())
    for key, value in case.env.items():
        monkeypatch.setenv(key, value.format(tmp=tmp))
    monkeypatch.chdir(tmp_path)  # anything written to a relative default path would land here
    before = _tree(tmp_path)
    argv = [word.format(tmp=tmp) for word in shlex.split(case.argv)]

    code, out, err = run(argv, capsys)

    assert code == 2, err
    assert err.startswith(f"envpipe {argv[0]}: error: ") and err.count("\n") == 1, err
    assert case.needle.format(tmp=tmp) in err and case.also in err, err
    assert "Traceback" not in err and out == ""
    assert _tree(tmp_path) == before, "the failed command left files behind"


# -- through a real interpreter: what reaches the terminal -------------------------------
# One error argparse raises and one a reader raises deep in a command: the interpreter's entry
# (`python -m megatron_envpipe.apps.cli`: sys.exit(main())) is one path for every error, and each
# message is the table's above, in process (the extra warm-up, image format, plan key and demo --out
# cases that ran here too have their twins there: plan-warmup-short, frontier-csv-and-bad-plot,
# show-missing-key, demo-out-is-file).
@pytest.mark.parametrize(
    "argv,needle",
    [
        (PLAN + " --p2p-power nan", "envpipe plan: error: argument --p2p-power: must be a finite number"),
        ("plan --profile {tmp}/p.bin -m 4", "envpipe plan: error: {tmp}/p.bin:1: not UTF-8 text"),
    ],
    ids=["nan-flag", "binary-profile"],
)
def test_no_traceback_reaches_the_terminal(argv, needle, tmp_path):
    tmp = str(tmp_path)
    (tmp_path / "p.json").write_text(plan_json(setitem("baseline.energy_j", DELETE))())
    (tmp_path / "p.bin").write_bytes(BINARY)
    before = _tree(tmp_path)
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "-m", "megatron_envpipe.apps.cli", *shlex.split(argv.format(tmp=tmp))],
                          capture_output=True, text=True, cwd=tmp_path, env=env, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.startswith(needle.format(tmp=tmp)) and proc.stderr.count("\n") == 1, proc.stderr
    assert "Traceback" not in proc.stderr and proc.stdout == ""
    assert _tree(tmp_path) == before


# -- outputs are written last, all or none ----------------------------------------------
def test_a_write_failing_after_the_checks_leaves_no_output(tmp_path, monkeypatch, capsys):
    """The checks passed, then the JSON cannot be written: the picture, rendered first, is not left behind."""
    monkeypatch.setattr(outputs, "check_writable", lambda path, what: None)  # as if the path broke meanwhile
    (tmp_path / "f").write_text("x")
    before = _tree(tmp_path)
    code, out, err = run(PLAN.split() + ["--plot", str(tmp_path / "t.png"), "--out", str(tmp_path / "f" / "p.json")],
                         capsys)
    assert code == 2 and "cannot write the output: " in err and "no output file was written" in err, err
    assert str(tmp_path / "f" / "p.json") in err and out == ""
    assert _tree(tmp_path) == before


def test_write_all_atomic_is_all_or_none(tmp_path):
    (tmp_path / "f").write_text("x")
    with pytest.raises(OSError):
        write_all_atomic([(tmp_path / "new" / "a.json", "{}"), (tmp_path / "f" / "b.json", "{}")])
    assert _tree(tmp_path) == {"f"}  # neither file, nor the folder made for the first
    written = write_all_atomic([(tmp_path / "new" / "a.json", "{}"), (tmp_path / "b.png", b"\x89PNG")])
    assert [p.read_bytes() for p in written] == [b"{}", b"\x89PNG"]
    assert _tree(tmp_path) == {"f", "new", "new/a.json", "b.png"}


def test_good_outputs_are_still_written(tmp_path, capsys):
    """The checks do not reject what worked before: new folders are made, both files land."""
    code, out, err = run(PLAN.split() + ["--out", str(tmp_path / "o" / "p.json"), "--plot", str(tmp_path / "o" / "t.svg")],
                         capsys)
    assert code == 0, err
    assert json.loads((tmp_path / "o" / "p.json").read_text())["num_stages"] == 8
    assert (tmp_path / "o" / "t.svg").read_text().lstrip().startswith("<?xml")
    assert _tree(tmp_path) == {"o", "o/p.json", "o/t.svg"}


# -- the Python API is as strict as the flags --------------------------------------------
@pytest.mark.parametrize(
    "fields,needle",
    [
        ({"p2p_power_w": float("nan")}, "P2P blocking power must be a finite number >= 0 W, got nan"),
        ({"p2p_power_w": float("inf")}, "P2P blocking power must be a finite number"),
        ({"p2p_latency_s": float("nan")}, "P2P latency must be a finite number >= 0 s, got nan"),
        ({"p2p_latency_s": -1.0}, "P2P latency must be a finite number >= 0 s"),
        ({"plan_type": "optimal", "max_slowdown": float("inf")}, "max_slowdown must be a finite number >= 0"),
        ({"plan_type": "optimal", "max_slowdown": float("nan")}, "max_slowdown must be a finite number >= 0"),
        ({"plan_type": "optimal", "target_time_s": float("inf")}, "target iteration time must be a finite number"),
        ({"plan_type": "optimal", "target_time_s": 9.0, "max_slowdown": 0.05}, "not both"),
        ({"extra_warmup": (2, -1, 0)}, "extra warm-up values must be >= 0"),
    ],
)
def test_planner_config_rejects_what_the_flags_reject(fields, needle):
    with pytest.raises(PlannerError, match=re.escape(needle)):
        PlannerConfig(**fields).validate()


def test_planner_rejects_a_warmup_of_the_wrong_length():
    prof = Profile.from_csv(shipped_profile("a40/gpt3-175b"))
    with pytest.raises(PlannerError, match=re.escape("extra warm-up has 3 value(s) [3, 2, 1] for 8 stages")):
        plan_envpipe(prof, 12, PlannerConfig(extra_warmup=(3, 2, 1)))
