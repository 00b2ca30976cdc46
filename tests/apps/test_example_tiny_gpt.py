"""examples/train_tiny_gpt.py end to end, and the corpus/tokenizer/dataset it trains on.

The end-to-end tests launch the example with torchrun on 4 CPU ranks (gloo):
once as stock Megatron-core (``--no-envpipe``: EnvPipe never installed, its
executor never imported), and with EnvPipe (``envelope``/``ours``/``balanced``,
and on the simulated GPU), and require the per-iteration losses to be equal bit
for bit: EnvPipe only reorders units, the arithmetic is Megatron's. Each run's
``--losses-out`` names the schedule function every rank ran, and the tests
check it: Megatron's own on the stock side, EnvPipe's executor on the other.
"""

from __future__ import annotations

import json
import math
import threading
import time
from pathlib import Path
from types import ModuleType

import pytest

torch = pytest.importorskip("torch", reason="needs torch and megatron-core: pip install -e '.[megatron]' (install.sh does)")
pytest.importorskip("megatron.core", reason="needs torch and megatron-core: pip install -e '.[megatron]' (install.sh does)")

from launching import torchrun

from megatron_envpipe.apps import tiny_data

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "train_tiny_gpt.py"
NPROC = 4
ITERS = 3
SIM_ITERS = 9  # 1 warm-up + 4 swept clocks (300 MHz apart, 1 iteration each), then 4 planned
MEGATRON_1F1B = "megatron.core.pipeline_parallel.schedules.forward_backward_pipelining_without_interleaving"
EXECUTOR = "megatron_envpipe.megatron.executor.envpipe_forward_backward"


# --------------------------------------------------------------------------- corpus and tokenizer


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("tokenizer-cache")


@pytest.fixture(scope="module")
def tokenizer(cache_dir: Path) -> tiny_data.TinyTokenizer:
    return tiny_data.load_tokenizer(tiny_data.ensure_tokenizer(cache_dir=cache_dir))


@pytest.fixture(scope="module")
def stream(tokenizer: tiny_data.TinyTokenizer) -> torch.Tensor:
    return tiny_data.tokenize_documents(tokenizer, tiny_data.read_documents())


def test_shipped_corpus_is_small_plain_text_with_sources() -> None:
    path = tiny_data.corpus_path()
    raw = path.read_bytes()
    assert 100_000 < len(raw) <= 300_000
    assert raw.isascii()
    assert len(tiny_data.read_documents(path)) > 500
    sources = (path.parent / "SOURCES.md").read_text()
    assert "Python Software Foundation" in sources and path.name in sources


def test_tokenizer_is_cached_under_a_content_key(cache_dir: Path, tokenizer: tiny_data.TinyTokenizer) -> None:
    path = tiny_data._tokenizer_path(cache_dir=cache_dir)
    assert tokenizer.path == path and path.is_file()
    assert f"-v{tiny_data.DEFAULT_VOCAB_SIZE}-" in path.name
    stamp = path.stat().st_mtime_ns
    assert tiny_data.ensure_tokenizer(cache_dir=cache_dir) == path  # cached: not retrained
    assert path.stat().st_mtime_ns == stamp
    assert sorted(p.name for p in cache_dir.iterdir()) == [path.name, path.name + ".lock"]
    # Another vocabulary size is another file.
    assert tiny_data._tokenizer_path(256, cache_dir=cache_dir) != path


def test_tokenizer_training_is_deterministic(tokenizer: tiny_data.TinyTokenizer) -> None:
    again = tiny_data._train_model_bytes(tiny_data.corpus_path(), tiny_data.DEFAULT_VOCAB_SIZE)
    assert again == tokenizer.path.read_bytes()


def test_tokenizer_round_trip(tokenizer: tiny_data.TinyTokenizer) -> None:
    assert tokenizer.vocab_size == tiny_data.DEFAULT_VOCAB_SIZE
    assert tokenizer.eod == 2
    text = "Return a new list containing all items from the iterable in ascending order."
    ids = tokenizer.encode(text)
    assert 0 < len(ids) < len(text) / 2  # BPE merges: well under a token per character
    assert 0 not in ids  # no <unk>: the corpus covers plain English text
    assert tokenizer.decode(ids) == text


def test_concurrent_callers_train_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Four ranks asking at once: one trains, all get the same complete file, no leftovers."""
    real_train = tiny_data._train_model_bytes
    calls: list[int] = []

    def counting_train(corpus: Path, vocab_size: int) -> bytes:
        calls.append(vocab_size)
        time.sleep(0.3)  # keep the others waiting on the lock while "training"
        return real_train(corpus, vocab_size)

    monkeypatch.setattr(tiny_data, "_train_model_bytes", counting_train)
    results: list[Path] = []
    errors: list[BaseException] = []
    start = threading.Barrier(4)

    def rank() -> None:
        try:
            start.wait()
            results.append(tiny_data.ensure_tokenizer(128, cache_dir=tmp_path / "cache"))
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=rank) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert not errors, errors
    assert len(results) == 4 and len(set(results)) == 1
    assert calls == [128]
    files = sorted(p.name for p in (tmp_path / "cache").iterdir())
    assert files == [results[0].name, results[0].name + ".lock"]
    assert tiny_data.load_tokenizer(results[0]).vocab_size == 128


# --------------------------------------------------------------------------- dataset


def test_samples_are_next_token_windows_with_eod_mask(stream: torch.Tensor, tokenizer: tiny_data.TinyTokenizer) -> None:
    seq = 32
    dataset = tiny_data.TinyLMDataset(stream, seq, seed=7, eod=tokenizer.eod)
    assert dataset.samples_per_epoch == (len(stream) - 1) // seq
    saw_eod = False
    for index in range(0, 400, 7):
        sample = dataset.sample(index)
        start = int(dataset._permutation(0)[index]) * seq
        assert torch.equal(sample["tokens"], stream[start : start + seq])
        assert torch.equal(sample["labels"], stream[start + 1 : start + seq + 1])
        eod = sample["tokens"] == tokenizer.eod
        saw_eod |= bool(eod.any())
        assert torch.equal(sample["loss_mask"], (~eod).float())
    assert saw_eod  # the mask is exercised


def test_epochs_are_seeded_permutations(stream: torch.Tensor) -> None:
    dataset = tiny_data.TinyLMDataset(stream[:2001], 10, seed=3)
    n = dataset.samples_per_epoch
    assert n == 200
    assert sorted(dataset._permutation(0).tolist()) == list(range(n))
    assert not torch.equal(dataset._permutation(0), dataset._permutation(1))
    assert torch.equal(dataset.sample(n + 5)["tokens"], dataset.sample(n + 5)["tokens"])


def test_microbatches_are_deterministic(stream: torch.Tensor, tokenizer: tiny_data.TinyTokenizer) -> None:
    def iteration(seed: int, it: int) -> list[dict[str, torch.Tensor]]:
        dataset = tiny_data.TinyLMDataset(stream, 16, seed=seed, eod=tokenizer.eod)
        torch.manual_seed(12345 + it)  # the global RNG must not matter
        return list(dataset.microbatches(it, num_microbatches=3, micro_batch_size=2))

    first = iteration(1234, 1)
    assert len(first) == 3
    batch = first[0]
    assert batch["tokens"].shape == batch["labels"].shape == batch["loss_mask"].shape == (2, 16)
    assert batch["tokens"].dtype == torch.int64 and batch["loss_mask"].dtype == torch.float32
    assert torch.equal(batch["position_ids"], torch.arange(16).expand(2, 16))
    assert batch["attention_mask"].shape == (1, 1, 16, 16) and bool(batch["attention_mask"][0, 0, 0, 1])
    again = iteration(1234, 1)
    for a, b in zip(first, again, strict=True):
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    # Iteration 1, micro-batch 2, row 1 is global sample (1*3 + 2)*2 + 1 = 11.
    dataset = tiny_data.TinyLMDataset(stream, 16, seed=1234, eod=tokenizer.eod)
    assert torch.equal(first[2]["tokens"][1], dataset.sample(11)["tokens"])
    assert not torch.equal(iteration(1235, 1)[0]["tokens"], batch["tokens"])
    assert not torch.equal(iteration(1234, 0)[0]["tokens"], batch["tokens"])


# --------------------------------------------------------------------------- the example


def _example_module() -> ModuleType:
    from megatron_envpipe.apps import train_tiny_gpt

    return train_tiny_gpt


def test_example_arguments() -> None:
    example = _example_module()
    args = example.parse_args(["--global-batch-size", "12", "--micro-batch-size", "3",
                               "--envpipe-type", "envelope", "--envpipe-scheduling", "ours"])
    assert args.num_microbatches == 4 and args.pipeline_model_parallel_size == 4
    assert args.envpipe_plan_type == "envelope" and args.envpipe_scheduling == "ours"
    for bad in (["--num-layers", "6"], ["--global-batch-size", "5"], ["--hidden-size", "30"]):
        with pytest.raises(SystemExit):
            example.parse_args(bad)
    assert example.parse_args(["--no-envpipe"]).no_envpipe
    # A stock run takes no EnvPipe flags: it would silently pass for an EnvPipe run.
    for bad in (["--no-envpipe", "--envpipe-type", "envelope"], ["--no-envpipe", "--stock-reference-iters", "2"]):
        with pytest.raises(SystemExit):
            example.parse_args(bad)


def _run_example(flags: list[str], cache: Path, out: Path, iters: int = ITERS, *,
                 forked: bool = True) -> tuple[dict, str]:
    """The example on NPROC ranks. ``forked``: ranks forked from one interpreter that imported torch,
    megatron-core and the example's module, never EnvPipe's patch or executor (tests/launching.py); the
    stock reference runs under real torchrun, so one run of the example is launched as users launch it."""
    result = torchrun(["--nproc-per-node", NPROC, EXAMPLE, "--pipeline-model-parallel-size", NPROC,
                       "--device", "cpu", "--train-iters", iters, "--cache-dir", cache, "--losses-out", out,
                       *flags], cwd=REPO, log_dir=out.parent / f"{out.stem}-log", timeout_s=300, forked=forked)
    return json.loads(out.read_text()), result.log


def assert_stock(schedule: list[dict]) -> None:
    """Every rank ran Megatron's own 1F1B, EnvPipe neither installed nor its executor imported."""
    assert schedule == [{"functions": [MEGATRON_1F1B], "envpipe_installed": False, "executor_imported": False}] * NPROC


def assert_envpipe(schedule: list[dict]) -> None:
    assert schedule == [{"functions": [EXECUTOR], "envpipe_installed": True, "executor_imported": True}] * NPROC


def hexes(losses: list[float]) -> list[str]:
    # Exact: same floats, bit for bit (JSON round-trips Python floats exactly).
    return [x.hex() for x in losses]


@pytest.fixture(scope="module")
def example_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("example") / "cache"


@pytest.fixture(scope="module")
def stock(example_cache: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, str]:
    """The reference: stock Megatron-core, SIM_ITERS iterations (a shorter run's losses are a prefix)."""
    return _run_example(["--no-envpipe"], example_cache, tmp_path_factory.mktemp("stock") / "stock.json", SIM_ITERS,
                        forked=False)


def test_stock_run_is_megatron_without_envpipe(stock: tuple[dict, str]) -> None:
    result, log = stock
    assert result["envpipe"] is None and result["envpipe_run"] == {}
    assert_stock(result["schedule"])
    assert "EnvPipe off: Megatron's own schedule" in log and "EnvPipe plan" not in log
    losses = result["losses"]
    assert len(losses) == SIM_ITERS and all(math.isfinite(x) for x in losses)
    assert abs(losses[0] - math.log(tiny_data.DEFAULT_VOCAB_SIZE)) < 0.5  # near-uniform at init
    assert losses[-1] < losses[0]  # every stage's optimizer stepped
    assert f"iteration {SIM_ITERS}/{SIM_ITERS} | lm loss {losses[-1]!r}" in log


def test_envpipe_schedule_trains_bitwise_like_stock_megatron(
    stock: tuple[dict, str], example_cache: Path, tmp_path: Path
) -> None:
    envpipe, log = _run_example(
        ["--envpipe-type", "envelope", "--envpipe-scheduling", "ours", "--envpipe-reconfig", "balanced",
         "--stock-reference-iters", str(ITERS)],
        example_cache, tmp_path / "envpipe.json")
    assert envpipe["envpipe"] == {"type": "envelope", "scheduling": "ours", "reconfig": "balanced"}
    assert_envpipe(envpipe["schedule"])
    # CPU ranks have no GPU, so no clock control: Megatron's own order, no clock plan, said once on every rank.
    assert "EnvPipe plan" not in log and "predicted energy saving" not in log
    assert all(log.count(f"EnvPipe stage {s}: no GPU clock control") == 1 for s in range(NPROC)), log[-6000:]
    assert f"iteration {ITERS}/{ITERS} | lm loss {envpipe['losses'][-1]!r}" in log
    reference = stock[0]
    assert envpipe["tokens"] == reference["tokens"][:ITERS]
    assert hexes(envpipe["losses"]) == hexes(reference["losses"][:ITERS])
    # The in-process reference (before install(), same ranks) is stock Megatron too, and agrees.
    in_process = envpipe["stock_reference"]
    assert_stock(in_process["schedule"])
    assert hexes(in_process["losses"]) == hexes(reference["losses"][:ITERS])


def test_simulated_gpu_profiles_plans_trains_and_reports_energy(
    stock: tuple[dict, str], example_cache: Path, tmp_path: Path
) -> None:
    """Issue 4's loop on CPU: start-up profiler on the simulated GPU, plan, train, energy log."""
    flags = ["--envpipe-type", "envelope", "--envpipe-scheduling", "ours", "--envpipe-reconfig", "balanced",
             "--envpipe-gpu", "simulated:a40/gpt3-175b",
             "--envpipe-profile-step", "300", "--envpipe-profile-iterations", "1",
             "--envpipe-profile-cache", str(tmp_path / "profiles"), "--envpipe-log-interval", "1"]
    simulated, log = _run_example(flags, example_cache, tmp_path / "sim.json", SIM_ITERS)
    assert "EnvPipe profiler: start-up profiler" in log and "profile cached at" in log
    assert "EnvPipe plan envelope/ours/balanced for 4 stages x 8 micro-batches from <start-up profiler" in log
    energy_lines = [line for line in log.splitlines() if "EnvPipe energy (simulated)" in line]
    assert energy_lines and all("W | saving" in line for line in energy_lines[-2:])
    # Same math: the simulated GPU changes clocks and timing, never the losses.
    assert_envpipe(simulated["schedule"])
    assert hexes(simulated["losses"]) == hexes(stock[0]["losses"])
    # The next run reuses the cached profile: no profiling iterations.
    _, again = _run_example(flags, example_cache, tmp_path / "again.json", 2)
    assert "reusing the cached profile" in again and "start-up profiler:" not in again.split("reusing")[0]


def test_every_energy_window_spans_the_whole_pipeline_iteration(
    stock: tuple[dict, str], example_cache: Path, tmp_path: Path
) -> None:
    """1F1B at f_max from a given profile: no iteration is measured for the reconfigurer, yet each
    reported energy is the plan's prediction, cool-down bubble included (every stage's window ends
    where the last stage's does; ending each at its own last unit dropped ~2.7 % of the energy)."""
    from megatron_envpipe.core.profile import Profile
    from megatron_envpipe.core.resources import shipped_profile

    csv = tmp_path / "p4.csv"
    Profile.from_csv(shipped_profile("a40/gpt3-175b")).for_pipeline(NPROC).to_csv(csv)
    flags = ["--envpipe-type", "baseline", "--envpipe-scheduling", "1f1b", "--envpipe-profile", str(csv),
             "--envpipe-gpu", "simulated:a40/gpt3-175b",
             "--envpipe-log-interval", "1"]
    result, log = _run_example(flags, example_cache, tmp_path / "baseline.json", 5)
    run = result["envpipe_run"]
    predicted = run["plan"]["predicted_baseline_energy_j"]
    measured = [e["energy_j"] for e in run["energy"][1:]]  # the first iteration warms the processes up
    assert len(measured) == 4 and predicted > 0
    # Host work on a busy CPU only ever adds time (at P2P power): at most +2 %, never below -0.5 %.
    for energy in measured:
        assert predicted * 0.995 <= energy <= predicted * 1.02, (measured, predicted)
    assert hexes(result["losses"]) == hexes(stock[0]["losses"][:5])


# --------------------------------------------------------------------------- interleaved (model chunks)

MEGATRON_INTERLEAVED = "megatron.core.pipeline_parallel.schedules.forward_backward_pipelining_with_interleaving"
INTERLEAVED_EXECUTOR = "megatron_envpipe.megatron.executor.envpipe_interleaved_forward_backward"
VPP = ["--virtual-pipeline-model-parallel-size", "2"]


def test_example_virtual_pipeline_arguments() -> None:
    example = _example_module()
    assert example.parse_args(VPP).virtual_pipeline_model_parallel_size == 2
    assert example.parse_args([]).virtual_pipeline_model_parallel_size is None
    for bad in (["--virtual-pipeline-model-parallel-size", "1"], [*VPP, "--num-layers", "4"],
                [*VPP, "--pipeline-model-parallel-size", "2"]):
        with pytest.raises(SystemExit):
            example.parse_args(bad)


def test_interleaved_envpipe_trains_bitwise_like_stock_interleaved_megatron(example_cache: Path, tmp_path: Path) -> None:
    """Issue 14's acceptance: V = 2 chunks per stage, EnvPipe's optimal plan on the interleaved order,
    losses equal to stock Megatron's interleaved schedule, trained first in the same ranks before EnvPipe
    was installed (--stock-reference-iters; that such a reference is what a process that never installed
    EnvPipe computes is test_envpipe_schedule_trains_bitwise_like_stock_megatron's to prove)."""
    envpipe, log = _run_example(["--envpipe-type", "optimal", "--envpipe-scheduling", "interleaved", *VPP,
                                 "--stock-reference-iters", str(ITERS)], example_cache, tmp_path / "envpipe.json")
    stock = envpipe["stock_reference"]
    assert stock["schedule"] == [{"functions": [MEGATRON_INTERLEAVED], "envpipe_installed": False,
                                  "executor_imported": False}] * NPROC
    assert "4 stages x 2 model chunks" in log
    assert envpipe["schedule"] == [{"functions": [INTERLEAVED_EXECUTOR], "envpipe_installed": True,
                                    "executor_imported": True}] * NPROC
    assert envpipe["virtual_pipeline_model_parallel_size"] == 2
    assert len(envpipe["losses"]) == ITERS and all(math.isfinite(x) for x in envpipe["losses"])
    assert envpipe["tokens"] == stock["tokens"]
    assert hexes(envpipe["losses"]) == hexes(stock["losses"])
