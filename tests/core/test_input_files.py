"""Issue 20, the input files through the Python API: bounded reads of regular files only, profile columns and
linear parsing, values too small to compute with, plan files that name huge sizes or absurd clocks, and GPU
tables with duplicate or empty NVML names. Every bad input raises the UsageError subclass of its reader, with
one line naming the file (and line, column, stage or key).

The command-line side of the same classes is tests/apps/test_cli_input_files.py.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import tracemalloc
from pathlib import Path

import pytest

from megatron_envpipe.config import EnvPipeConfigError, load_profile
from megatron_envpipe.core import textfile
from megatron_envpipe.core.atomic import write_json_atomic
from megatron_envpipe.core.gpu_specs import GpuSpecError, default_table_path, load_gpu_table
from megatron_envpipe.core.plan import FrequencyPlan
from megatron_envpipe.core.profile import MIN_TIME_S, Profile, ProfileError
from megatron_envpipe.core.schedule import ScheduleError, one_f_one_b
from megatron_envpipe.core.textfile import read_text
from megatron_envpipe.errors import UsageError

HEADER = "stage,instruction,frequency,time,energy"
ROWS = "0,forward,1740,0.1,30\n0,backward,1740,0.2,60\n0,forward,1500,0.12,25\n0,backward,1500,0.24,50\n"


@pytest.fixture
def no_hang():
    """Fail (instead of hanging the suite) when a read blocks: a FIFO's open waits for a writer forever."""
    def blocked(signum, frame):
        raise TimeoutError("the read blocked: a FIFO was opened as a file")

    old = signal.signal(signal.SIGALRM, blocked)
    signal.alarm(10)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, old)


def special_file(tmp_path: Path, kind: str) -> Path:
    """A path that is not a regular file: a FIFO, /dev/zero, a symlink to /dev/zero, or a folder."""
    path = tmp_path / f"input-{kind}"
    if kind == "fifo":
        os.mkfifo(path)
        return path
    if kind == "dev-zero":
        return Path("/dev/zero")
    if kind == "link-to-dev-zero":
        path.symlink_to("/dev/zero")
        return path
    path.mkdir()
    return path


KINDS = {"fifo": "is a FIFO, not a regular file", "dev-zero": "is a character device, not a regular file",
         "link-to-dev-zero": "is a character device, not a regular file", "folder": "is a directory"}


# -- 1. every read bounded, regular files only ---------------------------------------------------------------
@pytest.mark.parametrize("kind", KINDS)
def test_read_text_refuses_what_is_not_a_regular_file(kind, tmp_path, no_hang):
    path = special_file(tmp_path, kind)
    with pytest.raises(ValueError, match=f"^{path}: {KINDS[kind]}"):
        read_text(path, "plan", ValueError)


@pytest.mark.parametrize("kind", ["fifo", "dev-zero", "link-to-dev-zero"])
def test_profile_from_csv_refuses_special_files(kind, tmp_path, no_hang):
    path = special_file(tmp_path, kind)
    with pytest.raises(ProfileError, match=f"{path}: {KINDS[kind]}: give the profile as a file"):
        Profile.from_csv(path)


@pytest.mark.parametrize("kind", ["fifo", "link-to-dev-zero"])
def test_training_profile_flag_refuses_special_files(kind, tmp_path, no_hang):
    """--envpipe-profile (and --envpipe-gpu simulated:<csv>) read through config.load_profile."""
    path = special_file(tmp_path, kind)
    with pytest.raises(EnvPipeConfigError, match=f"--envpipe-profile: {path}: {KINDS[kind]}"):
        load_profile(str(path))


@pytest.mark.parametrize("kind", ["fifo", "dev-zero", "link-to-dev-zero"])
def test_gpu_table_refuses_special_files(kind, tmp_path, monkeypatch, no_hang):
    path = special_file(tmp_path, kind)
    with pytest.raises(GpuSpecError, match=f"{path}: {KINDS[kind]}: give the GPU table as a file"):
        load_gpu_table(path)
    monkeypatch.setenv("ENVPIPE_GPU_TABLE", str(path))
    with pytest.raises(GpuSpecError, match="the table named by ENVPIPE_GPU_TABLE"):
        load_gpu_table()


def test_a_file_over_its_limit_is_refused(tmp_path):
    path = tmp_path / "p.csv"
    path.write_text(HEADER + "\n" + ROWS * 10)
    with pytest.raises(ProfileError, match=r"p\.csv: larger than 100 bytes, the limit of a profile file"):
        textfile.read_text(path, "profile", ProfileError, max_bytes=100)
    assert read_text(path, "profile", ProfileError, max_bytes=path.stat().st_size) == path.read_text()


def test_role_limits_are_documented_and_used(tmp_path, monkeypatch):
    """Profiles get the profile limit, GPU tables theirs: a 5 MB TOML is refused, a 5 MB profile is not."""
    assert textfile._MAX_BYTES["profile"] == 64 * textfile.MIB
    assert textfile._MAX_BYTES["GPU table"] <= 4 * textfile.MIB
    big = tmp_path / "gpus.toml"
    big.write_text("# padding\n" * 500_000 + default_table_path().read_text())
    with pytest.raises(GpuSpecError, match="the limit of a GPU table file"):
        load_gpu_table(big)


def test_at_most_limit_plus_one_bytes_are_read(tmp_path, monkeypatch):
    """A file whose size stat() does not tell (a /proc file, one still growing): the read stops past the limit."""
    path = tmp_path / "grows.csv"
    path.write_bytes(b"x" * 100_000)
    real_fstat, real_read = os.fstat, os.read
    asked: list[int] = []

    class Small:  # what fstat says of /proc files: a regular file of size 0
        def __init__(self, st):
            self.st_mode, self.st_size = st.st_mode, 0

    monkeypatch.setattr(os, "fstat", lambda fd: Small(real_fstat(fd)))
    monkeypatch.setattr(os, "read", lambda fd, n: (asked.append(n), real_read(fd, n))[1])
    with pytest.raises(ValueError, match="larger than"):
        textfile.read_bytes(path, "plan", ValueError, max_bytes=1000)
    assert sum(asked) <= 1001


# -- 2. profile columns: unknown or misspelled ones named; parsing linear ---------------------------------
@pytest.mark.parametrize(
    "column,needle",
    [
        ("Chunk", "unknown column(s) 'Chunk' (did you mean 'chunk'?)"),
        ("chunks", "unknown column(s) 'chunks' (did you mean 'chunk'?)"),
        ("freq", "unknown column(s) 'freq' (did you mean 'frequency'?)"),
        ("Rank", "unknown column(s) 'Rank' (did you mean 'rank'?)"),
        ("power", "unknown column(s) 'power';"),
    ],
)
def test_unknown_profile_columns_are_named(column, needle):
    rows = "".join(line + ",0\n" for line in ROWS.splitlines())
    with pytest.raises(ProfileError) as info:
        Profile.from_csv_text(f"{HEADER},{column}\n{rows}", source="p.csv")
    message = str(info.value)
    assert message.startswith("p.csv:1: ") and needle in message and "\n" not in message
    assert "duplicate" not in message


def test_chunked_rows_under_a_misspelled_column_are_not_reported_as_duplicates():
    """The issue's case: 'Chunk' was ignored, so chunk 1's rows collided with chunk 0's."""
    rows = "".join(f"{line},{v}\n" for v in (0, 1) for line in ROWS.splitlines())
    with pytest.raises(ProfileError, match=r"unknown column\(s\) 'Chunk' \(did you mean 'chunk'\?\)"):
        Profile.from_csv_text(f"{HEADER},Chunk\n{rows}", source="p.csv")
    assert Profile.from_csv_text(f"{HEADER},chunk\n{rows}").num_chunks == 2


def test_merak_rank_columns_stay_accepted():
    text = "rank,dp_rank,pp_rank,tp_rank," + HEADER + "\n" + "".join(
        f"{r},0,0,{r},{line}\n" for r in (0, 1) for line in ROWS.splitlines())
    assert Profile.from_csv_text(text).num_stages == 1


def merak_rows(ranks: int) -> str:
    """One stage at one clock, ``ranks`` TP ranks: every row shares its (stage, instruction, clock) key, the worst
    case of a duplicate check that compares each row with the earlier rows of its key."""
    return "rank,tp_rank," + HEADER + "\n" + "".join(
        f"{r},{r},0,{ins},1740,0.1,30\n" for r in range(ranks) for ins in ("forward", "backward"))


class TooManySteps(Exception):
    pass


def parse_steps(text: str, budget: int) -> int:
    """Python lines executed in core/profile.py while parsing ``text``; TooManySteps once past ``budget``
    (so a quadratic parser fails fast instead of running for hours). Counts steps, not seconds."""
    steps = 0

    def local(frame, event, arg):
        nonlocal steps
        steps += 1
        if steps > budget:
            raise TooManySteps(f"over {budget} steps")
        return local

    def calls(frame, event, arg):
        return local if frame.f_code.co_filename.endswith(os.path.join("core", "profile.py")) else None

    sys.settrace(calls)
    try:
        Profile.from_csv_text(text)
    finally:
        sys.settrace(None)
    return steps


def test_profile_parsing_is_linear_in_the_rows():
    """Steps per row stay constant from 2,000 to 20,000 rows (the old scan of the key's earlier rows: ~rows/4 each)."""
    per_row = parse_steps(merak_rows(1_000), budget=10**9) / 2_000
    large = parse_steps(merak_rows(10_000), budget=int(1.2 * per_row * 20_000))
    assert large / 20_000 <= 1.2 * per_row


def test_a_large_profile_parses_and_aggregates():
    """200,000 rows built in memory (1,000 TP ranks of one stage at 100 clocks): aggregated to max time, mean
    energy. (Linearity is the test above's: with 1,000 rows per key a quadratic check would only be slow here.)"""
    text = "rank,tp_rank," + HEADER + "\n" + "".join(
        f"{r},{r},0,{ins},{1740 - 10 * f},{0.1 + r * 1e-6:.6f},{30 + r % 2}\n" for f in range(100) for r in range(1_000)
        for ins in ("forward", "backward"))
    profile = Profile.from_csv_text(text)
    assert len(profile.frequencies(0, "forward")) == 100
    assert profile.time_s(0, "forward", 1740) == pytest.approx(0.1 + 999e-6)
    assert profile.energy_j(0, "backward", 750) == pytest.approx(30.5)


def test_a_duplicate_rank_row_is_still_found():
    text = merak_rows(3) + "1,1,0,forward,1740,0.1,30\n"
    with pytest.raises(ProfileError, match=r"p\.csv:8: duplicate row for stage 0 forward at 1740 MHz \(first at line 4\)"):
        Profile.from_csv_text(text, source="p.csv")


# -- 3. values too small to compute with; outputs standard JSON ----------------------------------------------
@pytest.mark.parametrize(
    "row,needle",
    [
        ("0,forward,1200,1e-310,20", "p.csv:6: time 1e-310 s / energy 20 J is below any micro-batch"),
        ("0,forward,1200,1e-12,20", "p.csv:6: time 1e-12 s"),
        ("0,forward,1200,0.2,1e-300", "p.csv:6: time 0.2 s / energy 1e-300 J is below any micro-batch"),
    ],
)
def test_profile_values_too_small_are_refused_naming_the_row(row, needle):
    with pytest.raises(ProfileError, match=needle.replace(".", r"\.")):
        Profile.from_csv_text(f"{HEADER}\n{ROWS}{row}\n", source="p.csv")


def test_energy_zero_stays_allowed():
    assert Profile.from_csv_text(f"{HEADER}\n{ROWS}0,forward,1200,0.2,0\n").energy_j(0, "forward", 1200) == 0


@pytest.mark.parametrize(
    "scales,needle",
    [
        ((1e-300, 1.0), "--time-scale 1e-300 makes the profile's 0.1..0.24 s 1e-301..2.4e-301 s, outside the 1e-09..86400 s"),
        ((1e6, 1.0), "--time-scale 1e+06 makes"),
        ((1.0, 1e-20), "--energy-scale 1e-20 makes the profile's 25..60 J"),
        ((1.0, 1e300), "--energy-scale 1e+300 makes"),
    ],
)
def test_scales_that_break_the_arithmetic_are_refused_naming_the_scale(scales, needle):
    profile = Profile.from_csv_text(f"{HEADER}\n{ROWS}")
    with pytest.raises(ProfileError) as info:
        profile.scaled(*scales, names=("--time-scale", "--energy-scale"))
    assert needle in str(info.value)


def test_every_profile_keeps_its_values_computable():
    """Whatever builds a profile (a measurement, a split into chunks), a value below MIN_TIME_S is refused."""
    short = f"0,forward,1740,{1.5 * MIN_TIME_S},{300 * 1.5 * MIN_TIME_S}"  # 300 W, as a GPU draws
    profile = Profile.from_csv_text(f"{HEADER}\n{ROWS}".replace("0,forward,1740,0.1,30", short))
    with pytest.raises(ProfileError, match=r"stage 0 forward at 1740 MHz has time 1\.5e-10 s, energy \S+ J: a micro-batch needs 1e-09"):
        profile.for_chunks(10)


@pytest.mark.parametrize("row", ["0,forward,1740,0.1,3000", "0,forward,1740,1e-3,30", "0,forward,1740,0.1,1e6"])
def test_a_row_drawing_more_power_than_any_gpu_is_a_unit_mistake(row):
    """Energy per GPU over time: 30 kW (kJ for J, ms for s) names the line, the power and the limit."""
    with pytest.raises(ProfileError, match=r"<text>:2: energy \S+ J in \S+ s is \S+ W, beyond any GPU \(5000 W\)"):
        Profile.from_csv_text(f"{HEADER}\n{ROWS}".replace("0,forward,1740,0.1,30", row))


def test_json_files_are_written_as_standard_json(tmp_path):
    with pytest.raises(ValueError, match="Out of range float values are not JSON compliant"):
        write_json_atomic(tmp_path / "x.json", {"lower_bound_j": float("-inf")})
    assert list(tmp_path.iterdir()) == []


# -- 4. plan files: sizes and clocks checked before anything is built --------------------------------------------
def plan_dict(**cells) -> dict:
    """A 1-stage, 1-micro-batch plan; ``cells`` replace units/clocks."""
    return {"stages": [[[cells.get("f", "F0"), cells.get("f_mhz", 1740)], [cells.get("b", "B0"), 1740]]]}


@pytest.mark.parametrize(
    "data,needle",
    [
        (plan_dict(f="F99999999", b="B99999999"), "stage 0: F99999999 names micro-batch 99999999, but the stage has only 2 units"),
        (plan_dict(f="F0v100000000", b="B0v100000000"), "F0v100000000 names chunk 100000000"),
        (plan_dict(f="F" + "9" * 5000), "stage 0: cannot parse unit 'F99999999999"),
        ({"stages": [[["F999", 1740], ["F0v999", 1740]] * 1000]},
         "stage 0: 2000 units, but the plan's ids (micro-batches 0..999 x 1000 chunks) need F and B of each: 2000000"),
        ({"stages": [[[f"{k}{m}", 1740] for m in range(50) for k in "FB"], [["F0", 1740], ["B0", 1740]]]},
         "stage 1: 2 units, but the plan's ids (micro-batches 0..49) need F and B of each: 100"),
        ({"stages": [[["F0", 1740], ["B0", 1740]]] * 10_001}, "10001 stages, more than the 10000"),
        (dict(plan_dict(), extra_warmup=[10**300]), "extra warm-up [1000000"),
        (plan_dict(f_mhz=1e30), "stage 0, unit F0: clock 1e+30 MHz is not a clock (1..100000 MHz)"),
        (plan_dict(f_mhz=0), "stage 0, unit F0: clock 0 MHz is not a clock"),
        (plan_dict(f_mhz=-1740), "clock -1740 MHz is not a clock"),
    ],
    ids=["microbatch-1e8", "chunk-1e8", "5000-digit-id", "ids-product", "unit-count", "stage-count", "warmup-huge", "clock-1e30",
         "clock-0", "clock-negative"],
)
def test_plan_files_with_absurd_sizes_or_clocks_are_refused(data, needle):
    with pytest.raises(ScheduleError) as info:
        FrequencyPlan.from_dict(data)
    assert needle in str(info.value) and "\n" not in str(info.value)
    assert isinstance(info.value, UsageError)


def test_a_huge_micro_batch_id_allocates_nothing_before_it_is_refused():
    """200,000 (not 10^8, so that a regression fails in a second): the old parser built the 400,000 units first."""
    tracemalloc.start()
    try:
        with pytest.raises(ScheduleError, match="names micro-batch 200000"):
            FrequencyPlan.from_dict(plan_dict(f="F200000", b="B200000"))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 1_000_000


def test_clock_range_names_the_unit():
    plan = FrequencyPlan.from_dict(plan_dict(f_mhz=5000))
    with pytest.raises(ScheduleError, match="stage 0, unit F0: clock 5000 MHz is outside the a40's range 210..1740 MHz"):
        plan.check_clock_range(210, 1740, "the a40's range")


def test_good_plans_still_load():
    plan = FrequencyPlan.constant(one_f_one_b(4, 8), [1740] * 4)
    again = FrequencyPlan.from_dict(json.loads(json.dumps(plan.to_dict())))
    assert again.freqs_mhz == plan.freqs_mhz and again.schedule.orders == plan.schedule.orders


# -- 5. GPU table: NVML names unique and non-empty ---------------------------------------------------------------
def table_with(tmp_path: Path, old: str, new: str) -> Path:
    text = default_table_path().read_text()
    assert old in text
    path = tmp_path / "gpus.toml"
    path.write_text(text.replace(old, new, 1))
    return path


@pytest.mark.parametrize(
    "old,new,needle",
    [
        ('nvml_names = ["NVIDIA A40"]', 'nvml_names = ["NVIDIA A40", "NVIDIA A40"]',
         "[a40] nvml_names has 'NVIDIA A40' twice in it"),
        ('nvml_names = ["NVIDIA A40"]', 'nvml_names = ["NVIDIA RTX A6000"]',
         "[a40] nvml_names has 'NVIDIA RTX A6000' also in [a6000]"),
        ('nvml_names = ["NVIDIA A40"]', 'nvml_names = [""]', "[a40] nvml_names has an empty name ''"),
        ('nvml_names = ["NVIDIA A40"]', 'nvml_names = ["NVIDIA A40", "  "]', "[a40] nvml_names has an empty name '  '"),
    ],
    ids=["twice-in-one-entry", "in-two-entries", "empty", "blank"],
)
def test_gpu_table_nvml_names_are_unique_and_non_empty(old, new, needle, tmp_path):
    path = table_with(tmp_path, old, new)
    with pytest.raises(GpuSpecError) as info:
        load_gpu_table(path)
    assert str(info.value).startswith(f"{path}: ") and needle in str(info.value)
