"""`envpipe plan --type optimal --json` prints JSON and nothing else (HiGHS's start-up banner is silenced)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("numpy")

pytestmark = pytest.mark.cli  # a fresh interpreter per test (test tiers: docs/testing.md)
ROOT = Path(__file__).resolve().parents[2]
CLI = "from megatron_envpipe.apps.cli import main; import sys; sys.exit(main(sys.argv[1:]))"


def test_plan_json_stdout_is_only_json():
    # A fresh process: highspy prints its banner at the first Highs() of a process, at the C level.
    proc = subprocess.run(
        [sys.executable, "-c", CLI, "plan", "--profile", "a40/gpt3-175b", "-m", "12", "--type", "optimal", "--json"],
        capture_output=True, text=True, cwd=ROOT, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    assert "HiGHS" not in proc.stdout
    data = json.loads(proc.stdout)  # the whole of stdout
    assert data["num_microbatches"] == 12
