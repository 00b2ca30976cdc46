"""The package tree is the architecture: these tests keep it that way.

Read off the source with ``ast`` (nothing is imported except in the purity
test, which uses fresh interpreters): layers import only the layers before
them, no import cycles (function-level imports included), no module uses
another module's private names, modules stay small, and the pure layers load
without torch, numpy or matplotlib.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "megatron_envpipe"
ROOT = "megatron_envpipe"

# Each layer may import the layers listed before it (and itself).
LAYERS = ["errors", "core", "planning", "flag_types", "config", "gpu", "megatron", "apps", "testing"]
# Lazy imports of package modules allowed inside functions, and why.
LAZY_ALLOWED = {
    # `import megatron_envpipe` stays torch-free; install() pulls in torch + megatron-core on use.
    ("megatron_envpipe", "megatron_envpipe.megatron.patch"),
}
MAX_TOP_LEVEL_FILES = 10
MAX_MODULE_LINES = 500  # issue 38: down from 600; split a module by job rather than grow it


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


MODULES = _modules()


def _resolve(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _imports(module: str) -> list[tuple[str, list[str], bool]]:
    """(imported module, imported names, at function level) for every package import of ``module``."""
    path = MODULES[module]
    tree = ast.parse(path.read_text(), str(path))
    top_level = {id(n) for n in tree.body}
    # imports under `if TYPE_CHECKING:` / try at module level count as top level
    for n in tree.body:
        if isinstance(n, (ast.If, ast.Try)):
            top_level.update(id(c) for c in ast.walk(n))
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == ROOT:
                    out.append((alias.name, [], id(node) not in top_level))
        elif isinstance(node, ast.ImportFrom):
            target = _resolve(module, path.name == "__init__.py", node)
            if target.split(".")[0] != ROOT:
                continue
            names = [a.name for a in node.names]
            # `from megatron_envpipe.x import submodule` imports the submodule
            subs = [f"{target}.{n}" for n in names if f"{target}.{n}" in MODULES]
            for sub in subs:
                out.append((sub, [], id(node) not in top_level))
            rest = [n for n in names if f"{target}.{n}" not in MODULES]
            if rest or not subs:
                out.append((target, rest, id(node) not in top_level))
    return out


def _layer(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def test_layers_import_only_earlier_layers():
    bad = []
    for module in MODULES:
        layer = _layer(module)
        if layer not in LAYERS:
            continue
        for target, _, _ in _imports(module):
            t_layer = _layer(target)
            if t_layer in LAYERS and LAYERS.index(t_layer) > LAYERS.index(layer):
                bad.append(f"{module} ({layer}) imports {target} ({t_layer})")
    assert not bad, "layering violations:\n" + "\n".join(bad)


def test_every_module_lives_in_a_known_layer():
    unknown = sorted(m for m in MODULES if m != ROOT and _layer(m) not in LAYERS)
    assert not unknown, f"modules outside the layers {LAYERS}: {unknown}"


def test_no_import_cycles():
    graph = {m: sorted({t for t, _, _ in _imports(m) if t in MODULES and t != m}) for m in MODULES}
    state: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for t in graph[m]:
            if state.get(t) == 1:
                cycles.append(stack[stack.index(t):] + [t])
            elif t not in state:
                visit(t)
        stack.pop()
        state[m] = 2

    for m in graph:
        if m not in state:
            visit(m)
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_no_function_level_imports_of_package_modules():
    found = [
        f"{m} imports {t} inside a function"
        for m in MODULES
        for t, _, lazy in _imports(m)
        if lazy and (m, t) not in LAZY_ALLOWED
    ]
    assert not found, "\n".join(found)


def test_no_module_uses_another_modules_private_names():
    found = [
        f"{m} imports {t}.{n}"
        for m in MODULES
        for t, names, _ in _imports(m)
        for n in names
        if n.startswith("_") and not n.startswith("__") and t != m
    ]
    assert not found, "\n".join(found)


def test_package_root_is_small_and_modules_are_small():
    top = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert len(top) <= MAX_TOP_LEVEL_FILES, top
    sizes = {m: len(p.read_text().splitlines()) for m, p in MODULES.items()}
    big = {m: n for m, n in sizes.items() if n >= MAX_MODULE_LINES}
    assert not big, f"modules of {MAX_MODULE_LINES}+ lines: {big}"


def test_every_error_derives_from_the_root():
    from megatron_envpipe import EnvPipeError

    missing = []
    for module, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and node.name.endswith(("Error", "Deadline", "Unavailable")):
                missing.append((module, node.name))
    import importlib

    not_rooted = []
    for module, name in missing:
        try:
            cls = getattr(importlib.import_module(module), name)
        except ImportError as exc:  # a torch-edge module on a machine without torch
            pytest.importorskip(exc.name or "torch")
            raise
        if isinstance(cls, type) and issubclass(cls, BaseException) and not issubclass(cls, EnvPipeError):
            not_rooted.append(f"{module}.{name}")
    assert missing, "found no exception classes at all: the scan is broken"
    assert not not_rooted, f"exceptions outside EnvPipeError: {not_rooted}"


PURE_PREFIXES = ("megatron_envpipe.core", "megatron_envpipe.planning", "megatron_envpipe.errors", "megatron_envpipe.flag_types",
                 "megatron_envpipe.config", "megatron_envpipe.apps.cli", "megatron_envpipe.apps.plot")


PURE_MODULES = sorted(m for m in MODULES if m == ROOT or m.startswith(PURE_PREFIXES))
HEAVY = ("torch", "numpy", "matplotlib", "scipy", "highspy", "megatron")
# One interpreter checks the modules one by one, each imported with no package module loaded (the package's
# entries are dropped from sys.modules first), as a fresh interpreter would: while no heavy library is loaded,
# the cached third-party modules loaded none either. It stops at the first module that loads one (later
# results would be blurred); the next test then starts a fresh interpreter from there. Each source file, and
# each method text the dataclass decorator writes, is compiled once per interpreter (as a bytecode cache
# would; this environment writes none): a module's body still runs afresh at every import, its dataclasses'
# methods are made afresh; only compiling the same text again is skipped.
PURITY_CHILD = """
import builtins, dataclasses, importlib, importlib.machinery, json, sys
compiled = {}
plain_source_to_code = importlib.machinery.SourceFileLoader.source_to_code
def source_to_code(loader, data, path, *args, **kwargs):
    key = (path, bytes(data), args, tuple(sorted(kwargs.items())))
    if key not in compiled:
        compiled[key] = plain_source_to_code(loader, data, path, *args, **kwargs)
    return compiled[key]
importlib.machinery.SourceFileLoader.source_to_code = source_to_code
def exec_once_compiled(text, globals=None, locals=None):
    if not isinstance(text, str):
        return builtins.exec(text, globals, locals)
    if text not in compiled:
        compiled[text] = compile(text, "<string>", "exec")
    return builtins.exec(compiled[text], globals, locals)
dataclasses.exec = exec_once_compiled  # what dataclasses' _create_fn calls
results = {}
for module in sys.argv[1:]:
    for name in [n for n in sys.modules if n == "megatron_envpipe" or n.startswith("megatron_envpipe.")]:
        del sys.modules[name]
    error = ""
    try:
        importlib.import_module(module)
    except Exception as exc:
        error = f"{type(exc).__name__}: {exc}"
    heavy = sorted(m for m in %r if m in sys.modules)
    results[module] = {"heavy": heavy, "error": error}
    if heavy:
        break
print(json.dumps(results))
""" % (HEAVY,)


@pytest.fixture(scope="module")
def purity() -> dict[str, dict]:
    """Module -> what importing it loaded; filled by fresh interpreters, as few as the results allow."""
    return {}


@pytest.mark.parametrize("module", PURE_MODULES)
def test_pure_modules_import_without_torch_numpy_matplotlib(module, purity):
    if module not in purity:
        rest = PURE_MODULES[PURE_MODULES.index(module):]
        proc = subprocess.run([sys.executable, "-c", PURITY_CHILD, *rest], capture_output=True, text=True,
                              check=True)
        purity.update(json.loads(proc.stdout.strip().splitlines()[-1]))
    result = purity[module]
    assert not result["error"], f"importing {module} failed: {result['error']}"
    assert not result["heavy"], f"importing {module} loads {','.join(result['heavy'])}"
