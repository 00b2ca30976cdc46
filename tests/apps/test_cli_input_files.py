"""Issue 20, the input files through ``envpipe``: FIFOs, devices and oversized files given as profile, plan, demo
config or ENVPIPE_GPU_TABLE; unknown profile columns; values that break the arithmetic; plan files naming huge
sizes or absurd clocks; GPU tables with duplicate or empty NVML names. Each case runs ``main(argv)`` in a fresh
folder: exit 2, one line ``envpipe <cmd>: error: ...``, no traceback, nothing on stdout, nothing written.
And what ``plan --out`` writes is standard JSON that ``show`` and ``simulate --plan`` accept.

The Python API side is tests/core/test_input_files.py.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_envpipe.apps.cli import main, planning_cmds
from megatron_envpipe.apps.cli.common import CliError, plan_from_file
from megatron_envpipe.core import textfile
from megatron_envpipe.core.gpu_specs import default_table_path
from megatron_envpipe.errors import UsageError

ROOT = Path(__file__).resolve().parents[2]
HEADER = "stage,instruction,frequency,time,energy"
ROWS = [f"{s},{ins},{f},{t * 1740 / f:.4f},{e * f / 1740:.3f}"
        for s in range(2) for ins, t, e in (("forward", 0.01, 3.0), ("backward", 0.02, 6.0)) for f in (1740, 1500)]
GOOD_CSV = "\n".join([HEADER, *ROWS]) + "\n"
PLAN = "plan --profile a40/gpt3-175b -m 4"


def bare_plan(cells: list[list]) -> str:
    return json.dumps({"stages": [cells]})


def a40_plan(clock: int) -> str:
    """A plan file that names the A40, with its first clock replaced."""
    data = {"gpu": "a40", "stages": [[["F0", clock], ["B0", 1740]]]}
    return json.dumps(data)


def table(old: str, new: str) -> str:
    text = default_table_path().read_text()
    assert old in text
    return text.replace(old, new, 1)


@pytest.fixture
def no_hang():
    """Fail instead of hanging when a read blocks (a FIFO's open waits for a writer)."""
    def blocked(signum, frame):
        raise TimeoutError("the command blocked on a read")

    old = signal.signal(signal.SIGALRM, blocked)
    signal.alarm(20)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, old)


def make_inputs(tmp_path: Path, files: dict[str, str | bytes]) -> None:
    """``files``: name -> text, or one of the special kinds "<fifo>", "<dev-zero>" (a symlink to /dev/zero)."""
    for name, content in files.items():
        path = tmp_path / name
        if content == "<fifo>":
            os.mkfifo(path)
        elif content == "<dev-zero>":
            path.symlink_to("/dev/zero")
        else:
            path.write_bytes(content if isinstance(content, bytes) else content.encode())


def tree(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*")}


def run_case(tmp_path, monkeypatch, capsys, argv: str, needle: str, files: dict, env: dict | None = None) -> None:
    make_inputs(tmp_path, files)
    tmp = str(tmp_path)
    for key, value in (env or {}).items():
        monkeypatch.setenv(key, value.format(tmp=tmp))
    monkeypatch.chdir(tmp_path)
    before = tree(tmp_path)
    words = [w.format(tmp=tmp) for w in shlex.split(argv)]
    try:
        code = main(words)
    except SystemExit as exc:
        code = exc.code
    out = capsys.readouterr()
    assert code == 2, out.err
    assert out.err.startswith(f"envpipe {words[0]}: error: ") and out.err.count("\n") == 1, out.err
    assert needle.format(tmp=tmp) in out.err, out.err
    assert "Traceback" not in out.err and out.out == ""
    assert tree(tmp_path) == before, "the failed command left files behind"


def case(id: str, argv: str, needle: str, files: dict | None = None, **env: str):
    return pytest.param(argv, needle, files or {}, env, id=id)


GPU_ENV = {"ENVPIPE_GPU_TABLE": "{tmp}/gpus.toml"}

# -- 1. every file read bounded, regular files only --------------------------------------------------------------
SPECIAL_FILES = [
    case("profile-fifo", "plan --profile {tmp}/p.csv -m 4 --out {tmp}/o.json",
         "{tmp}/p.csv: is a FIFO, not a regular file: give the profile as a file", {"p.csv": "<fifo>"}),
    case("profile-dev-zero", "plan --profile /dev/zero -m 4", "/dev/zero: is a character device, not a regular file"),
    case("profile-link-to-dev-zero", "simulate --profile {tmp}/p.csv -m 4",
         "{tmp}/p.csv: is a character device, not a regular file", {"p.csv": "<dev-zero>"}),
    case("show-fifo", "show {tmp}/p.json", "{tmp}/p.json: is a FIFO, not a regular file: give the plan as a file",
         {"p.json": "<fifo>"}),
    case("show-dev-zero", "show /dev/zero", "/dev/zero: is a character device, not a regular file"),
    case("show-link-to-dev-zero", "show {tmp}/p.json", "{tmp}/p.json: is a character device", {"p.json": "<dev-zero>"}),
    case("simulate-plan-fifo", "simulate --profile a40/gpt3-175b --plan {tmp}/p.json",
         "{tmp}/p.json: is a FIFO, not a regular file", {"p.json": "<fifo>"}),
    case("simulate-plan-dev-zero", "simulate --profile a40/gpt3-175b --plan /dev/zero", "/dev/zero: is a character device"),
    case("demo-config-fifo", "demo --config {tmp}/demo.toml --out {tmp}/out",
         "{tmp}/demo.toml: is a FIFO, not a regular file: give the demo config as a file", {"demo.toml": "<fifo>"}),
    case("demo-config-link-to-dev-zero", "demo --config {tmp}/demo.toml --out {tmp}/out",
         "{tmp}/demo.toml: is a character device", {"demo.toml": "<dev-zero>"}),
    case("demo-config-dev-zero", "demo --config /dev/zero --out {tmp}/out", "/dev/zero: is a character device"),
    case("gpu-table-fifo-plan", PLAN + " --out {tmp}/o.json", "{tmp}/gpus.toml: is a FIFO, not a regular file: give "
         "the GPU table as a file (the table named by ENVPIPE_GPU_TABLE", {"gpus.toml": "<fifo>"}, **GPU_ENV),
    case("gpu-table-fifo-gpus", "gpus", "{tmp}/gpus.toml: is a FIFO", {"gpus.toml": "<fifo>"}, **GPU_ENV),
    case("gpu-table-link-to-dev-zero", "gpus", "{tmp}/gpus.toml: is a character device", {"gpus.toml": "<dev-zero>"},
         **GPU_ENV),
    case("gpu-table-dev-zero", "gpus", "/dev/zero: is a character device", ENVPIPE_GPU_TABLE="/dev/zero"),
]


@pytest.mark.parametrize("argv,needle,files,env", SPECIAL_FILES)
def test_special_files_are_refused_at_once(argv, needle, files, env, tmp_path, monkeypatch, capsys, no_hang):
    run_case(tmp_path, monkeypatch, capsys, argv, needle, files, env)


@pytest.mark.parametrize(
    "role,argv,needle,files",
    [
        ("plan", "show {tmp}/p.json", "{tmp}/p.json: larger than 1000 bytes, the limit of a plan file",
         {"p.json": bare_plan([["F0", 1740], ["B0", 1740]]) + " " * 1000}),
        ("profile", "plan --profile {tmp}/p.csv -m 4 --out {tmp}/o.json",
         "{tmp}/p.csv: larger than 1000 bytes, the limit of a profile file", {"p.csv": GOOD_CSV + "\n" * 1000}),
        ("demo config", "demo --config {tmp}/demo.toml --out {tmp}/out",
         "{tmp}/demo.toml: larger than 1000 bytes", {"demo.toml": "#\n" * 1000}),
    ],
    ids=["plan", "profile", "demo-config"],
)
def test_files_over_their_limit_are_refused(role, argv, needle, files, tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(textfile._MAX_BYTES, role, 1000)  # the real limits are MiBs: not worth writing in a test
    run_case(tmp_path, monkeypatch, capsys, argv, needle, files)


def test_a_fifo_through_a_real_interpreter_ends_at_once(tmp_path):
    """No hang, one line, no traceback: the command a user would type, with a timeout that fails instead of hanging."""
    os.mkfifo(tmp_path / "p.json")
    proc = subprocess.run([sys.executable, "-m", "megatron_envpipe.apps.cli", "show", str(tmp_path / "p.json")],
                          capture_output=True, text=True, cwd=tmp_path, env=dict(os.environ, PYTHONPATH=str(ROOT)),
                          timeout=60)
    assert proc.returncode == 2
    assert proc.stderr == f"envpipe show: error: {tmp_path}/p.json: is a FIFO, not a regular file: give the plan as a file\n"


# -- 2. profile columns -----------------------------------------------------------------------------------------------
def with_column(name: str) -> str:
    return "\n".join([f"{HEADER},{name}", *(f"{row},0" for row in ROWS)]) + "\n"


COLUMNS = [
    case("plan-Chunk", "plan --profile {tmp}/p.csv -m 4 --out {tmp}/o.json",
         "{tmp}/p.csv:1: unknown column(s) 'Chunk' (did you mean 'chunk'?)", {"p.csv": with_column("Chunk")}),
    case("simulate-chunks", "simulate --profile {tmp}/p.csv -m 4", "unknown column(s) 'chunks' (did you mean 'chunk'?)",
         {"p.csv": with_column("chunks")}),
    case("frontier-freq", "frontier --profile {tmp}/p.csv -m 4 --points 3",
         "unknown column(s) 'freq' (did you mean 'frequency'?)", {"p.csv": with_column("freq")}),
    case("plan-unknown", "plan --profile {tmp}/p.csv -m 4", "unknown column(s) 'gpu_power'; a profile has the columns",
         {"p.csv": with_column("gpu_power")}),
]


@pytest.mark.parametrize("argv,needle,files,env", COLUMNS)
def test_unknown_profile_columns_are_named(argv, needle, files, env, tmp_path, monkeypatch, capsys):
    run_case(tmp_path, monkeypatch, capsys, argv, needle, files, env)


# -- 3. numbers that break the arithmetic; outputs standard JSON -----------------------------------------------------
NUMBERS = [
    case("plan-time-scale-1e-300-optimal", PLAN + " --type optimal --time-scale 1e-300 --out {tmp}/p.json",
         "--time-scale 1e-300 makes the profile's"),
    case("plan-time-scale-1e-300", PLAN + " --time-scale 1e-300 --out {tmp}/p.json", "outside the 1e-09..86400 s"),
    case("frontier-time-scale-1e-300", "frontier --profile a40/gpt3-175b -m 4 --time-scale 1e-300 --csv {tmp}/f.csv",
         "--time-scale 1e-300 makes"),
    case("simulate-time-scale-1e-300", "simulate --profile a40/gpt3-175b -m 4 --time-scale 1e-300",
         "--time-scale 1e-300 makes"),
    case("plan-energy-scale-1e-20", PLAN + " --energy-scale 1e-20 --out {tmp}/p.json", "--energy-scale 1e-20 makes"),
    case("plan-subnormal-time", "plan --profile {tmp}/p.csv -m 4 --out {tmp}/p.json",
         "{tmp}/p.csv:10: time 1e-310 s / energy 3 J is below any micro-batch",
         {"p.csv": GOOD_CSV + "1,forward,1200,1e-310,3\n"}),
]


@pytest.mark.parametrize("argv,needle,files,env", NUMBERS)
def test_numbers_that_break_the_arithmetic_are_refused(argv, needle, files, env, tmp_path, monkeypatch, capsys):
    run_case(tmp_path, monkeypatch, capsys, argv, needle, files, env)


@pytest.mark.parametrize("flag", ["--out {tmp}/p.json", "--json"])
def test_a_result_that_is_not_standard_json_is_one_line_and_nothing_written(flag, tmp_path, monkeypatch, capsys):
    """The safety net behind the checks: a nan or infinity left in a result never reaches a file or stdout."""
    real = planning_cmds.result_to_dict
    monkeypatch.setattr(planning_cmds, "result_to_dict", lambda *a: {**real(*a), "lower_bound_j": float("-inf")})
    run_case(tmp_path, monkeypatch, capsys, f"{PLAN} {flag}", "not finite (nan or infinity), which JSON cannot hold", {})


def strict(text: str):
    def refuse(name):
        raise AssertionError(f"{name} is not standard JSON")
    return json.loads(text, parse_constant=refuse)


@pytest.mark.parametrize(
    "flags",
    ["", "--type optimal", "--type optimal --max-slowdown 5%", "--scheduling 1f1b", "--type baseline",
     "--compat perseus --scheduling 1f1b", "--scheduling interleaved --virtual-stages 2", "--time-scale 1e-8",
     "--time-scale 10 --energy-scale 80"],
)
def test_what_plan_writes_show_and_simulate_accept(flags, tmp_path, capsys):
    out = tmp_path / "p.json"
    assert main(shlex.split(f"plan --profile a40/gpt3-175b -m 8 {flags} --out {out}")) == 0
    strict(out.read_text())
    assert main(["show", str(out)]) == 0
    capsys.readouterr()
    assert main(["show", str(out), "--json"]) == 0
    strict(capsys.readouterr().out)
    scale = shlex.split(flags)[flags.split().index("--time-scale"):][:2] if "--time-scale" in flags else []
    assert main(["simulate", "--profile", "a40/gpt3-175b", "--plan", str(out), *scale, "--json"]) == 0
    strict(capsys.readouterr().out)


# -- 4. plan files: sizes and clocks -----------------------------------------------------------------------------------
PLANS = [
    case("show-microbatch-1e8", "show {tmp}/p.json", "{tmp}/p.json: not a valid plan: stage 0: F99999999 names "
         "micro-batch 99999999, but the stage has only 2 units", {"p.json": bare_plan([["F99999999", 1740], ["B99999999", 1740]])}),
    case("simulate-microbatch-1e8", "simulate --profile a40/gpt3-175b --plan {tmp}/p.json", "names micro-batch 99999999",
         {"p.json": bare_plan([["F99999999", 1740], ["B99999999", 1740]])}),
    case("show-chunk-1e8", "show {tmp}/p.json", "F0v100000000 names chunk 100000000",
         {"p.json": bare_plan([["F0v100000000", 1740], ["B0v100000000", 1740]])}),
    case("show-units-product", "show {tmp}/p.json", "need F and B of each: 2000000",
         {"p.json": bare_plan([["F999", 1740], ["F0v999", 1740]] * 1000)}),
    case("show-clock-1e30", "show {tmp}/p.json", "stage 0, unit F0: clock 1e+30 MHz is not a clock (1..100000 MHz)",
         {"p.json": bare_plan([["F0", 1e30], ["B0", 1740]])}),
    case("show-a40-5000", "show {tmp}/p.json", "stage 0, unit F0: clock 5000 MHz is outside the clock range of its "
         "GPU a40 210..1740 MHz", {"p.json": a40_plan(5000)}),
    case("simulate-a40-100", "simulate --profile a40/gpt3-175b --plan {tmp}/p.json", "clock 100 MHz is outside",
         {"p.json": a40_plan(100)}),
    case("show-gpu-not-a-name", "show {tmp}/p.json", "gpu 5 is not a GPU name",
         {"p.json": json.dumps({"gpu": 5, "stages": [[["F0", 1740], ["B0", 1740]]]})}),
]


@pytest.mark.parametrize("argv,needle,files,env", PLANS)
def test_plan_files_with_absurd_sizes_or_clocks_are_refused(argv, needle, files, env, tmp_path, monkeypatch, capsys):
    run_case(tmp_path, monkeypatch, capsys, argv, needle, files, env)


@pytest.mark.parametrize(
    "content,needle",
    [
        (a40_plan(5000), "clock 5000 MHz is outside the clock range of its GPU a40"),
        (bare_plan([["F99999999", 1740], ["B99999999", 1740]]), "names micro-batch 99999999"),
    ],
    ids=["a40-5000", "microbatch-1e8"],
)
def test_plan_from_file_raises_the_usage_error(content, needle, tmp_path):
    path = tmp_path / "p.json"
    path.write_text(content)
    with pytest.raises(CliError, match=needle) as info:
        plan_from_file(str(path))
    assert isinstance(info.value, UsageError)


# -- 5. GPU table: NVML names --------------------------------------------------------------------------------------------
TABLES = [
    case("plan-nvml-name-twice", PLAN + " --out {tmp}/o.json", "{tmp}/gpus.toml: [a40] nvml_names has 'NVIDIA A40' twice",
         {"gpus.toml": table('nvml_names = ["NVIDIA A40"]', 'nvml_names = ["NVIDIA A40", "NVIDIA A40"]')}, **GPU_ENV),
    case("gpus-nvml-name-in-two-entries", "gpus", "{tmp}/gpus.toml: [a40] nvml_names has 'NVIDIA RTX A6000' also in [a6000]",
         {"gpus.toml": table('nvml_names = ["NVIDIA A40"]', 'nvml_names = ["NVIDIA RTX A6000"]')}, **GPU_ENV),
    case("gpus-nvml-name-empty", "gpus", "{tmp}/gpus.toml: [a40] nvml_names has an empty name ''",
         {"gpus.toml": table('nvml_names = ["NVIDIA A40"]', 'nvml_names = [""]')}, **GPU_ENV),
]


@pytest.mark.parametrize("argv,needle,files,env", TABLES)
def test_gpu_tables_with_duplicate_or_empty_nvml_names_are_refused(argv, needle, files, env, tmp_path, monkeypatch,
                                                                   capsys):
    run_case(tmp_path, monkeypatch, capsys, argv, needle, files, env)
