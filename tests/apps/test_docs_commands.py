"""Every command in README.md and docs/*.md runs in a test.

Commands are the lines of ```bash blocks (a trailing `\\` continues a line, `  # ...` is a comment):

* `envpipe ...` lines run here, through the CLI's `main`, in a temporary folder (state and cache
  folders pointed there too, so nothing on the machine changes); `envpipe demo` is CI's main job
  (.ci/run runs it, see MAPPED);
* ```python blocks are executed here;
* the SLURM and torchrun scripts' lines (`VAR=... sbatch examples/slurm/...sbatch`,
  `VAR=... bash examples/torchrun_single_node.sh`) run here as dry runs of their shared body
  (`ENVPIPE_DRY_RUN=1`: the torchrun command is printed, not run), which must carry the line's knobs;
* `python3 bench/X.py ...` lines (benchmarks take minutes, so their figures are quoted, not rerun):
  here the script's `--help` runs and must list every flag the line uses;
* every other command is in MAPPED, command -> the file that runs it, and that file must contain the
  command's words (its flags, variables, values and script names), so a doc command that drifts from
  what its test runs fails here.
"""

from __future__ import annotations

import os
import re
import runpy
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_envpipe.apps.cli import main
from megatron_envpipe.config import add_envpipe_args

REPO = Path(__file__).resolve().parents[2]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]

# Commands that a test elsewhere (or CI's own script) runs: command as the doc writes it -> that file.
MAPPED = {
    "bash install.sh": ".ci/run",
    "mkdir -p logs": "examples/slurm/pretrain_gpt_envpipe.sbatch",  # its header: SLURM opens logs/ before it runs
    "envpipe demo": ".ci/run",
    "python3 -m pytest -q -rs tests": ".ci/run",
    "python3 -m pytest -q --fast": "tests/test_tiering.py",  # it runs --fast on a sample; docs/testing.md
    "bash bench/gpu_check.sh --out out/gpu-check": "tests/apps/test_gpu_check_runner.py",
    "torchrun --nproc-per-node 4 examples/train_tiny_gpt.py --pipeline-model-parallel-size 4 --device cpu "
    "--train-iters 40 --envpipe-type optimal --envpipe-scheduling ours --envpipe-gpu simulated:a40/gpt3-175b "
    "--envpipe-sim-unit-scale 0.15 --envpipe-sim-dynamics realistic": "tests/megatron/test_fast_gpu_log.py",
    "ENVPIPE_EXAMPLE=tiny-cpu GPUS_PER_NODE=4 sbatch --nodes=1 --gpus-per-node=0 "
    "examples/slurm/pretrain_gpt_envpipe.sbatch": "tests/slurm/test_slurm_job.py",
    "torchrun --nproc-per-node 4 examples/train_tiny_gpt.py --pipeline-model-parallel-size 4 "
    "--envpipe-type envelope --envpipe-scheduling ours --envpipe-reconfig balanced --device cpu --train-iters 3":
        "tests/apps/test_example_tiny_gpt.py",
    "torchrun --nproc-per-node 4 examples/train_tiny_gpt.py --pipeline-model-parallel-size 4 "
    "--virtual-pipeline-model-parallel-size 2 --device cpu --train-iters 3 "
    "--envpipe-type optimal --envpipe-scheduling interleaved": "tests/apps/test_example_tiny_gpt.py",
    "torchrun --nproc-per-node 4 examples/train_tiny_gpt.py --pipeline-model-parallel-size 4 --device cpu "
    "--envpipe-type envelope --envpipe-scheduling ours --envpipe-reconfig balanced "
    "--envpipe-gpu simulated:a40/gpt3-175b --train-iters 30 --envpipe-log-interval 5":
        "tests/apps/test_example_tiny_gpt.py",
    "torchrun --nproc-per-node 4 examples/train_tiny_gpt.py --pipeline-model-parallel-size 4 --device cpu "
    "--variable-seq-lengths --train-iters 20 --no-envpipe": "tests/apps/test_tiny_variable_lengths.py",
    "torchrun --nproc-per-node 4 examples/train_tiny_gpt.py --pipeline-model-parallel-size 4 --device cpu "
    "--variable-seq-lengths --train-iters 50 --envpipe-type optimal --envpipe-scheduling ours "
    "--envpipe-gpu simulated:a40/gpt3-175b": "tests/megatron/test_readme_examples.py",  # read from the README
    "torchrun --nproc-per-node 4 examples/train_tiny_gpt.py --pipeline-model-parallel-size 4 "
    "--virtual-pipeline-model-parallel-size 2 --device cpu --train-iters 6 --envpipe-type optimal "
    "--envpipe-scheduling interleaved --envpipe-deadline-from 1f1b --envpipe-gpu simulated:a40/gpt3-175b":
        "tests/megatron/test_deadline_from_acceptance.py",
    "torchrun --nproc-per-node 4 examples/train_tiny_gpt.py --pipeline-model-parallel-size 2 --device cpu "
    "--train-iters 40 --envpipe-type optimal --envpipe-scheduling ours --envpipe-gpu simulated:a40/gpt3-175b "
    "--envpipe-sim-straggler 1:1.15": "tests/megatron/test_stragglers_acceptance.py",
}

# Tests that read their torchrun command out of README.md (readme_example("<a word of it>")) and run it as written.
READS_THE_DOC = {"tests/megatron/test_readme_examples.py"}

# The test that runs the Megatron-LM entry's command as a doc writes it (it reads the command from README.md).
MEGATRON_LM_TEST = "tests/megatron/test_megatron_lm_entry.py"

# Words of a command that say nothing about what runs (launchers, privilege, shell).
_NEUTRAL = {"sudo", "-E", "python3", "python", "bash", "sbatch", "torchrun", "-m", "pytest", "-q", "-rs"}


def doc_commands(path: Path) -> list[str]:
    """The command lines of the ```bash blocks of one doc, continuations joined, comments dropped."""
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", path.read_text(), flags=re.S):
        for line in re.sub(r"\\\n\s*", " ", block).splitlines():
            line = " ".join(re.split(r"\s+#\s", " " + line.strip())[0].split())
            if line:
                commands.append(line)
    return commands


def all_commands() -> list[tuple[Path, str]]:
    return [(path, command) for path in DOCS for command in doc_commands(path)]


def python_blocks() -> list[tuple[Path, int, str]]:
    return [(path, i, block) for path in DOCS
            for i, block in enumerate(re.findall(r"```python\n(.*?)```", path.read_text(), flags=re.S))]


def kind(command: str) -> str:
    if command in MAPPED:
        return "mapped"
    if command.startswith(("torchrun ", "envpipe torchrun ")) and "-m megatron_envpipe.megatron.pretrain_gpt" in command:
        return "megatron-lm"  # needs Megatron-LM's own training stack: MEGATRON_LM_TEST reads it from the doc
    if command.startswith("envpipe "):
        return "envpipe"
    if re.match(r"(sudo -E )?python3 bench/\w+\.py\b", command):
        return "bench"
    if re.fullmatch(r"(\w+=\S+ )+(sbatch( --[\w-]+=\S+)* examples/slurm/pretrain_gpt_envpipe\.sbatch"
                    r"|bash examples/torchrun_single_node\.sh)", command):
        return "script"
    return "unknown"


def words(command: str) -> list[str]:
    """What a test running this command must say: flags, variables and values, script names."""
    out = []
    for token in shlex.split(command):
        for part in token.split("=", 1) if re.match(r"-{0,2}[\w-]+=", token) else [token]:
            if part in _NEUTRAL or "$" in part or part.isdigit() or not part:
                continue
            out.append(Path(part).name if "/" in part and not part.startswith("-") and ":" not in part else part)
    return out


def test_docs_have_commands():
    kinds = [kind(c) for _, c in all_commands()]
    assert kinds.count("envpipe") >= 15 and kinds.count("bench") >= 8, kinds
    assert kinds.count("mapped") >= 6 and kinds.count("script") >= 4, kinds


def test_every_doc_command_is_run_or_mapped():
    unknown = [f"{path.relative_to(REPO)}: {command}" for path, command in all_commands() if kind(command) == "unknown"]
    assert not unknown, ("doc commands no test runs (run them in tests/apps/test_docs_commands.py, "
                         "or map them to the test that runs them in MAPPED):\n" + "\n".join(unknown))


def test_megatron_lm_commands_are_read_by_their_test():
    for path, command in all_commands():
        if kind(command) == "megatron-lm":
            test = REPO / MEGATRON_LM_TEST
            assert test.is_file() and path.name in test.read_text(), \
                f"{path.name}: `{command}` must be run by {MEGATRON_LM_TEST}, reading it from {path.name}"


def test_commands_outside_bash_blocks_are_not_copyable():
    """A command shown in a ```text block escapes the tests above: only a template (with a `<...>`
    placeholder to fill in) may stand there."""
    loose = []
    for path in DOCS:
        for block in re.findall(r"```text\n(.*?)```", path.read_text(), flags=re.S):
            for line in re.sub(r"\\\n\s*", " ", block).splitlines():
                if re.match(r"(sudo |[A-Z_]+=\S+ )*(torchrun|sbatch|envpipe|python3?|bash) ", line) and "<" not in line:
                    loose.append(f"{path.name}: {line}")
    assert not loose, "commands in ```text blocks (make them ```bash, so a test runs them):\n" + "\n".join(loose)


def test_every_mapping_is_used_and_its_test_says_the_command():
    used = {command for _, command in all_commands()}
    stale = [command for command in MAPPED if command not in used]
    assert not stale, f"MAPPED names commands no doc has any more: {stale}"
    drifted = []
    for command, target in MAPPED.items():
        text = (REPO / target).read_text()
        # (a command may run the mapped file itself: `python3 -m pytest tests/x.py`)
        missing = [w for w in words(command) if w not in text and w != Path(target).name]
        if target in READS_THE_DOC and any(f'readme_example("{w}")' in text for w in words(command)):
            missing = []  # it runs the command read out of the README, found by one of its words: no drift
        if missing:
            drifted.append(f"{target} does not run the doc command `{command}`: it never says {missing}")
    assert not drifted, "\n".join(drifted)


@pytest.mark.parametrize("path", [p for p in DOCS if any(kind(c) == "envpipe" for c in doc_commands(p))],
                         ids=lambda p: p.name)
def test_envpipe_commands_run(path, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)  # out/plan.json etc. land here; a page's commands run in its order
    monkeypatch.setenv("ENVPIPE_STATE_DIR", str(tmp_path / "state"))  # reset-clocks reads only this
    monkeypatch.setenv("MEGATRON_ENVPIPE_CACHE", str(tmp_path / "cache"))
    (tmp_path / "state").mkdir(mode=0o700)
    for command in doc_commands(path):
        if kind(command) != "envpipe":
            continue
        code = main(shlex.split(command)[1:])
        err = capsys.readouterr().err
        assert code == 0, f"{path.name}: `{command}` exited {code}\n{err}"


@pytest.mark.cli  # a bash dry run: it prints the torchrun command, starts none
@pytest.mark.parametrize("command", [c for _, c in all_commands() if kind(c) == "script"])
def test_script_commands_carry_their_knobs(command, tmp_path):
    """The line's variables, given to the scripts' shared body in a dry run, reach the torchrun command."""
    knobs = dict(token.split("=", 1) for token in shlex.split(command) if re.fullmatch(r"[A-Z_]+=\S*", token))
    (tmp_path / "pretrain_gpt.py").write_text("")  # a stand-in Megatron-LM checkout
    knobs = {k: str(tmp_path) if k == "MEGATRON_LM" else v for k, v in knobs.items()}
    env = {k: v for k, v in os.environ.items() if not k.startswith("ENVPIPE_") and k != "MEGATRON_LM"}
    proc = subprocess.run(["bash", str(REPO / "examples" / "torchrun_single_node.sh")], capture_output=True,
                          text=True, env={**env, **knobs, "ENVPIPE_DRY_RUN": "1"}, cwd=tmp_path, timeout=60)
    assert proc.returncode == 0, f"`{command}` (dry run): {proc.stderr[-2000:]}"
    ran = proc.stdout.strip().splitlines()[-1]
    assert "torch.distributed.run" in ran, ran
    if knobs.get("ENVPIPE_EXAMPLE") == "tiny-cpu":
        assert "-m megatron_envpipe.apps.train_tiny_gpt" in ran, ran
    else:
        assert str(tmp_path / "pretrain_gpt.py") in ran or "megatron_envpipe.megatron.pretrain_gpt" in ran, ran
    if knobs.get("ENVPIPE_DISABLE") == "1":
        assert "--envpipe-" not in ran, ran
    for knob, flag in (("ENVPIPE_TYPE", "--envpipe-type"), ("ENVPIPE_SCHEDULING", "--envpipe-scheduling")):
        if knob in knobs:
            assert f"{flag} {knobs[knob]}" in ran, (knob, ran)
    if "GPUS_PER_NODE" in knobs:
        assert f"--nproc-per-node {knobs['GPUS_PER_NODE']}" in ran, ran


@pytest.mark.parametrize("script", sorted({re.search(r"bench/\w+\.py", c).group(0)
                                           for _, c in all_commands() if kind(c) == "bench"}))
def test_bench_commands_take_the_flags_the_docs_give(script, monkeypatch, capsys):
    flags = {f for _, c in all_commands() if script in c for f in re.findall(r"(?<!\S)--[\w-]+", c)}
    # `python3 bench/x.py --help` in this process (a fresh interpreter per script cost ~0.5 CPU-s each): the
    # script runs as __main__ with its folder first on sys.path, as python puts it; argparse exits 0.
    monkeypatch.chdir(REPO)
    monkeypatch.syspath_prepend(str((REPO / script).parent))
    monkeypatch.setattr(sys, "argv", [str(REPO / script), "--help"])
    with pytest.raises(SystemExit) as exit_:
        runpy.run_path(str(REPO / script), run_name="__main__")
    out, err = capsys.readouterr()
    assert exit_.value.code in (0, None), err[-2000:]
    missing = sorted(f for f in flags if not re.search(rf"(?<![\w-]){re.escape(f)}(?![\w-])", out))
    assert not missing, f"the docs run {script} with {missing}, which its --help does not list"


@pytest.mark.parametrize("index", range(len(python_blocks())),
                         ids=lambda i: f"{python_blocks()[i][0].name}-{python_blocks()[i][1]}")
def test_python_blocks_run(index, capsys):
    path, number, block = python_blocks()[index]
    if any(word in block for word in ("megatron.core", "import torch", ".install(")):
        pytest.importorskip("torch", reason="this example trains with torch + megatron-core")
        pytest.importorskip("megatron.core", reason="this example trains with torch + megatron-core")
    exec(compile(block, f"{path.name} python block {number}", "exec"), {})
    assert capsys.readouterr().out


def test_flag_reference_names_every_training_flag():
    import argparse

    parser = argparse.ArgumentParser()
    add_envpipe_args(parser)
    flags = {s for action in parser._actions for s in action.option_strings if s.startswith("--envpipe-")}
    assert len(flags) >= 30
    text = (REPO / "docs" / "flags.md").read_text()
    missing = sorted(f for f in flags if not re.search(rf"`{re.escape(f)}(?![\w-])", text))
    assert not missing, f"docs/flags.md does not describe {missing}"


def test_links_between_docs_resolve():
    broken = []
    for path in DOCS:
        for target in re.findall(r"\]\(([^)\s]+)\)", path.read_text()):
            if re.match(r"[a-z]+:", target):
                continue
            file, _, anchor = target.partition("#")
            dest = (path.parent / file).resolve() if file else path
            if not dest.exists():
                broken.append(f"{path.relative_to(REPO)}: {target}")
            elif anchor and dest.suffix == ".md":
                slugs = {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-")
                         for h in re.findall(r"^#+ (.*)$", dest.read_text(), flags=re.M)}
                if anchor not in slugs:
                    broken.append(f"{path.relative_to(REPO)}: {target} (no such heading)")
    assert not broken, "broken links:\n" + "\n".join(broken)


def test_docs_index_lists_every_page():
    index = (REPO / "docs" / "README.md").read_text()
    missing = [p.name for p in DOCS[1:] if p.name != "README.md" and f"({p.name})" not in index]
    assert not missing, f"docs/README.md does not list {missing}"
