"""Micro-batch sizes for tests and benches."""

from __future__ import annotations

from collections.abc import Sequence

from megatron_envpipe.core.length_costs import LengthCostError, MicrobatchSize

__all__ = ["average_size"]


def average_size(sizes: Sequence[MicrobatchSize]) -> MicrobatchSize:
    """The mean micro-batch of ``sizes`` (rounded to whole tokens): what one plan for every iteration assumes
    (the baseline that per-iteration plans are compared with). Its attention term is capped at tokens**2 (one
    sequence): a mean of uneven micro-batches can exceed it."""
    if not sizes:
        raise LengthCostError("no micro-batch sizes to average")
    n = len(sizes)
    tokens = round(sum(s.tokens for s in sizes) / n)
    return MicrobatchSize(tokens, min(tokens * tokens, round(sum(s.attention_tokens2 for s in sizes) / n)))
