"""The parts of a training run own their state (issue 38, part 1), checked on the package's source (ast).

megatron/training_run.py composes a run from parts; each part's attributes are assigned, and its containers
changed, only by the modules listed as its owners in :data:`OWNERS` (the others read them, or call the part's
methods). Which part a write reaches is worked out from the objects, not from attribute names: a receiver's
class comes from a parameter's annotation, a local assigned from a known receiver, the run-state classes'
own attributes (``TrainingRun.phases`` is an ``EnvPipeRuntime``, its ``measured`` a ``MeasuredRuns``, ...),
the process-wide ``STATE`` (an ``ExecutorState``), or, for receivers nothing annotates, the names the package
gives them (:data:`RECEIVERS`). A write whose receiver stays unknown is judged by its attribute's name, where
only one run-state class has that name and no other class of the package assigns it.

Checked: no module assigns (``=``, ``+=``, ``setattr``) a part's attributes it does not own, or changes a
part's containers (``x.part.items.append(...)``, ``x.part.table[k] = v``, ``del x.part.table[k]``); the set-up
objects are frozen; no side table keyed by the run; every module-level mutable value in megatron/ is listed in
:data:`MODULE_STATE` (owned state, changed only by its owners) or :data:`CONSTANTS` (changed by nobody); every
megatron/ module stays under 500 lines. The checks are plain functions over source text, so the tests below
first prove on small snippets of each bad pattern that they catch it.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "megatron_envpipe"

# Run-state class -> (module defining it, modules that may assign its attributes), paths under the package.
OWNERS: dict[str, tuple[str, tuple[str, ...]]] = {
    "TrainingRun": ("megatron/training_run.py", ("megatron/training_run.py",)),
    "EnvPipeRuntime": ("megatron/runtime.py", ("megatron/runtime.py",)),  # the phase machine
    "ProfileSource": ("megatron/profile_source.py", ("megatron/profile_source.py",)),
    "MeasuredRuns": ("megatron/phase_parts.py", ("megatron/phase_parts.py",)),
    "BaselineRuns": ("megatron/phase_parts.py", ("megatron/phase_parts.py",)),
    "BaselineRefresh": ("megatron/baseline_refresh.py", ("megatron/baseline_refresh.py",)),
    "EnergyLedger": ("megatron/energy_ledger.py", ("megatron/energy_ledger.py",)),
    # The ledger's per-GPU sums: the ledger keeps them, the reporting reads the counter into them at log points.
    "Local": ("megatron/energy_ledger.py", ("megatron/energy_ledger.py", "megatron/reporting.py")),
    "EnergyReporting": ("megatron/reporting.py", ("megatron/reporting.py",)),
    "StragglerFollow": ("megatron/stragglers.py", ("megatron/stragglers.py",)),
    "_FollowLedger": ("megatron/stragglers.py", ("megatron/stragglers.py",)),
    "IterationPlans": ("megatron/iteration_plans.py", ("megatron/iteration_plans.py",)),
    "_PlanStats": ("megatron/iteration_plans.py", ("megatron/iteration_plans.py",)),
    # The executor's process-wide state (megatron/state.py's STATE): install() and set-up go through its methods.
    "ExecutorState": ("megatron/state.py", ("megatron/state.py",)),
}
# Set up once, replaced whole: frozen dataclasses (an assignment fails at run time; they must stay frozen).
FROZEN: dict[str, str] = {
    "RunSetup": "megatron/phase_parts.py",
    "MadePlan": "megatron/phase_parts.py",
    "DeviceSession": "megatron/device_session.py",
    "ClockTiming": "megatron/device_session.py",
    "IterationStep": "megatron/run_parts.py",
    "SimStraggler": "megatron/stragglers.py",
}
# What the package calls references to run state where no annotation says (``self.runtime``, ``rt``, ...).
RECEIVERS = {"runtime": "EnvPipeRuntime", "rt": "EnvPipeRuntime", "phases": "EnvPipeRuntime", "run": "TrainingRun",
             "run_parts": "TrainingRun", "energy": "EnergyLedger", "ledger": "EnergyLedger",
             "follow": "StragglerFollow", "stragglers": "StragglerFollow", "iteration_plans": "IterationPlans",
             "session": "DeviceSession", "STATE": "ExecutorState"}
# Module-level mutable values in megatron/: "module:NAME" -> the modules that may change it (its part's class
# for an instance of one); and the constants, which no module changes.
MODULE_STATE: dict[str, tuple[str, ...] | str] = {
    "megatron/state.py:STATE": "ExecutorState",
    "megatron/patch.py:_saved": ("megatron/patch.py",),  # Megatron's functions install() replaced
    "megatron/reporting.py:_WARNED": ("megatron/reporting.py",),  # warnings said once per process
    "megatron/host_p2p.py:_ACTIVE": ("megatron/host_p2p.py",),  # the staging counts of the active transport
}
CONSTANTS = {"megatron/channels.py:_DESC", "megatron/channels.py:_DATA_OF", "megatron/channels.py:_DATA_RECV",
             "megatron/compat.py:_FORWARD_STEP_OPTIONAL", "megatron/gpt_provider.py:ARGS_DEFAULTS",
             "megatron/patch.py:_NOT_REPLACED", "megatron/phase_parts.py:MEMORY_ITERATIONS"}
# Writes to run state that are instrumentation, not state, and why (each must still occur).
INSTRUMENTATION = {("testing/monitor_runs.py", "STATE.use_hooks"): "the harness wraps the hooks' installer to "
                                                                    "record every unit the hooks are told of"}
MUTATORS = {"append", "extend", "insert", "add", "update", "setdefault", "pop", "popitem", "remove", "discard",
            "clear", "sort", "reverse", "appendleft", "popleft", "__setitem__", "__delitem__"}
MUTABLE_CALLS = {"dict", "list", "set", "defaultdict", "OrderedDict", "deque", "Counter", "WeakKeyDictionary",
                 "WeakValueDictionary", "WeakSet"}
MAX_MEGATRON_LINES = 500
KNOWN = set(OWNERS) | set(FROZEN)


# -- what the run-state classes hold ----------------------------------------------------------------
def _class_node(tree: ast.Module, name: str) -> ast.ClassDef:
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == name:
            return node
    raise AssertionError(f"class {name} not found: update OWNERS/FROZEN in {__file__}")


def _known_in(note: ast.AST | None) -> str | None:
    """The run-state class an annotation names (``X``, ``X | None``, ``"X"``), if one."""
    if note is None:
        return None
    text = ast.unparse(note).replace('"', "").replace("'", "")
    found = [c for c in KNOWN if c in {w.strip() for w in text.replace("|", " ").replace("[", " ").split()}]
    return found[0] if len(found) == 1 else None


def _assigned(node: ast.AST) -> list[ast.expr]:
    """The targets ``node`` assigns or deletes (tuples unpacked)."""
    if isinstance(node, ast.Assign):
        targets = list(node.targets)
    elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
        targets = [node.target]
    elif isinstance(node, ast.Delete):
        targets = list(node.targets)
    else:
        return []
    out: list[ast.expr] = []
    while targets:
        t = targets.pop()
        if isinstance(t, (ast.Tuple, ast.List)):
            targets.extend(t.elts)
        elif isinstance(t, ast.Starred):
            targets.append(t.value)
        else:
            out.append(t)
    return out


def _self_attr(target: ast.expr) -> str | None:
    if isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name) and target.value.id == "self":
        return target.attr
    return None


def class_shapes(package: Path = PACKAGE) -> tuple[dict[str, set[str]], dict[str, dict[str, str]], set[str]]:
    """Per run-state class: its attributes (annotated fields, every ``self.x`` its methods assign), the run-state
    class each attribute holds where known (``self.x = Part(...)``, an annotated ``self.x: Part``, a parameter
    annotated ``Part``), and its methods."""
    attrs: dict[str, set[str]] = {}
    types: dict[str, dict[str, str]] = {}
    methods: set[str] = set()
    for cls in KNOWN:
        module = OWNERS[cls][0] if cls in OWNERS else FROZEN[cls]
        node = _class_node(ast.parse((package / module).read_text()), cls)
        mine, typed = set(), {}
        for item in node.body:
            if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                mine.add(item.target.id)
                if (known := _known_in(item.annotation)) is not None:
                    typed[item.target.id] = known
            elif isinstance(item, ast.FunctionDef):
                methods.add(f"{cls}.{item.name}")
                params = {a.arg: _known_in(a.annotation) for a in item.args.args + item.args.kwonlyargs}
                for sub in ast.walk(item):
                    for target in _assigned(sub):
                        if (name := _self_attr(target)) is None:
                            continue
                        mine.add(name)
                        value = getattr(sub, "value", None)
                        known = _known_in(sub.annotation) if isinstance(sub, ast.AnnAssign) else None
                        if isinstance(value, ast.Call) and isinstance(value.func, ast.Name) and value.func.id in KNOWN:
                            known = value.func.id
                        elif isinstance(value, ast.Name) and params.get(value.id):
                            known = params[value.id]
                        if known is not None:
                            typed[name] = known
        attrs[cls], types[cls] = mine, typed
    return attrs, types, methods


def name_owners(package: Path = PACKAGE) -> dict[str, set[str]]:
    """Attribute name -> its owners, for names that tell the class on their own: held by one run-state class
    only, and assigned by no other class of the scanned package."""
    attrs, _, _ = class_shapes(package)
    by_name: dict[str, set[str]] = {}
    for cls, names in attrs.items():
        if cls in OWNERS:
            for name in names:
                by_name.setdefault(name, set()).add(cls)
    elsewhere: set[str] = set()
    for source in (p.read_text() for p in sorted(package.rglob("*.py"))):
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.ClassDef) and node.name not in KNOWN:
                elsewhere |= {n for sub in ast.walk(node) for t in _assigned(sub) if (n := _self_attr(t))}
    return {name: set(OWNERS[next(iter(classes))][1]) for name, classes in by_name.items()
            if len(classes) == 1 and name not in elsewhere}


# -- which part a write reaches -------------------------------------------------------------------
class _Scope:
    """Resolves receivers to run-state classes within one function (or module) of one module."""

    def __init__(self, types: dict[str, dict[str, str]], cls: str | None, env: dict[str, str]) -> None:
        self.types, self.cls, self.env = types, cls, env

    def resolve(self, expr: ast.expr) -> str | None:
        if isinstance(expr, ast.Name):
            if expr.id == "self":
                return self.cls
            return self.env.get(expr.id) or RECEIVERS.get(expr.id)
        if isinstance(expr, ast.Attribute):
            base = self.resolve(expr.value)
            if base is not None and base in self.types:
                return self.types[base].get(expr.attr)
            return RECEIVERS.get(expr.attr)
        if isinstance(expr, ast.Call) and isinstance(expr.func, ast.Name) and expr.func.id in KNOWN:
            return expr.func.id
        return None


def _scopes(tree: ast.Module, types: dict[str, dict[str, str]]):
    """(statements, scope) per function of the module (and the module's own statements), with its locals'
    run-state classes: annotated parameters and names assigned from a known receiver, in source order."""
    def walk(node: ast.AST, cls: str | None):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ClassDef):
                yield from walk(child, child.name if child.name in KNOWN else None)
            elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                env = {a.arg: k for a in child.args.args + child.args.kwonlyargs
                       if (k := _known_in(a.annotation)) is not None}
                scope = _Scope(types, cls, env)
                body = [n for n in ast.walk(child) if n is not child]
                for n in body:  # locals assigned from a known receiver: ``rt = self.runtime``
                    if isinstance(n, ast.Assign) and len(n.targets) == 1 and isinstance(n.targets[0], ast.Name):
                        if (known := scope.resolve(n.value)) is not None:
                            env.setdefault(n.targets[0].id, known)
                yield body, scope
    module_nodes = [n for stmt in tree.body if not isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef,
                                                                     ast.ClassDef)) for n in ast.walk(stmt)]
    yield module_nodes, _Scope(types, None, {})
    yield from walk(tree, None)


def _owned_by(cls: str) -> tuple[str, ...]:
    return OWNERS[cls][1] if cls in OWNERS else ()


def foreign_writes(source: str, module: str, shapes=None, by_name: dict[str, set[str]] | None = None) -> list[str]:
    """``module`` assigning run-state attributes it does not own, or changing another part's containers."""
    _, types, methods = shapes if shapes is not None else class_shapes()
    by_name = by_name if by_name is not None else name_owners()
    found, tree = [], ast.parse(source)

    def flag(node: ast.AST, what: str, cls: str | None, owners: set[str] | tuple[str, ...]) -> None:
        if module in owners:
            return
        whose = f"{cls} is owned by {list(owners)}" if cls else f"owned by {sorted(owners)}"
        if cls in FROZEN:
            whose = f"{cls} is frozen: set up once"
        found.append(f"{module}:{node.lineno}: {what} ({whose})")

    for body, scope in _scopes(tree, types):
        for node in body:
            for target in _assigned(node):
                verb = "deletes" if isinstance(node, ast.Delete) else "assigns"
                if isinstance(target, ast.Attribute) and not _self_attr(target):
                    cls = scope.resolve(target.value)
                    if cls is not None:
                        if f"{cls}.{target.attr}" in methods and (module, ast.unparse(target)) in INSTRUMENTATION:
                            continue  # a method wrapped by a test harness (listed with why)
                        flag(node, f"{verb} {ast.unparse(target)}", cls, _owned_by(cls))
                    elif target.attr in by_name:
                        flag(node, f"{verb} {ast.unparse(target)}", None, by_name[target.attr])
                elif isinstance(target, ast.Subscript) and isinstance(target.value, ast.Attribute):
                    holder = target.value  # x.part.table[k] = v: the part's container
                    cls = scope.resolve(holder.value)
                    if cls is not None:
                        flag(node, f"changes {ast.unparse(holder)}[...]", cls, _owned_by(cls))
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in MUTATORS:
                holder = node.func.value  # x.part.items.append(...)
                if isinstance(holder, ast.Attribute):
                    cls = scope.resolve(holder.value)
                    if cls is not None and scope.resolve(holder) is None:  # a part's method is its interface
                        flag(node, f"changes {ast.unparse(holder)} (.{node.func.attr})", cls, _owned_by(cls))
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "setattr" \
                    and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant):
                cls = scope.resolve(node.args[0])
                name = node.args[1].value
                if cls is not None:
                    flag(node, f"setattr(..., {name!r})", cls, _owned_by(cls))
                elif name in by_name:
                    flag(node, f"setattr(..., {name!r})", None, by_name[name])
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


# -- module-level state ------------------------------------------------------------------------------
def module_values(source: str, module: str) -> list[str]:
    """``module:NAME`` of each module-level name bound to a mutable value: a dict/list/set display or
    comprehension, a call of a container type, or an instance of a class (of this module or run state)."""
    tree = ast.parse(source)
    classes = {n.name for n in tree.body if isinstance(n, ast.ClassDef)} | KNOWN
    found = []
    for node in tree.body:
        if not isinstance(node, (ast.Assign, ast.AnnAssign)) or node.value is None:
            continue
        value = node.value
        mutable = isinstance(value, (ast.Dict, ast.List, ast.Set, ast.DictComp, ast.ListComp, ast.SetComp)) or (
            isinstance(value, ast.Call) and ast.unparse(value.func).split(".")[-1] in MUTABLE_CALLS | classes)
        targets = node.targets if isinstance(node, ast.Assign) else [node.target]
        if mutable:
            found += [f"{module}:{t.id}" for t in targets if isinstance(t, ast.Name) and t.id != "__all__"]
    return found


def module_state_changes(source: str, module: str, listed: dict[str, tuple[str, ...] | str],
                         constants: set[str]) -> list[str]:
    """Changes of a listed module-level value (item assignment, a mutating call, ``+=``, rebinding through
    ``global``) by a module that does not own it, or of a constant by any module."""
    names: dict[str, tuple[str, ...]] = {}
    for key, owners in listed.items():
        if not isinstance(owners, str):  # an instance of a run-state class: the ownership check covers it
            names[key.split(":")[1]] = owners
    for key in constants:
        names[key.split(":")[1]] = ()
    found = []
    for node in ast.walk(ast.parse(source)):
        roots: list[ast.expr] = []
        for target in _assigned(node):
            if isinstance(target, ast.Subscript):
                roots.append(target.value)
            elif isinstance(target, ast.Name) and isinstance(node, ast.AugAssign):
                roots.append(target)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in MUTATORS:
            roots.append(node.func.value)
        if isinstance(node, ast.Global):
            roots += [ast.Name(id=n, lineno=node.lineno) for n in node.names]
        for root in roots:
            if isinstance(root, ast.Name) and root.id in names and module not in names[root.id]:
                what = "a constant" if not names[root.id] else f"owned by {list(names[root.id])}"
                found.append(f"{module}:{node.lineno}: changes {root.id} ({what})")
    return found


# Where run state can be reached: the Megatron edge and what sits above it. core/, planning/, config/ and gpu/
# import no megatron/ module (tests/test_architecture.py), so they never hold a run's parts.
SCANNED = ("megatron", "testing", "apps")


def _package_modules(package: Path = PACKAGE) -> list[tuple[str, str]]:
    return [(str(p.relative_to(package)), p.read_text()) for d in SCANNED for p in sorted((package / d).rglob("*.py"))]


# -- the checks catch what they are for ---------------------------------------------------
def test_the_checker_flags_foreign_writes_by_object_and_by_name():
    shapes, by_name = class_shapes(), name_owners()
    attrs, types, _ = shapes
    # The classes' shapes are read off the source: the run's parts and what they hold.
    assert types["TrainingRun"]["phases"] == "EnvPipeRuntime" and types["EnvPipeRuntime"]["measured"] == "MeasuredRuns"
    assert types["EnvPipeRuntime"]["setup"] == "RunSetup" and types["BaselineRuns"]["refresh"] == "BaselineRefresh"
    assert types["EnergyLedger"]["phases"] == "EnvPipeRuntime" and "dp_wait" in attrs["StragglerFollow"]

    def writes(src: str, module: str = "megatron/stage_iteration.py") -> list[str]:
        return foreign_writes(src, module, shapes, by_name)

    bad = "def f(runtime, follow):\n    runtime.baseline = 1\n    follow.dp_wait, x.y = None, 2\n"
    assert len(writes(bad)) == 2
    mine = "def f(ledger, follow):\n    ledger.baseline = 1\n    follow.dp_wait = None\n"  # the ledger's own baseline
    assert [f.split(": ", 1)[1] for f in writes(mine, "megatron/energy_ledger.py")] == [
        "assigns follow.dp_wait (StragglerFollow is owned by ['megatron/stragglers.py'])"]
    assert writes("setattr(follow, 'pace_plan', p)\n", "megatron/runtime.py")
    assert writes("setattr(x, 'pace_plan', p)\n", "megatron/runtime.py")  # by the name: StragglerFollow's
    assert not writes("class A:\n    def f(self):\n        self.baseline = 1\n", "megatron/x.py")
    # By the object, whatever the names: an annotated parameter, a local taken from it, a part's part.
    by_object = ("def f(x: TrainingRun):\n    x.phases.profiles.profile = None\n",
                 "def f(x: 'EnvPipeRuntime'):\n    m = x.measured\n    m.times = {}\n",
                 "def f(s):\n    s.run.phases.baselines.refresh.span = 3\n",
                 "def f(run):\n    run.phases.iteration += 1\n",
                 "def f(run):\n    run.phases.setup = None\n")
    for src in by_object:
        assert writes(src), src
    # Within the phase machine itself, its parts' state goes through their methods.
    inside = "class EnvPipeRuntime:\n    def f(self):\n        self.baselines.runs += 1\n"
    assert writes(inside, "megatron/runtime.py") and not writes(inside, "megatron/phase_parts.py")
    assert not writes("class EnvPipeRuntime:\n    def f(self):\n        self.iteration += 1\n", "megatron/runtime.py")
    # The set-up objects are frozen: nobody assigns them, not even their module.
    assert "frozen" in writes("def f(rt):\n    rt.setup.num_chunks = 2\n", "megatron/runtime.py")[0]
    # An unknown receiver is judged by an attribute name that tells the class: not by a common one.
    assert writes("def f(x):\n    x.dp_wait = None\n") and not writes("def f(x):\n    x.profile = None\n")
    # What the run was before its composition root: the reporting set the runtime's baseline, the straggler
    # follower its dp_wait, the per-iteration plans attached themselves to it; each is caught by its receiver.
    before = ("runtime.baseline = Baseline()\n", "self.runtime.dp_wait = (1, 2.0)\n", "runtime.iteration_plans = p\n")
    for module, line in zip(("megatron/reporting.py", "megatron/stragglers.py", "megatron/iteration_plans.py"),
                            before, strict=True):
        assert writes("def f(self, runtime):\n    " + line, module), line
    assert side_tables("import weakref\n_LOCAL = weakref.WeakKeyDictionary()\n", "megatron/x.py")
    assert side_tables('_FOLLOW: "dict[EnvPipeRuntime, int]" = {}\n', "megatron/x.py")
    assert not side_tables("_WARNED: set[str] = set()\n", "megatron/x.py")


def test_the_checker_flags_changes_of_another_parts_containers():
    shapes, by_name = class_shapes(), name_owners()

    def writes(src: str, module: str = "megatron/stage_iteration.py") -> list[str]:
        return foreign_writes(src, module, shapes, by_name)

    bad = ("def f(run):\n    run.energy.energy_log.append(r)\n",  # x.part.items.append(...)
           "def f(rt):\n    rt.measured.budgets[(4, 8)] = None\n",  # x.part.table[k] = v
           "def f(rt):\n    del rt.measured.budgets[(4, 8)]\n",
           "def f(rt):\n    rt.measured.times.setdefault(k, []).append(m)\n",
           "def f(rt):\n    rt.measured.memory[k] += [m]\n",
           "def f(run):\n    run.phases.baselines.runs += 1\n",  # +=
           "def f():\n    STATE.channels[k] = c\n",  # the executor's process-wide state
           "def f():\n    STATE.warned.add('x')\n",
           "def f():\n    STATE.shown_program = p\n")
    for src in bad:
        assert writes(src), src
    # The owner changes its own containers; anyone calls a part's methods (its interface) or reads.
    assert not writes("def f(rt):\n    rt.measured.times.setdefault(k, []).append(m)\n", "megatron/phase_parts.py")
    assert not writes("def f():\n    STATE.warned.add('x')\n", "megatron/state.py")
    fine = ("def f(rt, run):\n    rt.baselines.refresh.due(3)\n    run.energy.add_iteration(e, 1)\n"
            "    STATE.warn_once('x')\n    n = len(rt.measured.times)\n    local_list.append(rt.iteration)\n")
    assert not writes(fine)


def test_the_checker_flags_unlisted_and_foreign_changed_module_state():
    assert module_values("_CACHE: dict[str, int] = {}\nSTATE = ExecutorState()\nN = 3\nT = (1, 2)\n",
                         "megatron/x.py") == ["megatron/x.py:_CACHE", "megatron/x.py:STATE"]
    listed = {"megatron/x.py:_SEEN": ("megatron/x.py",)}
    constants = {"megatron/x.py:LIMITS"}
    bad = ("_SEEN.add(1)\n", "def f():\n    _SEEN[k] = 1\n", "def f():\n    global _SEEN\n    _SEEN = set()\n")
    for src in bad:
        assert module_state_changes(src, "megatron/y.py", listed, constants), src
        assert not module_state_changes(src, "megatron/x.py", listed, constants), src
    for src in ("LIMITS['a'] = 1\n", "LIMITS.update(a=1)\n", "def f():\n    LIMITS['a'] += 1\n"):
        assert module_state_changes(src, "megatron/x.py", listed, constants), src  # a constant: not even its own
    assert not module_state_changes("n = LIMITS['a']\nx = _SEEN.copy()\n", "megatron/y.py", listed, constants)


# -- the package ------------------------------------------------------------------------------
def test_no_module_assigns_run_state_it_does_not_own():
    shapes, by_name = class_shapes(), name_owners()
    found = [f for module, source in _package_modules() for f in foreign_writes(source, module, shapes, by_name)]
    assert not found, "\n".join(found)


def test_instrumentation_exceptions_still_occur():
    for module, what in INSTRUMENTATION:
        assert what in (PACKAGE / module).read_text(), f"stale INSTRUMENTATION entry: {module} {what}"


def test_the_set_up_objects_are_frozen():
    for cls, module in FROZEN.items():
        node = _class_node(ast.parse((PACKAGE / module).read_text()), cls)
        assert any("frozen=True" in ast.unparse(d) for d in node.decorator_list), f"{module}:{cls} is not frozen"


def test_no_side_tables_keyed_by_the_run():
    found = [f for module, source in _package_modules() for f in side_tables(source, module)]
    assert not found, "\n".join(found)


def test_module_level_state_is_listed_and_changed_only_by_its_owners():
    megatron = [(m, s) for m, s in _package_modules() if m.startswith("megatron/")]
    values = {v for module, source in megatron for v in module_values(source, module)}
    unlisted = sorted(values - set(MODULE_STATE) - CONSTANTS)
    assert not unlisted, f"module-level mutable state: give it to a part, or list it in MODULE_STATE/CONSTANTS: {unlisted}"
    stale = sorted((set(MODULE_STATE) | CONSTANTS) - values)
    assert not stale, f"no longer module-level mutable values (remove them): {stale}"
    for key, owners in MODULE_STATE.items():
        assert not isinstance(owners, str) or owners in OWNERS, key
    found = [f for module, source in _package_modules()
             for f in module_state_changes(source, module, MODULE_STATE, CONSTANTS)]
    assert not found, "\n".join(found)


def test_megatron_modules_stay_small():
    big = {str(p.relative_to(PACKAGE)): n for p in sorted((PACKAGE / "megatron").glob("*.py"))
           if (n := len(p.read_text().splitlines())) >= MAX_MEGATRON_LINES}
    assert not big, f"split by job (issue 38): {big}"
