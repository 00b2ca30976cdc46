"""EnvPipe's instruction executor: a drop-in for Megatron's 1F1B and interleaved schedules.

:func:`envpipe_forward_backward` has the keyword signature of
``megatron.core.pipeline_parallel.schedules.forward_backward_pipelining_without_interleaving``,
:func:`envpipe_interleaved_forward_backward` that of
``forward_backward_pipelining_with_interleaving`` (model chunks: a list of V
modules and V data iterators; chunk v of rank s is virtual stage v*P+s).
It asks the run (:class:`~megatron_envpipe.megatron.training_run.TrainingRun`) for this
iteration's schedule and clock plan, then :class:`~megatron_envpipe.megatron.stage_iteration.StageIteration`
runs the stage's instruction program (:mod:`megatron_envpipe.core.instructions`)
through a handler table: ``isend``/``irecv`` on one communicator per direction
and neighbour (:mod:`~megatron_envpipe.megatron.channels`), Megatron's own
``forward_step`` / ``backward_step``, and all of Megatron's bookkeeping
(no-sync and grad sync, ``finalize_model_grads_func``, ``total_num_tokens``,
timers, pseudo-freeing an output only after its send completed,
``forward_data_store``; per chunk: ``vp_stage``, input and output tensors,
grad and param sync as :mod:`~megatron_envpipe.megatron.grad_sync` says). The
math is Megatron's: only the order of units and the clocks change. Before a
schedule's programs run for the first time, they are proved deadlock-free
(``check_deadlock`` with lazy communicators and the channels' warm-up). With
Megatron's ``variable_seq_lengths`` each data message is preceded by a shape
message on channels of its own (:mod:`~megatron_envpipe.megatron.shape_exchange`).
Device set-up is :mod:`~megatron_envpipe.megatron.devices`, energy reports
:mod:`~megatron_envpipe.megatron.reporting`.

Anything it does not support (forward-only evaluation, virtual pipelines
unless EnvPipe's scheduling is ``interleaved``, standalone MTP stages, partial
activation checkpointing, CUDA graphs, multi-module pipelines, ...:
:mod:`~megatron_envpipe.megatron.support`) goes to Megatron's original
schedule, logged once per reason.

Megatron-core is imported inside functions: ``install()`` and the gloo test
harness import this module with torch alone, before Megatron is set up.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from megatron_envpipe.core.kinds import scheduling_kind
from megatron_envpipe.errors import OutOfOrderError
from megatron_envpipe.megatron.channels import CommError, CommTimeoutError
from megatron_envpipe.megatron.stage_iteration import StageIteration
from megatron_envpipe.megatron.state import STATE
from megatron_envpipe.megatron.support import default_pg_collection, interleaved_unsupported_reason, unsupported_reason

__all__ = ["CommError", "CommTimeoutError", "StageIteration", "envpipe_forward_backward",
           "envpipe_interleaved_forward_backward"]

log = logging.getLogger("megatron_envpipe")

def _fallback(reason: str, kwargs: dict[str, Any], interleaved: bool = False) -> list[Any]:
    if STATE.warn_once(reason):
        log.warning("EnvPipe: %s: running Megatron's own schedule for these calls", reason)
    original = STATE.original_interleaved if interleaved else STATE.original
    if original is None:
        raise OutOfOrderError("EnvPipe executor called before megatron_envpipe.install()")
    plans = STATE.run.iteration_plans if STATE.run is not None else None
    if plans is not None:  # variable lengths: read through the look-ahead, or its read-ahead would be skipped
        kwargs = {**kwargs, "data_iterator": plans.passed_on(kwargs["data_iterator"])}
    return original(**kwargs)


def _call_kwargs(**kwargs: Any) -> dict[str, Any]:
    extra = kwargs.pop("extra")
    return {**kwargs, **extra}


def envpipe_forward_backward(
    *,
    forward_step_func: Any,
    data_iterator: Any,
    model: Any,
    num_microbatches: int,
    seq_length: int,
    micro_batch_size: int,
    decoder_seq_length: int | None = None,
    forward_only: bool = False,
    collect_non_loss_data: bool = False,
    first_val_step: bool | None = None,
    adjust_tensor_shapes_fn: Callable | None = None,
    p2p_communicator: Any = None,
    pg_collection: Any = None,
    force_all_reduce: bool | None = False,
    **extra: Any,
) -> list[Any]:
    """Run one training iteration of this pipeline stage in EnvPipe's order."""
    kwargs = _call_kwargs(
        forward_step_func=forward_step_func, data_iterator=data_iterator, model=model,
        num_microbatches=num_microbatches, seq_length=seq_length, micro_batch_size=micro_batch_size,
        decoder_seq_length=decoder_seq_length, forward_only=forward_only,
        collect_non_loss_data=collect_non_loss_data, first_val_step=first_val_step,
        adjust_tensor_shapes_fn=adjust_tensor_shapes_fn, p2p_communicator=p2p_communicator,
        pg_collection=pg_collection, force_all_reduce=force_all_reduce, extra=extra,
    )
    if extra:
        return _fallback(f"unknown schedule arguments {sorted(extra)}", kwargs)
    if isinstance(model, list):
        if len(model) != 1:
            return _fallback("virtual pipeline (model chunks)", kwargs)
        model = model[0]
    if isinstance(data_iterator, list):
        if len(data_iterator) != 1:
            return _fallback("virtual pipeline (data iterators)", kwargs)
        data_iterator = data_iterator[0]
    from megatron.core.utils import get_model_config

    config = get_model_config(model)
    reason = unsupported_reason(model, config, kwargs)
    if reason:
        return _fallback(reason, kwargs)
    return _iteration(kwargs, [model], [data_iterator], config, interleaved=False).run()


def envpipe_interleaved_forward_backward(
    *,
    forward_step_func: Any,
    data_iterator: Any,
    model: Any,
    num_microbatches: int,
    seq_length: int,
    micro_batch_size: int,
    decoder_seq_length: int | None = None,
    forward_only: bool = False,
    collect_non_loss_data: bool = False,
    first_val_step: bool | None = None,
    adjust_tensor_shapes_fn: Callable | None = None,
    p2p_communicator: Any = None,
    pg_collection: Any = None,
    force_all_reduce: bool | None = False,
    **extra: Any,
) -> list[Any]:
    """Run one training iteration of this rank's model chunks in EnvPipe's (interleaved) order."""
    kwargs = _call_kwargs(
        forward_step_func=forward_step_func, data_iterator=data_iterator, model=model,
        num_microbatches=num_microbatches, seq_length=seq_length, micro_batch_size=micro_batch_size,
        decoder_seq_length=decoder_seq_length, forward_only=forward_only,
        collect_non_loss_data=collect_non_loss_data, first_val_step=first_val_step,
        adjust_tensor_shapes_fn=adjust_tensor_shapes_fn, p2p_communicator=p2p_communicator,
        pg_collection=pg_collection, force_all_reduce=force_all_reduce, extra=extra,
    )
    if extra:
        return _fallback(f"unknown schedule arguments {sorted(extra)}", kwargs, interleaved=True)
    runtime = STATE.runtime
    if runtime is not None and not scheduling_kind(runtime.config.scheduling).model_chunks:
        return _fallback(f"virtual pipeline with --envpipe-scheduling {runtime.config.scheduling} (EnvPipe runs "
                         f"model chunks only with --envpipe-scheduling interleaved)", kwargs, interleaved=True)
    if not isinstance(model, list) or not isinstance(data_iterator, list) or len(model) < 2 \
            or len(data_iterator) != len(model):
        return _fallback("virtual pipeline without one model chunk and data iterator per chunk", kwargs,
                         interleaved=True)
    from megatron.core.utils import get_model_config

    config = get_model_config(model[0])
    reason = unsupported_reason(model[0], config, kwargs, interleaved=True) or interleaved_unsupported_reason(
        config, len(model), num_microbatches, kwargs)
    if reason:
        return _fallback(reason, kwargs, interleaved=True)
    return _iteration(kwargs, model, data_iterator, config, interleaved=True).run()


def _iteration(kwargs: dict[str, Any], models: list[Any], data_iterators: list[Any], config: Any,
               interleaved: bool) -> StageIteration:
    run = STATE.run
    if run is None:
        raise OutOfOrderError("EnvPipe executor called before megatron_envpipe.install()")
    pg_collection = kwargs["pg_collection"]
    if pg_collection is None:
        pg_collection = default_pg_collection()
    return StageIteration(
        run, STATE.hooks, kwargs["forward_step_func"], data_iterators, models, config,
        kwargs["num_microbatches"], kwargs["seq_length"], kwargs["micro_batch_size"],
        kwargs["collect_non_loss_data"], kwargs["first_val_step"], kwargs["adjust_tensor_shapes_fn"],
        pg_collection, kwargs["force_all_reduce"], interleaved=interleaved,
    )
