"""One middle pipeline stage of a Megatron GPT, alone on one device, with its forward/backward kernels.

``envpipe gpu-check`` steps 5 and 6 profile and replay it
(``megatron_envpipe/apps/gpu_check/profile_step.py``, ``replay_step.py``): a stack of Megatron-core
GPT layers (``TransformerBlock`` with the local, non-Transformer-Engine layer
spec, so it also runs on the CPU), fed a received activation of shape
``[seq, micro-batch, hidden]`` and, in backward, the gradient of its output:
exactly what a middle stage computes per micro-batch. Megatron is imported
inside :func:`open_stage` only.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from megatron_envpipe.core.schedule import Unit
from megatron_envpipe.errors import UsageError
from megatron_envpipe.megatron.compat import cpu_shims, model_parallel_manual_seed

__all__ = ["StageModel", "StageSpec", "open_stage", "parameter_count"]


@dataclass(frozen=True)
class StageSpec:
    hidden_size: int
    num_heads: int
    num_layers: int
    seq_length: int
    micro_batch_size: int
    seed: int = 1234

    def validate(self) -> "StageSpec":
        for name in ("hidden_size", "num_heads", "num_layers", "seq_length", "micro_batch_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 1 << 20:
                raise UsageError(f"stage model: {name} must be a whole number in 1..{1 << 20}, got {value!r}")
        if self.hidden_size % self.num_heads:
            raise UsageError(f"stage model: hidden size {self.hidden_size} is not a multiple of the "
                             f"{self.num_heads} attention heads; choose sizes that divide")
        return self


class StageModel:
    """The stage's kernels (:class:`megatron_envpipe.apps.gpu_check.replay.StageKernels`): ``run(F(m))`` runs the
    forward of micro-batch ``m`` and keeps its output, ``run(B(m))`` its backward."""

    def __init__(self, block: torch.nn.Module, spec: StageSpec, device: torch.device, dtype: torch.dtype) -> None:
        self.block = block
        self.spec = spec
        self.device = device
        gen = torch.Generator(device="cpu").manual_seed(spec.seed)
        shape = (spec.seq_length, spec.micro_batch_size, spec.hidden_size)
        # One received activation and one output gradient, reused: the kernels, not the data, matter.
        self._input = torch.randn(shape, generator=gen).to(device=device, dtype=dtype)
        self._grad = torch.randn(shape, generator=gen).to(device=device, dtype=dtype)
        self._outputs: dict[int, torch.Tensor] = {}
        # GPT's causal mask (True = masked), built once: Megatron's default one is made on CUDA.
        ones = torch.ones(spec.seq_length, spec.seq_length, dtype=torch.bool, device=device)
        self._mask = torch.triu(ones, diagonal=1)[None, None]

    def run(self, unit: Unit) -> None:
        if unit.kind == "F":
            x = self._input.detach().requires_grad_(True)
            self.block.set_input_tensor(x)  # a stage without embedding reads its received activation here
            self._outputs[unit.microbatch] = self.block(hidden_states=x, attention_mask=self._mask)
            return
        out = self._outputs.pop(unit.microbatch, None)
        if out is None:
            raise UsageError(f"stage model: backward of micro-batch {unit.microbatch} before its forward")
        out.backward(self._grad)

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def reset(self) -> None:
        self._outputs.clear()
        self.block.zero_grad(set_to_none=True)


@contextlib.contextmanager
def open_stage(spec: StageSpec, device: torch.device | str = "cpu") -> Iterator[StageModel]:
    """Build the stage on ``device`` in a one-process model-parallel world (set up here and torn down
    on exit when this process had none); bf16 on CUDA, fp32 on the CPU."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.transformer_block import TransformerBlock

    spec.validate()
    device = torch.device(device)
    cuda = device.type == "cuda"
    dtype = torch.bfloat16 if cuda and torch.cuda.is_bf16_supported() else torch.float32
    own_world = not dist.is_initialized()
    if own_world:
        if cuda:
            torch.cuda.set_device(device)
        dist.init_process_group("nccl" if cuda else "gloo", store=dist.HashStore(), rank=0, world_size=1)
    own_mp = not parallel_state.model_parallel_is_initialized()
    try:
        if own_mp:
            parallel_state.initialize_model_parallel()
        with cpu_shims(device):
            model_parallel_manual_seed(spec.seed)
            config = TransformerConfig(
                num_layers=spec.num_layers,
                hidden_size=spec.hidden_size,
                num_attention_heads=spec.num_heads,
                params_dtype=dtype,
                bf16=dtype == torch.bfloat16,
                use_cpu_initialization=True,
                hidden_dropout=0.0,
                attention_dropout=0.0,
                # Older megatron-core defaults to True, and bf16 on CUDA then imports the optional
                # scaled_masked_softmax_cuda extension (ModuleNotFoundError without Megatron's kernels).
                masked_softmax_fusion=False,
            )
            block: Any = TransformerBlock(config, get_gpt_layer_local_spec(), pre_process=False,
                                          post_process=False)
            block = block.to(device=device, dtype=dtype)
            model = StageModel(block, spec, device, dtype)
            for m in range(2):  # warm-up: first-call allocations and kernel selection
                model.run(Unit("F", m))
            for m in range(2):
                model.run(Unit("B", m))
            model.sync()
            model.reset()
            yield model
    finally:
        if own_mp:
            parallel_state.destroy_model_parallel()
        if own_world:
            dist.destroy_process_group()


def parameter_count(model: StageModel) -> int:
    """Parameters of the stage (for the report)."""
    return sum(p.numel() for p in model.block.parameters())

