"""`envpipe demo` on the planning core alone (``pip install .``: no torch): one line naming what is missing (issue 35)."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

from megatron_envpipe.apps import demo

REPO = Path(__file__).resolve().parents[2]

# Runs the CLI in a Python where torch, megatron and sentencepiece cannot be imported, as after `pip install .`.
WITHOUT_TRAINING = """
import importlib.abc, sys
class Absent(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("torch", "megatron", "sentencepiece"):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None
sys.meta_path.insert(0, Absent())
from megatron_envpipe.apps.cli import main
sys.exit(main(["demo", "--out", sys.argv[1]]))
"""


def test_missing_packages_are_named_without_importing_them():
    absent = {"torch", "sentencepiece"}
    assert demo._missing_training_packages(lambda name: None if name in absent else object()) == ["torch", "sentencepiece"]
    assert demo._missing_training_packages(lambda name: object()) == []


def test_demo_without_torch_says_so_in_one_line_within_5_s(tmp_path):
    out = tmp_path / "demo"
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", WITHOUT_TRAINING, str(out)], cwd=REPO, capture_output=True,
                          text=True, timeout=60)
    took_s = time.monotonic() - start
    assert proc.returncode == 2, proc.stderr[-2000:]
    (line,) = [line for line in (proc.stdout + proc.stderr).splitlines() if line.strip()]
    assert "needs torch, megatron-core, sentencepiece, not installed" in line and "install.sh" in line, line
    assert took_s < 5, f"took {took_s:.1f} s"
    assert not out.exists()
