"""The ``envpipe`` command stays light: planning imports neither torch nor numpy; the entry point resolves."""

from __future__ import annotations

import importlib
import json
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_plan_json_imports_neither_torch_nor_numpy():
    code = (
        "import sys\n"
        "from megatron_envpipe.apps.cli import main\n"
        "code = main(['plan', '--profile', 'a40/gpt3-175b', '--microbatches', '12', '--json'])\n"
        "heavy = [m for m in ('torch', 'numpy', 'scipy', 'matplotlib', 'megatron') if m in sys.modules]\n"
        "print('HEAVY', ','.join(heavy), file=sys.stderr)\n"
        "sys.exit(code)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == "HEAVY", proc.stderr
    assert json.loads(proc.stdout)["num_stages"] == 8


def test_console_entry_point_resolves_to_main():
    match = re.search(r'"envpipe=([\w.]+):(\w+)"', (ROOT / "setup.py").read_text())
    assert match, "setup.py lost the envpipe console script"
    module, attr = match.groups()
    assert module == "megatron_envpipe.apps.cli"
    from megatron_envpipe.apps.cli import main

    assert getattr(importlib.import_module(module), attr) is main


def test_cli_modules_are_small():
    package = ROOT / "megatron_envpipe" / "apps" / "cli"
    sizes = {p.name: len(p.read_text().splitlines()) for p in package.glob("*.py")}
    assert {"__init__.py", "parser.py", "render.py", "common.py", "planning_cmds.py", "pipeline_cmds.py",
            "gpu_cmds.py", "demo_cmd.py"} <= set(sizes)
    assert max(sizes.values()) < 300, sizes
