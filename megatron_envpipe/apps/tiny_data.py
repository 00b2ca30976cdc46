"""Real text for the tiny-GPT example: shipped corpus, SentencePiece tokenizer, LM samples.

* **Corpus.** ``data/corpus/stdlib_docstrings.txt`` (shipped, ~260 KB of
  docstrings from Python's standard library, PSF license; see
  ``data/corpus/SOURCES.md``). Documents are separated by one blank line.
  Nothing is downloaded at run time.
* **Tokenizer.** A small SentencePiece BPE model trained on the corpus the first
  time it is needed, with deterministic settings (one thread, no sampling or
  shuffling), and cached under ``~/.cache/megatron-envpipe/`` (or
  ``$MEGATRON_ENVPIPE_CACHE``, or an explicit directory). The file name is keyed
  by the corpus hash, the vocabulary size and a hash of the trainer settings
  and SentencePiece version. :func:`ensure_tokenizer` is safe when several
  processes call it at once: it serialises on a lock file and publishes the
  model with an atomic rename, so a reader never sees a partial file.
* **Dataset.** The corpus becomes one token stream (end-of-document token after
  each document), cut into samples of ``seq_length + 1`` tokens that overlap by
  one token, as Megatron's GPT dataset does. Sample order is a seeded
  permutation per epoch, so global sample ``k`` is a pure function of
  ``(corpus, tokenizer, seq_length, seed, k)``. Labels are the next tokens; the
  loss mask drops positions whose input is the end-of-document token
  (Megatron's ``--eod-mask-loss``), so per-micro-batch token counts vary.
* **Variable lengths** (``--variable-seq-lengths``). :class:`VariableLengthDataset`
  cuts the same stream into consecutive pieces of log-normal lengths
  (:class:`LengthDistribution`: median ``seq_length / 4``, sigma 0.8, at most
  ``seq_length``; seeded), visited in the same seeded epoch order; each
  micro-batch is padded to its own longest sample (loss mask 0 on padding), so
  sequence lengths differ between micro-batches.

No megatron import here: the example and the tests share this module.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from megatron_envpipe.core.atomic import write_atomic
from megatron_envpipe.core.resources import data_dir
from megatron_envpipe.core.textfile import read_bytes, read_text
from megatron_envpipe.errors import InvalidValueError

__all__ = ["DEFAULT_VOCAB_SIZE", "Batch", "TinyLMDataset", "TinyTokenizer", "corpus_path", "ensure_tokenizer", "load_tokenizer", "read_documents", "tokenize_documents", "causal_attention_mask"]

_CORPUS_FILE = "stdlib_docstrings.txt"
DEFAULT_VOCAB_SIZE = 512

Batch = dict[str, torch.Tensor]

# SentencePiece trainer settings. Part of the cache key: change one and every
# cached model is retrained. unk/bos/eos ids are SentencePiece's defaults.
_TRAINER_OPTIONS: dict[str, Any] = {
    "model_type": "bpe",
    "character_coverage": 1.0,
    "num_threads": 1,
    "input_sentence_size": 0,  # use every sentence: no sampling
    "shuffle_input_sentence": False,
    "max_sentence_length": 8192,
    "unk_id": 0,
    "bos_id": 1,
    "eos_id": 2,
    "pad_id": -1,
}


# --------------------------------------------------------------------------- corpus


def corpus_path() -> Path:
    """The shipped corpus, in a source checkout (``data/``) or an installed package."""
    path = data_dir() / "corpus" / _CORPUS_FILE
    if not path.is_file():
        raise FileNotFoundError(f"shipped corpus {path} is missing; reinstall megatron-envpipe")
    return path


def read_documents(path: str | Path | None = None) -> list[str]:
    """Documents of a corpus file: blocks separated by blank lines, whitespace collapsed."""
    text = read_text(Path(path or corpus_path()), "corpus", ValueError)  # bounded, regular files only
    documents = []
    for block in text.split("\n\n"):
        words = block.split()
        if words:
            documents.append(" ".join(words))
    if not documents:
        raise InvalidValueError(f"corpus {path} has no text")
    return documents


def _training_sentences(path: Path) -> list[str]:
    """What the tokenizer is trained on: every non-empty line, stripped, in file order."""
    lines = read_text(path, "corpus", ValueError).splitlines()
    return [" ".join(line.split()) for line in lines if line.strip()]


# --------------------------------------------------------------------------- tokenizer


def _default_cache_dir() -> Path:
    """``$MEGATRON_ENVPIPE_CACHE``, else ``$XDG_CACHE_HOME/megatron-envpipe``, else ``~/.cache/...``."""
    explicit = os.environ.get("MEGATRON_ENVPIPE_CACHE")
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "megatron-envpipe"


def _settings_digest(vocab_size: int) -> str:
    import sentencepiece

    settings = dict(_TRAINER_OPTIONS, vocab_size=vocab_size, sentencepiece=sentencepiece.__version__)
    return hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:8]


def _tokenizer_path(
    vocab_size: int = DEFAULT_VOCAB_SIZE,
    corpus: str | Path | None = None,
    cache_dir: str | Path | None = None,
) -> Path:
    """Where the tokenizer for this corpus and vocabulary size is (or will be) cached."""
    corpus = Path(corpus or corpus_path())
    corpus_digest = hashlib.sha256(read_bytes(corpus, "corpus", ValueError)).hexdigest()[:16]
    directory = Path(cache_dir) if cache_dir is not None else _default_cache_dir()
    name = f"spm-{_TRAINER_OPTIONS['model_type']}-v{vocab_size}-{corpus_digest}-{_settings_digest(vocab_size)}.model"
    return directory / name


def _train_model_bytes(corpus: Path, vocab_size: int) -> bytes:
    """Train in memory; the model proto holds no paths, so equal inputs give equal bytes."""
    import sentencepiece

    writer = io.BytesIO()
    with open(os.devnull, "w") as quiet:
        sentencepiece.SentencePieceTrainer.train(
            sentence_iterator=iter(_training_sentences(corpus)),
            model_writer=writer,
            vocab_size=vocab_size,
            logstream=quiet,
            **_TRAINER_OPTIONS,
        )
    return writer.getvalue()


@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    """Exclusive advisory lock (POSIX ``flock``); on other systems only the atomic rename protects."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - Windows
        yield
        return
    with open(path, "a") as handle:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle.fileno(), fcntl.LOCK_UN)


def ensure_tokenizer(
    vocab_size: int = DEFAULT_VOCAB_SIZE,
    corpus: str | Path | None = None,
    cache_dir: str | Path | None = None,
) -> Path:
    """The cached tokenizer model's path, training it first if it is not cached yet.

    Concurrent callers (the ranks of one job, or several jobs sharing a cache)
    queue on ``<model>.lock``; the first trains, the others find the file. The
    model is written to a temporary file in the same directory and renamed into
    place, so the final name only ever holds a complete model.
    """
    if vocab_size < 16:
        raise InvalidValueError(f"vocab_size must be >= 16, got {vocab_size}")
    corpus = Path(corpus or corpus_path())
    target = _tokenizer_path(vocab_size, corpus, cache_dir)
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with _file_lock(target.with_name(target.name + ".lock")):
        if target.is_file():  # another process trained it while we waited
            return target
        model = _train_model_bytes(corpus, vocab_size)
        write_atomic(target, model, fsync=True)
    return target


@dataclass(frozen=True)
class TinyTokenizer:
    """A loaded SentencePiece model with the ids the dataset needs."""

    path: Path
    processor: Any  # sentencepiece.SentencePieceProcessor

    @property
    def vocab_size(self) -> int:
        return int(self.processor.get_piece_size())

    @property
    def eod(self) -> int:
        """End-of-document id: SentencePiece's ``</s>``."""
        return int(self.processor.eos_id())

    def encode(self, text: str) -> list[int]:
        return list(self.processor.encode(text))

    def decode(self, ids: Sequence[int]) -> str:
        return str(self.processor.decode([int(i) for i in ids]))


def load_tokenizer(path: str | Path) -> TinyTokenizer:
    import sentencepiece

    path = Path(path)
    return TinyTokenizer(path=path, processor=sentencepiece.SentencePieceProcessor(model_file=str(path)))


def tokenize_documents(tokenizer: TinyTokenizer, documents: Sequence[str]) -> torch.Tensor:
    """One int64 token stream: each document's ids followed by the end-of-document id."""
    stream: list[int] = []
    for ids in tokenizer.processor.encode(list(documents)):
        stream.extend(ids)
        stream.append(tokenizer.eod)
    return torch.tensor(stream, dtype=torch.int64)


# --------------------------------------------------------------------------- dataset


class SeededOrder:
    """Samples in a seeded order per epoch, grouped into the micro-batches of each iteration.

    A subclass sets ``seed`` and ``samples_per_epoch`` and defines ``sample`` and ``batch``.
    Sample ``i`` of epoch ``e`` is sample ``perm_e[i]`` of the epoch's source,
    ``perm_e`` drawn from ``torch.Generator().manual_seed(seed + e)``; global sample
    indices run on across epochs.
    """

    seed: int
    samples_per_epoch: int
    _perms: dict[int, torch.Tensor]

    def _permutation(self, epoch: int) -> torch.Tensor:
        if epoch not in self._perms:
            generator = torch.Generator().manual_seed(self.seed + epoch)
            self._perms[epoch] = torch.randperm(self.samples_per_epoch, generator=generator)
        return self._perms[epoch]

    def _source_index(self, index: int) -> int:
        """Which sample of the epoch's source global sample ``index`` is."""
        if index < 0:
            raise IndexError(f"sample index must be >= 0, got {index}")
        epoch, position = divmod(index, self.samples_per_epoch)
        return int(self._permutation(epoch)[position])

    def batch(self, first_sample: int, micro_batch_size: int) -> Batch:
        raise NotImplementedError

    def microbatches(self, iteration: int, num_microbatches: int, micro_batch_size: int) -> Iterator[Batch]:
        """Exactly the ``num_microbatches`` micro-batches of training iteration ``iteration`` (0-based).

        Micro-batch ``m`` holds global samples
        ``(iteration * num_microbatches + m) * micro_batch_size + row``. Each
        pipeline stage iterates its own copy; one more ``next()`` than there
        are micro-batches raises StopIteration.
        """
        first = iteration * num_microbatches * micro_batch_size
        for m in range(num_microbatches):
            yield self.batch(first + m * micro_batch_size, micro_batch_size)

    def iterations(self, first: int, step: int, count: int, num_microbatches: int,
                   micro_batch_size: int) -> Iterator[Batch]:
        """The micro-batches of iterations ``first, first + step, ...`` (``count`` of them) in one stream.

        One iterator for the whole training, as Megatron-LM's data iterators are, so a look-ahead over
        it (:mod:`megatron_envpipe.megatron.lookahead`) sees the next iteration's micro-batches. After
        the last iteration's, ``next()`` raises StopIteration.
        """
        for k in range(count):
            yield from self.microbatches(first + k * step, num_microbatches, micro_batch_size)


class TinyLMDataset(SeededOrder):
    """Next-token samples from a token stream, in a seeded order.

    Sample ``i`` of an epoch is tokens ``[j*S, (j+1)*S + 1)`` of the stream,
    ``j = perm_epoch[i]``, where ``perm_epoch`` is a permutation drawn from
    ``torch.Generator().manual_seed(seed + epoch)``. Global sample indices run
    on across epochs. Every process that builds the dataset from the same
    inputs sees the same samples, whatever else it does with torch's RNG.
    """

    def __init__(
        self,
        tokens: torch.Tensor,
        seq_length: int,
        *,
        seed: int,
        eod: int | None = None,
        eod_mask_loss: bool = True,
    ) -> None:
        if tokens.dim() != 1:
            raise InvalidValueError("tokens must be a 1-D stream")
        if seq_length < 1:
            raise InvalidValueError(f"seq_length must be >= 1, got {seq_length}")
        self.tokens = tokens.to(torch.int64)
        self.seq_length = seq_length
        self.seed = seed
        self.eod = eod
        self.eod_mask_loss = eod_mask_loss and eod is not None
        self.samples_per_epoch = (len(self.tokens) - 1) // seq_length
        if self.samples_per_epoch < 1:
            raise InvalidValueError(
                f"a stream of {len(self.tokens)} tokens is too short for seq_length {seq_length}"
            )
        self._perms = {}
        self._attention_mask = causal_attention_mask(seq_length)
        self._position_ids = torch.arange(seq_length, dtype=torch.int64)

    def sample(self, index: int) -> dict[str, torch.Tensor]:
        """Global sample ``index`` (any non-negative integer): tokens, labels, loss_mask."""
        start = self._source_index(index) * self.seq_length
        window = self.tokens[start : start + self.seq_length + 1]
        tokens, labels = window[:-1], window[1:]
        loss_mask = torch.ones(self.seq_length, dtype=torch.float32)
        if self.eod_mask_loss:
            loss_mask[tokens == self.eod] = 0.0
        return {"tokens": tokens.clone(), "labels": labels.clone(), "loss_mask": loss_mask}

    def batch(self, first_sample: int, micro_batch_size: int) -> Batch:
        """Samples ``first_sample ..`` stacked into one Megatron GPT micro-batch (on the CPU)."""
        rows = [self.sample(first_sample + row) for row in range(micro_batch_size)]
        batch = {key: torch.stack([row[key] for row in rows]) for key in rows[0]}
        batch["position_ids"] = self._position_ids.expand(micro_batch_size, -1).clone()
        batch["attention_mask"] = self._attention_mask.clone()
        return batch


def causal_attention_mask(length: int) -> torch.Tensor:
    """``(1, 1, length, length)`` bool; Megatron's convention: True marks a position that must not be attended."""
    return torch.ones(length, length, dtype=torch.bool).triu(1).view(1, 1, length, length)


# --------------------------------------------------------------------------- variable lengths


