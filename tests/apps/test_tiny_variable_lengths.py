"""The tiny GPT's ``--variable-seq-lengths``: its length distribution, its micro-batches, its flags, and a
short pipeline run of stock Megatron (variable_seq_lengths: shapes exchanged before every transfer).

The distribution (documented in docs/tiny-gpt.md and ``tiny_data.LengthDistribution``): sample lengths
log-normal, median ``--seq-length / 4``, sigma 0.8, rounded and clamped to 1..``--seq-length``, cut from
the shipped corpus; micro-batches padded to their own longest sample.
"""

from __future__ import annotations

import json
import math
import socket
from pathlib import Path
from typing import Any

import pytest
from launching import torchrun

torch = pytest.importorskip("torch", reason="needs torch and megatron-core: pip install -e '.[megatron]' (install.sh does)")
pytest.importorskip("megatron.core", reason="needs torch and megatron-core: pip install -e '.[megatron]' (install.sh does)")

from megatron_envpipe.apps import tiny_data, tiny_samples
from megatron_envpipe.apps.tiny_samples import LengthDistribution, VariableLengthDataset

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "train_tiny_gpt.py"
SEQ = 64


@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> VariableLengthDataset:
    """Built from the shipped corpus with sockets refused: nothing is downloaded (tokenizer trained locally)."""
    cache = tmp_path_factory.mktemp("variable-lengths-cache")
    patch = pytest.MonkeyPatch()

    def refuse(*_: Any, **__: Any) -> None:
        raise AssertionError("the tiny GPT's data must not touch the network")

    patch.setattr(socket, "socket", refuse)
    patch.setattr(socket, "create_connection", refuse)
    try:
        _, built = tiny_samples.build_dataset(SEQ, seed=1234, cache_dir=cache, lengths=LengthDistribution.default(SEQ))
    finally:
        patch.undo()
    assert isinstance(built, VariableLengthDataset)
    return built


# --------------------------------------------------------------------------- the distribution


def test_lengths_are_log_normal_with_the_documented_median_and_sigma(dataset: VariableLengthDataset) -> None:
    lengths = dataset.sample_lengths.double()
    assert dataset.samples_per_epoch == len(lengths) > 3000  # the whole corpus, cut into pieces
    assert int(lengths.min()) >= 1 and int(lengths.max()) == SEQ  # within --seq-length, the tail clamped there
    assert abs(float(lengths.median()) - SEQ / 4) <= 1
    # sigma of ln(length) over the unclamped middle (clamping and rounding distort the ends).
    inner = lengths[(lengths >= 4) & (lengths < SEQ)].log()
    quartiles = torch.quantile(inner, torch.tensor([0.25, 0.75], dtype=torch.float64))
    assert abs(float(quartiles[1] - quartiles[0]) / 1.349 - 0.8) < 0.08  # IQR of a normal is 1.349 sigma
    clamped = float((lengths == SEQ).double().mean())
    assert 0.025 < clamped < 0.06  # P(L > 4 x median) = P(Z > ln 4 / 0.8) = 4.2 %
    # The pieces cover the stream front to back.
    assert torch.equal(dataset.starts[1:], (dataset.starts + dataset.sample_lengths)[:-1])
    assert int(dataset.starts[0]) == 0 and int(dataset.starts[-1] + dataset.sample_lengths[-1]) < len(dataset.tokens)


def test_micro_batches_are_padded_to_their_own_longest_sample(dataset: VariableLengthDataset) -> None:
    eod = dataset.eod
    shapes = set()
    for m, batch in enumerate(dataset.microbatches(3, num_microbatches=8, micro_batch_size=2)):
        rows = [dataset.sample((3 * 8 + m) * 2 + r) for r in range(2)]
        length = max(len(row["tokens"]) for row in rows)
        assert batch["tokens"].shape == batch["labels"].shape == batch["loss_mask"].shape == (2, length)
        shapes.add(length)
        for r, row in enumerate(rows):
            n = len(row["tokens"])
            assert torch.equal(batch["tokens"][r, :n], row["tokens"]) and torch.equal(batch["labels"][r, :n], row["labels"])
            assert torch.equal(batch["loss_mask"][r, :n], (row["tokens"] != eod).float())  # end-of-document masked
            assert not batch["loss_mask"][r, n:].any() and bool((batch["tokens"][r, n:] == eod).all())  # padding
        assert torch.equal(batch["position_ids"], torch.arange(length).expand(2, length))
        assert torch.equal(batch["attention_mask"], tiny_data.causal_attention_mask(length))
        assert batch["attention_mask"].shape == (1, 1, length, length)
    assert len(shapes) >= 4  # the lengths vary between micro-batches


def test_samples_are_next_token_windows_of_the_stream(dataset: VariableLengthDataset) -> None:
    for index in (0, 1, 77, dataset.samples_per_epoch + 5):
        sample = dataset.sample(index)
        piece = dataset._source_index(index)
        start, n = int(dataset.starts[piece]), int(dataset.sample_lengths[piece])
        assert torch.equal(sample["tokens"], dataset.tokens[start : start + n])
        assert torch.equal(sample["labels"], dataset.tokens[start + 1 : start + n + 1])


def test_deterministic_for_a_seed_whatever_the_global_rng(dataset: VariableLengthDataset) -> None:
    def iteration(seed: int, it: int) -> list[dict[str, torch.Tensor]]:
        torch.manual_seed(999 + it)  # the global RNG must not matter
        built = VariableLengthDataset(dataset.tokens, LengthDistribution.default(SEQ), seed=seed, eod=dataset.eod)
        return list(built.microbatches(it, num_microbatches=4, micro_batch_size=2))

    first, again = iteration(1234, 2), iteration(1234, 2)
    for a, b in zip(first, again, strict=True):
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    for a, b in zip(first, dataset.microbatches(2, 4, 2), strict=True):  # = the fixture's (another process's) data
        assert all(torch.equal(a[k], b[k]) for k in a)
    assert [b["tokens"].shape for b in iteration(1235, 2)] != [b["tokens"].shape for b in first]
    assert [b["tokens"].shape for b in iteration(1234, 3)] != [b["tokens"].shape for b in first]


def test_one_stream_for_the_training_gives_each_replica_its_iterations(dataset: VariableLengthDataset) -> None:
    """The training's long-lived iterator (one per model chunk, as Megatron-LM's): replica 1 of 2 pulls
    iterations 1, 3, 5, micro-batch by micro-batch, then ends."""
    stream = list(dataset.iterations(1, 2, 3, num_microbatches=4, micro_batch_size=2))
    expected = [b for it in (1, 3, 5) for b in dataset.microbatches(it, 4, 2)]
    assert len(stream) == len(expected) == 12
    for a, b in zip(stream, expected, strict=True):
        assert all(torch.equal(a[k], b[k]) for k in a)


def test_distribution_arguments_are_checked() -> None:
    assert LengthDistribution.default(64) == LengthDistribution(16.0, 0.8, 64)
    assert LengthDistribution.default(3).median_tokens == 1.0
    for bad in ((16.0, 0.8, 1), (0.5, 0.8, 64), (65.0, 0.8, 64), (16.0, 0.0, 64), (16.0, 3.5, 64), (16.0, 0.8, 64.0)):
        with pytest.raises(ValueError, match="variable sequence lengths|median sample length|log-normal sigma"):
            LengthDistribution(*bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="too short for one sample"):
        VariableLengthDataset(torch.tensor([5]), LengthDistribution.default(8), seed=1)


# --------------------------------------------------------------------------- the flag


def test_variable_seq_lengths_flags() -> None:
    from megatron_envpipe.apps import train_tiny_gpt

    args = train_tiny_gpt.parse_args(["--variable-seq-lengths", "--seq-length", "32", "--no-envpipe"])
    assert args.length_distribution == LengthDistribution(8.0, 0.8, 32)
    args = train_tiny_gpt.parse_args(["--variable-seq-lengths", "--variable-seq-length-median", "10",
                                      "--variable-seq-length-sigma", "0.5"])
    assert args.length_distribution == LengthDistribution(10.0, 0.5, 64)
    assert train_tiny_gpt.parse_args([]).length_distribution is None


@pytest.mark.parametrize(("flags", "says"), [
    (["--variable-seq-length-median", "10"], "--variable-seq-length-median shape(s) the lengths"),
    (["--variable-seq-length-sigma", "0.5"], "--variable-seq-length-sigma shape(s) the lengths"),
    (["--variable-seq-lengths", "--seq-length", "1"], "maximum of >= 2 tokens"),
    (["--variable-seq-lengths", "--variable-seq-length-median", "100"], "must lie in 1..64"),
    (["--variable-seq-lengths", "--variable-seq-length-sigma", "0"], "sigma of sample lengths must lie in"),
])
def test_bad_variable_length_flags_are_one_clear_line(flags: list[str], says: str,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    from megatron_envpipe.apps import train_tiny_gpt

    with pytest.raises(SystemExit) as exit_:
        train_tiny_gpt.parse_args(flags)
    assert exit_.value.code == 2
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert says in error and error.count("error:") == 1


# --------------------------------------------------------------------------- a pipeline run


def _run(flags: list[str], out: Path, cache: Path, nproc: int = 2, iters: int = 6) -> tuple[dict, str]:
    # Forked ranks (tests/launching.py): what the ranks train is tested, not the launch.
    result = torchrun(["--nproc-per-node", nproc, EXAMPLE, "--pipeline-model-parallel-size", nproc,
                       "--device", "cpu", "--train-iters", iters, "--cache-dir", cache, "--losses-out", out,
                       "--variable-seq-lengths", *flags],
                      cwd=REPO, log_dir=out.parent / f"{out.stem}-log", timeout_s=300, forked=True)
    return json.loads(out.read_text()), result.log


def test_stock_megatron_pipeline_trains_on_variable_length_micro_batches(tmp_path: Path) -> None:
    """docs/tiny-gpt.md's `torchrun ... --variable-seq-lengths --no-envpipe`, on 2 stages for 6 iterations.

    PP = 2, stock Megatron (EnvPipe never installed): micro-batches of different lengths cross the
    pipeline (Megatron exchanges their shapes: without variable_seq_lengths the receive buffers have the
    fixed shape and the run fails), losses finite and falling."""
    result, log = _run(["--no-envpipe"], tmp_path / "stock.json", tmp_path / "cache")
    assert "seq log-normal lengths (median 16 tokens, sigma 0.8, at most 64" in log
    assert "EnvPipe off: Megatron's own schedule" in log
    assert result["schedule"][0]["functions"] == [
        "megatron.core.pipeline_parallel.schedules.forward_backward_pipelining_without_interleaving"]
    losses = result["losses"]
    assert len(losses) == 6 and all(math.isfinite(x) for x in losses)
    assert abs(losses[0] - math.log(tiny_data.DEFAULT_VOCAB_SIZE)) < 0.5  # near-uniform at init
    assert losses[-1] < losses[0] - 0.1 and sum(losses[3:]) < sum(losses[:3])
    assert len(set(result["tokens"])) > 1  # iterations of different token counts
