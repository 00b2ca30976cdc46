"""A tiny, deterministic Megatron ``GPTModel`` with synthetic data, for pipeline tests.

Everything is fp32 on the CPU with dropout off, so a run is a pure function of
the spec: two builds with the same spec and pipeline rank have identical
weights (tensor-parallel ranks hold slices of the same CPU-initialised master
weights), and the data iterator yields identical micro-batches (each
data-parallel replica its own). Megatron is imported inside the builders only,
so the spec can be pickled and passed around by processes that never import
megatron.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from megatron_envpipe.megatron.compat import model_parallel_manual_seed

if TYPE_CHECKING:
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer import TransformerConfig

__all__ = [
    "Batch",
    "TinyGPTSpec",
    "average_data_parallel_grads",
    "build_config",
    "build_model",
    "forward_step_func",
    "loss_func",
    "synthetic_batches",
]

Batch = dict[str, torch.Tensor]


@dataclass(frozen=True)
class TinyGPTSpec:
    """Shape of the model and data. Defaults keep one micro-batch to a few ms on CPU."""

    layers_per_stage: int = 2
    hidden_size: int = 32
    num_attention_heads: int = 4
    vocab_size: int = 128
    seq_length: int = 16
    micro_batch_size: int = 2
    seed: int = 1234
    # Fraction of label positions excluded from the loss; non-zero so that the
    # per-micro-batch token count (Megatron's 3-tuple loss path) actually varies.
    masked_fraction: float = 0.125
    # Megatron's overlap_p2p_comm (async P2P, with batch_p2p_comm off): what Megatron-LM requires for
    # an interleaved pipeline of 2 stages, whose batched exchanges would pair two messages per rank pair.
    overlap_p2p_comm: bool = False
    # What megatron.training sets: outputs pseudo-freed after their send. megatron-core 0.16's interleaved
    # schedule frees them before an overlapped (async) send has read them (fixed in 0.19): with
    # overlap_p2p_comm on 0.16 the stock reference needs it off.
    deallocate_pipeline_outputs: bool = True
    # Variable sequence lengths (Megatron's variable_seq_lengths, shapes exchanged per message): each
    # micro-batch draws its length uniformly from [min_seq_length, seq_length]. None: all seq_length.
    min_seq_length: int | None = None

    def __post_init__(self) -> None:
        if self.min_seq_length is not None and not 1 <= self.min_seq_length <= self.seq_length:
            raise ValueError(f"TinyGPTSpec: min_seq_length must be None or 1..seq_length ({self.seq_length}), "
                             f"got {self.min_seq_length!r}")


def build_config(spec: TinyGPTSpec, pipeline_size: int, tensor_parallel_size: int = 1,
                 data_parallel_size: int = 1, virtual_pipeline_size: int | None = None) -> TransformerConfig:
    """TransformerConfig with the fields Megatron's pipeline schedules read set explicitly.

    With ``data_parallel_size > 1`` the schedule finalizes gradients with
    :func:`average_data_parallel_grads`, so replicas end the iteration with the same grads.
    ``virtual_pipeline_size`` V: each stage's ``layers_per_stage`` layers are split into V model chunks.
    """
    if virtual_pipeline_size is not None and spec.layers_per_stage % virtual_pipeline_size:
        raise ValueError(f"layers_per_stage {spec.layers_per_stage} must be a multiple of the virtual "
                         f"pipeline size {virtual_pipeline_size}")
    from megatron.core.transformer import TransformerConfig

    return TransformerConfig(
        num_layers=spec.layers_per_stage * pipeline_size,
        hidden_size=spec.hidden_size,
        num_attention_heads=spec.num_attention_heads,
        pipeline_model_parallel_size=pipeline_size,
        virtual_pipeline_model_parallel_size=virtual_pipeline_size,
        tensor_model_parallel_size=tensor_parallel_size,
        params_dtype=torch.float32,
        # Receive buffers of P2PCommunicator are allocated with this dtype.
        pipeline_dtype=torch.float32,
        overlap_p2p_comm=spec.overlap_p2p_comm,
        batch_p2p_comm=not spec.overlap_p2p_comm,
        # What megatron.training sets: outputs are pseudo-freed after their send
        # and backward goes through custom_backward. An executor must cope with it.
        deallocate_pipeline_outputs=spec.deallocate_pipeline_outputs,
        # Initialise on CPU with the default generator, independent of device.
        use_cpu_initialization=True,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        # No DDP wrapper on CPU (its buffers are CUDA-only): data-parallel replicas
        # average their grads in a plain all-reduce instead; one replica has nothing to finalize.
        finalize_model_grads_func=average_data_parallel_grads if data_parallel_size > 1 else None,
        variable_seq_lengths=spec.min_seq_length is not None,
        # No MoE here; Megatron's config refuses variable lengths with its default (allgather) dispatcher.
        **({"moe_token_dispatcher_type": "alltoall"} if spec.min_seq_length is not None else {}),
    )


def average_data_parallel_grads(models: list[torch.nn.Module], num_tokens: Any = None, **_: Any) -> None:
    """``finalize_model_grads_func`` for CPU data parallelism: every grad averaged over the replicas.

    Megatron's own finalize needs its DDP wrapper's (CUDA) buffers; this does the
    one thing it would do here, in a fixed parameter order, for both schedules alike.
    """
    from megatron.core import parallel_state

    group = parallel_state.get_data_parallel_group()
    for model in models:
        for param in model.parameters():
            if param.grad is not None:
                dist.all_reduce(param.grad, group=group)
                param.grad /= dist.get_world_size(group)


def build_model(spec: TinyGPTSpec, config: TransformerConfig, vp_stage: int | None = None) -> GPTModel:
    """This rank's pipeline stage of the GPT (model chunk ``vp_stage``), with weights fixed by ``spec.seed``.

    Requires ``initialize_model_parallel`` and, on CPU, active ``cpu_shims``.
    Each stage seeds with ``seed + 100 * stage`` (as megatron.training does) so
    stages differ from each other but each is reproducible; chunk v adds ``10000 * v``.
    """
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    stage = parallel_state.get_pipeline_model_parallel_rank()
    model_parallel_manual_seed(spec.seed + 100 * stage + 10_000 * (vp_stage or 0))
    chunked = {} if vp_stage is None else {"vp_stage": vp_stage}
    return GPTModel(
        config=config,
        # Local spec: plain torch modules, no Transformer Engine or apex.
        transformer_layer_spec=get_gpt_layer_local_spec(),
        vocab_size=spec.vocab_size,
        max_sequence_length=spec.seq_length,
        pre_process=parallel_state.is_pipeline_first_stage(ignore_virtual=vp_stage is None, vp_stage=vp_stage),
        post_process=parallel_state.is_pipeline_last_stage(ignore_virtual=vp_stage is None, vp_stage=vp_stage),
        # Untied: tying makes the last stage copy the embedding with
        # `weight.data.cuda()` plus an all-reduce, which has no CPU path.
        share_embeddings_and_output_weights=False,
        **chunked,
    )


def synthetic_batches(spec: TinyGPTSpec, num_microbatches: int, replica: int = 0) -> Iterator[Batch]:
    """Exactly ``num_microbatches`` language-model micro-batches from a seeded generator.

    Data-parallel replica ``replica`` draws its own sequence (seeded ``seed + replica``).

    Every pipeline stage gets its own iterator over the same sequence: the first
    stage reads tokens, the last reads labels and mask, and any schedule that runs
    a stage's forwards in micro-batch order sees micro-batch ``i`` on its ``i``-th
    ``next()``. A schedule that pulls too many micro-batches gets StopIteration.
    """
    generator = torch.Generator().manual_seed(spec.seed + replica)
    for _ in range(num_microbatches):
        length = spec.seq_length
        if spec.min_seq_length is not None:  # drawn first, from the same generator: every stage agrees
            length = int(torch.randint(spec.min_seq_length, spec.seq_length + 1, (1,), generator=generator))
        shape = (spec.micro_batch_size, length)
        sequence = torch.randint(spec.vocab_size, (spec.micro_batch_size, length + 1), generator=generator)
        keep = torch.rand(shape, generator=generator) >= spec.masked_fraction
        yield {
            "tokens": sequence[:, :-1].contiguous(),
            "labels": sequence[:, 1:].contiguous(),
            "loss_mask": keep.float(),
            "position_ids": torch.arange(length).expand(shape).clone(),
            # Megatron convention: True marks a position that must not be attended.
            "attention_mask": torch.ones(length, length, dtype=torch.bool).triu(1).view(1, 1, length, length),
        }


def loss_func(
    loss_mask: torch.Tensor, output_tensor: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """Masked token-loss sum in Megatron's 3-tuple form ``(loss, num_tokens, report)``.

    forward_step divides the returned loss in place by ``num_tokens`` and the
    micro-batch count, so the reported value is a copy, not a detached view.
    """
    mask = loss_mask.reshape(-1)
    loss = torch.sum(output_tensor.float().reshape(-1) * mask)
    num_tokens = mask.sum().to(torch.int)
    return loss, num_tokens, {"lm loss": loss.detach().clone(), "num_tokens": num_tokens.clone()}


def forward_step_func(
    data_iterator: Iterator[Batch], model: torch.nn.Module
) -> tuple[torch.Tensor, Callable[[torch.Tensor], Any]]:
    """Megatron-style forward step: one micro-batch through this stage.

    Non-first stages ignore the tokens (their input arrives via
    ``set_input_tensor``); non-last stages return hidden states and their loss
    function is never called.
    """
    batch = next(data_iterator)
    output = model(
        batch["tokens"],
        batch["position_ids"],
        batch["attention_mask"],
        labels=batch["labels"],
    )
    return output, functools.partial(loss_func, batch["loss_mask"])
