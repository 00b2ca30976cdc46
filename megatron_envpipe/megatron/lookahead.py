"""Read a Megatron data iterator one iteration ahead, to know the next iteration's micro-batch sizes.

With variable-length micro-batches (issue 25) a clock plan depends on the sizes of the micro-batches
it runs. :class:`DataLookahead` wraps the ``data_iterator`` argument of a schedule call (one
iterator, the list of per-chunk iterators of the interleaved schedule, or None on stages that read no
data) and hands the schedule the same structure, whose iterators yield exactly the objects the
originals would, in the same order: pull ``k`` of a wrapped iterator gives what the source's
``k``-th ``next()`` gave, an object, or the StopIteration or other exception it raised, re-raised at
that pull. The training sees no difference. (Reading ahead past the end calls ``next()`` on an
ended iterator again, which the iterator protocol makes harmless.) A look-ahead lives across schedule
calls: wrap the training's iterator once (Megatron-LM passes the same iterator object to every call,
as the tiny GPT does) and pass :attr:`DataLookahead.data_iterator` to each call.

**When it reads.** Iterations are counted from the wrap, ``num_microbatches`` (M) pulls each, as
Megatron's schedules pull per iterator. The first pull of iteration ``i`` first reads the source
through the end of iteration ``i + 1``; :meth:`DataLookahead.read_ahead` does the same earlier, e.g.
before iteration 0. Reading happens only on the thread that pulls (or calls ``read_ahead``): data
iterators are not thread-safe. Cost: up to ``2 M - 1`` micro-batches are held ahead of the
schedule (the rest of the running iteration and all of the next). Not for a source that refills one
buffer in place for each ``next()``: the micro-batches held ahead would all be its latest.

**Sizes.** Each micro-batch read is sized at once by ``size_of`` (default :func:`_microbatch_size`,
from :func:`_microbatch_seq_lengths`). :meth:`DataLookahead.sizes` and
:meth:`DataLookahead.next_sizes` only read those records under a lock, so a planner thread may call
them at any time; they never read the source. ``next_sizes()`` is the sizes of the next iteration to
start (the first whose first micro-batch has not been pulled): known throughout iteration ``i``
(from its first pull) as the sizes of ``i + 1``, the iteration a background planner prepares. A
micro-batch that cannot be sized makes its iteration's sizes None and is logged once, with the
reason in :attr:`_LookaheadIterator.problem`; the training goes on unchanged.

**Which ranks know the sizes.** Only ranks that pull data: in the tiny GPT every stage, in
Megatron-LM the first and last stages (middle stages pass None, or never pull), and with tensor
parallelism only the ranks that read before broadcasting to their group. Every rank of a pipeline
needs the same sizes for its plan: :mod:`~megatron_envpipe.megatron.iteration_plans` broadcasts
the first stage's sizes of iteration ``i + 1`` over the pipeline group during iteration ``i``
(asynchronously, one small message per iteration).
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from megatron_envpipe.core.length_costs import MicrobatchSize
from megatron_envpipe.errors import UsageError

__all__ = [
    "DataLookahead",
    "LookaheadError",
]

_log = logging.getLogger(__name__)

SizeOf = Callable[[Any], MicrobatchSize]


class LookaheadError(UsageError, ValueError):
    """A micro-batch whose size cannot be read, or a look-ahead that cannot be set up."""


def _ints(value: Any) -> list[int]:
    """A 1-D tensor, array or sequence of ints as Python ints (duck-typed: no torch import)."""
    items = value.tolist() if hasattr(value, "tolist") else list(value)
    if not isinstance(items, list) or any(isinstance(n, bool) or not isinstance(n, int) for n in items):
        raise LookaheadError(f"'seq_lengths' must be a 1-D sequence of ints, got {str(items)[:80]}")
    return items


def _microbatch_seq_lengths(batch: Any) -> list[int]:
    """The lengths of the sequences one micro-batch computes, from the batch itself.

    The contract for data other than the tiny GPT's:

    * a mapping with ``seq_lengths`` (a 1-D tensor or sequence of ints): those lengths, e.g. the
      documents of a packed sequence, each attending only to itself;
    * else a mapping with ``tokens`` of shape ``(batch, seq)`` (Megatron's GPT batch layout, and the
      tiny GPT's): ``batch`` sequences of ``seq`` tokens. A micro-batch padded to its longest sample
      computes its padding too, so its padded length is what it costs;
    * else a tensor of shape ``(batch, seq)`` (the tokens alone).

    Anything else raises :class:`LookaheadError`; pass ``size_of`` to :class:`DataLookahead` for
    other layouts.
    """
    if isinstance(batch, Mapping):
        if "seq_lengths" in batch:
            return _ints(batch["seq_lengths"])
        tokens = batch.get("tokens")
    else:
        tokens = batch
    shape = getattr(tokens, "shape", None)
    if shape is None or len(shape) != 2:
        raise LookaheadError(
            f"cannot size a micro-batch of type {type(batch).__name__}: it has neither a 'seq_lengths' entry nor "
            f"2-D (batch, seq) 'tokens'; give DataLookahead a size_of function for this data"
        )
    rows, length = int(shape[0]), int(shape[1])
    return [length] * rows


def _microbatch_size(batch: Any) -> MicrobatchSize:
    """The :class:`MicrobatchSize` of one micro-batch: tokens and attention cost of its sequences."""
    return MicrobatchSize.from_lengths(_microbatch_seq_lengths(batch))


class _LookaheadIterator:
    """One data iterator, read one iteration ahead (see the module docstring)."""

    def __init__(self, source: Iterator[Any], num_microbatches: int, size_of: SizeOf = _microbatch_size,
                 lock: threading.Lock | None = None,
                 on_sizes: Callable[[int, list[MicrobatchSize]], None] | None = None) -> None:
        if not hasattr(source, "__next__"):
            raise LookaheadError(f"the look-ahead wraps an iterator, got {type(source).__name__}: pass iter(...)")
        self._source = source
        self._m = num_microbatches
        self._size_of = size_of
        self._on_sizes = on_sizes
        self._lock = lock or threading.Lock()
        # Read and not yet yielded, in order: (value, None) or (None, exception the source raised).
        self._buffer: deque[tuple[Any, BaseException | None]] = deque()
        self._read = 0  # items read from the source (an exception counts as one)
        self._yielded = 0
        self._sizes: dict[int, list[MicrobatchSize | None]] = {}
        self.problem: str | None = None

    def __iter__(self) -> _LookaheadIterator:
        return self

    def __next__(self) -> Any:
        self.read_ahead()
        value, error = self._buffer.popleft()  # never empty: read_ahead reads past this pull
        with self._lock:
            self._yielded += 1
        if error is not None:
            raise error
        return value

    def read_ahead(self) -> None:
        """Read now what the next pull reads first: through the end of the iteration after the next
        pull's (owner's thread only)."""
        self._read_through((self._yielded // self._m + 2) * self._m)

    @property
    def iterations_started(self) -> int:
        """Iterations whose first micro-batch was pulled."""
        with self._lock:
            return -(-self._yielded // self._m)

    def sizes(self, iteration: int) -> list[MicrobatchSize] | None:
        """The sizes of iteration ``iteration`` (counted from the wrap), once all M are read and sized."""
        with self._lock:
            sizes = self._sizes.get(iteration)
            if sizes is None or len(sizes) < self._m or any(s is None for s in sizes):
                return None
            return list(sizes)  # type: ignore[arg-type]  # no None left

    def next_sizes(self) -> list[MicrobatchSize] | None:
        """The sizes of the next iteration to start (during iteration i: those of i + 1), or None."""
        with self._lock:
            started = -(-self._yielded // self._m)
        return self.sizes(started)

    def _read_through(self, count: int) -> None:
        while self._read < count:
            index = self._read
            try:
                value, error = next(self._source), None
            except Exception as exc:  # noqa: BLE001 - StopIteration included: re-raised at its own pull
                value, error = None, exc
            self._buffer.append((value, error))
            self._read += 1
            self._record(index, value, error)

    def _record(self, index: int, value: Any, error: BaseException | None) -> None:
        size: MicrobatchSize | None = None
        if error is None:
            try:
                size = self._size_of(value)
            except Exception as exc:  # noqa: BLE001 - sizes are advisory: the training must not notice
                if self.problem is None:
                    self.problem = f"micro-batch {index}: {exc}"
                    _log.warning("EnvPipe look-ahead: cannot size %s; those iterations keep the previous plan",
                                 self.problem)
        iteration = index // self._m
        with self._lock:
            self._sizes.setdefault(iteration, []).append(size)
            # Bounded: from the iteration before the consumer's on (a few iterations).
            for old in [k for k in self._sizes if k < self._yielded // self._m - 1]:
                del self._sizes[old]
        if self._on_sizes is not None and index % self._m == self._m - 1:
            complete = self.sizes(iteration)
            if complete is not None:
                self._on_sizes(iteration, complete)


class DataLookahead:
    """The ``data_iterator`` of a schedule call, read one iteration ahead (see the module docstring).

    ``data_iterator``: an iterator, a list of per-model-chunk iterators (entries may be None), or
    None. :attr:`data_iterator` is what to pass to the schedule instead: the same structure, each
    iterator wrapped. Sizes come from the first wrapped iterator (model chunk 0 where it reads data:
    Megatron gives every chunk of a stage the same micro-batches). ``on_sizes(iteration, sizes)`` is
    called on the reading thread when an iteration's sizes are complete: keep it short (hand the
    work to a planner thread).
    """

    def __init__(self, data_iterator: Any, num_microbatches: int, size_of: SizeOf = _microbatch_size,
                 on_sizes: Callable[[int, list[MicrobatchSize]], None] | None = None) -> None:
        if isinstance(num_microbatches, bool) or not isinstance(num_microbatches, int) or num_microbatches < 1:
            raise LookaheadError(f"num_microbatches must be a whole number >= 1, got {num_microbatches!r}")
        lock = threading.Lock()
        sources = data_iterator if isinstance(data_iterator, list) else [data_iterator]
        self.chunks: list[_LookaheadIterator | None] = []
        for source in sources:
            if source is None:
                self.chunks.append(None)
                continue
            # Only the first wrapped iterator reports: the chunks read the same micro-batches.
            first = all(chunk is None for chunk in self.chunks)
            self.chunks.append(_LookaheadIterator(source, num_microbatches, size_of, lock, on_sizes if first else None))
        self.data_iterator: Any = self.chunks if isinstance(data_iterator, list) else self.chunks[0]
        self._sizer = next((chunk for chunk in self.chunks if chunk is not None), None)

    @property
    def has_data(self) -> bool:
        """Whether this rank reads data at all (else it learns sizes from a rank that does)."""
        return self._sizer is not None

    @property
    def problem(self) -> str | None:
        """Why some micro-batches could not be sized (logged once), or None."""
        return None if self._sizer is None else self._sizer.problem

    def read_ahead(self) -> None:
        """Read every wrapped iterator through the end of the iteration after the next one to start.

        Call it on the thread that owns the data, e.g. before iteration 0 to know the sizes of
        iterations 0 and 1 before its first pull; pulls read ahead by themselves.
        """
        for chunk in self.chunks:
            if chunk is not None:
                chunk.read_ahead()

    def sizes(self, iteration: int) -> list[MicrobatchSize] | None:
        """The sizes of iteration ``iteration`` (counted from the wrap), or None if not read (or no data)."""
        return None if self._sizer is None else self._sizer.sizes(iteration)

    def next_sizes(self) -> list[MicrobatchSize] | None:
        """The sizes of the next iteration to start, or None (not read yet, not sizeable, or no data)."""
        return None if self._sizer is None else self._sizer.next_sizes()
