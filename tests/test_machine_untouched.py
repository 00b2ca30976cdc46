"""Tests leave the machine alone (issue 22, item 1).

`python3 -m pytest -q -rs tests` must not install packages, start or stop services, or set SLURM up:
system set-up belongs to `.ci/run` (which runs `bash tests/slurm/setup_slurm.sh` as root), and a test
that needs it skips, saying so, when it is absent. This is a static check of every test module: no
command a test runs (subprocess, os.system, os.exec*, ...) names a package manager, a service manager,
SLURM's set-up script or a SLURM/munge daemon. `bash -n` and `shellcheck` only read a script, so
they may name any.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent

# Words that, in a command a test runs, change the machine.
FORBIDDEN = {
    "apt-get": "installs packages", "apt": "installs packages", "dpkg": "installs packages",
    "yum": "installs packages", "dnf": "installs packages", "apk": "installs packages",
    "systemctl": "starts or stops services", "service": "starts or stops services",
    "setup_slurm.sh": "installs SLURM and starts its daemons (.ci/run runs it)",
    "munged": "starts a daemon", "slurmctld": "starts a daemon", "slurmd": "starts a daemon",
}
PIP = {"pip", "pip3"}  # with "install": installs packages

_EXEC_MODULE_CALLS = {
    "subprocess": {"run", "Popen", "call", "check_call", "check_output", "getoutput", "getstatusoutput"},
    "os": {"system", "popen", "execv", "execve", "execvp", "execvpe", "execl", "execle", "execlp", "execlpe",
           "spawnv", "spawnve", "spawnvp", "spawnvpe", "posix_spawn", "posix_spawnp"},
    "asyncio": {"create_subprocess_exec", "create_subprocess_shell"},
}
_NOT_THE_COMMAND = {"cwd", "timeout", "capture_output", "text", "check", "stdout", "stderr", "stdin", "encoding",
                    "errors", "input", "start_new_session", "preexec_fn", "close_fds", "universal_newlines"}


def _words(text: str) -> list[str]:
    """The words of a command string, each path reduced to its file name."""
    return [w.strip("'\";&|()`").rsplit("/", 1)[-1] for w in text.split()]


class _Checker:
    """Finds, in one module, the commands run by subprocess & co. (or by a function of the module that hands
    its argument to one) and the forbidden words in each; names are followed to what is assigned to them."""

    def __init__(self, source: str, name: str) -> None:
        self.tree = ast.parse(source, name)
        self.name = name
        self.exec_names: set[str] = set()  # `from subprocess import run` -> "run"
        for node in ast.walk(self.tree):
            if isinstance(node, ast.ImportFrom) and node.module in _EXEC_MODULE_CALLS:
                self.exec_names |= {a.asname or a.name for a in node.names if a.name in _EXEC_MODULE_CALLS[node.module]}
        # What is assigned to each name, per scope: the module's top level, and each function.
        self.module_names = self._assigned(self._top_level(self.tree))
        self.scopes = [(fn, self._assigned(ast.walk(fn))) for fn in ast.walk(self.tree)
                       if isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef)]
        self.runners = self._runner_functions()

    @staticmethod
    def _top_level(tree: ast.AST):
        """The module's nodes outside functions and classes."""
        todo = list(ast.iter_child_nodes(tree))
        while todo:
            node = todo.pop()
            if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                yield node
                todo += ast.iter_child_nodes(node)

    @staticmethod
    def _assigned(nodes) -> dict[str, list[ast.AST]]:
        names: dict[str, list[ast.AST]] = {}
        for node in nodes:
            pairs = []
            if isinstance(node, ast.Assign):
                pairs = [(t, node.value) for t in node.targets]
            elif isinstance(node, ast.AnnAssign | ast.AugAssign | ast.NamedExpr) and node.value is not None:
                pairs = [(node.target, node.value)]
            elif isinstance(node, ast.For | ast.comprehension):
                pairs = [(node.target, node.iter)]
            for target, value in pairs:
                for leaf in ast.walk(target):
                    if isinstance(leaf, ast.Name):
                        names.setdefault(leaf.id, []).append(value)
        return names

    def _values(self, name: str, call: ast.Call) -> list[ast.AST]:
        """What ``name`` may hold at ``call``: the innermost function around it that assigns it, else the module."""
        around = [(fn, names) for fn, names in self.scopes
                  if fn.lineno <= call.lineno <= (fn.end_lineno or fn.lineno) and name in names]
        if around:
            return max(around, key=lambda pair: pair[0].lineno)[1][name]
        return self.module_names.get(name, [])

    def _is_exec(self, call: ast.Call, runners: set[str] = frozenset()) -> bool:
        f = call.func
        if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name):
            if f.attr in _EXEC_MODULE_CALLS.get(f.value.id, ()):
                return True
        name = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else None
        return name in self.exec_names or name in runners

    def _runner_functions(self) -> set[str]:
        """Functions (and methods) that run a command built from one of their parameters."""
        runners: set[str] = set()
        changed = True
        while changed:
            changed = False
            for fn in ast.walk(self.tree):
                if not isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef) or fn.name in runners:
                    continue
                params = {a.arg for a in (*fn.args.posonlyargs, *fn.args.args, *fn.args.kwonlyargs)} - {"self"}
                params |= {a.arg for a in (fn.args.vararg, fn.args.kwarg) if a is not None}
                for call in ast.walk(fn):
                    if isinstance(call, ast.Call) and self._is_exec(call, runners) and params & {
                            n.id for arg in self._command_parts(call) for n in ast.walk(arg) if isinstance(n, ast.Name)}:
                        runners.add(fn.name)
                        changed = True
                        break
        return runners

    @staticmethod
    def _command_parts(call: ast.Call) -> list[ast.AST]:
        return [*call.args, *(k.value for k in call.keywords if k.arg not in _NOT_THE_COMMAND)]

    def _strings(self, node: ast.AST, call: ast.Call, seen: set[str]) -> list[str]:
        found = []
        for leaf in ast.walk(node):
            if isinstance(leaf, ast.Constant) and isinstance(leaf.value, str):
                found.append(leaf.value)
            elif isinstance(leaf, ast.Name) and leaf.id not in seen:
                seen.add(leaf.id)
                for value in self._values(leaf.id, call):
                    found += self._strings(value, call, seen)
        return found

    @staticmethod
    def _only_reads_scripts(call: ast.Call) -> bool:
        """`bash -n SCRIPT` and `shellcheck SCRIPT` read a script without running it."""
        if not call.args or not isinstance(call.args[0], ast.List | ast.Tuple):
            return False
        head = [e.value for e in call.args[0].elts[:2] if isinstance(e, ast.Constant) and isinstance(e.value, str)]
        return head[:1] == ["shellcheck"] or head == ["bash", "-n"]

    def violations(self) -> list[str]:
        found = []
        for call in ast.walk(self.tree):
            if not (isinstance(call, ast.Call) and self._is_exec(call, self.runners)) or self._only_reads_scripts(call):
                continue
            words = {w for part in self._command_parts(call) for s in self._strings(part, call, set()) for w in _words(s)}
            bad = sorted(w for w in words if w in FORBIDDEN)
            if words & PIP and "install" in words:
                bad.append("pip install")
            for word in bad:
                why = FORBIDDEN.get(word, "installs packages")
                found.append(f"{self.name}:{call.lineno}: runs `{word}` ({why}): tests must leave the machine "
                             "alone; do it in .ci/run and skip (or, in CI, fail) when it is missing")
        return found


def violations(source: str, name: str = "<test>") -> list[str]:
    return _Checker(source, name).violations()


def test_no_test_module_changes_the_machine() -> None:
    found = [v for path in sorted(TESTS.rglob("*.py"))
             for v in violations(path.read_text(), str(path.relative_to(TESTS.parent)))]
    assert not found, "\n".join(found)


# The checker itself: what it must find (as the SLURM test's fixture once did) and what it must let be.
OLD_SLURM_FIXTURE = '''
import subprocess
from pathlib import Path
REPO = Path(__file__).resolve().parents[2]
SETUP = REPO / "tests" / "slurm" / "setup_slurm.sh"
SCRIPTS = (SETUP,)

def slurm_cluster():
    proc = subprocess.run(["bash", str(SETUP)], capture_output=True, text=True, timeout=900)

def lint():
    for script in SCRIPTS:
        subprocess.run(["bash", "-n", str(script)])
    subprocess.run(["shellcheck", "-x", *map(str, SCRIPTS)], cwd=REPO)
'''


@pytest.mark.parametrize("source,expected", [
    (OLD_SLURM_FIXTURE, ["setup_slurm.sh"]),
    ("import subprocess\nsubprocess.run('apt-get install -y slurm-wlm', shell=True)", ["apt-get"]),
    ("import os\nos.system('systemctl start munge')", ["systemctl"]),
    ("import subprocess, sys\nsubprocess.check_call([sys.executable, '-m', 'pip', 'install', 'x'])",
     ["pip install"]),
    ("from subprocess import Popen\nCMD = ['/usr/sbin/slurmctld']\nPopen(CMD)", ["slurmctld"]),
    ("import subprocess\ndef sh(cmd):\n    return subprocess.run(cmd, shell=True)\nsh('munged --force')", ["munged"]),
    ("import subprocess\nsubprocess.run(['bash', 'examples/torchrun_single_node.sh'], env={'A': 'slurmd'})",
     ["slurmd"]),
    ("import subprocess\nsubprocess.run(['sinfo', '--noheader'])", []),
    ("import subprocess\nsubprocess.run(['bash', '-n', 'tests/slurm/setup_slurm.sh'])", []),
    ("import shutil\nshutil.which('apt-get')\nREASON = 'pip install -e .'", []),
])
def test_the_check_finds_what_changes_the_machine(source: str, expected: list[str]) -> None:
    found = violations(source)
    assert [v.split("runs `", 1)[1].split("`", 1)[0] for v in found] == expected, found
