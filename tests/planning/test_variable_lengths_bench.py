"""bench/variable_lengths.py (issue 25, part 5): its length distribution and a short run of its table.
Figures are simulated; the planning-time column depends on the host and is only checked to be printed."""

from __future__ import annotations

import importlib.util
import random
import re
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("envpipe_bench_variable_lengths", REPO / "bench" / "variable_lengths.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_documents_are_packed_in_order_up_to_the_maximum(bench):
    sizes = bench.packed_microbatches(random.Random(0), 200, 2048, 512, 1.0)
    again = bench.packed_microbatches(random.Random(0), 200, 2048, 512, 1.0)
    assert sizes == again  # seeded
    assert all(s.tokens <= 2048 for s in sizes)
    assert any(s.tokens == 2048 for s in sizes)  # a truncated long document fills one alone
    mean = sum(s.tokens for s in sizes) / len(sizes)
    assert 1200 < mean < 1900  # documents are not split: micro-batches are partly filled
    # Several documents per micro-batch: attention is per document, below one sequence's tokens**2.
    assert sum(s.attention_tokens2 < s.tokens**2 for s in sizes) > 100


def test_a_short_run_prints_per_iteration_plans_on_time_and_cheaper(bench, capsys):
    assert bench.main(["--microbatches", "8", "--iterations", "2", "--scheduling", "1f1b",
                       "--profiles", "a40/gpt3-175b"]) == 0
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if line.startswith("| gpt3-175b | 8 |"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    stock_s, single_s, per_s = float(cells[3]), float(cells[5]), float(cells[9])
    assert per_s <= stock_s < single_s  # 1F1B has no slack: the average's plan is late
    assert cells[7] == "2/2"
    assert float(cells[13].rstrip(" %")) > 0  # the per-iteration plans' extra saving
    assert re.fullmatch(r"\d+\.\d\d %, \d+\.\d\d %", cells[14])
    assert "fell back" not in out and "worst slowdown" not in out
