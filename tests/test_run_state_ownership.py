"""The parts of a training run own their state (issue 38, part 1), checked on the package's source (ast).

megatron/training_run.py composes a run from parts; each part's attributes are assigned only by the
modules listed as its owners in :data:`OWNERS` (the others read them, or call the part's methods). A
module that assigns ``other.attr`` where ``attr`` belongs to a run-state class it does not own fails, as
does a side table keyed by the run (a module-level ``WeakKeyDictionary``, or a module-level mapping
annotated with a run-state class as its key) or a ``setattr`` of a run-state attribute by name. Also:
every megatron/ module stays under 500 lines. The checks are plain functions over source text, so the
tests below first prove on small snippets that they catch what they are for.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "megatron_envpipe"

# Run-state class -> (module defining it, modules that may assign its attributes), paths under the package.
OWNERS: dict[str, tuple[str, tuple[str, ...]]] = {
    "TrainingRun": ("megatron/training_run.py", ("megatron/training_run.py",)),
    "EnvPipeRuntime": ("megatron/runtime.py", ("megatron/runtime.py",)),
    "DeviceSession": ("megatron/device_session.py", ("megatron/device_session.py",)),
    "EnergyLedger": ("megatron/energy_ledger.py", ("megatron/energy_ledger.py",)),
    # The ledger's per-GPU sums: the ledger keeps them, the reporting reads the counter into them at log points.
    "Local": ("megatron/energy_ledger.py", ("megatron/energy_ledger.py", "megatron/reporting.py")),
    "StragglerFollow": ("megatron/stragglers.py", ("megatron/stragglers.py",)),
    "FollowLedger": ("megatron/stragglers.py", ("megatron/stragglers.py",)),
    "IterationPlans": ("megatron/iteration_plans.py", ("megatron/iteration_plans.py",)),
}
# The names the package gives references to run state (``runtime``, ``self.runtime``, ``run.phases``, ...):
# assigning any attribute through one needs the class's ownership, whatever the attribute is called.
RECEIVERS = {"runtime": "EnvPipeRuntime", "rt": "EnvPipeRuntime", "phases": "EnvPipeRuntime", "run": "TrainingRun",
             "run_parts": "TrainingRun", "energy": "EnergyLedger",
             "follow": "StragglerFollow", "stragglers": "StragglerFollow", "iteration_plans": "IterationPlans",
             "session": "DeviceSession"}
MAX_MEGATRON_LINES = 500


def _class_attributes(tree: ast.Module, name: str) -> set[str]:
    """Attributes of class ``name``: its annotated fields and every ``self.x`` its methods assign."""
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == name:
            attrs = {n.target.id for n in node.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)}
            for sub in ast.walk(node):
                for target in _assigned(sub):
                    if isinstance(target.value, ast.Name) and target.value.id == "self":
                        attrs.add(target.attr)
            return attrs
    raise AssertionError(f"class {name} not found: update OWNERS in {__file__}")


def _assigned(node: ast.AST) -> list[ast.Attribute]:
    """The attribute targets ``node`` assigns (tuples unpacked)."""
    if isinstance(node, ast.Assign):
        targets = list(node.targets)
    elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
        targets = [node.target]
    else:
        return []
    out: list[ast.Attribute] = []
    while targets:
        t = targets.pop()
        if isinstance(t, (ast.Tuple, ast.List)):
            targets.extend(t.elts)
        elif isinstance(t, ast.Starred):
            targets.append(t.value)
        elif isinstance(t, ast.Attribute):
            out.append(t)
    return out


def run_state_attributes(package: Path = PACKAGE) -> dict[str, set[str]]:
    """Attribute name -> the modules allowed to assign it (the owners of every run-state class that has it)."""
    allowed: dict[str, set[str]] = {}
    for cls, (module, owners) in OWNERS.items():
        tree = ast.parse((package / module).read_text())
        for attr in _class_attributes(tree, cls):
            allowed.setdefault(attr, set()).update(owners)
    return allowed


def foreign_writes(source: str, module: str, allowed: dict[str, set[str]]) -> list[str]:
    """``module`` assigning (or ``setattr``-ing) run-state attributes it does not own."""
    found = []
    for node in ast.walk(ast.parse(source)):
        for target in _assigned(node):
            receiver = target.value
            if isinstance(receiver, ast.Name) and receiver.id in ("self", "cls"):
                continue  # a class's own state
            named = receiver.attr if isinstance(receiver, ast.Attribute) else getattr(receiver, "id", None)
            cls = RECEIVERS.get(named)
            if cls is not None and module not in OWNERS[cls][1]:
                found.append(f"{module}:{node.lineno}: assigns {ast.unparse(target)} ({cls} is owned by "
                             f"{list(OWNERS[cls][1])})")
            elif target.attr in allowed and module not in allowed[target.attr]:
                found.append(f"{module}:{node.lineno}: assigns {ast.unparse(target)} "
                             f"(owned by {sorted(allowed[target.attr])})")
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "setattr" \
                and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant) \
                and node.args[1].value in allowed and module not in allowed[node.args[1].value]:
            found.append(f"{module}:{node.lineno}: setattr(..., {node.args[1].value!r}) of run state")
    return found


def side_tables(source: str, module: str) -> list[str]:
    """Module-level tables keyed by a run (weak-keyed dictionaries, mappings keyed by a run-state class)."""
    found = []
    for node in ast.parse(source).body:
        value = node.value if isinstance(node, (ast.Assign, ast.AnnAssign)) else None
        if isinstance(value, ast.Call) and ast.unparse(value.func).split(".")[-1] in (
                "WeakKeyDictionary", "WeakValueDictionary"):
            found.append(f"{module}:{node.lineno}: module-level {ast.unparse(value.func)}")
        if isinstance(node, ast.AnnAssign):
            note = ast.unparse(node.annotation)
            if any(f"[{cls}" in note.replace('"', "").replace("'", "") for cls in OWNERS):
                found.append(f"{module}:{node.lineno}: module-level table {note} keyed by run state")
    return found


# Where run state can be reached: the Megatron edge and what sits above it. core/, planning/, config/ and gpu/
# import no megatron/ module (tests/test_architecture.py), so they never hold a run's parts.
SCANNED = ("megatron", "testing", "apps")


def _package_modules() -> list[tuple[str, str]]:
    return [(str(p.relative_to(PACKAGE)), p.read_text()) for d in SCANNED for p in sorted((PACKAGE / d).rglob("*.py"))]


# -- the checks catch what they are for ---------------------------------------------------
def test_the_checker_flags_a_foreign_write_and_a_side_table():
    allowed = run_state_attributes()
    assert {"baseline", "energy_log"} <= set(allowed) and allowed["dp_wait"] == {"megatron/stragglers.py"}
    bad = "def f(runtime, follow):\n    runtime.baseline = 1\n    follow.dp_wait, x.y = None, 2\n"
    assert len(foreign_writes(bad, "megatron/stage_iteration.py", allowed)) == 2
    mine = "def f(ledger, follow):\n    ledger.baseline = 1\n    follow.dp_wait = None\n"  # the ledger's own baseline
    assert [f.split(": ", 1)[1] for f in foreign_writes(mine, "megatron/energy_ledger.py", allowed)] == [
        "assigns follow.dp_wait (StragglerFollow is owned by ['megatron/stragglers.py'])"]
    assert foreign_writes("setattr(rt, 'pace_plan', p)\n", "megatron/runtime.py", allowed)
    assert not foreign_writes("class A:\n    def f(self):\n        self.baseline = 1\n", "megatron/x.py", allowed)
    # What the run was before its composition root: the reporting set the runtime's baseline, the straggler
    # follower its dp_wait, the per-iteration plans attached themselves to it; each is caught by its receiver.
    before = ("runtime.baseline = Baseline()\n", "self.runtime.dp_wait = (1, 2.0)\n", "runtime.iteration_plans = p\n")
    for module, line in zip(("megatron/reporting.py", "megatron/stragglers.py", "megatron/iteration_plans.py"),
                            before, strict=True):
        assert foreign_writes(line, module, allowed), line
    assert side_tables("import weakref\n_LOCAL = weakref.WeakKeyDictionary()\n", "megatron/x.py")
    assert side_tables('_FOLLOW: "dict[EnvPipeRuntime, int]" = {}\n', "megatron/x.py")
    assert not side_tables("_WARNED: set[str] = set()\n", "megatron/x.py")


# -- the package ------------------------------------------------------------------------------
def test_no_module_assigns_run_state_it_does_not_own():
    allowed = run_state_attributes()
    found = [f for module, source in _package_modules() for f in foreign_writes(source, module, allowed)]
    assert not found, "\n".join(found)


def test_no_side_tables_keyed_by_the_run():
    found = [f for module, source in _package_modules() for f in side_tables(source, module)]
    assert not found, "\n".join(found)


def test_megatron_modules_stay_small():
    big = {str(p.relative_to(PACKAGE)): n for p in sorted((PACKAGE / "megatron").glob("*.py"))
           if (n := len(p.read_text().splitlines())) >= MAX_MEGATRON_LINES}
    assert not big, f"split by job (issue 38): {big}"
