"""GPT pre-training without a Megatron-LM checkout (megatron-core >= 0.17 ships ``megatron.training``).

What Megatron-LM's ``pretrain_gpt.py`` and ``gpt_builders.py`` add on top of
``megatron.training.pretrain``, written for EnvPipe's entry: the GPT model
provider (<= 0.18; 0.19 builds the model from ``gpt_config_from_args``), the
datasets provider (``--mock-data`` or indexed ``--data-path``), the forward
step and the loss. Tensor, pipeline (interleaved too), context and data
parallelism and MoE layers are covered; the rarer paths of Megatron-LM's
script (SFT, FIM, MTP, packed sequences, ModelOpt, cached-logit
distillation, legacy models) are refused in one line that points to
``--megatron-lm DIR``, which runs Megatron-LM's own script instead.

torch and ``megatron`` are imported inside the functions: the entry imports
this module before it knows that ``megatron.training`` can load here.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from collections.abc import Callable, Iterator
from typing import Any

from megatron_envpipe.errors import EnvPipeError

# Megatron-LM's pretrain_gpt.py passes the same default.
ARGS_DEFAULTS = {"tokenizer_type": "GPT2BPETokenizer"}
BATCH_KEYS = ("tokens", "labels", "loss_mask", "attention_mask", "position_ids")
# Flags whose code path lives only in Megatron-LM's script: (Megatron argument, flag as typed).
CHECKOUT_ONLY = (
    ("sft", "--sft"), ("fim_data", "--fim-data"), ("mtp_num_layers", "--mtp-num-layers"),
    ("hybrid_context_parallel", "--hybrid-context-parallel"),
    ("dataloader_inter_document_masking", "--dataloader-inter-document-masking"),
    ("logits_load_dir", "--logits-load-dir"), ("use_legacy_models", "--use-legacy-models"),
    ("overlap_moe_expert_parallel_comm", "--overlap-moe-expert-parallel-comm"),
    ("modelopt_enabled", "ModelOpt"), ("per_dataset_sequences_path", "--per-dataset-sequences-path"),
)
# GPTDatasetConfig field <- Megatron argument, passed where both exist in the installed version.
DATASET_FIELDS = (
    ("random_seed", "seed"), ("sequence_length", "seq_length"), ("split", "split"),
    ("multiple_validation_sets", "multiple_validation_sets"), ("full_validation", "full_validation"),
    ("num_dataset_builder_threads", "num_dataset_builder_threads"), ("path_to_cache", "data_cache_path"),
    ("mmap_bin_files", "mmap_bin_files"), ("reset_position_ids", "reset_position_ids"),
    ("reset_attention_mask", "reset_attention_mask"), ("eod_mask_loss", "eod_mask_loss"),
    ("create_attention_mask", "create_attention_mask_in_dataloader"),
    ("object_storage_cache_path", "object_storage_cache_path"),
    ("mid_level_dataset_surplus", "mid_level_dataset_surplus"),
    ("allow_ambiguous_pad_tokens", "allow_ambiguous_pad_tokens"), ("fast_cache_load", "dataloader_fast_cache_load"),
    ("defer_npy_index_mmap", "dataloader_defer_npy_index_mmap"), ("context_parallel_size", "context_parallel_size"),
    ("data_parallel_size", "data_parallel_size"),
)


class CheckoutNeeded(EnvPipeError, RuntimeError):
    """A flag whose code path only Megatron-LM's own ``pretrain_gpt.py`` has."""


def check_supported(args: Any, megatron_core_version: str) -> None:
    """Refuse, in one line, the flags whose code path only Megatron-LM's script has."""
    for name, flag in CHECKOUT_ONLY:
        if getattr(args, name, None):
            raise CheckoutNeeded(
                f"{flag} needs Megatron-LM's own pretrain_gpt.py: git clone --branch core_v{megatron_core_version} "
                f"https://github.com/NVIDIA/Megatron-LM and pass --megatron-lm DIR (or set MEGATRON_LM=DIR)")


def slice_for_context_parallel(batch: dict[str, Any], cp_size: int, cp_rank: int) -> dict[str, Any]:
    """This context-parallel rank's share of the sequence, balanced for causal attention.

    The sequence is cut into ``2 * cp_size`` chunks and rank ``r`` keeps chunks
    ``r`` and ``2 * cp_size - 1 - r``: an early (cheap) and a late (costly)
    chunk each, as Megatron's attention expects under context parallelism.
    """
    if cp_size == 1:
        return batch
    import torch

    out = {}
    for key, tensor in batch.items():
        if tensor is None:
            out[key] = None
            continue
        dim = 2 if key == "attention_mask" else 1  # [b, 1, s, s] is cut along its query rows
        shape = tensor.shape
        chunks = tensor.view(*shape[:dim], 2 * cp_size, shape[dim] // (2 * cp_size), *shape[dim + 1:])
        keep = torch.tensor([cp_rank, 2 * cp_size - 1 - cp_rank], device=tensor.device)
        kept = chunks.index_select(dim, keep)
        out[key] = kept.reshape(*shape[:dim], -1, *shape[dim + 1:])
    return out


def _receive_buffers(args: Any, device: Any) -> dict[str, Any]:
    import torch

    b, s = args.micro_batch_size, args.seq_length
    mask = torch.empty((b, 1, s, s), dtype=torch.bool, device=device) if args.create_attention_mask_in_dataloader else None
    return {"tokens": torch.empty((b, s), dtype=torch.int64, device=device),
            "labels": torch.empty((b, s), dtype=torch.int64, device=device),
            "loss_mask": torch.empty((b, s), dtype=torch.float32, device=device),
            "attention_mask": mask,
            "position_ids": torch.empty((b, s), dtype=torch.int64, device=device)}


def get_batch(data_iterator: Iterator | None, vp_stage: int | None = None) -> tuple:
    """(tokens, labels, loss_mask, attention_mask, position_ids) of this rank's micro-batch.

    Only the first and last pipeline stages read data; tensor-parallel rank 0
    reads it and broadcasts it to its group; context parallelism then keeps
    this rank's share of the sequence.
    """
    import torch
    from megatron.core import parallel_state as ps
    from megatron.training import get_args
    from megatron.training.utils import is_first_or_last_pipeline_stage

    if not is_first_or_last_pipeline_stage(vp_stage):
        return (None,) * len(BATCH_KEYS)
    args = get_args()
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    buffers = _receive_buffers(args, device)
    if ps.get_tensor_model_parallel_rank() == 0:
        data = next(data_iterator)
        # Receivers allocate by dtype: rank 0 sends exactly those dtypes.
        batch = {k: (None if data.get(k) is None or buffers[k] is None
                     else data[k].to(device=device, dtype=buffers[k].dtype, non_blocking=True)) for k in BATCH_KEYS}
    else:
        batch = buffers
    if ps.get_tensor_model_parallel_world_size() > 1:
        for tensor in batch.values():
            if tensor is not None:
                torch.distributed.broadcast(tensor, ps.get_tensor_model_parallel_src_rank(),
                                            group=ps.get_tensor_model_parallel_group())
    batch = slice_for_context_parallel(batch, ps.get_context_parallel_world_size(), ps.get_context_parallel_rank())
    return tuple(batch[k] for k in BATCH_KEYS)


def loss_func(loss_mask: Any, output_tensor: Any) -> tuple[Any, Any, dict[str, Any]]:
    """Summed masked loss, its token count, and the ``lm loss`` report Megatron averages over DP."""
    import torch

    losses = output_tensor.view(-1).float()
    mask = loss_mask.view(-1).float()
    loss = torch.sum(losses * mask)
    num_tokens = mask.sum().clone().detach().to(torch.int)
    return loss, num_tokens, {"lm loss": torch.cat([loss.clone().detach().view(1), num_tokens.view(1)])}


def forward_step(data_iterator: Iterator | None, model: Any) -> tuple[Any, Callable]:
    """Megatron's ``forward_step_func``: one micro-batch through this stage's model chunk."""
    from megatron.core.utils import get_attr_wrapped_model
    from megatron.training import get_timers

    timers = get_timers()
    timers("batch-generator", log_level=2).start()
    tokens, labels, loss_mask, attention_mask, position_ids = get_batch(
        data_iterator, get_attr_wrapped_model(model, "vp_stage"))
    timers("batch-generator").stop()
    output = model(tokens, position_ids, attention_mask, labels=labels, loss_mask=loss_mask)
    return output, functools.partial(loss_func, loss_mask)


def _dataset_built_here(vp_stage: int | None = None) -> bool:
    from megatron.core import parallel_state as ps
    from megatron.training.utils import is_first_or_last_pipeline_stage

    return is_first_or_last_pipeline_stage(vp_stage) and ps.get_tensor_model_parallel_rank() == 0


def train_valid_test_datasets_provider(num_samples: list[int], vp_stage: int | None = None) -> tuple:
    """Train, validation and test GPT datasets: mock (``--mock-data``) or indexed (``--data-path``)."""
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig, MockGPTDataset
    from megatron.training import get_args, get_tokenizer, print_rank_0
    from megatron.training.utils import get_blend_and_blend_per_split

    args = get_args()
    blend, blend_per_split = get_blend_and_blend_per_split(args)
    fields = {f.name for f in dataclasses.fields(GPTDatasetConfig) if f.init}
    values = {field: getattr(args, arg) for field, arg in DATASET_FIELDS if field in fields and hasattr(args, arg)}
    values.update(blend=blend, blend_per_split=blend_per_split, tokenizer=get_tokenizer())
    if "sequence_parallel_size" in fields:
        values["sequence_parallel_size"] = args.tensor_model_parallel_size * args.sequence_parallel
    config = GPTDatasetConfig(**values)
    print_rank_0("> building train, validation, and test datasets for GPT (megatron-envpipe) ...")
    return BlendedMegatronDatasetBuilder(MockGPTDataset if args.mock_data else GPTDataset, num_samples,
                                         functools.partial(_dataset_built_here, vp_stage=vp_stage), config).build()


# Megatron builds datasets on every rank and asks each whether it holds data (is_built_on_rank).
train_valid_test_datasets_provider.is_distributed = True  # type: ignore[attr-defined]


def gpt_model_provider(pre_process: bool = True, post_process: bool = True, vp_stage: int | None = None,
                       config: Any = None, pg_collection: Any = None) -> Any:
    """This rank's GPT model chunk (megatron-core <= 0.18, whose ``pretrain`` takes a model provider)."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt import gpt_layer_specs as specs
    from megatron.training import get_args, print_rank_0
    from megatron.training.arguments import core_transformer_config_from_args

    args = get_args()
    print_rank_0("building GPT model (megatron-envpipe) ...")
    config = config if config is not None else core_transformer_config_from_args(args)
    use_te = args.transformer_impl == "transformer_engine"
    if args.num_experts:
        layer_spec = specs.get_gpt_decoder_block_spec(config, use_transformer_engine=use_te,
                                                      normalization=args.normalization, vp_stage=vp_stage)
    else:
        make = specs.get_gpt_layer_with_transformer_engine_spec if use_te else specs.get_gpt_layer_local_spec
        extra = {} if use_te else {"normalization": config.normalization}
        layer_spec = make(num_experts=config.num_moe_experts, moe_grouped_gemm=config.moe_grouped_gemm,
                          qk_layernorm=config.qk_layernorm, multi_latent_attention=config.multi_latent_attention,
                          **extra)
    extra = {"pg_collection": pg_collection} if pg_collection is not None else {}
    return GPTModel(config=config, transformer_layer_spec=layer_spec, vocab_size=args.padded_vocab_size,
                    max_sequence_length=args.max_position_embeddings, pre_process=pre_process,
                    post_process=post_process, fp16_lm_cross_entropy=args.fp16_lm_cross_entropy,
                    parallel_output=True, share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
                    position_embedding_type=args.position_embedding_type, rotary_percent=args.rotary_percent,
                    rotary_base=args.rotary_base, rope_scaling=args.use_rope_scaling, vp_stage=vp_stage, **extra)


def pretrain_gpt(add_args: Callable) -> None:
    """Run ``megatron.training.pretrain`` with EnvPipe's GPT pieces, for the installed API generation.

    ``add_args`` registers EnvPipe's flags with Megatron's parser. Up to 0.17
    ``pretrain`` parses the flags itself; from 0.18 the caller parses them and
    passes a config container; 0.19 builds the model from that container.
    """
    import megatron.training as mtraining
    from megatron.core.enums import ModelType
    from megatron.training import arguments as marguments

    wrapped, store = mtraining.inprocess_restart.maybe_wrap_for_inprocess_restart(mtraining.pretrain)
    common = {"train_valid_test_dataset_provider": train_valid_test_datasets_provider,
              "model_type": ModelType.encoder_or_decoder, "forward_step_func": forward_step, "store": store}
    if "extra_args_provider" in inspect.signature(mtraining.pretrain).parameters:  # <= 0.17
        wrapped(model_provider=gpt_model_provider, extra_args_provider=add_args, args_defaults=ARGS_DEFAULTS, **common)
        return
    from megatron.training import argument_utils

    args = marguments.parse_and_validate_args(extra_args_provider=add_args, args_defaults=ARGS_DEFAULTS)
    if hasattr(argument_utils, "gpt_config_from_args"):  # 0.19: the model comes from its config
        container = argument_utils.pretrain_cfg_container_from_args(args, argument_utils.gpt_config_from_args(args))
        wrapped(container, model_provider=None, **common)
    else:  # 0.18
        wrapped(argument_utils.pretrain_cfg_container_from_args(args), model_provider=gpt_model_provider, **common)
