"""Extension points stay extension points (issue 38), read off the source with ``ast``:

* device kinds are asked as capabilities, never tested by name outside the device layer
  (no ``startswith("simulated")``, no ``.simulated`` of a device);
* deliberate errors are ``EnvPipeError``s: no bare ``raise ValueError/RuntimeError/TypeError``
  on a package path, but for the internal invariants listed here with the reason;
* no public name that nothing but its own module uses, but for the debt listed in
  ``architecture_public_names.txt`` (which may only shrink) and the entry points below.

Every allow-list is checked for stale entries too, so it cannot outlive what it excuses.
"""

from __future__ import annotations

import ast
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
    ("gpu/energy/iteration_energy.py", ""): "invariant: one part per stage of one iteration, by construction",
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

DEBT_FILE = HERE / "architecture_public_names.txt"
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


def _lonely_public_names() -> set[str]:
    idents = {rel: _identifiers(tree) for rel, tree in TREES.items()}
    everyone: dict[str, int] = {}
    for ids in idents.values():
        for name in ids:
            everyone[name] = everyone.get(name, 0) + 1
    lonely = set()
    for rel, tree in TREES.items():
        if rel.startswith(tuple(ENTRY_POINTS)):
            continue
        for name in _public_names(tree):
            # used by another module: some other module's identifiers include it
            if everyone.get(name, 0) - (name in idents[rel]) == 0:
                lonely.add(f"{rel}:{name}")
    return lonely


def _debt() -> set[str]:
    return {line.split("#")[0].strip() for line in DEBT_FILE.read_text().splitlines()} - {""}


def test_no_new_public_name_that_only_its_module_uses():
    lonely, debt = _lonely_public_names(), _debt()
    assert lonely, "found no lonely name at all: the scan is broken"
    new = sorted(lonely - debt)
    assert not new, ("public names nothing but their own module uses: make them private (_name), delete them "
                     "if dead, or move test-only code to megatron_envpipe/testing/:\n" + "\n".join(new))
    paid = sorted(debt - lonely)
    assert not paid, f"now used elsewhere, private or gone: remove from {DEBT_FILE.name}: {paid}"


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



if __name__ == "__main__":  # the current lonely names, one a line (to pay debt down: diff against the file)
    print("\n".join(sorted(_lonely_public_names())))
