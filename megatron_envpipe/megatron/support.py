"""Which of Megatron's schedule calls EnvPipe's executor runs, and Megatron's default groups.

Anything the executor does not support (forward-only evaluation, standalone
multi-token-prediction stages, partial activation checkpointing, CUDA graphs, encoder-decoder
models, ...) is named by :func:`unsupported_reason`; the executor then runs
Megatron's original schedule, logging the reason once. Megatron-core is
imported inside the functions, so this module imports with torch absent.
"""

from __future__ import annotations

from typing import Any

__all__ = ["default_pg_collection", "interleaved_unsupported_reason", "unsupported_reason"]


def unsupported_reason(model: Any, config: Any, kwargs: dict[str, Any], interleaved: bool = False) -> str | None:
    """Why EnvPipe cannot run this schedule call (Megatron's own schedule runs it), or None.

    ``kwargs`` are the call's keyword arguments. The ``getattr`` reads config
    fields that exist only in some megatron-core releases. ``overlap_p2p_comm``
    only makes Megatron's interleaved schedule's P2P asynchronous, as EnvPipe's
    always is: the same math, so it runs with model chunks (1F1B has no such mode).
    ``variable_seq_lengths`` runs, with a shape message ahead of each data message
    (:mod:`~megatron_envpipe.megatron.shape_exchange`); ``mtp_standalone``, which
    also makes Megatron exchange shapes, puts multi-token prediction on a stage of
    its own, a layout the executor does not run.
    """
    if kwargs.get("forward_only"):
        return "forward-only (evaluation) iterations"
    if config.overlap_p2p_comm and not interleaved:
        return "overlap_p2p_comm"
    if getattr(config, "mtp_standalone", False):
        return "mtp_standalone (multi-token prediction on a stage of its own)"
    if getattr(config, "variable_seq_lengths", False) and kwargs.get("adjust_tensor_shapes_fn") is not None:
        return "adjust_tensor_shapes_fn with variable_seq_lengths (the sizes come with each message)"
    if config.num_microbatches_with_partial_activation_checkpoints is not None:
        return "partial activation checkpointing (num_microbatches_with_partial_activation_checkpoints)"
    if getattr(config, "cuda_graph_impl", "none") not in (None, "none") or getattr(config, "enable_cuda_graph", False):
        return "CUDA graphs"
    if getattr(config, "moe_paged_stash", False) or getattr(config, "fine_grained_activation_offloading", False):
        return "MoE paged stash / fine-grained activation offloading"
    if getattr(config, "overlap_moe_expert_parallel_comm", False):
        return "overlap_moe_expert_parallel_comm (combined 1F1B)"
    if getattr(config, "defer_embedding_wgrad_compute", False):
        return "defer_embedding_wgrad_compute"
    from megatron.core.enums import ModelType
    from megatron.core.utils import get_model_type

    if get_model_type(model) == getattr(ModelType, "encoder_and_decoder", object()):
        return "encoder-decoder models"
    pgc = kwargs.get("pg_collection")
    if pgc is not None and type(pgc).__name__ != "ProcessGroupCollection":
        return f"{type(pgc).__name__} process groups"
    if (kwargs.get("p2p_communicator") is None) != (pgc is None):
        return "p2p_communicator without pg_collection (or the reverse)"
    return None


def interleaved_unsupported_reason(config: Any, num_chunks: int, num_microbatches: int,
                                   kwargs: dict[str, Any]) -> str | None:
    """Why EnvPipe cannot run this call of Megatron's interleaved schedule, or None.

    On top of :func:`unsupported_reason`: what the stock interleaved schedule
    itself refuses (it then raises its own error) and chunk counts that
    disagree with the config.
    """
    if kwargs.get("adjust_tensor_shapes_fn") is not None:
        return "adjust_tensor_shapes_fn with a virtual pipeline"
    if config.virtual_pipeline_model_parallel_size != num_chunks:
        return (f"{num_chunks} model chunks but config.virtual_pipeline_model_parallel_size "
                f"{config.virtual_pipeline_model_parallel_size}")
    group = config.microbatch_group_size_per_vp_stage
    pp = config.pipeline_model_parallel_size
    if group is None or not pp <= group <= num_microbatches or 0 < num_microbatches % group < pp:
        return (f"micro-batch counts Megatron's interleaved schedule refuses (M {num_microbatches}, "
                f"microbatch_group_size_per_vp_stage {group}, pipeline size {pp})")
    return None


def default_pg_collection() -> Any:
    """Megatron's default process groups, as its own schedule builds them."""
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import schedules

    build = getattr(schedules, "_build_default_pg_collection", None)  # Megatron's, where it has one
    if build is not None:
        return build()
    from megatron.core.process_groups_config import ProcessGroupCollection

    pgc = ProcessGroupCollection()
    pgc.tp = parallel_state.get_tensor_model_parallel_group()
    pgc.pp = parallel_state.get_pipeline_model_parallel_group()
    pgc.cp = parallel_state.get_context_parallel_group()
    pgc.embd = parallel_state.get_embedding_group(check_initialized=False)
    pgc.pos_embd = parallel_state.get_position_embedding_group(check_initialized=False)
    pgc.dp_cp = parallel_state.get_data_parallel_group(with_context_parallel=True, partial_data_parallel=False)
    return pgc
