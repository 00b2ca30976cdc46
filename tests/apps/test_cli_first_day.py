"""The `envpipe` CLI as a new user meets it (issue 22, item 10).

* `plan --compat perseus` alone runs (Perseus's EnvPipe is envelope/1f1b/balanced); a clash names only
  the flags the user gave.
* A clamped `--extra-warmup` is said on stderr in one line: which stages, to what, and why.
* `show` prints the receive waits the plan's simulated timeline had, not 0.0 everywhere.
* Long rows (M = 96) print as a short summary by default; `--rows full` and `--json` keep every unit,
  and the README's M = 12 rows stay in full.
"""

from __future__ import annotations

import json
import random
import re
import sys

import pytest

from megatron_envpipe.apps.cli import main
from megatron_envpipe.apps.cli.common import _warmup_clamp_text
from megatron_envpipe.apps.cli.rows import ROW_LIMIT_CHARS
from megatron_envpipe.core.schedule import clamp_extra_warmup, clamp_extra_warmup_explained

PLAN = ["plan", "--profile", "a40/gpt3-175b"]


def run(capsys, argv):
    code = main(argv)
    out = capsys.readouterr()
    return code, out.out, out.err


def stage_rows(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("Stage ")]


# ------------------------------------------------------------------ --compat perseus


def test_compat_perseus_alone_runs_as_perseus(capsys):
    code, out, err = run(capsys, PLAN + ["-m", "12", "--compat", "perseus"])
    assert code == 0, err
    assert "plan envelope/1f1b/balanced" in out and "as Perseus reports it" in out


@pytest.mark.parametrize("flags,named,not_named", [
    (["--scheduling", "ours"], ["--scheduling ours"], ["--type", "--reconfig"]),
    (["--type", "uniform"], ["--type uniform"], ["--scheduling", "--reconfig"]),
    (["--reconfig", "greedy", "--scheduling", "1f1b"], ["--reconfig greedy"], ["--type", "--scheduling"]),
])
def test_compat_perseus_clash_names_only_flags_given(capsys, flags, named, not_named):
    code, _, err = run(capsys, PLAN + ["-m", "12", "--compat", "perseus", *flags])
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    message = err.split("), not ", 1)[1]  # after the list of the values Perseus uses
    for flag in named:
        assert flag in message
    for flag in not_named:
        assert flag not in message, err


def test_compat_perseus_with_its_own_values_given_runs(capsys):
    code, out, err = run(capsys, PLAN + ["-m", "12", "--compat", "perseus", "--type", "envelope",
                                         "--scheduling", "1f1b", "--reconfig", "balanced"])
    assert code == 0 and "plan envelope/1f1b/balanced" in out, err


# ------------------------------------------------------------------ clamped --extra-warmup


def test_simulate_says_the_warmup_was_clamped_and_why(capsys):
    code, out, err = run(capsys, ["simulate", "--profile", "a40/gpt3-175b", "-m", "8", "--scheduling", "ours",
                                  "--extra-warmup", "4,4,4,3,2,1,1,0"])
    assert code == 0
    assert "extra warm-up [0, 0, 0, 0, 0, 0, 0, 0]" in out  # what actually ran
    notes = [line for line in err.splitlines() if line.strip()]
    assert len(notes) == 1, err
    note = notes[0]
    assert note.startswith("envpipe simulate: note: --extra-warmup 4,4,4,3,2,1,1,0 runs as 0,0,0,0,0,0,0,0")
    # Stage 0: 8 micro-batches on 8 stages leave no forward beyond 1F1B's own warm-up ...
    assert "stage 0 4->0: only M - (P - s) = 8 - 8 = 0 forwards are left" in note
    # ... and the others may not exceed the stage before.
    assert re.search(r"stage 1 4->0, .*stage 6 1->0: no more than the stage before \(0\)", note), note


def test_schedule_names_the_memory_budget_and_the_last_stage(capsys):
    code, out, err = run(capsys, ["schedule", "--stages", "4", "-m", "8", "--scheduling", "ours",
                                  "--extra-warmup", "6,3,3,2", "--max-inflight", "6"])
    assert code == 0 and "extra warm-up [2, 2, 2, 0]" in out
    assert "stage 0 6->2: activation budget 6 (--max-inflight) less 1F1B's own 4 leaves 2" in err
    assert "stage 3 2->0: the last stage has no extra warm-up" in err


def test_plan_says_so_too_and_nothing_when_nothing_is_clamped(capsys):
    code, out, err = run(capsys, PLAN + ["-m", "8", "--extra-warmup", "4,4,4,3,2,1,1,0"])
    assert code == 0 and "runs as 0,0,0,0,0,0,0,0" in err and "extra forwards per stage [0, 0, 0" in out
    code, out, err = run(capsys, ["schedule", "--stages", "4", "-m", "8", "--scheduling", "ours",
                                  "--extra-warmup", "3,2,1,0"])
    assert code == 0 and err == "" and "extra warm-up [3, 2, 1, 0]" in out


def test_the_note_always_states_what_the_clamp_does():
    """Random pipelines: the note's 'runs as' is clamp_extra_warmup's result, and every lowered stage is named."""
    rng = random.Random(22)
    for _ in range(500):
        p, m = rng.randint(1, 8), rng.randint(1, 16)
        raw = [rng.randint(0, 12) for _ in range(p)]
        budget = rng.choice([None, [rng.randint(min(m, p - s), 20) for s in range(p)]])
        clamped = clamp_extra_warmup(p, m, raw, budget)
        text = _warmup_clamp_text(p, m, clamp_extra_warmup_explained(p, m, raw, budget))
        if list(clamped) == raw:
            assert text is None
            continue
        assert f"runs as {','.join(map(str, clamped))} " in text
        for s in range(p):
            assert (f"stage {s} {raw[s]}->{clamped[s]}" in text) == (raw[s] != clamped[s]), (p, m, raw, text)


# ------------------------------------------------------------------ show: receive waits


def test_show_prints_the_plans_receive_waits(capsys, tmp_path):
    out_json = tmp_path / "plan.json"
    code, planned, _ = run(capsys, PLAN + ["-m", "12", "--out", str(out_json)])
    assert code == 0
    code, shown, err = run(capsys, ["show", str(out_json)])
    assert code == 0, err
    waits = [float(w) for row in stage_rows(shown) for w in re.findall(r"[FB]\d+ \d+ (\d+\.\d)", row)]
    assert len(waits) == 8 * 24 and max(waits) > 100  # stage 7's F0 waits ~787 ms for the pipeline to fill
    assert stage_rows(shown) == stage_rows(planned)  # the same waits and critical units as 'plan' printed


def test_show_of_a_file_without_waits_says_so_instead_of_zeros(capsys, tmp_path):
    out_json = tmp_path / "plan.json"
    assert run(capsys, PLAN + ["-m", "12", "--out", str(out_json)])[0] == 0
    data = json.loads(out_json.read_text())
    bare = tmp_path / "bare.json"
    bare.write_text(json.dumps({"frequencies": data["plan"]["frequencies"]}))
    code, shown, _ = run(capsys, ["show", str(bare)])
    assert code == 0 and "receive waits: not in this file" in shown
    assert not re.search(r"\b\d+ 0\.0\b", "\n".join(stage_rows(shown)))  # no invented 0.0 waits
    data["plan"]["recv_wait_ms"][3] = data["plan"]["recv_wait_ms"][3][:-1]
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(data))
    code, _, err = run(capsys, ["show", str(bad)])
    assert code == 2 and "recv_wait_ms must hold" in err


# ------------------------------------------------------------------ long rows


def test_long_rows_print_as_a_summary_by_default(capsys):
    code, summary, _ = run(capsys, PLAN + ["-m", "96"])
    assert code == 0
    rows = stage_rows(summary)
    assert len(rows) == 8 and max(map(len, summary.splitlines())) <= 250
    code, data, _ = run(capsys, PLAN + ["-m", "96", "--json"])
    freqs = json.loads(data)["plan"]["frequencies"]
    assert len(freqs[0]) == 192  # --json keeps every unit
    for s, row in enumerate(rows):  # the runs expand to the plan's clocks, unit by unit
        runs = row.split(" | ")[1].split()
        expanded = [int(f) for run_ in runs for f in [run_.split("x")[0]] * int(run_.split("x")[1])]
        assert expanded == [f for _, f in freqs[s]]
    code, full, _ = run(capsys, PLAN + ["-m", "96", "--rows", "full"])
    assert code == 0 and max(map(len, stage_rows(full))) > 2000 and "[B95 1740" in full


def test_alternating_clocks_summarise_as_counts(capsys):
    code, out, _ = run(capsys, ["plan", "--profile", "a40/bloom-176b", "-m", "96", "--type", "optimal"])
    assert code == 0
    rows = stage_rows(out)
    assert max(map(len, rows)) <= 250 and "MHz:units" in out
    code, data, _ = run(capsys, ["plan", "--profile", "a40/bloom-176b", "-m", "96", "--type", "optimal", "--json"])
    freqs = json.loads(data)["plan"]["frequencies"]
    for s, row in enumerate(rows):
        counts = dict(map(int, cell.split(":")) for cell in row.split(" | ")[1].split())
        assert sum(counts.values()) == 192 and counts == {f: [c for _, c in freqs[s]].count(f) for f in counts}


def test_readme_sized_rows_stay_in_full(capsys):
    code, out, _ = run(capsys, PLAN + ["--microbatches", "12"])
    assert code == 0
    rows = stage_rows(out)
    assert rows[0].startswith("Stage 0 | [F0 1740 0.0]  F1 1140 0.0") and max(map(len, rows)) <= ROW_LIMIT_CHARS
    code, summary, _ = run(capsys, PLAN + ["--microbatches", "12", "--rows", "summary"])
    assert code == 0 and "Stage 7 | 1740x24 |" in summary


def test_simulate_rows_follow_rows_too(capsys):
    argv = ["simulate", "--profile", "a40/gpt3-175b", "-m", "96"]
    code, out, _ = run(capsys, argv)
    assert code == 0 and "Stage 0 | 1740x192 |" in out and max(map(len, stage_rows(out))) <= 250
    code, out, _ = run(capsys, argv + ["--rows", "full"])
    assert code == 0 and max(map(len, stage_rows(out))) > 2000


@pytest.mark.parametrize("argv", [
    [*PLAN, "-m", "12", "--type", "envelope", "--scheduling", "ours", "--extra-warmup", "9,9,9,9,9,9,9,9"],
    [*PLAN, "-m", "12", "--type", "optimal", "--scheduling", "ours", "--extra-warmup", "1,0,3,0,0,0,0,0"],
    ["frontier", "--profile", "a40/gpt3-175b", "-m", "12", "--points", "3", "--extra-warmup", "9,9,9,9,9,9,9,9"],
], ids=["plan-envelope", "plan-optimal", "frontier"])
def test_plan_and_frontier_note_the_clamp_their_planner_ran(capsys, monkeypatch, argv):
    """Issue 38: the note is the planner's own clamp (PlanResult/Frontier.warmup_clamp); the CLI does not clamp
    --extra-warmup a second time to explain it."""
    import megatron_envpipe.apps.cli.common as common
    import megatron_envpipe.core.schedule as schedule
    import megatron_envpipe.planning.envpipe as envpipe_planner
    import megatron_envpipe.planning.optimal.entry as entry

    callers = []  # the module of each call

    def counting(*args, **kwargs):
        callers.append(sys._getframe(1).f_globals["__name__"])
        return real(*args, **kwargs)

    real = schedule.clamp_extra_warmup_explained
    for module in (schedule, common, envpipe_planner, entry):  # wherever the name is (or was) looked up
        monkeypatch.setattr(module, "clamp_extra_warmup_explained", counting, raising=False)
    code, _, err = run(capsys, argv)
    assert code == 0, err
    assert err.count("note: --extra-warmup") == 1 and " runs as " in err, err
    # Optimal plans clamp once for the LP's schedule and once for EnvPipe's rival plan; the CLI never.
    assert callers and not [c for c in callers if c.startswith("megatron_envpipe.apps")], callers
