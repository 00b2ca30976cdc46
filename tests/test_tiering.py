"""The test tiers' safety net (tests/tiering.py): a test that launches processes is marked from its code."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path

import pytest
import tiering

REPO = Path(__file__).resolve().parents[1]

MODULE = '''
import subprocess, sys
import pytest
from megatron_envpipe.testing import run_pipeline
from launching import torchrun

CMD = ["sbatch", "--parsable", "job.sbatch"]


def _torchrun_cmd(*flags):
    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4", "examples/train_tiny_gpt.py", *flags]


def _train(tmp_path):
    return subprocess.run(_torchrun_cmd("--device", "cpu"), cwd=tmp_path, capture_output=True)


def _cases():
    return subprocess.run([sys.executable, "-c", "print(1)"]).stdout


def test_in_process():
    assert sorted([2, 1]) == [1, 2]


def test_fresh_interpreter():
    assert subprocess.run([sys.executable, "-c", "pass"]).returncode == 0


def test_training_through_a_helper(tmp_path):
    assert _train(tmp_path).returncode == 0


def test_harness():
    assert run_pipeline(None)


def test_shared_torchrun(tmp_path):
    run = torchrun(["--nproc-per-node", 4, "examples/train_tiny_gpt.py"], cwd=tmp_path, log_dir=tmp_path, timeout_s=60)
    assert run.returncode == 0


def test_sbatch():
    assert subprocess.run(CMD).returncode == 0


def test_a_bash_dry_run_of_a_torchrun_script():
    assert subprocess.run(["bash", "examples/torchrun_single_node.sh"]).returncode == 0


@pytest.mark.parametrize("case", _cases())
def test_parameters_computed_by_a_launch_at_collection(case):
    assert case


@pytest.fixture
def launched(tmp_path):
    return subprocess.run(["true"])


def test_through_a_fixture(launched):
    assert launched.returncode == 0


@pytest.fixture
def ranks_p2():
    return run_pipeline(2)


@pytest.fixture(params=[2])
def ranks(request):
    return request.getfixturevalue(f"ranks_p{request.param}")


def test_through_a_fixture_named_at_run_time(ranks):
    assert ranks


class TestInClass:
    def _spawn(self):
        import torch.multiprocessing as mp
        mp.spawn(print, nprocs=2)

    def test_method(self):
        self._spawn()
'''

EXPECTED = {
    "test_in_process": set(),
    "test_fresh_interpreter": {"cli"},
    "test_training_through_a_helper": {"dist", "e2e"},
    "test_harness": {"dist"},
    "test_shared_torchrun": {"dist", "e2e"},
    "test_sbatch": {"slurm"},
    "test_a_bash_dry_run_of_a_torchrun_script": {"cli"},
    "test_parameters_computed_by_a_launch_at_collection": set(),  # decorators run at collection, not in the test
    "TestInClass.test_method": {"dist"},
}


@pytest.fixture(scope="module")
def module_path(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("tiering") / "test_sample.py"
    path.write_text(textwrap.dedent(MODULE))
    return str(path)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_a_test_is_marked_after_what_it_launches(module_path: str, name: str):
    assert tiering.inferred_tiers(module_path, [name], []) == EXPECTED[name]


def test_a_fixture_that_launches_marks_the_tests_that_use_it(module_path: str, tmp_path: Path):
    assert tiering.inferred_tiers(module_path, ["test_through_a_fixture"], []) == {"cli"}  # same module: by name
    conftest = tmp_path / "conftest.py"  # a fixture of another file reaches the test through pytest only
    conftest.write_text("import subprocess\nimport pytest\n\n\n@pytest.fixture\ndef ranks():\n"
                        "    return subprocess.run(['torchrun', '--nproc-per-node', '2', 'x.py'])\n")
    assert tiering.inferred_tiers(module_path, ["test_in_process"], [(str(conftest), "ranks")]) == {"dist"}
    # request.getfixturevalue(...): a fixture named at run time; every fixture of the module counts (here
    # also `launched`: on the safe side, out of the fast tier)
    assert tiering.inferred_tiers(module_path, ["test_through_a_fixture_named_at_run_time"],
                                  [(module_path, "ranks")]) == {"dist", "cli"}

MCORE_SAMPLE = '''
import subprocess, sys
import pytest
from megatron_envpipe.apps.cli import main
from megatron_envpipe.megatron.executor import envpipe_forward_backward
from megatron_envpipe.testing import run_pipeline

ENTRY = "megatron_envpipe.megatron.pretrain_gpt"


def test_plan_in_process():
    assert main(["plan", "--profile", "a40/gpt3-175b"]) == 0


def test_cli_in_a_fresh_interpreter():
    assert subprocess.run([sys.executable, "-m", "megatron_envpipe.apps.cli", "plan"]).returncode == 0


def test_a_dry_run_prints_the_command_it_would_run():
    assert subprocess.run(["bash", "examples/torchrun_single_node.sh"], env={"ENVPIPE_DRY_RUN": "1"})


def test_uses_the_executor():
    assert envpipe_forward_backward


def test_imports_megatron_core_itself():
    assert pytest.importorskip("megatron.core")


def test_imports_megatron_core_in_the_test():
    from megatron.core import parallel_state
    assert parallel_state


def test_trains_the_tiny_gpt():
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "examples/train_tiny_gpt.py"])


def test_harness():
    assert run_pipeline(2)


def test_the_entry_in_a_fresh_interpreter():
    assert subprocess.run([sys.executable, "-m", ENTRY, "--help"]).returncode == 0
'''
RUNS_MCORE = {"test_uses_the_executor", "test_imports_megatron_core_itself", "test_imports_megatron_core_in_the_test",
              "test_trains_the_tiny_gpt", "test_harness", "test_the_entry_in_a_fresh_interpreter"}


def test_mcore_marks_the_tests_whose_code_runs_megatron_core(tmp_path: Path):
    """``mcore`` (CI's megatron-core 0.19 phase): in process or in what the test launches; a planner
    command, a fresh CLI, a dry run of a launch script run none of it."""
    path = tmp_path / "test_mcore_sample.py"
    path.write_text(MCORE_SAMPLE)
    names = [line.split("(")[0][4:] for line in MCORE_SAMPLE.splitlines() if line.startswith("def test_")]
    marked = {name for name in names if tiering.depends_on_mcore(
        str(path), [name], [], str(REPO), tiering.inferred_tiers(str(path), [name], []))}
    assert marked == RUNS_MCORE


def test_the_package_modules_that_run_megatron_core():
    """Loading the CLI loads modules that import megatron-core lazily, but runs none of it: not ``mcore``."""
    found = tiering.mcore_modules(str(REPO))
    assert {"megatron_envpipe.megatron.executor", "megatron_envpipe.megatron.compat",
            "megatron_envpipe.apps.train_tiny_gpt", "megatron_envpipe.testing.harness"} <= found
    assert not found & {"megatron_envpipe.apps.cli", "megatron_envpipe.apps.cli.parser", "megatron_envpipe.core.schedule",
                        "megatron_envpipe.planning.planner", "megatron_envpipe.megatron.launch"}


def test_slow_entries_name_tests_or_fixtures():
    for entry in tiering.SLOW:
        path, name = entry.split("::")
        assert (REPO / path).is_file() and name.isidentifier(), entry  # no parameters: every case


def test_the_tiers_are_registered_and_the_fast_tier_leaves_each_out():
    config = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]
    registered = {line.split(":")[0] for line in config["markers"]}
    assert set(tiering.TIERS) | {tiering.KEEP_FAST, tiering.MCORE} <= registered
    assert "--strict-markers" in config["addopts"]  # a misspelt tier marker is an error, not a fast test
    assert tiering.FAST_EXPRESSION.split(" and ") == [f"not {tier}" for tier in tiering.TIERS]



SAMPLE = '''
import subprocess, sys
import pytest


def test_in_process():
    assert True


def test_fresh_interpreter():
    subprocess.run([sys.executable, "-c", "pass"])


@pytest.mark.slow
def test_marked_slow():
    assert True


@pytest.mark.fast
def test_cheap_command_kept_fast():
    subprocess.run(["true"])
'''


@pytest.mark.cli
def test_fast_option_selects_the_fast_tier(tmp_path: Path):
    """``--fast`` end to end: the hooks in a fresh pytest, on a sample test file."""
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    (tmp_path / "conftest.py").write_text(f"import sys\nsys.path.insert(0, {str(REPO / 'tests')!r})\n"
                                          "from tiering import pytest_addoption, pytest_collection_modifyitems, "
                                          "pytest_configure\n")
    (tmp_path / "test_sample.py").write_text(SAMPLE)

    def selected(*args: str) -> list[str]:
        proc = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                               *args, "test_sample.py"], cwd=tmp_path, capture_output=True, text=True, timeout=120)
        assert proc.returncode in (0, 5), proc.stdout + proc.stderr  # 5: nothing selected
        return sorted(line.split("::")[1] for line in proc.stdout.splitlines() if "::" in line)

    assert selected("--fast") == ["test_cheap_command_kept_fast", "test_in_process"]
    assert selected("-m", "cli") == ["test_fresh_interpreter"]
    assert selected("--fast", "-m", "not slow") == ["test_cheap_command_kept_fast", "test_in_process"]
