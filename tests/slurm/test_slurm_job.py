"""The launch scripts, and a real SLURM job on a one-node cluster on localhost.

The tests never change the machine: they use a SLURM cluster that is already up
(`sinfo` answers and a node is idle) and otherwise skip, naming the command that
sets one up, ``bash tests/slurm/setup_slurm.sh`` (as root: it installs
slurm-wlm, munge and shellcheck and starts munged, slurmctld and slurmd; .ci/run
runs it). With ``ENVPIPE_CI_SLURM=1`` (.ci/run exports it once that set-up
succeeded) a missing cluster or shellcheck is a failure, not a skip.

The job is the production script, ``examples/slurm/pretrain_gpt_envpipe.sbatch``,
submitted exactly as the README's ``tiny-cpu`` line writes it (plus the test's
own --job-name/--time/--output/--chdir): one node, one srun task, torchrun with
4 gloo ranks = 4 pipeline stages of the tiny GPT under EnvPipe's schedule. It
must complete, say on every rank that it runs without clock control, reset clocks on the node, and train bit
for bit like stock Megatron-core run through the single-node torchrun script
(``examples/torchrun_single_node.sh``, same body) with ``ENVPIPE_DISABLE=1``:
EnvPipe never installed, Megatron's own 1F1B on every rank (each run's losses
file names the function that ran). A second job is cancelled mid-training: each
node's runner must still run ``envpipe reset-clocks --force`` and leave no
process behind.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("torch", reason="needs torch and megatron-core: pip install -e '.[megatron]' (install.sh does)")
pytest.importorskip("megatron.core", reason="needs torch and megatron-core: pip install -e '.[megatron]' (install.sh does)")

from megatron_envpipe.megatron.localhost import free_port

REPO = Path(__file__).resolve().parents[2]
SBATCH = REPO / "examples" / "slurm" / "pretrain_gpt_envpipe.sbatch"
COMMON = REPO / "examples" / "slurm" / "envpipe_common.sh"
SINGLE_NODE = REPO / "examples" / "torchrun_single_node.sh"
SETUP = REPO / "tests" / "slurm" / "setup_slurm.sh"
SCRIPTS = (SBATCH, COMMON, SINGLE_NODE, SETUP)
README = REPO / "README.md"
SET_UP = f"bash {SETUP.relative_to(REPO)}"  # the one command that sets SLURM up here (as root); .ci/run runs it
CI_SLURM = os.environ.get("ENVPIPE_CI_SLURM") == "1"  # .ci/run set SLURM up: its absence is a failure

NPROC = 4
ITERS = 3
MEGATRON_1F1B = "megatron.core.pipeline_parallel.schedules.forward_backward_pipelining_without_interleaving"
EXECUTOR = "megatron_envpipe.megatron.executor.envpipe_forward_backward"
JOB_TIMEOUT_S = 240
FINAL_STATES = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY",
                "PREEMPTED", "BOOT_FAIL", "DEADLINE"}


# --------------------------------------------------------------------------- the scripts, without SLURM


def test_scripts_are_valid_bash_and_shellcheck_clean() -> None:
    for script in SCRIPTS:
        proc = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
        assert proc.returncode == 0, f"bash -n {script}: {proc.stderr}"
    if shutil.which("shellcheck") is None:
        why = f"shellcheck is not installed (`{SET_UP}` as root installs it): the scripts were checked with bash -n only"
        if CI_SLURM:
            pytest.fail(f"ENVPIPE_CI_SLURM=1 but {why}")
        pytest.skip(why)
    proc = subprocess.run(["shellcheck", "-x", *map(str, SCRIPTS)], capture_output=True, text=True, cwd=REPO)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def _envpipe_actions() -> list[argparse.Action]:
    from megatron_envpipe.config import add_envpipe_args

    parser = add_envpipe_args(argparse.ArgumentParser())
    return [a for a in parser._actions if a.option_strings and a.option_strings[0].startswith("--envpipe-")]


def _knob(action: argparse.Action) -> str:
    return "ENVPIPE_" + action.option_strings[0][len("--envpipe-"):].upper().replace("-", "_")


def _sample_value(action: argparse.Action) -> tuple[str, object]:
    """A value to put in the knob, and what the parsed flag must then hold."""
    if action.nargs == 0:  # --envpipe-verbose
        return "1", True
    if action.choices:
        choice = list(action.choices)[-1]
        return choice, choice
    if action.dest == "envpipe_extra_warmup":
        return "3,2,1,0", [3, 2, 1, 0]
    if action.type is int:
        return "7", 7
    if action.type is float:
        return "0.5", 0.5
    if callable(action.type):  # a parsing function (e.g. a fraction): what it makes of a small number
        for text in ("0.05", "7", "2,256", "1:1.15"):
            try:
                return text, action.type(text)
            except (ValueError, TypeError, argparse.ArgumentTypeError):
                continue
    return f"value-of-{action.dest}", f"value-of-{action.dest}"


def _dry_run(env_overrides: dict[str, str], *extra: str) -> list[str]:
    env = dict(os.environ, ENVPIPE_DRY_RUN="1", ENVPIPE_EXAMPLE="tiny-cpu")
    env.update(env_overrides)
    proc = subprocess.run(["bash", str(SINGLE_NODE), *extra], capture_output=True, text=True, env=env, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return shlex.split(proc.stdout.strip().splitlines()[-1])


def test_every_envpipe_flag_is_a_knob_and_reaches_the_command() -> None:
    """Each --envpipe-X is ENVPIPE_X in the shared body, with a default, and a set
    knob ends up, parsed, in the command torchrun runs."""
    text = COMMON.read_text()
    actions = _envpipe_actions()
    assert len(actions) >= 20
    for action in actions:
        assert re.search(rf"^{_knob(action)}=\${{{_knob(action)}:-[^}}]*}}", text, re.M), \
            f"{action.option_strings[0]}: no `{_knob(action)}=${{{_knob(action)}:-default}}` in {COMMON.name}"

    from megatron_envpipe.apps.train_tiny_gpt import parse_args

    samples = {_knob(a): _sample_value(a) for a in actions}
    cmd = _dry_run({knob: value for knob, (value, _) in samples.items()}, "--train-iters", "5")
    assert cmd[1:4] == ["-m", "torch.distributed.run", "--nproc-per-node"]
    module = cmd.index("-m", 2)
    assert cmd[module + 1] == "megatron_envpipe.apps.train_tiny_gpt"
    args = parse_args(cmd[module + 2:])
    for action in actions:
        assert getattr(args, action.dest) == samples[_knob(action)][1], action.option_strings[0]
    assert args.train_iters == 5  # extra arguments come last and win
    assert args.pipeline_model_parallel_size == NPROC and args.device == "cpu"


def test_defaults_are_envpipe_with_the_package_constants() -> None:
    from megatron_envpipe.apps.train_tiny_gpt import parse_args
    from megatron_envpipe.config import EnvPipeConfig, EnvPipeConfigError

    cmd = _dry_run({_knob(a): "" for a in _envpipe_actions()})
    args = parse_args(cmd[cmd.index("-m", 2) + 2:])
    assert (args.envpipe_plan_type, args.envpipe_scheduling, args.envpipe_reconfig) == ("envelope", "ours", "balanced")
    defaults = argparse.Namespace(**{a.dest: a.default for a in _envpipe_actions()})
    for action in _envpipe_actions():
        if action.dest in ("envpipe_plan_type", "envpipe_scheduling", "envpipe_reconfig", "envpipe_gpu"):
            continue
        assert getattr(args, action.dest) == getattr(defaults, action.dest), action.option_strings[0]
    assert args.envpipe_gpu == "auto"
    try:
        EnvPipeConfig.from_args(args).validate_with_megatron_args(args)
    except EnvPipeConfigError as exc:  # pragma: no cover - a failure message
        pytest.fail(f"the scripts' defaults are not a valid EnvPipe config: {exc}")


def test_envpipe_disable_runs_stock_megatron(tmp_path: Path) -> None:
    """ENVPIPE_DISABLE=1: the tiny GPT gets --no-envpipe, Megatron-LM runs its own pretrain_gpt.py;
    no --envpipe-* flag either way, whatever the ENVPIPE_<NAME> knobs say."""
    from megatron_envpipe.apps.train_tiny_gpt import parse_args

    knobs = {"ENVPIPE_DISABLE": "1", "ENVPIPE_TYPE": "optimal", "ENVPIPE_VERBOSE": "1"}
    cmd = _dry_run(knobs)
    module = cmd.index("-m", 2)
    assert cmd[module + 1] == "megatron_envpipe.apps.train_tiny_gpt"
    assert not [a for a in cmd if a.startswith("--envpipe-")]
    args = parse_args(cmd[module + 2:])
    assert args.no_envpipe and args.pipeline_model_parallel_size == NPROC
    (tmp_path / "pretrain_gpt.py").write_text("")
    cmd = _dry_run({**knobs, "ENVPIPE_EXAMPLE": "megatron-lm", "MEGATRON_LM": str(tmp_path)})
    script = cmd.index(str(tmp_path / "pretrain_gpt.py"))
    assert cmd[1:3] == ["-m", "torch.distributed.run"] and "-m" not in cmd[3:script]
    assert not [a for a in cmd if a.startswith("--envpipe-")] and "--pipeline-model-parallel-size" in cmd
    env = dict(os.environ, ENVPIPE_DRY_RUN="1", ENVPIPE_EXAMPLE="tiny-cpu", ENVPIPE_DISABLE="maybe")
    proc = subprocess.run(["bash", str(SINGLE_NODE)], capture_output=True, text=True, env=env, timeout=60)
    assert proc.returncode == 2 and "ENVPIPE_DISABLE=maybe: use 1" in proc.stderr


def test_megatron_lm_variant_needs_a_checkout_and_composes_megatron_flags(tmp_path: Path) -> None:
    env = dict(os.environ, ENVPIPE_DRY_RUN="1")
    env.pop("MEGATRON_LM", None)
    env.pop("ENVPIPE_EXAMPLE", None)
    proc = subprocess.run(["bash", str(SINGLE_NODE)], capture_output=True, text=True, env=env, timeout=60)
    assert proc.returncode != 0 and "set MEGATRON_LM to a Megatron-LM checkout" in proc.stderr
    (tmp_path / "pretrain_gpt.py").write_text("")
    cmd = _dry_run({"ENVPIPE_EXAMPLE": "megatron-lm", "MEGATRON_LM": str(tmp_path), "TP": "2", "PP": "4"})
    module = cmd.index("-m", 2)
    assert cmd[module + 1] == "megatron_envpipe.megatron.pretrain_gpt"
    flags = cmd[module + 2:]
    joined = " ".join(cmd)
    for pair in ("--nproc-per-node 8", "--tensor-model-parallel-size 2", "--pipeline-model-parallel-size 4",
                 "--envpipe-type envelope --envpipe-scheduling ours --envpipe-reconfig balanced"):
        assert pair in joined, pair
    assert "--mock-data" in flags and "--bf16" in flags


# --------------------------------------------------------------------------- a real SLURM cluster


def readme_tiny_cpu_line() -> str:
    """The README's SLURM tiny-cpu command: the one line of its ```bash blocks with ENVPIPE_EXAMPLE=tiny-cpu and sbatch."""
    lines = []
    for block in re.findall(r"```bash\n(.*?)```", README.read_text(), flags=re.S):
        for line in re.sub(r"\\\n\s*", " ", block).splitlines():
            line = re.split(r"\s+#\s", " " + line.strip())[0].strip()  # a trailing `  # comment` is no part of it
            if "ENVPIPE_EXAMPLE=tiny-cpu" in line and re.search(r"(^|\s)sbatch\s", line):
                lines.append(" ".join(line.split()))
    assert len(lines) == 1, (f"{README.name}: expected one ```bash line with ENVPIPE_EXAMPLE=tiny-cpu and sbatch "
                             f"(the SLURM CPU job this test submits), found {len(lines)}: {lines}")
    return lines[0]


def parse_sbatch_line(line: str) -> tuple[dict[str, str], list[str], str, list[str]]:
    """``A=1 B=2 sbatch --opt ... script.sbatch args`` -> (environment, sbatch options, script, script args)."""
    words = shlex.split(line)
    env = {}
    while words and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=.*", words[0]):
        key, _, value = words.pop(0).partition("=")
        env[key] = value
    assert words and words[0] == "sbatch", f"not an sbatch command: {line}"
    script_at = next((i for i, w in enumerate(words) if w.endswith(".sbatch")), None)
    assert script_at is not None, f"no .sbatch script in: {line}"
    return env, words[1:script_at], words[script_at], words[script_at + 1:]


def sbatch_option(header: str, options: list[str], long: str, short: str | None = None) -> str | None:
    """The value sbatch uses for ``--long``: the last one given on the command line, else the script's #SBATCH."""
    value = None
    for line in header.splitlines():
        m = re.match(rf"#SBATCH\s+--{long}(?:=|\s+)(\S+)", line)
        if m:
            value = m.group(1)
    for i, word in enumerate(options):
        if word.startswith(f"--{long}="):
            value = word.split("=", 1)[1]
        elif word == f"--{long}" or (short and word == short):
            value = options[i + 1]
        elif short and word.startswith(short) and len(word) > len(short):
            value = word[len(short):]
    return value


def test_readme_tiny_cpu_line_fits_a_one_node_cluster() -> None:
    """The README's CPU job runs on one node: the production header asks for 2 nodes of 8 GPUs, which on
    a one-node cluster pends forever, so the README's line must override it (--nodes=1 --gpus-per-node=0)."""
    line = readme_tiny_cpu_line()
    env, options, script, _ = parse_sbatch_line(line)
    assert (REPO / script).resolve() == SBATCH, f"README's tiny-cpu line submits {script}, not {SBATCH.relative_to(REPO)}"
    header = SBATCH.read_text()
    nodes = sbatch_option(header, options, "nodes", "-N")
    assert nodes == "1", (f"README's tiny-cpu line `{line}` asks for {nodes} nodes (the script's header says "
                          f"{sbatch_option(header, [], 'nodes', '-N')}): it pends forever on a one-node cluster; "
                          "add --nodes=1")
    assert sbatch_option(header, options, "gpus-per-node") == "0", f"`{line}`: a CPU job must ask for no GPU"
    assert env.get("ENVPIPE_EXAMPLE") == "tiny-cpu" and env.get("GPUS_PER_NODE") == str(NPROC), line


@pytest.fixture(scope="module")
def slurm_cluster() -> Iterator[None]:
    """A SLURM cluster that is already up, with an idle node; never set up here (tests leave the machine alone)."""
    problem = _cluster_problem()
    if problem is not None:
        if CI_SLURM:
            pytest.fail(f"ENVPIPE_CI_SLURM=1 (.ci/run set SLURM up) but {problem}")
        pytest.skip(f"no SLURM cluster up here ({problem}): `{SET_UP}` as root sets up a one-node cluster on localhost")
    yield


def _cluster_problem() -> str | None:
    """Why no job could run now (None: sinfo answers and some node is idle or partly used)."""
    for cmd in ("sinfo", "sbatch", "scontrol", "squeue", "scancel"):
        if shutil.which(cmd) is None:
            return f"{cmd} is not installed"
    try:
        proc = subprocess.run(["sinfo", "--noheader", "--format", "%T %N"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"sinfo: {exc}"
    if proc.returncode != 0:
        return f"sinfo exited {proc.returncode}: {(proc.stderr or proc.stdout).strip().splitlines()[-1:]}"
    states = [line.split()[0].rstrip("*~#!%$@^-") for line in proc.stdout.splitlines() if line.strip()]
    if not any(state in ("idle", "mixed") for state in states):
        return f"no idle node (sinfo: {', '.join(states) or 'no nodes'})"
    return None


class Jobs:
    """Submits the production sbatch script; scancels whatever is left at the end."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.ids: list[str] = []

    def env(self, **overrides: str) -> dict[str, str]:
        pythonpath = os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])
        path = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
        env = dict(os.environ, PYTHON=sys.executable, PYTHONPATH=pythonpath, PATH=path,
                   ENVPIPE_EXAMPLE="tiny-cpu", GPUS_PER_NODE=str(NPROC), TRAIN_ITERS=str(ITERS),
                   TOKENIZER_CACHE=str(self.tmp / "tokenizer"))
        for key in ("MASTER_ADDR", "MASTER_PORT", "ENVPIPE_STATE_DIR"):
            env.pop(key, None)
        env.update(overrides)
        return env

    def submit(self, name: str, **overrides: str) -> tuple[str, Path]:
        """The README's tiny-cpu line as written (its variables, sbatch options and script), plus the test's own
        options: --parsable for the job id, a job name, a time limit, where the log goes, where it runs."""
        readme_env, options, script, args = parse_sbatch_line(readme_tiny_cpu_line())
        cmd = ["sbatch", *options, "--parsable", f"--job-name={name}", "--time=00:10:00",
               f"--output={self.tmp}/%x-%j.out", f"--chdir={REPO}", script, *args]
        proc = subprocess.run(cmd, capture_output=True, text=True, env=self.env(**{**readme_env, **overrides}),
                              timeout=60, cwd=REPO)
        assert proc.returncode == 0, f"{' '.join(cmd)}: {proc.stdout}{proc.stderr}"
        job_id = proc.stdout.strip().split(";")[0]
        self.ids.append(job_id)
        return job_id, self.tmp / f"{name}-{job_id}.out"

    @staticmethod
    def state(job_id: str) -> tuple[str, str]:
        """(JobState, ExitCode), from scontrol (kept MinJobAge), else sacct."""
        proc = subprocess.run(["scontrol", "-o", "show", "job", job_id], capture_output=True, text=True, timeout=30)
        fields = dict(re.findall(r"(\w+)=(\S*)", proc.stdout))
        if proc.returncode == 0 and "JobState" in fields:
            return fields["JobState"], fields.get("ExitCode", "?")
        proc = subprocess.run(["sacct", "-n", "-X", "-P", "-j", job_id, "-o", "State,ExitCode"],
                              capture_output=True, text=True, timeout=30)
        if proc.returncode == 0 and proc.stdout.strip():
            state, _, code = proc.stdout.strip().splitlines()[0].partition("|")
            return state.split()[0], code
        return "UNKNOWN", "?"

    @staticmethod
    def in_queue(job_id: str) -> bool:
        proc = subprocess.run(["squeue", "-h", "-j", job_id, "-o", "%T"], capture_output=True, text=True, timeout=30)
        return proc.returncode == 0 and bool(proc.stdout.strip())

    def wait(self, job_id: str, log: Path, until: str | None = None, timeout: float = JOB_TIMEOUT_S) -> tuple[str, str]:
        """Poll until the job is over (or, with ``until``, the log shows it); returns (state, exit code)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if until is not None and log.is_file() and until in log.read_text(errors="replace"):
                return self.state(job_id)
            state, code = self.state(job_id)
            if state in FINAL_STATES and not self.in_queue(job_id):
                return state, code
            time.sleep(0.5)
        subprocess.run(["scancel", job_id], timeout=30)
        tail = log.read_text(errors="replace")[-4000:] if log.is_file() else "(no log)"
        pytest.fail(f"job {job_id} still {self.state(job_id)} after {timeout:.0f} s "
                    f"(waiting for {until or 'its end'}); cancelled. Log:\n{tail}")

    def cancel_leftovers(self) -> None:
        for job_id in self.ids:
            if self.in_queue(job_id):
                subprocess.run(["scancel", job_id], timeout=30)


@pytest.fixture()
def jobs(slurm_cluster: None, tmp_path: Path) -> Iterator[Jobs]:
    j = Jobs(tmp_path)
    try:
        yield j
    finally:
        j.cancel_leftovers()


def test_sbatch_job_trains_bitwise_like_stock_megatron(jobs: Jobs, tmp_path: Path) -> None:
    envpipe_out = tmp_path / "envpipe.json"
    job_id, log = jobs.submit("envpipe-test", LOSSES_OUT=str(envpipe_out))
    state, code = jobs.wait(job_id, log)
    text = log.read_text(errors="replace") if log.is_file() else "(no log)"
    assert (state, code) == ("COMPLETED", "0:0"), f"job {job_id}: {state} {code}\n{text[-6000:]}"

    # One srun task on the node ran torchrun with 4 ranks, through the shared body.
    assert re.search(r"envpipe-launch: node \S+ \(rank 0\): \S*python\S* -m torch.distributed.run --node-rank 0 "
                     rf"--nnodes 1 --nproc-per-node {NPROC} ", text), text[-6000:]
    assert "-m megatron_envpipe.apps.train_tiny_gpt" in text and "--device cpu" in text
    # CPU ranks have no GPU, so no clock control: no clock plan, and every rank says so once.
    assert "EnvPipe plan" not in text, text[-6000:]
    for stage in range(NPROC):
        assert text.count(f"EnvPipe stage {stage}: no GPU clock control") == 1, text[-6000:]
    # Clocks: reset by the node's runner after torchrun, and again at the job's end.
    assert re.search(r"node \S+ \(rank 0\): torchrun exited with status 0\n.*envpipe reset-clocks --force", text)
    assert "job end, node" in text and f"job {job_id} (envpipe-test) ends with status 0" in text

    envpipe = json.loads(envpipe_out.read_text())
    assert envpipe["envpipe"] == {"type": "envelope", "scheduling": "ours", "reconfig": "balanced"}
    assert envpipe["schedule"] == [{"functions": [EXECUTOR], "envpipe_installed": True,
                                    "executor_imported": True}] * NPROC
    assert envpipe["pipeline_model_parallel_size"] == NPROC and len(envpipe["losses"]) == ITERS
    assert f"iteration {ITERS}/{ITERS} | lm loss {envpipe['losses'][-1]!r}" in text

    # The reference: stock Megatron-core at the same settings (EnvPipe never installed),
    # through the single-node torchrun script.
    baseline_out = tmp_path / "baseline.json"
    env = jobs.env(ENVPIPE_DISABLE="1", LOSSES_OUT=str(baseline_out), MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(free_port()))
    proc = subprocess.run(["bash", str(SINGLE_NODE)], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    baseline = json.loads(baseline_out.read_text())
    assert baseline["envpipe"] is None and "--no-envpipe" in proc.stdout
    assert baseline["schedule"] == [{"functions": [MEGATRON_1F1B], "envpipe_installed": False,
                                     "executor_imported": False}] * NPROC
    assert baseline["tokens"] == envpipe["tokens"]
    # Exact: the same floats, bit for bit.
    assert [x.hex() for x in envpipe["losses"]] == [x.hex() for x in baseline["losses"]]


def test_megatron_lm_variant_through_sbatch_composes_the_gpu_launch(jobs: Jobs, tmp_path: Path) -> None:
    """The GPU variant's srun/torchrun line, as SLURM runs it (dry run: no GPU, no Megatron-LM here)."""
    (tmp_path / "pretrain_gpt.py").write_text("")
    job_id, log = jobs.submit("envpipe-gpu-dry", ENVPIPE_EXAMPLE="megatron-lm", MEGATRON_LM=str(tmp_path),
                              GPUS_PER_NODE="8", TP="2", PP="4", ENVPIPE_DRY_RUN="1")
    state, code = jobs.wait(job_id, log)
    text = log.read_text(errors="replace") if log.is_file() else "(no log)"
    assert (state, code) == ("COMPLETED", "0:0"), f"job {job_id}: {state} {code}\n{text[-4000:]}"
    line = next((x for x in text.splitlines() if "torch.distributed.run" in x), "")
    cmd = shlex.split(line)
    assert cmd[1:4] == ["-m", "torch.distributed.run", "--node-rank"] and cmd[4] == "0", text[-4000:]
    port = 20000 + int(job_id) % 20000
    nodes = re.search(r"\bNodeList=(\S+)", subprocess.run(["scontrol", "-o", "show", "job", job_id],
                                                         capture_output=True, text=True).stdout)
    assert nodes, f"job {job_id}: no NodeList"
    master = subprocess.run(["scontrol", "show", "hostnames", nodes.group(1)], capture_output=True,
                            text=True).stdout.split()[0]
    assert cmd[5:13] == ["--nnodes", "1", "--nproc-per-node", "8", "--master-addr", master,
                         "--master-port", str(port)], cmd
    assert cmd[13:15] == ["-m", "megatron_envpipe.megatron.pretrain_gpt"]
    joined = " ".join(cmd)
    for part in ("--tensor-model-parallel-size 2 --pipeline-model-parallel-size 4", "--mock-data", "--bf16",
                 "--envpipe-type envelope --envpipe-scheduling ours --envpipe-reconfig balanced --envpipe-gpu auto"):
        assert part in joined, part


def _processes_mentioning(marker: str) -> list[str]:
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if marker in cmdline:
            found.append(f"{proc.name}: {cmdline[:200]}")
    return found


def test_cancelled_job_resets_clocks_on_its_node_and_leaves_nothing(jobs: Jobs, tmp_path: Path) -> None:
    """scancel mid-training: SIGTERM to the step; the node's runner still runs
    `envpipe reset-clocks --force`, which finds the state file of a "GPU" locked
    by a live process (a test double: no NVML here, so it is reported, not reset)."""
    state_dir = tmp_path / "locked-clocks"
    state_dir.mkdir()
    uuid = "GPU-00000000-envpipe-slurm-test"
    (state_dir / f"{uuid}.json").write_text(json.dumps(
        {"uuid": uuid, "pid": os.getpid(), "hostname": socket.gethostname(), "name": "test double",
         "locked_mhz": 1200, "time": "now"}))
    marker = str(tmp_path / "cancelled.json")
    job_id, log = jobs.submit("envpipe-cancel", TRAIN_ITERS="100000", LOSSES_OUT=marker,
                              ENVPIPE_STATE_DIR=str(state_dir))
    jobs.wait(job_id, log, until="iteration 2/100000")
    subprocess.run(["scancel", job_id], check=True, timeout=30)
    state, _ = jobs.wait(job_id, log)
    text = log.read_text(errors="replace")
    assert state == "CANCELLED", f"job {job_id}: {state}\n{text[-6000:]}"
    after = text.split("torchrun exited with status", 1)
    assert len(after) == 2 and after[1].split("\n", 1)[0].endswith("(terminated)"), text[-6000:]
    # --force: the owner is alive, so only a forced reset tries the GPU (and here cannot open it).
    assert "envpipe reset-clocks --force" in after[1] and uuid in after[1], text[-6000:]
    assert "left alone" not in after[1]
    assert not _processes_mentioning(marker), _processes_mentioning(marker)
