"""Per-iteration plans at run time (issue 25 part 3, megatron/iteration_plans.py): the size mapping, the
length model chosen, the sizes message, the flag, and the fallback to the previous plan when a plan is late
(the broadcast of the sizes is held back on purpose: no timing involved). Training with them, against stock
Megatron: tests/megatron/test_variable_lengths_acceptance.py."""

from __future__ import annotations

import argparse
import json
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from megatron_envpipe.config import EnvPipeConfig, EnvPipeConfigError, add_envpipe_args
from megatron_envpipe.core.instructions import SetFrequency
from megatron_envpipe.core.length_costs import LengthCostError, LengthSample, MicrobatchSize
from megatron_envpipe.core.profile import Profile, ProfilePoint
from megatron_envpipe.core.resources import shipped_profile
from megatron_envpipe.megatron.iteration_plans import (
    IterationPlans,
    SizeMapping,
    _length_model_for,
    _plans_wanted,
)
from megatron_envpipe.megatron.runtime import EnvPipeRuntime

M = 8


def test_sizes_are_scaled_to_the_shipped_profiles_reference_only_where_its_costs_are_used():
    sim = SizeMapping.for_run(EnvPipeConfig(gpu="simulated:a40/gpt3-175b"), seq_length=64, micro_batch_size=2)
    assert sim.scale == 16  # 2048 / (64 x 2)
    full = MicrobatchSize.from_lengths([64, 64])
    assert sim.apply(full) == MicrobatchSize(2048, 2 * 1024**2)  # two 1024-token sequences
    short = sim.apply(MicrobatchSize.from_lengths([3, 5]))
    assert short == MicrobatchSize(128, 16**2 * 34)
    assert SizeMapping.for_run(EnvPipeConfig(), 64, 2).scale == 1.0  # a profile of this model: as read
    assert SizeMapping.for_run(EnvPipeConfig(profile="a40/bloom-176b"), 512, 1).scale == 4.0


def _two_size_profile() -> Profile:
    ref = MicrobatchSize.from_lengths([100])
    points = {(s, ins): [ProfilePoint(f, 0.01 * (2 if ins == "backward" else 1) * 1500 / f, 1.0 * 1500 / f)
                         for f in (1500, 900)] for s in range(2) for ins in ("forward", "backward")}
    samples = [LengthSample(s, 0, ins, f, MicrobatchSize.from_lengths([50]), p.time_s * 0.6, p.energy_j * 0.6)
               for (s, ins), pts in points.items() for p in pts for f in (p.freq_mhz,)]
    return Profile(points, source="measured.csv", reference_size=ref, length_samples=samples)


def test_the_length_model_is_the_profiles_fit_else_the_shipped_default_else_none():
    fitted = _length_model_for(_two_size_profile(), EnvPipeConfig())
    assert fitted.source == "measured.csv (fitted)"
    assert fitted.factors(0, 0, "forward", 900, MicrobatchSize.from_lengths([50]))[0] == pytest.approx(0.6)
    shipped = Profile.from_csv(shipped_profile("a40/gpt3-175b")).for_pipeline(4)
    sweep = Profile({k: shipped.points(*k) for k in [(s, i) for s in range(4) for i in ("forward", "backward")]},
                    source="<start-up profiler: 15 clocks>")
    assert "gpt3-175b" in _length_model_for(sweep, EnvPipeConfig(gpu="simulated:a40/gpt3-175b")).source
    with pytest.raises(LengthCostError, match="no micro-batch sizes in the profile"):
        _length_model_for(sweep, EnvPipeConfig())


def test_the_flag_defaults_on_with_optimal_and_is_refused_where_it_would_do_nothing():
    parser = add_envpipe_args(argparse.ArgumentParser())
    on = EnvPipeConfig.from_args(parser.parse_args(["--envpipe-type", "optimal"]))
    assert on.per_iteration_plans is None and _plans_wanted(on)
    assert not _plans_wanted(EnvPipeConfig(plan_type="envelope"))
    off = EnvPipeConfig.from_args(parser.parse_args(["--envpipe-type", "optimal", "--no-envpipe-per-iteration-plans"]))
    assert off.per_iteration_plans is False and not _plans_wanted(off)
    with pytest.raises(EnvPipeConfigError, match="--envpipe-per-iteration-plans plans clocks with --envpipe-type "
                                                 "optimal's planner .* --envpipe-type envelope"):
        EnvPipeConfig.from_args(parser.parse_args(["--envpipe-type", "envelope", "--envpipe-per-iteration-plans"]))
    with pytest.raises(EnvPipeConfigError, match="this run's are all alike: add --variable-seq-lengths"):
        EnvPipeConfig(plan_type="optimal", per_iteration_plans=True).validate_with_megatron_args(
            SimpleNamespace(variable_seq_lengths=False))


class _HeldBroadcast:
    """The sizes broadcast, held until released (so a plan is late on purpose)."""

    def __init__(self) -> None:
        self.released = threading.Event()

    def wait(self) -> None:
        assert self.released.wait(60), "never released"


def _message(sizes: list[MicrobatchSize]) -> torch.Tensor:
    return torch.tensor([1, len(sizes), *(s.tokens for s in sizes), *(s.attention_tokens2 for s in sizes)],
                        dtype=torch.int64)


def test_a_late_plan_runs_the_previous_one_counted_then_each_iteration_its_own(tmp_path: Path):
    profile = tmp_path / "gpt3-175b-p4.csv"
    Profile.from_csv(shipped_profile("a40/gpt3-175b")).for_pipeline(4).to_csv(profile)
    config = EnvPipeConfig(plan_type="optimal", scheduling="ours", reconfig="default", profile=str(profile),
                           gpu="simulated:a40/gpt3-175b", max_inflight=None)
    runtime = EnvPipeRuntime(config)
    startup = runtime.prepare(4, M)
    assert startup.phase == "steady"
    plans = IterationPlans(runtime, SizeMapping.for_run(config, 64, 2))
    short = [MicrobatchSize.from_lengths([n, n]) for n in (64, 10, 12, 64, 8, 20, 16, 6)]
    held = [_HeldBroadcast(), _HeldBroadcast()]
    try:
        plans._pending, plans.sizes = (held[0], _message(short)), None  # iteration 1's sizes, still in flight
        assert plans.install(startup, stage=0) is startup  # the first steady iteration: the start-up plan
        plans._pending, plans.sizes = (held[1], _message(short)), plans.mapping.sizes(short)
        assert plans.install(startup, stage=0) is startup  # its plan is late: the previous plan runs
        assert (plans.stats.fallbacks, plans.stats.planned) == (1, 0)
        for h in held:
            h.released.set()
        plans._next.result(60)
        plans._pending = (held[1], _message(short))
        got = plans.install(startup, stage=0)  # iteration 3: its own plan, ready
        assert (plans.stats.fallbacks, plans.stats.planned) == (1, 1)
        assert got.plan.schedule is startup.plan.schedule and got.plan != startup.plan
        assert got.plan.freqs_mhz[0] != startup.plan.freqs_mhz[0]
        # Same order: the programs differ only in their clock changes.
        strip = [[i for i in p.instructions if not isinstance(i, SetFrequency)] for p in startup.programs]
        assert [[i for i in p.instructions if not isinstance(i, SetFrequency)] for p in got.programs] == strip
        assert 0 < plans.stats.energy_j < plans.stats.baseline_energy_j
        # Its energy line: held to its own plan's figures, against the stock run predicted for the same sizes.
        time_s, saving, stock = plans.window_prediction(1)
        assert stock.for_sizes and (stock.energy_j, stock.time_s) == (plans.stats.baseline_energy_j,
                                                                      plans.stats.baseline_time_s)
        assert time_s == plans.stats.time_s and saving == pytest.approx(1 - plans.stats.energy_j / stock.energy_j)
        assert plans.window_prediction(2) is None  # a window with an iteration under another plan: not theirs
        assert len(got.unit_times_s[0]) == len(startup.plan.schedule.orders[0])
        plans._next.result(60)
        plans.sizes = None  # iteration 4's sizes unknown (e.g. data that cannot be sized): the last plan runs
        assert plans.install(startup, stage=0) is got
        assert (plans.stats.fallbacks, plans.stats.planned, plans.stats.unknown) == (1, 1, 1)
    finally:
        for h in held:
            h.released.set()
        plans.close()


def test_every_rank_gets_the_first_stages_sizes_of_each_iteration(tmp_path: Path):
    """Stock-free bookkeeping check in gloo ranks: hooks.iteration_sizes on every rank is the sizes of the
    micro-batches the first stage reads (broadcast over the pipeline group), one per micro-batch."""
    pytest.importorskip("megatron.core", reason="needs megatron-core: pip install -e '.[megatron]'")
    from megatron_envpipe.testing.envpipe_runs import envpipe_schedule
    from megatron_envpipe.testing.harness import PipelineRun, run_pipeline
    from megatron_envpipe.testing.tiny_gpt import TinyGPTSpec, synthetic_batches

    spec = TinyGPTSpec(min_seq_length=4)
    record_dir = tmp_path / "records"
    record_dir.mkdir()
    run_pipeline(4, [PipelineRun(M, envpipe_schedule(EnvPipeConfig(), str(record_dir), repeat=2))], spec=spec,
                 timeout_s=240)
    expected = [[b["tokens"].numel(), b["tokens"].shape[0] * b["tokens"].shape[1] ** 2]
                for b in synthetic_batches(spec, M)]
    assert len({row[0] for row in expected}) > 1  # the lengths vary
    for rank in range(4):
        (path,) = record_dir.glob(f"rank{rank}-*.json")
        sizes = json.loads(path.read_text())["sizes"]
        # The second iteration reads a new iterator object (the harness's repeat): the sizes posted a call
        # earlier were the first iterator's next iteration, which it does not have: unknown, on every rank.
        assert sizes == [expected, None], (rank, sizes)


def test_a_sizes_message_for_another_micro_batch_count_or_bad_sizes_reads_as_unknown():
    from megatron_envpipe.megatron import iteration_plans as ip

    sizes = [MicrobatchSize.from_lengths([3, 3])] * 3  # (6, 18): any token count pairs with any attention
    assert ip._decode(ip._encode(sizes, 3), 3) == tuple(sizes)
    assert ip._decode(ip._encode(sizes, 3), 4) is None  # sent before Megatron-LM's ramp-up changed M
    assert ip._decode(ip._encode(sizes, 3), 2) is None
    assert ip._decode(ip._encode(None, 3), 3) is None
    assert ip._decode(torch.tensor([1, 1, 5, 99]), 1) is None  # attention above tokens**2: not a size


def test_a_call_that_falls_back_reads_through_the_look_ahead(tmp_path: Path):
    # A training call that runs Megatron's own schedule after the iterator was wrapped must read the
    # micro-batches the look-ahead already holds first, in order; any other iterator is passed as it is.
    config = EnvPipeConfig(plan_type="optimal", scheduling="1f1b", gpu="simulated:a40/gpt3-175b")
    plans = IterationPlans(EnvPipeRuntime(config), SizeMapping())
    source = iter([{"tokens": torch.zeros(1, n)} for n in range(1, 13)])
    wrapped = plans.wrap([source], 2)
    assert next(wrapped[0])["tokens"].shape[1] == 1  # the look-ahead reads on
    assert plans.passed_on(source) is wrapped[0] and plans.passed_on([source]) == wrapped
    assert [b["tokens"].shape[1] for b in plans.passed_on(source)][:3] == [2, 3, 4]
    other = iter([])
    assert plans.passed_on(other) is other
