"""The one-iteration look-ahead over Megatron data iterators (megatron_envpipe.megatron.lookahead).

The schedule must see exactly what the unwrapped iterator gives: the same objects (identity), in
the same order, the same exception at the same pull, StopIteration at the same pull, for a single
iterator, per-chunk iterators pulled in Megatron's interleaved order, and None on stages without
data. The sizes of the next iteration are known from the first pull of the running one, reading
no further than that, and can be read from another thread.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from typing import Any

import pytest

from megatron_envpipe.core.interleaved import _interleaved_order
from megatron_envpipe.core.length_costs import MicrobatchSize
from megatron_envpipe.errors import EnvPipeError
from megatron_envpipe.megatron.lookahead import (
    DataLookahead,
    LookaheadError,
    _microbatch_seq_lengths,
    _microbatch_size,
)

M = 4


class Tokens:
    """A stand-in for a (batch, seq) token tensor: only its shape is read."""

    def __init__(self, rows: int, length: int) -> None:
        self.shape = (rows, length)


def batches(count: int) -> list[dict[str, Any]]:
    """Micro-batch k: 2 rows of 3 + (5 k mod 11) tokens, so sizes differ within an iteration."""
    return [{"tokens": Tokens(2, 3 + (5 * k) % 11), "k": k} for k in range(count)]


def expected_size(k: int) -> MicrobatchSize:
    return MicrobatchSize.from_lengths([3 + (5 * k) % 11] * 2)


class Counting:
    """An iterator over ``items`` that counts how far it has been read, and can raise at one pull."""

    def __init__(self, items: list[Any], raise_at: int | None = None) -> None:
        self.items, self.raise_at, self.read = items, raise_at, 0
        self.error = RuntimeError("disk gone")

    def __iter__(self) -> Iterator[Any]:
        return self

    def __next__(self) -> Any:
        if self.read == self.raise_at:
            self.read += 1
            raise self.error
        if self.read >= len(self.items):
            raise StopIteration
        self.read += 1
        return self.items[self.read - 1]


def pulls(iterator: Iterator[Any], count: int) -> list[tuple[str, Any]]:
    """What ``count`` pulls give: ("item", obj), ("raise", exc) or ("stop", None), one per pull."""
    out: list[tuple[str, Any]] = []
    for _ in range(count):
        try:
            out.append(("item", next(iterator)))
        except StopIteration:
            out.append(("stop", None))
        except RuntimeError as exc:
            out.append(("raise", exc))
    return out


def same(a: list[tuple[str, Any]], b: list[tuple[str, Any]]) -> bool:
    return len(a) == len(b) and all(x[0] == y[0] and x[1] is y[1] for x, y in zip(a, b, strict=True))


# --------------------------------------------------------------------------- same objects, same order


@pytest.mark.parametrize("count", [0, 3, 2 * M, 2 * M + 3, 5 * M])
def test_yields_the_same_objects_then_ends_where_the_source_ends(count: int) -> None:
    items = batches(count)
    plain = pulls(iter(items), count + 3)
    wrapped = DataLookahead(iter(items), M)
    assert same(pulls(wrapped.data_iterator, count + 3), plain)
    assert [x for kind, x in plain if kind == "item"] == items and plain[count:] == [("stop", None)] * 3


class Resuming:
    """An iterator that ends and then goes on (not what the protocol asks, but what pull k gives is the rule)."""

    def __init__(self, items: list[Any]) -> None:
        self.items, self.read = items, 0

    def __iter__(self) -> Iterator[Any]:
        return self

    def __next__(self) -> Any:
        self.read += 1
        if self.read % 3 == 0:
            raise StopIteration
        return self.items[self.read % len(self.items)]


def test_every_pull_gives_what_the_sources_pull_gave_even_past_an_end() -> None:
    items = batches(5)
    assert same(pulls(DataLookahead(Resuming(items), M).data_iterator, 4 * M), pulls(Resuming(items), 4 * M))

    def generator() -> Iterator[Any]:
        yield from items[:3]
        raise RuntimeError("shard missing")

    assert [kind for kind, _ in pulls(DataLookahead(generator(), M).data_iterator, 6)] == [
        kind for kind, _ in pulls(generator(), 6)] == ["item"] * 3 + ["raise"] + ["stop"] * 2


def test_an_error_while_reading_ahead_is_raised_at_its_own_pull() -> None:
    items = batches(3 * M)
    raise_at = M + 2  # read ahead during iteration 0: the consumer must still get M + 2 items first
    plain_source, wrapped_source = Counting(items, raise_at), Counting(items, raise_at)
    wrapped_source.error = plain_source.error
    wrapped = DataLookahead(wrapped_source, M)
    first = pulls(wrapped.data_iterator, 1)
    assert wrapped_source.read == 2 * M > raise_at  # the error was met ahead of the consumer
    assert wrapped.sizes(0) is not None and wrapped.sizes(1) is None  # iteration 1 cannot be sized
    assert same(first + pulls(wrapped.data_iterator, 3 * M), pulls(plain_source, 3 * M + 1))


def test_none_iterators_stay_none_on_stages_without_data() -> None:
    nothing = DataLookahead(None, M)
    assert nothing.data_iterator is None and not nothing.has_data
    assert nothing.next_sizes() is None and nothing.sizes(0) is None and nothing.problem is None
    nothing.read_ahead()
    chunks = DataLookahead([None, None], M)
    assert chunks.data_iterator == [None, None] and not chunks.has_data
    items = batches(2 * M)
    mixed = DataLookahead([None, iter(items)], M)
    assert isinstance(mixed.data_iterator, list) and mixed.data_iterator[0] is None
    assert same(pulls(mixed.data_iterator[1], 2 * M + 1), pulls(iter(items), 2 * M + 1))
    assert mixed.has_data and mixed.sizes(1) == [expected_size(k) for k in range(M, 2 * M)]


def test_interleaved_chunks_pulled_in_megatrons_order_get_their_own_objects() -> None:
    """Each model chunk's iterator, pulled in the order Megatron's interleaved schedule runs its forwards."""
    stages, chunks, iterations = 4, 2, 3
    per_chunk = [batches(iterations * M) for _ in range(chunks)]
    for stage in range(stages):
        forwards = [u.chunk for u in _interleaved_order(stage, stages, M, chunks) if u.is_forward]
        wrapped = DataLookahead([iter(items) for items in per_chunk], M)
        plain = [iter(items) for items in per_chunk]
        for _ in range(iterations):
            for chunk in forwards:
                assert next(wrapped.data_iterator[chunk]) is next(plain[chunk])
        for chunk in range(chunks):
            assert pulls(wrapped.data_iterator[chunk], 1) == pulls(plain[chunk], 1) == [("stop", None)]


# --------------------------------------------------------------------------- sizes one iteration ahead


def test_sizes_of_the_next_iteration_are_known_from_the_first_pull_of_the_running_one() -> None:
    source = Counting(batches(3 * M + 2))  # 3 whole iterations and 2 micro-batches of a fourth
    seen: list[tuple[int, list[MicrobatchSize]]] = []
    look = DataLookahead(source, M, on_sizes=lambda i, sizes: seen.append((i, sizes)))
    iteration_sizes = [[expected_size(k) for k in range(i * M, (i + 1) * M)] for i in range(3)]
    assert look.next_sizes() is None and source.read == 0  # nothing read before it is asked for
    look.read_ahead()  # before iteration 0: iterations 0 and 1, no further
    assert source.read == 2 * M and look.next_sizes() == iteration_sizes[0]
    assert look.sizes(1) == iteration_sizes[1] and look.sizes(2) is None
    it = look.data_iterator
    for i in range(3):
        for _ in range(M):
            next(it)
            # During iteration i (and until i + 1's first pull): the sizes of i + 1, read no further.
            assert source.read == min((i + 2) * M, 3 * M + 2)
            assert look.next_sizes() == (iteration_sizes[i + 1] if i < 2 else None)
    assert seen == [(0, iteration_sizes[0]), (1, iteration_sizes[1]), (2, iteration_sizes[2])]
    assert look.sizes(3) is None  # a partial iteration has no sizes


def test_sizes_come_from_the_first_chunk_with_data_with_interleaved_chunks() -> None:
    seen: list[int] = []
    look = DataLookahead([None, iter(batches(2 * M)), iter(batches(3 * M))], M,
                         on_sizes=lambda i, _: seen.append(i))
    next(look.data_iterator[1])
    assert look.next_sizes() == [expected_size(k) for k in range(M, 2 * M)]
    for _ in range(M):
        next(look.data_iterator[2])
    assert seen == [0, 1]  # reported once per iteration, by the first chunk with data only


def test_an_iteration_being_read_has_no_sizes_yet() -> None:
    """Asked while iteration 1 is half read (from the size function itself, deterministically): None."""
    midway: list[Any] = []

    def size_of(batch: dict[str, Any]) -> MicrobatchSize:
        if batch["k"] == M + 2:
            midway.append(look.sizes(1))
            midway.append(look.sizes(0))
        return _microbatch_size(batch)

    look = DataLookahead(iter(batches(2 * M)), M, size_of=size_of)
    look.read_ahead()
    assert midway == [None, [expected_size(k) for k in range(M)]]
    assert look.sizes(1) == [expected_size(k) for k in range(M, 2 * M)]


def test_a_planner_thread_reads_sizes_while_the_schedule_pulls() -> None:
    """Every answer the planner gets is None or one whole iteration's sizes, never a partial list."""
    iterations = 40
    look = DataLookahead(iter(batches(iterations * M)), M)
    valid = [[expected_size(k) for k in range(i * M, (i + 1) * M)] for i in range(iterations)]
    answers: list[Any] = []
    done = threading.Event()

    def planner() -> None:
        while not done.is_set():
            answers.append(look.next_sizes())

    thread = threading.Thread(target=planner)
    thread.start()
    try:
        for _ in range(iterations * M):
            next(look.data_iterator)
    finally:
        done.set()
        thread.join(timeout=60)
    assert not thread.is_alive()
    assert answers and all(a is None or a in valid for a in answers)


# --------------------------------------------------------------------------- sizing a micro-batch


def test_micro_batch_lengths_contract() -> None:
    torch = pytest.importorskip("torch")
    tokens = torch.zeros(3, 17, dtype=torch.int64)
    assert _microbatch_seq_lengths({"tokens": tokens, "labels": tokens}) == [17, 17, 17]
    assert _microbatch_seq_lengths(tokens) == [17, 17, 17]
    packed = {"tokens": torch.zeros(1, 12), "seq_lengths": torch.tensor([5, 4, 3])}
    assert _microbatch_seq_lengths(packed) == [5, 4, 3]
    assert _microbatch_seq_lengths({"seq_lengths": [7]}) == [7]
    assert _microbatch_size(packed) == MicrobatchSize(12, 25 + 16 + 9)
    assert _microbatch_size({"tokens": tokens}) == MicrobatchSize(51, 3 * 17 * 17)
    for bad in ({"labels": tokens}, [tokens], {"tokens": torch.zeros(17)}, {"seq_lengths": [[1, 2]]},
                {"seq_lengths": [1.5]}):
        with pytest.raises(LookaheadError) as caught:
            _microbatch_size(bad)
        assert isinstance(caught.value, EnvPipeError) and "\n" not in str(caught.value)
    with pytest.raises(EnvPipeError, match="> 0"):
        _microbatch_size({"seq_lengths": [3, 0]})


def test_a_micro_batch_that_cannot_be_sized_is_logged_once_and_changes_nothing(caplog: pytest.LogCaptureFixture) -> None:
    items: list[Any] = batches(3 * M)
    items[M + 1] = {"labels": "no tokens here"}
    items[M + 2] = ("nor", "here")
    look = DataLookahead(iter(items), M)
    plain = iter(items)
    with caplog.at_level(logging.WARNING, logger="megatron_envpipe"):
        assert same(pulls(look.data_iterator, M + 1), pulls(plain, M + 1))
        assert look.sizes(0) is not None and look.sizes(1) is None and look.sizes(2) is not None
        assert same(pulls(look.data_iterator, 2 * M), pulls(plain, 2 * M))
    assert look.problem is not None and look.problem.startswith(f"micro-batch {M + 1}: cannot size")
    assert len([r for r in caplog.records if "look-ahead" in r.getMessage()]) == 1


def test_bad_arguments_say_what_to_do() -> None:
    for bad in (0, -1, 2.0, True):
        with pytest.raises(LookaheadError, match="num_microbatches must be a whole number >= 1"):
            DataLookahead(iter([]), bad)  # type: ignore[arg-type]
    with pytest.raises(LookaheadError, match=r"pass iter\(\.\.\.\)"):
        DataLookahead([1, 2, 3], M)


# --------------------------------------------------------------------------- the tiny GPT's data


def test_tiny_gpt_variable_length_micro_batches_are_sized_by_their_padded_shape() -> None:
    torch = pytest.importorskip("torch")
    from megatron_envpipe.apps.tiny_samples import LengthDistribution, VariableLengthDataset

    dataset = VariableLengthDataset(torch.arange(5000) % 97, LengthDistribution.default(32), seed=5, eod=0)
    look = DataLookahead(dataset.microbatches(0, M, 2), M)
    look.read_ahead()
    shapes = [tuple(b["tokens"].shape) for b in dataset.microbatches(0, M, 2)]
    assert look.sizes(0) == [MicrobatchSize(2 * s, 2 * s * s) for _, s in shapes]
    assert len({s for _, s in shapes}) > 1  # the lengths do vary
    # The iteration's iterator: exactly M micro-batches, equal to a fresh read, then the end.
    got = pulls(look.data_iterator, M + 1)
    assert got[-1] == ("stop", None)
    for (_, batch), again in zip(got, dataset.microbatches(0, M, 2), strict=False):
        assert batch.keys() == again.keys() and all(torch.equal(batch[k], again[k]) for k in batch)
