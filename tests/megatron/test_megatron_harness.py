"""Megatron-core on CPU/gloo: the harness, the CPU shims and the version-agnostic calls.

Megatron's own 1F1B must be bitwise reproducible through the harness before an
alternative executor can be compared with it bit for bit. megatron-core is a
hard requirement here: without it these tests fail with an install hint.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterator

import pytest

torch = pytest.importorskip("torch", reason="needs torch and megatron-core: pip install -e '.[megatron]' (install.sh does)")
pytest.importorskip("megatron.core", reason="needs torch and megatron-core: pip install -e '.[megatron]' (install.sh does)")

from megatron_envpipe.megatron import compat as megatron_compat
from megatron_envpipe.testing.harness import (
    MEGATRON_1F1B,
    PipelineRun,
    StageResult,
    compare_results,
    identify,
    megatron_1f1b,
    run_pipeline,
)
from megatron_envpipe.testing.tiny_gpt import TinyGPTSpec

Runs = dict[tuple[str, int], list[StageResult]]

# Expected on a CPU-only machine: Megatron falls back to plain torch modules.
pytestmark = pytest.mark.filterwarnings(
    "ignore:(Transformer Engine and )?Apex (is|are) not installed"
)


def test_megatron_core_is_importable() -> None:
    # CI installs megatron-core; if it is missing, say how to install it.
    megatron_compat._require_megatron()


def _native_runs(p: int) -> Runs:
    """One set of ranks for pipeline size ``p``: M in {P, 2P} twice, plus an explicit schedule."""
    plan = [
        (("first", p), PipelineRun(p)),
        (("first", 2 * p), PipelineRun(2 * p)),
        (("repeat", p), PipelineRun(p)),
        (("repeat", 2 * p), PipelineRun(2 * p)),
        (("explicit", 2 * p), PipelineRun(2 * p, schedule=megatron_1f1b)),
    ]
    results = run_pipeline(p, [run for _, run in plan])
    return {key: result for (key, _), result in zip(plan, results, strict=True)}


@pytest.fixture(scope="module")
def p2_runs() -> Runs:
    return _native_runs(2)


@pytest.fixture(scope="module")
def p4_runs() -> Runs:
    return _native_runs(4)


@pytest.fixture(params=[2, 4], ids=lambda p: f"P{p}")
def native_runs(request: pytest.FixtureRequest) -> tuple[int, Runs]:
    return request.param, request.getfixturevalue(f"p{request.param}_runs")


@pytest.mark.parametrize("factor", [1, 2], ids=["M=P", "M=2P"])
def test_native_1f1b_produces_finite_losses_and_grads(
    native_runs: tuple[int, Runs], factor: int
) -> None:
    p, runs = native_runs
    m = factor * p
    result = runs[("first", m)]
    assert [stage.rank for stage in result] == list(range(p))
    for stage in result:  # get_forward_backward_func() gave Megatron's own 1F1B, EnvPipe not installed
        assert [i.name for i in stage.schedules] == [MEGATRON_1F1B] and stage.schedules[0].is_stock_megatron
    for stage in result[:-1]:
        assert stage.losses == []
    reports = result[-1].losses
    assert len(reports) == m
    for report in reports:
        assert report["num_tokens"].item() > 0
        assert math.isfinite(report["lm loss"].item())
        # Untrained model: mean token loss near ln(vocab).
        per_token = report["lm loss"].item() / report["num_tokens"].item()
        assert abs(per_token - math.log(TinyGPTSpec().vocab_size)) < 0.5
    for stage in result:
        assert stage.grads, f"rank {stage.rank} has no parameters"
        for name, grad in stage.grads.items():
            assert grad is not None, f"rank {stage.rank} {name} got no gradient"
            assert torch.isfinite(grad).all(), f"rank {stage.rank} {name}"
        assert any(grad.abs().sum() > 0 for grad in stage.grads.values() if grad is not None)


@pytest.mark.parametrize("factor", [1, 2], ids=["M=P", "M=2P"])
def test_native_1f1b_is_bitwise_deterministic(native_runs: tuple[int, Runs], factor: int) -> None:
    p, runs = native_runs
    m = factor * p
    assert compare_results(runs[("first", m)], runs[("repeat", m)]) == []


def test_schedule_callable_replaces_default(native_runs: tuple[int, Runs]) -> None:
    p, runs = native_runs
    assert compare_results(runs[("first", 2 * p)], runs[("explicit", 2 * p)]) == []
    assert all(stage.schedules[0].is_stock_megatron for stage in runs[("explicit", 2 * p)])


def test_identity_tells_megatron_from_envpipe_and_wrappers() -> None:
    from megatron.core.pipeline_parallel import schedules

    import megatron_envpipe
    from megatron_envpipe.config import EnvPipeConfig

    original = schedules.forward_backward_pipelining_without_interleaving
    assert identify(original).is_stock_megatron and identify(megatron_1f1b).name.endswith("harness.megatron_1f1b")

    @functools.wraps(original)
    def wrapper(**kwargs: object) -> list:  # same __module__ and __qualname__, other code
        return original(**kwargs)

    assert identify(wrapper).name == MEGATRON_1F1B and not identify(wrapper).is_stock_megatron
    assert identify(functools.partial(original)).is_stock_megatron
    try:
        megatron_envpipe.install(EnvPipeConfig())
        installed = identify(schedules.forward_backward_pipelining_without_interleaving)
        assert installed.name == "megatron_envpipe.megatron.executor.envpipe_forward_backward"
        assert installed.envpipe_installed and not identify(original).is_stock_megatron
        # The reference schedule refuses to stand in for Megatron's where EnvPipe is installed.
        with pytest.raises(RuntimeError, match="must run in ranks where install.. was never called"):
            megatron_1f1b()
    finally:
        megatron_envpipe.uninstall()
    assert identify(schedules.forward_backward_pipelining_without_interleaving).is_stock_megatron


def test_fresh_processes_reproduce_results(p2_runs: Runs) -> None:
    # Executor tests may compare runs made by different sets of rank processes.
    (fresh,) = run_pipeline(2, [PipelineRun(4)])
    assert compare_results(p2_runs[("first", 4)], fresh) == []


def test_microbatch_count_changes_the_result(native_runs: tuple[int, Runs]) -> None:
    # Guards the determinism tests against a harness that ignores its input.
    p, runs = native_runs
    assert compare_results(runs[("first", p)], runs[("first", 2 * p)]) != []


# --------------------------------------------------------------------------- shims


def _patched_attributes() -> dict[str, object]:
    from megatron.core.pipeline_parallel import schedules
    from megatron.core.tensor_parallel import random as mp_random

    return {
        "torch.cuda.current_device": torch.cuda.current_device,
        "torch.cuda.synchronize": torch.cuda.synchronize,
        "schedules.torch": schedules.torch,
        "tracker": mp_random._CUDA_RNG_STATE_TRACKER,
        "tracker_initialized": mp_random._CUDA_RNG_STATE_TRACKER_INITIALIZED,
    }


def _assert_same(before: dict[str, object], after: dict[str, object]) -> None:
    for name, value in before.items():
        assert after[name] is value, f"{name} was not restored"


def test_cpu_shims_patch_and_restore() -> None:
    from megatron.core.pipeline_parallel import schedules

    before = _patched_attributes()
    with megatron_compat.cpu_shims("cpu") as handle:
        assert handle is not None and handle.active
        assert torch.cuda.current_device() == torch.device("cpu")
        torch.cuda.synchronize()
        counter = schedules.torch.zeros([], dtype=torch.int, device="cuda")
        assert counter.device.type == "cpu"
        assert schedules.torch.Tensor is torch.Tensor
    assert not handle.active
    _assert_same(before, _patched_attributes())


def test_cpu_shims_restore_on_error_and_nest() -> None:
    before = _patched_attributes()
    with pytest.raises(RuntimeError, match="boom"), megatron_compat.cpu_shims("cpu"):
        inner = megatron_compat._install_cpu_shims()
        inner.uninstall()
        # Uninstalling the inner set must leave the outer one in force.
        assert torch.cuda.current_device() == torch.device("cpu")
        raise RuntimeError("boom")
    _assert_same(before, _patched_attributes())


def test_cpu_shims_leave_non_cpu_runs_alone() -> None:
    before = _patched_attributes()
    with megatron_compat.cpu_shims("cuda") as handle:
        assert handle is None
        _assert_same(before, _patched_attributes())


def test_cpu_rng_tracker_forks_named_streams() -> None:
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    with megatron_compat.cpu_shims("cpu"):
        tracker = get_cuda_rng_tracker()
        tracker.add("a", 11)
        tracker.add("b", 22)
        torch.manual_seed(0)
        with tracker.fork("a"):
            a1 = torch.rand(3)
            with tracker.fork("b"):
                b1 = torch.rand(3)
            a2 = torch.rand(3)
        with tracker.fork("a"):
            a3 = torch.rand(3)
        default = torch.rand(3)
    stream_a = torch.rand(9, generator=torch.Generator().manual_seed(11))
    assert torch.equal(torch.cat([a1, a2, a3]), stream_a)
    assert torch.equal(b1, torch.rand(3, generator=torch.Generator().manual_seed(22)))
    assert torch.equal(default, torch.rand(3, generator=torch.Generator().manual_seed(0)))


# --------------------------------------------------------------------------- per-unit calls


class _StageModule(torch.nn.Module):
    """A one-layer last stage with the hook every Megatron pipeline model has."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(4, 3)

    def set_input_tensor(self, input_tensor: list[torch.Tensor | None]) -> None:
        self.input_tensor = input_tensor[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x)


def _loss(num_tokens: int, output: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict]:
    loss = output.square().sum()
    return loss, torch.tensor(num_tokens, dtype=torch.int), {"loss": loss.detach().clone()}


def test_call_forward_and_backward_step_run_megatron_units() -> None:
    from megatron.core.transformer import TransformerConfig

    torch.manual_seed(0)
    model = _StageModule()
    reference = _StageModule()
    reference.load_state_dict(model.state_dict())
    x = torch.randn(5, 4)
    # forward_step reads TransformerConfig fields (calculate_per_token_loss) too.
    config = TransformerConfig(
        num_layers=1,
        hidden_size=4,
        num_attention_heads=1,
        pipeline_dtype=torch.float32,
        deallocate_pipeline_outputs=True,
    )

    def forward_step_func(data: Iterator[torch.Tensor], module: torch.nn.Module) -> tuple:
        return module(next(data)), functools.partial(_loss, 7)

    store: list[dict] = []
    output, num_tokens = megatron_compat.call_forward_step(
        forward_step_func,
        iter([x]),
        model,
        2,
        None,
        store,
        config,
        cp_group_size=1,
        is_last_stage=True,
        current_microbatch=0,
    )
    assert num_tokens.item() == 7 and len(store) == 1
    input_grad = megatron_compat.call_backward_step(None, output, None, config)
    assert input_grad is None

    expected = reference(x).square().sum() / 7 / 2
    assert torch.equal(output.detach(), expected.detach())
    expected.backward()
    for got, want in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(got.grad, want.grad, rtol=0, atol=0)


def test_features_describe_installed_megatron() -> None:
    feats = megatron_compat._features()
    assert feats.has_p2p_communicator
    assert {"cp_group_size", "is_last_stage", "current_microbatch"} <= feats.forward_step_params
    assert {"input_tensor", "output_tensor", "output_tensor_grad", "config"} <= (
        feats.backward_step_params
    )
