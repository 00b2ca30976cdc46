"""Samples of the tiny GPT data: the variable-length dataset (a seeded log-normal length distribution cutting
the token stream) and :func:`build_dataset`, which picks it or the fixed-length one.

Split from apps/tiny_data.py (corpus, tokenizer, fixed-length dataset) by job.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch

from megatron_envpipe.apps.tiny_data import (
    DEFAULT_VOCAB_SIZE,
    Batch,
    SeededOrder,
    TinyLMDataset,
    TinyTokenizer,
    causal_attention_mask,
    corpus_path,
    ensure_tokenizer,
    load_tokenizer,
    read_documents,
    tokenize_documents,
)
from megatron_envpipe.errors import InvalidValueError

__all__ = [
    "DEFAULT_LENGTH_SIGMA", "LengthDistribution", "VariableLengthDataset", "build_dataset",
]


DEFAULT_LENGTH_SIGMA = 0.8


# Sample lengths are drawn from their own generator, seeded apart from the epoch orders (seed + epoch).
_LENGTH_SEED_OFFSET = 2**32


_LENGTH_BLOCK = 4096  # lengths drawn per generator call: the draw does not depend on it


@dataclass(frozen=True)
class LengthDistribution:
    """Sample lengths of ``--variable-seq-lengths``: log-normal, rounded to whole tokens, clamped to
    ``1..max_tokens``.

    ``ln(length)`` is normal with mean ``ln(median_tokens)`` and standard deviation ``sigma``: half the
    samples are shorter than the median, and with the defaults (median ``max_tokens / 4``, sigma 0.8)
    about 4 % reach ``max_tokens`` (longer ones are cut there), the long tail of fine-tuning and
    multi-task data.
    """

    median_tokens: float
    sigma: float
    max_tokens: int

    def __post_init__(self) -> None:
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 2:
            raise InvalidValueError(f"variable sequence lengths need a maximum of >= 2 tokens, got {self.max_tokens!r}")
        if not 1 <= self.median_tokens <= self.max_tokens:
            raise InvalidValueError(f"the median sample length must lie in 1..{self.max_tokens} tokens (the maximum), "
                             f"got {self.median_tokens!r}")
        if not 0 < self.sigma <= 3:
            raise InvalidValueError(f"the log-normal sigma of sample lengths must lie in (0, 3], got {self.sigma!r}")

    @classmethod
    def default(cls, max_tokens: int, median_tokens: float | None = None,
                sigma: float = DEFAULT_LENGTH_SIGMA) -> LengthDistribution:
        """Median ``max_tokens / 4`` (at least 1) unless given."""
        return cls(max(1.0, max_tokens / 4) if median_tokens is None else median_tokens, sigma, max_tokens)

    def __str__(self) -> str:
        return (f"log-normal lengths (median {self.median_tokens:g} tokens, sigma {self.sigma:g}, at most "
                f"{self.max_tokens}; micro-batches padded to their longest)")

    def draw(self, count: int, generator: torch.Generator) -> torch.Tensor:
        """``count`` lengths (int64) from ``generator``."""
        normal = torch.randn(count, generator=generator, dtype=torch.float64)
        lengths = torch.exp(math.log(self.median_tokens) + self.sigma * normal).round()
        return lengths.clamp(1, self.max_tokens).to(torch.int64)


class VariableLengthDataset(SeededOrder):
    """Next-token samples of log-normal lengths from a token stream; micro-batches padded to their longest.

    The stream is cut once, front to back, into consecutive pieces whose lengths are drawn from
    ``lengths`` with ``torch.Generator().manual_seed(seed + _LENGTH_SEED_OFFSET)`` (a piece of length
    ``L`` is ``L`` inputs and ``L`` next-token labels, so it reads ``L + 1`` tokens; the tail that
    does not fit is dropped). Each piece is one sample; the epoch order is the seeded permutation of
    :class:`SeededOrder`. A micro-batch stacks ``micro_batch_size`` samples **padded** (not packed)
    on the right to its own longest sample, so its sequence length varies from one micro-batch to
    the next (never above ``lengths.max_tokens``): padding holds the end-of-document id, its loss
    mask is 0, and the causal mask keeps every real token from attending to it. Positions and the
    causal mask are built for the micro-batch's length. The padded positions are computed too: the
    micro-batch costs ``micro_batch_size`` sequences of its padded length.
    """

    def __init__(
        self,
        tokens: torch.Tensor,
        lengths: LengthDistribution,
        *,
        seed: int,
        eod: int | None = None,
        eod_mask_loss: bool = True,
    ) -> None:
        if tokens.dim() != 1:
            raise InvalidValueError("tokens must be a 1-D stream")
        self.tokens = tokens.to(torch.int64)
        self.lengths = lengths
        self.seq_length = lengths.max_tokens
        self.seed = seed
        self.eod = eod
        self.eod_mask_loss = eod_mask_loss and eod is not None
        self.pad = 0 if eod is None else eod
        generator = torch.Generator().manual_seed(seed + _LENGTH_SEED_OFFSET)
        starts: list[int] = []
        sample_lengths: list[int] = []
        offset, room = 0, len(self.tokens) - 1  # the last token is only ever a label
        while offset < room:
            for length in lengths.draw(_LENGTH_BLOCK, generator).tolist():
                if offset + length > room:
                    offset = room  # the tail that does not fit is dropped
                    break
                starts.append(offset)
                sample_lengths.append(length)
                offset += length
        if not starts:
            raise InvalidValueError(f"a stream of {len(self.tokens)} tokens is too short for one sample")
        self.starts = torch.tensor(starts, dtype=torch.int64)
        self.sample_lengths = torch.tensor(sample_lengths, dtype=torch.int64)
        self.samples_per_epoch = len(starts)
        self._perms = {}

    def sample(self, index: int) -> dict[str, torch.Tensor]:
        """Global sample ``index``: tokens, labels and loss_mask of the piece's own length."""
        piece = self._source_index(index)
        start, length = int(self.starts[piece]), int(self.sample_lengths[piece])
        window = self.tokens[start : start + length + 1]
        tokens, labels = window[:-1], window[1:]
        loss_mask = torch.ones(length, dtype=torch.float32)
        if self.eod_mask_loss:
            loss_mask[tokens == self.eod] = 0.0
        return {"tokens": tokens.clone(), "labels": labels.clone(), "loss_mask": loss_mask}

    def batch(self, first_sample: int, micro_batch_size: int) -> Batch:
        """Samples ``first_sample ..`` padded to the longest of them, as one GPT micro-batch (on the CPU)."""
        rows = [self.sample(first_sample + row) for row in range(micro_batch_size)]
        length = max(len(row["tokens"]) for row in rows)
        batch = {
            "tokens": torch.full((micro_batch_size, length), self.pad, dtype=torch.int64),
            "labels": torch.full((micro_batch_size, length), self.pad, dtype=torch.int64),
            "loss_mask": torch.zeros(micro_batch_size, length, dtype=torch.float32),
        }
        for r, row in enumerate(rows):
            for key, values in row.items():
                batch[key][r, : len(values)] = values
        batch["position_ids"] = torch.arange(length, dtype=torch.int64).expand(micro_batch_size, -1).clone()
        batch["attention_mask"] = causal_attention_mask(length)
        return batch


def build_dataset(
    seq_length: int,
    *,
    seed: int,
    vocab_size: int = DEFAULT_VOCAB_SIZE,
    corpus: str | Path | None = None,
    cache_dir: str | Path | None = None,
    lengths: LengthDistribution | None = None,
) -> tuple[TinyTokenizer, TinyLMDataset | VariableLengthDataset]:
    """Tokenizer (trained if not cached) and dataset over the whole corpus, in one call.

    ``lengths``: samples of these lengths, micro-batches padded to their longest
    (:class:`VariableLengthDataset`; its ``max_tokens`` replaces ``seq_length``); else fixed-length samples.
    """
    corpus = Path(corpus or corpus_path())
    tokenizer = load_tokenizer(ensure_tokenizer(vocab_size, corpus, cache_dir))
    tokens = tokenize_documents(tokenizer, read_documents(corpus))
    if lengths is not None:
        return tokenizer, VariableLengthDataset(tokens, lengths, seed=seed, eod=tokenizer.eod)
    return tokenizer, TinyLMDataset(tokens, seq_length, seed=seed, eod=tokenizer.eod)
