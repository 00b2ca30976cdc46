"""Extension points stay extension points (issue 38), read off the source with ``ast``:

* device kinds are asked as capabilities, never tested by name outside the device layer
  (no ``startswith("simulated")``, no ``.simulated`` of a device);
* deliberate errors are ``EnvPipeError``s: no bare ``raise ValueError/RuntimeError/TypeError``
  on a package path, but for the internal invariants listed here with the reason;
* no public name that nothing but its own module uses, but for the entry points below. "Uses" is
  read off identifiers: another module names it (a name, an attribute, an import), or it is part of
  the interface of a function or class that another module uses: a parameter or return annotation of
  that function, of the class's ``__init__`` or of a method another module names, or the annotation of
  one of the class's public attributes (a dataclass field), or an exception class that function raises.
  A result type is public with its function even when no caller spells it; nothing else is exempt (see
  ``_lonely_public_names``). Tests and benches do not count as uses: a tunable, helper or error class only
  its module uses is private (``_name``) even when a test reaches it. The package itself may not use
  another module's private names (tests/test_architecture.py checks that), but a test or bench may reach
  the private names of the module it tests or measures. Code only tests and benches call lives in
  ``megatron_envpipe/testing/``;
* plan types and schedulings are asked as registry capabilities (core/kinds.py), never compared by name
  outside the registry modules, but for the comparisons listed with the reason.

Every allow-list is checked for stale entries too, so it cannot outlive what it excuses.
"""

from __future__ import annotations

import ast
import textwrap
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
PACKAGE = REPO / "megatron_envpipe"
# The device layer: where backends are named and modelled.
DEVICE_LAYER = ("gpu/", "core/device_backends.py")
# Test support, not a user path: its checks are the tests' own assertions.
NOT_USER_PATHS = ("testing/",)


def _sources() -> dict[str, str]:
    return {p.relative_to(PACKAGE).as_posix(): p.read_text() for p in sorted(PACKAGE.rglob("*.py"))}


SOURCES = _sources()
TREES = {rel: ast.parse(src, rel) for rel, src in SOURCES.items()}


def _outside(prefixes: tuple[str, ...]) -> dict[str, ast.Module]:
    return {rel: tree for rel, tree in TREES.items() if not rel.startswith(prefixes)}


# -- device kinds ------------------------------------------------------------------------------

# `.simulated` read outside the device layer on these receivers: a record's provenance label
# ("these figures are simulated"), copied into output, not a test of what a device is.
SIMULATED_LABELS = {
    ("core/energy_report.py", "self"): "EnergyReport.simulated labels the report's figures",
    ("core/energy_csv.py", "report"): "the CSV's simulated column of an EnergyReport",
    ("core/calibration.py", "self"): "Calibration.simulated: a preset made on the simulated GPU says so",
    ("core/calibration.py", "c"): "the same Calibration label, in its TOML",
    ("apps/gpu_check/preset_step.py", "calibration"): "the same Calibration label, in the step's figures",
    ("megatron/reporting.py", "report"): "an EnergyReport's label in the energy line",
    ("megatron/stragglers.py", "report"): "an EnergyReport's label in the straggler line",
}


def test_no_simulated_name_tests_outside_the_device_layer():
    found = [f"{rel}:{node.lineno}" for rel, tree in _outside(DEVICE_LAYER).items() for node in ast.walk(tree)
             if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
             and node.func.attr == "startswith" and node.args and isinstance(node.args[0], ast.Constant)
             and str(node.args[0].value).startswith("simulated")]
    assert not found, ("ask core.device_backends (backend_traits(spec).modelled, model_profile(spec)) instead of "
                       f"testing the spec's name: {found}")


def test_no_simulated_attribute_outside_the_device_layer():
    seen, found = set(), []
    for rel, tree in _outside(DEVICE_LAYER).items():
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and node.attr == "simulated":
                key = (rel, ast.unparse(node.value))
                seen.add(key)
                if key not in SIMULATED_LABELS:
                    found.append(f"{rel}:{node.lineno} {key[1]}.simulated")
    assert not found, "ask device.capabilities().modelled (or DeviceFacts.modelled) instead: " + ", ".join(found)
    stale = sorted(set(SIMULATED_LABELS) - seen)
    assert not stale, f"allow-list entries that no longer occur (remove them): {stale}"


# -- plan types and schedulings --------------------------------------------------------------------

# Where kinds are named and registered: their capabilities are written there.
KIND_REGISTRY = ("core/kinds.py", "core/kind_registry.py", "core/vocabulary.py")
BUILTIN_KINDS = {"baseline", "uniform", "envelope", "optimal", "1f1b", "ours", "interleaved"}
# (module, the comparison as ast.unparse writes it) -> why it stays a comparison of names.
ALLOWED_KIND_COMPARISONS = {
    ("config/settings.py", "self.plan_type == PlanType.BASELINE"):
        "is_stock: Megatron's own defaults by name (a new kind without capabilities is not stock)",
    ("config/settings.py", "self.scheduling == Scheduling.ONE_F_ONE_B"): "is_stock, as above",
    ("core/sizes.py", "str(plan_type) == 'optimal'"):
        "below the registry in the import order (core/kinds imports core/interleaved, which imports core/sizes)",
    ("core/sizes.py", "str(plan_type) != 'baseline'"): "the same size check, as above",
}


def _names_a_kind(node: ast.expr, strings: bool) -> bool:
    """``PlanType.X`` / ``Scheduling.X`` (or a tuple of them), or (``strings``) a built-in kind's name."""
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in ("PlanType", "Scheduling"):
        return True
    if strings and isinstance(node, ast.Constant) and node.value in BUILTIN_KINDS:
        return True
    return isinstance(node, ast.Tuple | ast.List | ast.Set) and any(_names_a_kind(e, strings) for e in node.elts)


def _is_kind_value(node: ast.expr) -> bool:
    """A plan type or scheduling value by its name: ``x.plan_type``, ``scheduling``, ``args.type``, ``str(...)``."""
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "str" and node.args:
        return _is_kind_value(node.args[0])
    name = node.attr if isinstance(node, ast.Attribute) else node.id if isinstance(node, ast.Name) else ""
    return name in ("plan_type", "scheduling", "type")


def _kind_comparisons(tree: ast.Module) -> list[tuple[int, str]]:
    """``== / != / is / is not / in / not in`` against a vocabulary member, and ``== / !=`` between a plan
    type or scheduling value and a built-in kind's name as a string."""
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Compare):
            continue
        sides = [node.left, *node.comparators]
        members = any(_names_a_kind(e, strings=False) for e in sides) and any(
            isinstance(op, ast.Eq | ast.NotEq | ast.Is | ast.IsNot | ast.In | ast.NotIn) for op in node.ops)
        strings = any(isinstance(op, ast.Eq | ast.NotEq) for op in node.ops) and any(
            _names_a_kind(e, strings=True) for e in sides) and any(_is_kind_value(e) for e in sides)
        if members or strings:
            found.append((node.lineno, ast.unparse(node)))
    return found


def test_plan_types_and_schedulings_are_asked_for_capabilities():
    found = {(rel, text): line for rel, tree in _outside(KIND_REGISTRY).items()
             for line, text in _kind_comparisons(tree)}
    new = sorted(f"{rel}:{line} {text}" for (rel, text), line in found.items() if (rel, text) not in ALLOWED_KIND_COMPARISONS)
    assert not new, ("ask core.kinds (plan_kind(t).has_deadline / .optimized / .sets_clocks / .per_iteration_plans / "
                     ".follows_stragglers, scheduling_kind(s).extra_warmup / .model_chunks / .own_baseline; add a "
                     "capability to kind_registry's entry if one is missing) instead of comparing names:\n"
                     + "\n".join(new))
    stale = sorted(set(ALLOWED_KIND_COMPARISONS) - set(found))
    assert not stale, f"allow-list entries that no longer occur (remove them): {stale}"


def test_the_kind_comparison_scan_sees_each_spelling():
    source = textwrap.dedent("""
        if config.plan_type == PlanType.OPTIMAL: ...
        if cfg.scheduling in (Scheduling.OURS, Scheduling.ONE_F_ONE_B): ...
        if schedule.name is not Scheduling.INTERLEAVED: ...
        if str(plan_type) != "baseline": ...
        if args.type == "optimal": ...
        if "baseline" in data: ...        # a dictionary key, not a kind
        if kept == "envelope": ...        # a detail's value, not a plan type's
        if plan_kind(config.plan_type).has_deadline: ...
    """)
    assert [line for line, _ in _kind_comparisons(ast.parse(source))] == [2, 3, 4, 5, 6]


# -- deliberate errors -------------------------------------------------------------------------

BARE = ("ValueError", "RuntimeError", "TypeError")
# (module, start of the message) -> why a builtin stays: an internal invariant (a bug if it fires,
# never the user's input), or an error that mirrors a library's own builtin.
ALLOWED_BARE_RAISES = {
    ("megatron/runtime.py", "EnvPipe: the model chunks per stage changed"): "invariant: Megatron keeps its chunks",
    ("megatron/stage_iteration.py", "EnvPipe: the plan has "): "invariant: plans are made for the model's chunks",
    ("megatron/stage_iteration.py", "EnvPipe stage "): "invariant: a program ends with no live transfers",
    ("megatron/host_p2p.py", "batch_isend_irecv: the list"): "mirrors torch.distributed's own ValueError",
    ("megatron/channels.py", "EnvPipe stage "): "invariant: the deadlock-proved programs post in order",
    ("megatron/compat.py", "megatron-core "): "mirrors Python's TypeError for an unexpected keyword",
    ("megatron/compat.py", "seed "): "mirrors Megatron's CudaRNGStatesTracker.add",
    ("megatron/compat.py", "rng state "): "mirrors Megatron's CudaRNGStatesTracker.add",
    ("gpu/energy/monitor.py", "window ends before it starts"): "invariant: windows are the executor's own marks",
    ("gpu/energy/monitor.py", "average power needs a window"): "invariant: windows are the executor's own marks",
    ("gpu/startup.py", "combine_stage_devices needs"): "invariant: every rank gathers at least itself",
    ("gpu/profiler/sweep_lengths.py", ""): "invariant: sizes come with the executor's own unit windows",
    ("gpu/profiler/attribution.py", "windows overlap"): "invariant: a stage's units never overlap",
    ("gpu/profiler/profile_cache.py", "profile cache key is not plain"): "invariant: the key is built from plain data",
    ("gpu/hooks.py", ""): "invariant: the plan and windows the executor hands its own hooks agree",
    ("gpu/control/clocks.py", "a clock request's delay"): "invariant: delays are computed, never given",
    ("gpu/profiler/sweep.py", "recorded an iteration at"): "invariant: the executor records what the sweep asked",
    ("gpu/profiler/sweep.py", "no stages in the samples"): "invariant: the executor records what the sweep asked",
    ("gpu/profiler/sweep.py", "got samples of"): "invariant: the executor records what the sweep asked",
    ("gpu/profiler/sweep.py", "stage "): "invariant: the executor records what the sweep asked",
    ("gpu/profiler/sweep.py", "no "): "invariant: the executor records what the sweep asked",
    ("gpu/profiler/sweep_readout.py", "no clock has been measured"): "invariant: the runtime asks after a measured clock",
    ("gpu/profiler/sweep_stats.py", "no values"): "invariant: statistics of at least one sample",
    ("gpu/control/state_store.py", ""): "invariant: state values are numbers the store wrote",
    ("apps/train_tiny_gpt.py", "stage "): "invariant: one loss report per micro-batch",
    ("apps/gpu_check/child.py", ""): "invariant: every step returns a StepResult",
    ("apps/gpu_check/step_api.py", ""): "invariant: a step's own result is well formed",
    ("core/timeline.py", "need "): "invariant: one duration per unit, from the same graph",
}


def _message_start(node: ast.Raise) -> str:
    call = node.exc
    if not isinstance(call, ast.Call) or not call.args:
        return ""
    first = call.args[0]
    if isinstance(first, ast.Constant):
        return str(first.value)
    if isinstance(first, ast.JoinedStr):
        return "".join(str(v.value) if isinstance(v, ast.Constant) else "{}" for v in first.values)
    return ""


def _bare_raises() -> list[tuple[str, int, str]]:
    out = []
    for rel, tree in _outside(NOT_USER_PATHS).items():
        for node in ast.walk(tree):
            if isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call) \
                    and isinstance(node.exc.func, ast.Name) and node.exc.func.id in BARE:
                out.append((rel, node.lineno, _message_start(node)))
    return out


def test_deliberate_errors_are_envpipe_errors():
    raises = _bare_raises()
    assert any(rel.startswith("gpu/") for rel, _, _ in raises), "found no bare raise at all: the scan is broken"
    used, found = set(), []
    for rel, line, message in raises:
        key = next((k for k in ALLOWED_BARE_RAISES if k[0] == rel and message.startswith(k[1])), None)
        if key is None:
            found.append(f"{rel}:{line} {message[:60]!r}")
        else:
            used.add(key)
    assert not found, ("raise a subclass of megatron_envpipe.errors.EnvPipeError (InvalidValueError, "
                       "OutOfOrderError or the module's own), or list an internal invariant here with why:\n"
                       + "\n".join(found))
    stale = sorted(set(ALLOWED_BARE_RAISES) - used)
    assert not stale, f"allow-list entries that no longer occur (remove them): {stale}"


# -- public names ------------------------------------------------------------------------------

# Public although nothing else in the package names them, and why.
ENTRY_POINTS = {
    "apps/cli/__init__.py": "the envpipe command's entry point (pyproject)",
    "megatron/pretrain_gpt.py": "a torchrun entry script: its functions are Megatron's callbacks",
    "megatron/gpt_provider.py": "providers handed to Megatron's pretrain() by name",
    "apps/train_tiny_gpt.py": "a torchrun entry script",
    "testing/": "test support: used by tests and benches, which this check does not count",
}


def _public_names(tree: ast.Module) -> list[str]:
    names: list[str] = []
    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.append(node.name)
        elif isinstance(node, ast.Assign):
            names += [t.id for t in node.targets if isinstance(t, ast.Name)]
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.append(node.target.id)
    return [n for n in names if not n.startswith("_") and n != "__all__"]


def _identifiers(tree: ast.Module) -> set[str]:
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            out.add(node.id)
        elif isinstance(node, ast.Attribute):
            out.add(node.attr)
        elif isinstance(node, ast.alias):
            out.add(node.name.rsplit(".", 1)[-1])
    return out


def _annotation_names(annotations: list[ast.expr | None]) -> set[str]:
    """The names an annotation spells (a quoted one is parsed): ``list["Row"] | None`` -> list, Row, None."""
    out: set[str] = set()
    for ann in annotations:
        if ann is None:
            continue
        if isinstance(ann, ast.Constant) and isinstance(ann.value, str):
            ann = ast.parse(ann.value, mode="eval").body
        for node in ast.walk(ann):
            if isinstance(node, ast.Name):
                out.add(node.id)
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                out |= _annotation_names([node])
    return out


def _signature_names(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> set[str]:
    """Its parameter and return annotations, and the exception classes its own body raises by name
    (``raise XError(...)``: what a caller catches is part of the interface as much as what it gets back)."""
    args = fn.args
    params = args.posonlyargs + args.args + args.kwonlyargs + [a for a in (args.vararg, args.kwarg) if a]
    raised = {(n.exc.func if isinstance(n.exc, ast.Call) else n.exc).id for n in ast.walk(fn)
              if isinstance(n, ast.Raise) and isinstance(n.exc.func if isinstance(n.exc, ast.Call) else n.exc, ast.Name)}
    return _annotation_names([a.annotation for a in params] + [fn.returns]) | raised


def _interfaces(tree: ast.Module, used_elsewhere: set[str]) -> dict[str, set[str]]:
    """A module's public functions and classes -> the names their interface declares.

    A function's interface is its parameter and return annotations and the exceptions it raises (see
    ``_signature_names``). A class's is its public annotated
    attributes (a dataclass's fields are its constructor's parameters), its ``__init__``'s signature,
    and the signatures of those of its public methods (properties too) whose name another module uses.
    """
    out: dict[str, set[str]] = {}
    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and not node.name.startswith("_"):
            out[node.name] = _signature_names(node)
        elif isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
            names: set[str] = set()
            for item in node.body:
                if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name) \
                        and not item.target.id.startswith("_"):
                    names |= _annotation_names([item.annotation])
                elif isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef) and (
                        item.name == "__init__" or (not item.name.startswith("_") and item.name in used_elsewhere)):
                    names |= _signature_names(item)
            out[node.name] = names
    return out


def _lonely_public_names(trees: dict[str, ast.Module] | None = None) -> set[str]:
    """``module:name`` for each public top-level name no other module uses.

    Another module uses a name when (1) one of its identifiers (a name, an attribute, an import) is that
    name, or (2) the name is part of the interface (see ``_interfaces``) of a function or class of its own
    module that another module uses, by (1) or (2): a result or parameter type is public with the function
    that declares it, even when no caller spells it. Entry points and testing/ are not checked.
    """
    trees = TREES if trees is None else trees
    idents = {rel: _identifiers(tree) for rel, tree in trees.items()}
    everyone: dict[str, int] = {}
    for ids in idents.values():
        for name in ids:
            everyone[name] = everyone.get(name, 0) + 1
    lonely = set()
    for rel, tree in trees.items():
        if rel.startswith(tuple(ENTRY_POINTS)):
            continue
        elsewhere = {name for name, n in everyone.items() if n - (name in idents[rel]) > 0}
        public = _public_names(tree)
        interfaces = _interfaces(tree, elsewhere)
        used = {name for name in public if name in elsewhere}
        grown = True
        while grown:  # (2), until no interface adds a name
            more = {name for owner in used for name in interfaces.get(owner, ()) if name in public} - used
            used |= more
            grown = bool(more)
        lonely |= {f"{rel}:{name}" for name in public if name not in used}
    return lonely


def test_no_public_name_that_only_its_module_uses():
    # The scan itself, on the real tree: alone, a module's public names are all lonely.
    assert _lonely_public_names({"core/graph.py": TREES["core/graph.py"]}), "the public-name scan is broken"
    lonely = sorted(_lonely_public_names())
    assert not lonely, ("public names nothing but their own module uses: make them private (_name; a test may "
                        "still reach them), delete them if dead, or move test-only code to "
                        "megatron_envpipe/testing/:\n" + "\n".join(lonely))


def _lonely_in(sources: dict[str, str]) -> set[str]:
    return _lonely_public_names({rel: ast.parse(textwrap.dedent(src)) for rel, src in sources.items()})


def test_a_result_or_parameter_type_is_public_with_the_function_that_declares_it():
    lib = """
        from dataclasses import dataclass
        @dataclass(frozen=True)
        class Row:
            cell: "Cell"
        class Cell: ...
        class Knob: ...
        class Part: ...
        class Sizer:
            def __init__(self, part: Part) -> None: ...
            def size(self, knob: Knob) -> int: ...
            def unused(self, lone: Lone) -> int: ...
        class Lone: ...
        class Helper: ...
        class RowsError(Exception): ...
        class QuietError(Exception): ...
        def rows(n: int) -> list[Row]:
            if n < 0:
                raise RowsError("n < 0")
            return [Row(Cell()) for _ in range(n)] + [Helper()]
        def unused(knob: Knob) -> Helper:
            raise QuietError
    """
    user = "from lib import rows, Sizer\nrows(2)\nSizer(None).size(None)\n"
    assert _lonely_in({"lib.py": lib, "user.py": user}) == {"lib.py:Lone", "lib.py:Helper", "lib.py:unused",
                                                                  "lib.py:QuietError"}
    # nobody calls rows(): its result type is nobody's interface either
    assert "lib.py:Row" in _lonely_in({"lib.py": lib, "user.py": "from lib import Sizer\n"})
    # a name only its own module's bodies use stays lonely however it is spelled there
    assert _lonely_in({"lib.py": "def f():\n    return g()\ndef g(): ...\n", "user.py": "f()\n"}) == {"lib.py:g"}


def test_modules_stay_below_500_lines_in_the_split_layers():
    # gpu/, core/ and apps/ were split by job (issue 38); the package-wide limit is test_architecture's.
    big = {rel: n for rel, src in SOURCES.items() if rel.startswith(("gpu/", "core/", "apps/"))
           and (n := len(src.splitlines())) >= 500}
    assert not big, f"modules of 500+ lines: split them by job: {big}"


# -- longest paths -----------------------------------------------------------------------------

# The longest-path relaxation, ``start = max(0, end_u + latency)`` over a node's edges (and its mirror
# ``finish = min(deadline, latest_start_w - latency)``), is written once, in core/graph.py: ready_s,
# ready_pair_s, due_s, due_pair_s (issue 38: it had been inlined 17 times). Plans depend on its float
# order bit for bit, so a second copy is a second thing to keep equal. Written out it looks like one of
#   A. ``x = <times>[u] + lat`` (or ``- lat``), then ``if x > t: t = x`` (``<`` for the mirror) or
#      ``t = max(t, x)``;
#   B. ``t = max(t, <times>[u] + lat)`` / ``min(...)`` on an edge's latency;
#   C. ``max(<times>[u] + lat for u, lat in edges)`` (a max/min over a generator doing the same);
# where the latency is a name the enclosing loop unpacks from an edge pair. Call the kernel instead.
KERNEL = "core/graph.py"
# Relaxations left outside the kernel, and why (each must still occur: the list cannot go stale).
ALLOWED_RELAXATIONS: dict[str, str] = {}


def _edges(tree: ast.Module) -> set[tuple[str, str]]:
    """(node, latency) name pairs unpacked from edges: ``for u, lat in preds[v]`` (and in comprehensions), or a
    flat step's ``v, a, lat_a, b, lat_b = step`` (a name with "lat" after the node it belongs to)."""
    pairs: set[tuple[str, str]] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.For | ast.comprehension):
            target = node.target
        elif isinstance(node, ast.Assign):
            target = node.targets[0]
        else:
            continue
        if not isinstance(target, ast.Tuple) or not all(isinstance(e, ast.Name) for e in target.elts):
            continue
        names = [e.id for e in target.elts]
        if len(names) == 2 and not isinstance(node, ast.Assign):
            pairs.add((names[0], names[1]))
        pairs |= {(a, b) for a, b in zip(names, names[1:]) if "lat" in b}
    return pairs


def _relaxes(expr: ast.AST, edges: set[tuple[str, str]]) -> bool:
    """``<times>[u] +/- lat`` (the read may sit inside a conditional), ``(u, lat)`` an edge: one edge relaxed."""
    if not (isinstance(expr, ast.BinOp) and isinstance(expr.op, ast.Add | ast.Sub) and isinstance(expr.right, ast.Name)):
        return False
    nodes = {u for u, lat in edges if lat == expr.right.id}
    return any(isinstance(n, ast.Subscript) and isinstance(n.slice, ast.Name) and n.slice.id in nodes
               for n in ast.walk(expr.left))


def _relaxations(tree: ast.Module) -> list[int]:
    edges = _edges(tree)
    found = []
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(body, list):  # A: x = ... + lat; if x > t: t = x, within one block
            relaxed = {stmt.targets[0].id for stmt in body if isinstance(stmt, ast.Assign)
                       and isinstance(stmt.targets[0], ast.Name) and _relaxes(stmt.value, edges)}
            for stmt in body:
                if (isinstance(stmt, ast.If) and isinstance(stmt.test, ast.Compare)
                        and isinstance(stmt.test.ops[0], ast.Gt | ast.Lt)
                        and isinstance(stmt.test.left, ast.Name) and stmt.test.left.id in relaxed
                        and len(stmt.body) == 1 and isinstance(stmt.body[0], ast.Assign)
                        and isinstance(stmt.body[0].value, ast.Name) and stmt.body[0].value.id == stmt.test.left.id):
                    found.append(stmt.lineno)
                elif (isinstance(stmt, ast.Assign) and isinstance(stmt.value, ast.Call)  # t = max(t, x), x as in A
                      and isinstance(stmt.value.func, ast.Name) and stmt.value.func.id in ("max", "min")
                      and any(isinstance(a, ast.Name) and a.id in relaxed for a in stmt.value.args)):
                    found.append(stmt.lineno)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("max", "min"):
            for arg in node.args:  # B: max(t, ... + lat); C: max(... + lat for u, lat in ...)
                if _relaxes(arg, edges) or (isinstance(arg, ast.GeneratorExp) and _relaxes(arg.elt, edges)):
                    found.append(node.lineno)
    return found


def test_the_longest_path_relaxation_is_written_once():
    """No module but core/graph.py relaxes edges itself (patterns A-C above): the walks call the kernel."""
    found = {rel: lines for rel, tree in TREES.items() if rel != KERNEL and (lines := _relaxations(tree))}
    new = {rel: lines for rel, lines in found.items() if rel not in ALLOWED_RELAXATIONS}
    assert not new, ("the longest-path relaxation written again: call core.graph's ready_s / ready_pair_s / "
                     f"due_s / due_pair_s (an Overlay for incremental walks) instead: {new}")
    stale = sorted(set(ALLOWED_RELAXATIONS) - set(found))
    assert not stale, f"allow-list entries that no longer relax edges themselves (remove them): {stale}"
    # The scan itself: the kernel's own relaxations are what it must recognise (all four, A and the pairs).
    assert len(_relaxations(TREES[KERNEL])) >= 4, "the relaxation scan no longer sees the kernel's own: it is broken"



if __name__ == "__main__":  # the current lonely names, one a line
    print("\n".join(sorted(_lonely_public_names())))
