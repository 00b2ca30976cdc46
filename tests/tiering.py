"""Test tiers: which tests launch processes, read from their code (used by conftest.py).

A test's tier markers say what it starts (docs/testing.md):

- ``dist``: several processes that talk to each other (torchrun, ``mp.spawn``, the spawned-rank harness);
- ``e2e``: a whole training run (the tiny GPT or ``pretrain_gpt`` under torchrun, the demo);
- ``cli``: a fresh interpreter or another command (``subprocess``), one process;
- ``slurm``: a SLURM job (sbatch/srun);
- ``slow``: in-process, but seconds long.

Heavy files say so themselves (``pytestmark``); this module is the safety net for the tests that do not:
it reads the test function, the helpers of its own test module it uses (transitively) and the fixtures
of the project's own files it asks for, and marks it after the launch calls it finds there. A new test that
runs ``subprocess.run([sys.executable, ...])`` or torchrun is thus out of the fast tier without anyone
remembering to mark it. It reads code only (no launch is intercepted), so a launch hidden inside package
code it does not read needs a marker in the test file: ``LAUNCHERS`` names the package's launchers.

Beside the tiers, ``mcore`` marks a test whose result can depend on the megatron-core version (CI runs
those again against megatron-core 0.19 on Python 3.12): its code imports megatron.core or
megatron.training, or a module of the package that does (``mcore_modules``), or it launches ranks that do
(the tiny GPT, ``pretrain_gpt``, the demo, the spawned-rank harness). Read from the code as the tiers are.
"""

from __future__ import annotations

import ast
import inspect
import re
import warnings
from collections.abc import Iterable
from functools import cache
from pathlib import Path

import pytest

TIERS = ("dist", "e2e", "cli", "slurm", "slow")
# Not a tier: "its result can depend on the megatron-core version" (.ci/run's second phase selects it).
MCORE = "mcore"
MEGATRON = ("megatron.core", "megatron.training")  # what megatron-core (and Megatron-LM's training) installs
PACKAGE = "megatron_envpipe"
# Launchers whose processes import megatron-core whatever the test gives them.
MCORE_LAUNCHERS = {"run_pipeline", "run_demo"}  # the spawned-rank harness, the demo
FAST_EXPRESSION = "not " + " and not ".join(TIERS)
# Explicit marker: "its code names a launcher, but it starts nothing or only something cheap; keep it fast".
KEEP_FAST = "fast"

# Call names (last dotted parts) that start processes, and the tiers each implies.
LAUNCHERS: dict[str, tuple[str, ...]] = {
    # a command or a fresh interpreter
    **dict.fromkeys(("subprocess.run", "subprocess.Popen", "subprocess.call", "subprocess.check_call",
                     "subprocess.check_output", "os.system", "os.popen", "pty.spawn", "create_subprocess_exec",
                     "create_subprocess_shell"), ("cli",)),
    # ranks that talk to each other
    **dict.fromkeys(("mp.spawn", "multiprocessing.spawn", "start_processes", "mp.Process", "multiprocessing.Process",
                     "run_pipeline", "start_ranks", "follow_run", "torchrun"), ("dist",)),
    # torchrun: tests/launching.py; start_ranks: the harness's forkserver ranks (megatron_envpipe/testing/harness.py)
    # the package's own launchers
    "run_check": ("cli",),  # envpipe gpu-check: a child process per step
    "_Running.start": ("cli",),  # gpu-check step 7's run of one command
    "executor_step.run": ("dist", "e2e"),  # gpu-check step 7: two tiny-GPT trainings under torchrun
    "demo.run_demo": ("dist", "e2e"), "run_demo": ("dist", "e2e"),
}
# In-process tests of a second or more (measured with --fast --durations=0): the fast tier leaves them to
# the full suite. Node ids without parameters (every case), or a fixture's (every test that uses it).
SLOW: tuple[str, ...] = (
    "tests/megatron/test_gpu_check_profile_replay.py::profiled",  # gpu-check step 5 on a simulated GPU, 8 s
    "tests/megatron/test_channels.py::test_the_1024_rank_counts_of_the_note",
    "tests/gpu/test_profiler_cost.py::test_a_third_of_envpipe_accurate_and_every_planned_clock_measured",
    "tests/apps/test_docs_commands.py::test_envpipe_commands_run",  # 7 pages, 8 s
    "tests/planning/test_optimal.py::test_within_half_a_percent_of_the_milp_optimum",  # 12 MILPs, 8 s
    "tests/planning/test_scale_lp_start.py::test_slack_deadline_starts_from_the_short_pipeline_and_stays_exact",
    "tests/gpu/test_sweep.py::test_acceptance_with_host_timestamps",
    "tests/core/test_interleaved.py::test_every_valid_size_validates_and_has_megatrons_warmup",
    "tests/apps/test_readme.py::test_readme_cost_paragraph_is_what_the_planner_gives",
    "tests/apps/test_readme.py::test_readme_envpipe_commands_run",
    "tests/planning/test_scale_repeated.py::test_short_pipeline_start_for_interleaved_keeps_the_lp_exact",
    "tests/planning/test_scale_repeated.py::test_plans_on_repeated_profiles_are_unchanged",
    "tests/planning/test_scale_repeated.py::test_short_pipeline_basis_start_keeps_the_lp_exact_and_skips_the_crossover",
    "tests/apps/test_bad_inputs.py::test_good_outputs_are_still_written",
    "tests/apps/test_bad_inputs.py::test_a_write_failing_after_the_checks_leaves_no_output",
    "tests/planning/test_search_scale.py::test_searches_return_the_plans_of_whole_passes",
    "tests/planning/test_compat_perseus.py::test_reproduces_perseus_envpipe_emulation_results",
    "tests/planning/test_menu.py::test_menu_rows_equal_envpipe_plan_run_by_hand",
    "tests/core/test_lazy_comm.py::test_property_random_plans_are_deadlock_free_after_the_warmup",
    "tests/apps/test_cli_first_day.py::test_alternating_clocks_summarise_as_counts",
    "tests/apps/test_cli_outputs.py::test_ctrl_c_during_the_final_writes_of_plan",
    "tests/planning/test_optimal_scale.py::test_large_problems_overlap_their_lps_and_rounding_without_changing_the_plan",
    "tests/planning/test_optimal_scale.py::test_shorter_pipeline_start_keeps_the_lp_exact_and_saves_iterations",
    "tests/gpu/test_faults.py::test_stalled_counter_makes_its_intervals_unmeasured_and_the_monitor_recovers",
    "tests/core/test_input_files.py::test_a_large_profile_parses_and_aggregates",
    "tests/planning/test_optimal.py::test_every_plan_meets_its_deadline",
    "tests/planning/test_planner.py::test_every_combination_terminates_and_reports_slowdown",
    "tests/gpu/test_profiler_lengths.py::test_the_fitted_model_recovers_the_simulated_one_exactly_on_an_exact_gpu",
)

# In the code of a test that launches: what the launched command is.
TORCHRUN = re.compile(r"\btorchrun\b|torch\.distributed\.run\b|--nproc[-_]per[-_]node")
TRAINING = re.compile(r"train_tiny_gpt|pretrain_gpt|\bdemo\b")
SLURM = re.compile(r"(?<![\w./-])(sbatch|srun|salloc)(?![\w./-])")


def dotted(node: ast.AST) -> str:
    """``a.b.c`` of a call's function, '' when it is not a plain dotted name."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
        return ".".join(reversed(parts))
    return ""


def code_nodes(node: ast.AST) -> list[ast.AST]:
    """What runs when ``node`` runs: a function's body and defaults, not its decorators
    (``parametrize`` arguments are evaluated at collection, not by the test)."""
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return [node.args, *node.body]
    if isinstance(node, ast.ClassDef):
        return list(node.body)
    return [node]


def walk(node: ast.AST):
    for part in code_nodes(node):
        yield from ast.walk(part)


def launcher_tiers(name: str) -> tuple[str, ...]:
    """The tiers a call to ``name`` implies (matching its last one or two dotted parts)."""
    parts = name.split(".")
    return LAUNCHERS.get(".".join(parts[-2:])) or LAUNCHERS.get(parts[-1]) or ()


class ModuleIndex:
    """A test module's top-level functions and classes (and class methods), by name, parsed once."""

    def __init__(self, path: Path) -> None:
        self.source = path.read_text(encoding="utf-8")
        self.tree = tree = ast.parse(self.source)
        self.defs: dict[str, ast.AST] = {}
        for node in tree.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                self.defs[node.name] = node
            if isinstance(node, ast.ClassDef):
                for member in node.body:
                    if isinstance(member, (ast.FunctionDef, ast.AsyncFunctionDef)):
                        self.defs[f"{node.name}.{member.name}"] = member
            if isinstance(node, ast.Assign):  # module constants: command lines, scripts run by a launch
                for target in node.targets:
                    if isinstance(target, ast.Name):
                        self.defs[target.id] = node


@cache
def module_index(path: str) -> ModuleIndex | None:
    try:
        return ModuleIndex(Path(path))
    except (OSError, SyntaxError, UnicodeDecodeError):
        return None


def is_fixture(node: ast.AST) -> bool:
    return isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and any(
        "fixture" in ast.unparse(decorator) for decorator in node.decorator_list)


def reach(index: ModuleIndex, roots: Iterable[str]) -> list[ast.AST]:
    """The definitions ``roots`` use, transitively, within one module. A ``request.getfixturevalue(...)``
    (a fixture named at run time) reaches every fixture of the module."""
    seen: dict[str, ast.AST] = {}
    todo = [name for name in roots if name in index.defs]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen[name] = node = index.defs[name]
        cls = name.split(".")[0] if "." in name else None
        for sub in walk(node):
            used = sub.id if isinstance(sub, ast.Name) else sub.attr if isinstance(sub, ast.Attribute) else None
            if used == "getfixturevalue":
                todo.extend(other for other, definition in index.defs.items() if is_fixture(definition))
            if used is None:
                continue
            for candidate in (used, f"{cls}.{used}" if cls else None):
                if candidate and candidate in index.defs and candidate not in seen:
                    todo.append(candidate)
    return list(seen.values())


def tiers_of(nodes: list[ast.AST], source: str) -> set[str]:
    """Tier markers implied by the launch calls in ``nodes`` (code from ``source``)."""
    kinds = set()
    for node in nodes:
        for sub in walk(node):
            if isinstance(sub, ast.Call):
                kinds.update(launcher_tiers(dotted(sub.func)))
    if not kinds:
        return set()
    text = "\n".join(ast.get_source_segment(source, node) or "" for node in nodes)
    if SLURM.search(text):
        return {"slurm"}
    if TORCHRUN.search(text):
        kinds = (kinds - {"cli"}) | {"dist"}
    if "dist" in kinds and TRAINING.search(text):
        kinds.add("e2e")
    return kinds


def inferred_tiers(module_path: str, roots: Iterable[str], fixture_sites: Iterable[tuple[str, str]]) -> set[str]:
    """Tiers for a test: ``roots`` are its own names in ``module_path`` (function, class.method);
    ``fixture_sites`` the (file, function name) of each fixture it uses that is defined under tests/."""
    found: set[str] = set()
    sites: dict[str, list[str]] = {module_path: list(roots)}
    for path, name in fixture_sites:
        sites.setdefault(path, []).append(name)
    for path, names in sites.items():
        index = module_index(path)
        if index is not None:
            found |= tiers_of(reach(index, names), index.source)
    return found


# megatron-core dependence: the package's modules that run it, and the tests that reach them.
# In launched code (a script in a constant, a command line): an import or ``-m`` of a module, or a
# string that is a module's name (``ENTRY = "megatron_envpipe.megatron.pretrain_gpt"``, run as ``-m ENTRY``).
LAUNCHED_IMPORT = re.compile(r"(?:\bimport|\bfrom|-m)[\s\"',]+((?:megatron|megatron_envpipe)\.[\w.]+)"
                             r"|[\"'](megatron_envpipe\.[\w.]+)[\"']")


def is_megatron(module: str) -> bool:
    return any(module == m or module.startswith(m + ".") for m in MEGATRON)


@cache
def module_names(root: str) -> frozenset[str]:
    """The package's modules (``a.b`` for ``a/b/__init__.py``)."""
    return frozenset(".".join(path.relative_to(root).with_suffix("").parts).removesuffix(".__init__")
                     for path in (Path(root) / PACKAGE).rglob("*.py"))


def bound_by_import(node: ast.AST, root: str) -> list[tuple[str, str]]:
    """(name bound, module it comes from) of an import statement: ``from a.b import c`` binds c from
    ``a.b.c`` when that is one of the package's modules, else from ``a.b``."""
    if isinstance(node, ast.Import):
        return [((alias.asname or alias.name).split(".")[0], alias.name) for alias in node.names]
    if isinstance(node, ast.ImportFrom) and node.module and not node.level:
        return [(alias.asname or alias.name, f"{node.module}.{alias.name}"
                 if f"{node.module}.{alias.name}" in module_names(root) else node.module) for alias in node.names]
    return []


def loaded_by_import(node: ast.AST, root: str) -> list[str]:
    """The modules an import statement loads, each with its parent packages (their ``__init__`` runs too)."""
    return [".".join(module.split(".")[:i]) for _, module in bound_by_import(node, root)
            for i in range(1, module.count(".") + 2)]


def top_level(tree: ast.AST):
    """The statements that run when a module loads: outside functions and ``if TYPE_CHECKING:`` blocks."""
    todo = list(ast.iter_child_nodes(tree))
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            continue
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            todo += node.orelse
            continue
        yield node
        todo += ast.iter_child_nodes(node)


@cache
def mcore_modules(root: str) -> frozenset[str]:
    """The package's modules that run megatron-core code: those whose own code imports megatron.core or
    megatron.training (when they load or in a function), and those that load megatron-core when they load.
    (A module that only loads one of the first kind, lazily importing ones, runs none by loading it: the
    CLI loads such modules, and ``envpipe plan`` never touches megatron-core.)"""
    direct, loads = set(), {}
    for name in module_names(root):
        path = Path(root, *name.split("."))
        tree = ast.parse((path / "__init__.py" if path.is_dir() else path.with_suffix(".py")).read_text("utf-8"))
        if any(is_megatron(m) for node in ast.walk(tree) for m in [
                *loaded_by_import(node, root), imported_by_call(node) if isinstance(node, ast.Call) else ""]):
            direct.add(name)
        loads[name] = {m for node in top_level(tree) for m in loaded_by_import(node, root)}
    found = {name for name, loaded in loads.items() if any(is_megatron(m) for m in loaded)}
    while grown := {name for name, loaded in loads.items() if loaded & found} - found:
        found |= grown
    return frozenset(direct | found)


def runs_mcore(module: str, root: str) -> bool:
    return is_megatron(module) or module in mcore_modules(root)


def imported_by_call(call: ast.Call) -> str:
    """The module of ``pytest.importorskip("x")`` or ``importlib.import_module("x")``, else ''."""
    if dotted(call.func).split(".")[-1] in ("importorskip", "import_module") and call.args \
            and isinstance(call.args[0], ast.Constant) and isinstance(call.args[0].value, str):
        return call.args[0].value
    return ""


@cache
def mcore_names(path: str, root: str) -> frozenset[str]:
    """A test module's names bound when it loads to something of a module that runs megatron-core."""
    index = module_index(path)
    names = set()
    for node in top_level(index.tree) if index else ():
        names |= {name for name, module in bound_by_import(node, root) if runs_mcore(module, root)}
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call) \
                and runs_mcore(imported_by_call(node.value) or "-", root):
            names |= {target.id for target in node.targets if isinstance(target, ast.Name)}
    return frozenset(names)


def mcore_in(nodes: list[ast.AST], path: str, root: str, launches: bool) -> bool:
    """Whether the code of ``nodes`` (of the test module at ``path``) runs megatron-core: in process (an
    import, an ``importorskip``, a name bound to such a module's) or, when the test ``launches`` something,
    in a command or script naming such a module (whole trainings, e2e, count without reading)."""
    bound = mcore_names(path, root)
    for node in nodes:
        for sub in walk(node):
            if isinstance(sub, ast.Name):
                if sub.id in bound:
                    return True
            elif isinstance(sub, (ast.Import, ast.ImportFrom)):
                if any(runs_mcore(m, root) for m in loaded_by_import(sub, root)):
                    return True
            elif isinstance(sub, ast.Call) and (runs_mcore(imported_by_call(sub) or "-", root)
                                                or dotted(sub.func).split(".")[-1] in MCORE_LAUNCHERS):
                return True
    if not launches:
        return False
    source = module_index(path).source
    text = "\n".join(ast.get_source_segment(source, node) or "" for node in nodes)
    return any(runs_mcore(m, root) for pair in LAUNCHED_IMPORT.findall(text) for m in pair if m)


def depends_on_mcore(module_path: str, roots: Iterable[str], fixture_sites: Iterable[tuple[str, str]],
                     root: str, tiers: Iterable[str] = ()) -> bool:
    """Whether a test (as in ``inferred_tiers``; ``tiers``: its tier markers) runs megatron-core, in
    process or in what it launches."""
    tiers = set(tiers)
    if "e2e" in tiers:  # a whole training: the tiny GPT, pretrain_gpt, the demo (its command may be read at run time)
        return True
    sites: dict[str, list[str]] = {module_path: list(roots)}
    for path, name in fixture_sites:
        sites.setdefault(path, []).append(name)
    launches = bool(tiers & {"dist", "cli", "slurm"})
    return any(mcore_at(path, tuple(sorted(names)), root, launches) for path, names in sites.items())


@cache
def mcore_at(path: str, names: tuple[str, ...], root: str, launches: bool) -> bool:
    """``mcore_in`` for what ``names`` reach in one module (once per test function, not per parameter)."""
    index = module_index(path)
    return index is not None and mcore_in(reach(index, names), path, root, launches)


# pytest hooks (tests/conftest.py imports them).


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--fast", action="store_true",
                     help=f"the fast tier: tests that launch no process and are not slow (-m '{FAST_EXPRESSION}')")


def pytest_configure(config: pytest.Config) -> None:
    if config.getoption("fast"):
        given = config.option.markexpr
        config.option.markexpr = f"({given}) and {FAST_EXPRESSION}" if given else FAST_EXPRESSION


def slow_ids(function_id: str, sites: list[tuple[str, str]], root: Path) -> set[str]:
    """The ``SLOW`` entries that name this test or a fixture it uses."""
    ids = {function_id} | {f"{Path(path).relative_to(root).as_posix()}::{name}" for path, name in sites}
    return ids & set(SLOW)


def fixture_sites(item: pytest.Function, root: Path) -> list[tuple[str, str]]:
    """(file, function name) of each fixture the test uses that is defined in the project's files."""
    sites = []
    for defs in item._fixtureinfo.name2fixturedefs.values():
        for fixturedef in defs:
            func = inspect.unwrap(fixturedef.func)
            try:
                path = Path(inspect.getsourcefile(func) or "").resolve()
            except TypeError:  # a builtin
                continue
            if root in path.parents and "site-packages" not in path.parts:
                sites.append((str(path), func.__name__))
    return sites


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Marks the tests that carry no tier marker after what their code launches, and those in ``SLOW``
    (runs before -m selects), and ``mcore`` on those that run megatron-core. Warns of a ``SLOW`` entry
    whose file was collected but has no such test."""
    explicit = set(TIERS) | {KEEP_FAST}
    root = config.rootpath.resolve()
    # mcore is read only when -m names it (CI's second phase): the other runs need not pay for it.
    reads_mcore = MCORE in (config.option.markexpr or "")
    slow_found: set[str] = set()
    files = set()
    for item in items:
        function_id = item.nodeid.split("[")[0]
        files.add(function_id.split("::")[0])
        if not isinstance(item, pytest.Function):
            continue
        sites = fixture_sites(item, root)
        slow = slow_ids(function_id, sites, root)
        slow_found |= slow
        roots = [f"{item.cls.__name__}.{item.originalname}"] if item.cls is not None else [item.originalname]
        if not any(m.name in explicit for m in item.iter_markers()):
            for tier in sorted(inferred_tiers(str(item.path), roots, sites) | ({"slow"} if slow else set())):
                item.add_marker(tier)
        if reads_mcore and item.get_closest_marker(MCORE) is None and depends_on_mcore(
                str(item.path), roots, sites, str(root), {m.name for m in item.iter_markers()} & set(TIERS)):
            item.add_marker(MCORE)
    for gone in sorted(set(SLOW) - slow_found):
        if gone.split("::")[0] in files:
            warnings.warn(pytest.PytestConfigWarning(f"tests/tiering.py SLOW names {gone}: no such test any more"),
                          stacklevel=1)
