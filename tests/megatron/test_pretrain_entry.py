"""`python -m megatron_envpipe.megatron.pretrain_gpt`: clear one-line failures where Megatron-LM cannot run."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=REPO, capture_output=True, text=True, timeout=120)


def test_without_megatron_training_it_says_why_in_one_line():
    try:
        import megatron.training  # noqa: F401
    except Exception:  # noqa: BLE001 - absent (0.16) or not importable on 3.11 (0.19): our case
        pass
    else:
        import pytest

        pytest.skip("megatron.training imports here: the success path applies instead")
    for cmd in (["-m", "megatron_envpipe.megatron.pretrain_gpt", "--help"], ["examples/pretrain_gpt.py", "--help"]):
        proc = run(*cmd)
        assert proc.returncode == 2
        lines = [line for line in proc.stderr.splitlines() if "error:" in line]
        assert len(lines) == 1 and "megatron.training" in lines[0], proc.stderr
        assert "Traceback" not in proc.stderr


def test_bad_envpipe_flags_fail_before_anything_starts():
    proc = run("-m", "megatron_envpipe.megatron.pretrain_gpt", "--envpipe-type", "turbo")
    assert proc.returncode == 2 and "invalid choice: 'turbo'" in proc.stderr
