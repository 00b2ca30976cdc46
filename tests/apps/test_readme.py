"""README.md: its commands run, its sample outputs and hero caption are current, it fits a first read."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

from megatron_envpipe.apps.cli import main

README = Path(__file__).resolve().parents[2] / "README.md"


def blocks(lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", README.read_text(), flags=re.S)


def envpipe_lines() -> list[str]:
    lines = []
    for block in blocks("bash"):
        for line in block.splitlines():
            line = line.split("  #")[0].strip()
            # `envpipe demo` (two training runs, ~1-2 min) is CI's main job: .ci/run runs it; `envpipe torchrun`
            # launches Megatron-LM on GPUs (tests/megatron/test_megatron_lm_entry.py runs it).
            if line.startswith("envpipe ") and not line.startswith(("envpipe demo", "envpipe torchrun")):
                lines.append(line)
    return lines


def test_readme_has_commands():
    # The README keeps one offline command; the rest live in docs/ (tests/apps/test_docs_commands.py).
    assert any(line.startswith("envpipe plan ") for line in envpipe_lines())


def test_readme_fits_a_first_read():
    assert len(README.read_text().splitlines()) <= 250, "README.md is for users: move detail to docs/"


def test_readme_envpipe_commands_run(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)  # out/plan.json etc. land here; order matters (plan before show)
    for line in envpipe_lines():
        code = main(shlex.split(line)[1:])
        err = capsys.readouterr().err
        assert code == 0, f"README command failed: {line}\n{err}"
    assert (tmp_path / "out" / "plan.json").is_file() and (tmp_path / "out" / "timeline.png").is_file()


def test_readme_main_job_numbers_are_current(capsys):
    main(["plan", "--profile", "a40/gpt3-175b", "--microbatches", "12"])
    out = capsys.readouterr().out
    text = README.read_text()
    for line in out.splitlines():
        if line.startswith(("baseline ", "plan ")):
            assert line.strip() in text, f"README's sample output is stale: {line}"
    saving = re.search(r"energy saving ([\d.]+) %", out).group(1)
    assert f"energy saving {saving} %" in text


def test_hero_picture_caption_is_what_its_command_draws_now(tmp_path, monkeypatch, capsys):
    """The caption names the command that draws the picture and quotes its figures: run it into tmp and
    compare, so neither the caption nor (redrawn by that command) the picture can go stale."""
    text = README.read_text()
    image = re.search(r"!\[[^]]*\]\((docs/[\w.-]+\.png)\)", text).group(1)
    caption = text[text.index(image):].split("\n\n", 2)[1]
    command = re.search(r"`(envpipe plan [^`]*)`", caption).group(1)
    args = shlex.split(command)[1:]
    assert args[args.index("--plot") + 1] == image, f"the caption's command draws {args[args.index('--plot') + 1]}"
    assert (README.parent / image).is_file()
    monkeypatch.chdir(tmp_path)
    args[args.index("--plot") + 1] = str(tmp_path / "hero.png")
    assert main(args) == 0
    assert (tmp_path / "hero.png").stat().st_size > 10_000
    capsys.readouterr()
    assert main([*[a for a in args if a != str(tmp_path / "hero.png") and a != "--plot"], "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    clocks = [f for stage in plan["plan"]["frequencies"] for _, f in stage]
    figures = {
        "f_max": f"{plan['f_max_mhz']} MHz", "lowest clock": f"down to {min(clocks)} MHz",
        "iteration time": f"{plan['plan']['iteration_time_s']:.4f} s",
        "saving": f"{100 * plan['energy_saving']:.2f} % less energy",
    }
    stale = {what: shown for what, shown in figures.items() if shown not in " ".join(caption.split())}
    assert not stale, f"the hero caption does not say what its command gives now: {stale}"
    assert abs(plan["slowdown"]) < 1e-9 and "Both iterations take" in caption


def test_readme_demo_sample_adds_up():
    """The demo's sample output: same iterations of both runs (median of N / N), saving = 1 - E_env/E_base."""
    sample = re.search(r"```text\n( +iteration time +energy / iteration.*?)```", README.read_text(), re.S).group(1)
    counts = re.search(r"median of (\d+) / (\d+) iterations", sample).groups()
    assert counts[0] == counts[1], "the demo compares the same iterations of both runs"
    (base_t, base_e), (env_t, env_e) = [map(float, m) for m in
                                        re.findall(r"^(?:1F1B @ max|EnvPipe) +([\d.]+) s +([\d.]+) J$", sample, re.M)]
    saving = re.search(r"energy saving ([\d.]+)%, iteration time ([+-][\d.]+)%", sample).groups()
    assert f"{100 * (1 - env_e / base_e):.1f}" == saving[0]
    assert f"{100 * (env_t / base_t - 1):+.1f}" == saving[1]
    # The header is the one demo.py prints.
    demo = (README.parent / "megatron_envpipe" / "apps" / "demo.py").read_text()
    assert "median of {bn} / {en} iterations" in demo and "energy saving {100 * (1 - ee / be):.1f}%" in demo


def test_readme_main_job_is_what_ci_runs():
    ci = (README.parent / ".ci" / "run").read_text()
    assert "envpipe demo" in README.read_text() and "envpipe demo" in ci
    # .ci/run calls exactly the test command the README documents
    command = re.search(r"^(python3 -m pytest .*?tests)\s", README.read_text(), re.M).group(1)
    assert "bash install.sh" in ci and command in ci, command


def _saving_and_peak(profile: str, m: int, capsys, *extra: str) -> tuple[float, int]:
    assert main(["plan", "--profile", profile, "--microbatches", str(m), "--json", *extra]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["slowdown"] < 1e-3  # every figure is at zero slowdown: never slower than 1F1B at f_max
    return 100 * plan["energy_saving"], plan["plan"]["peak_inflight_activations"][0]


def test_readme_cost_paragraph_is_what_the_planner_gives(capsys):
    """The first paragraph's saving with unlimited memory, its first-stage activations, and the saving at
    1F1B's memory (`--max-inflight 8,7,6,5,4,3,2,1`), over the shipped profiles and M = 12..96."""
    text = " ".join(README.read_text().split())
    one_f_one_b = ["--max-inflight", "8,7,6,5,4,3,2,1"]
    unlimited, peaks, tight, tight_opt = [], [], {}, []
    for profile in ("a40/gpt3-175b", "a40/bloom-176b"):
        for m in (12, 24, 48, 96):
            saving, peak = _saving_and_peak(profile, m, capsys)
            unlimited.append(saving)
            peaks.append(peak)
            tight.setdefault(profile, []).append(_saving_and_peak(profile, m, capsys, *one_f_one_b)[0])
            tight_opt.append(_saving_and_peak(profile, m, capsys, *one_f_one_b, "--type", "optimal")[0])
    def span(xs: list[float], digits: int) -> str:
        return f"{min(xs):.{digits}f}-{max(xs):.{digits}f} %"
    expected = [f"**{span(unlimited, 0)}** of GPU energy at zero slowdown",
                f"hold **{min(peaks)}-{max(peaks)} micro-batch activations where 1F1B holds 8**",
                f"it saves **{span(tight['a40/gpt3-175b'] + tight['a40/bloom-176b'], 0)}**",
                f"GPT-3 {span(tight['a40/gpt3-175b'], 1)[:-2]} %, Bloom {span(tight['a40/bloom-176b'], 1)}",
                f"`--type optimal` {span(tight_opt, 1)}"]
    stale = [phrase for phrase in expected if phrase not in text]
    assert not stale, f"README's cost paragraph is stale; the planner now gives: {stale}"
