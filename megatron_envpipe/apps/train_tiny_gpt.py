#!/usr/bin/env python3
"""Train a tiny Megatron-core GPT with pipeline parallelism under EnvPipe's executor.

    torchrun --nproc-per-node 4 examples/train_tiny_gpt.py --pipeline-model-parallel-size 4 \\
        --envpipe-type envelope --envpipe-scheduling ours --envpipe-reconfig balanced \\
        --device cpu --train-iters 3

A plain Megatron-core training loop (no ``megatron.training``): one rank per
pipeline stage (TP = 1); more processes than stages are data-parallel replicas
(DP = processes / stages: each replica trains on its own micro-batches, gradients
averaged over the replicas before the optimizer step), a ``GPTModel`` with the local layer spec built
per stage, real text (docstrings of Python's standard library, shipped in
``data/corpus/``) tokenized by a small SentencePiece model that is trained on
first use and cached (``--cache-dir``). Every iteration calls whatever
``get_forward_backward_func()`` returns, which after ``megatron_envpipe.install``
is EnvPipe's executor, then steps a plain torch optimizer.

``--no-envpipe`` is the stock reference: ``install()`` is never called and
EnvPipe's executor never imported, so Megatron's own 1F1B runs. (``--envpipe-type
baseline --envpipe-scheduling 1f1b`` is still EnvPipe's executor, in 1F1B order.)
``--losses-out`` records which schedule function each rank ran.
``--virtual-pipeline-model-parallel-size V`` splits every stage into V model
chunks (Megatron's interleaved pipeline): stock runs Megatron's interleaved
schedule, ``--envpipe-scheduling interleaved`` EnvPipe's executor in the same
order with its clock plan.
``--variable-seq-lengths``: samples of log-normal lengths, each micro-batch padded to
its own longest (``tiny_samples.VariableLengthDataset``), and Megatron's
``variable_seq_lengths`` (shapes exchanged before every pipeline transfer).
``--stock-reference-iters N`` first trains N iterations of a fresh model with
Megatron's own schedule in the same processes, before ``install()`` is called
(recorded as ``stock_reference``): a same-math reference that costs no extra
start-up (``envpipe demo`` checks both of its runs against it).

``--device cpu`` runs over gloo with ``megatron_compat.cpu_shims``;
``--device cuda`` runs over NCCL, one GPU per local rank, with Megatron
unmodified. ``--p2p-transport host`` runs over gloo on either device, with
every point-to-point tensor staged through host memory
(``megatron_envpipe.megatron.host_p2p``, applied alike to stock and EnvPipe
runs): on CUDA several local ranks may then share one GPU (rank r uses GPU
r mod count), e.g. a 4-stage pipeline on a one-GPU machine; stages sharing a
GPU cannot own its clocks, so EnvPipe then needs ``--envpipe-gpu simulated:...``. Everything is fp32 with dropout off, so a run is a pure function
of its flags: ``--no-envpipe`` and any EnvPipe schedule give the same losses bit
for bit (``--losses-out``).

The last stage prints one line per logged iteration, e.g.
``iteration 1/3 | lm loss 6.2385... | tokens 1008 | elapsed 0.214 s``.
"""

from __future__ import annotations

import argparse
import functools
import logging
import os
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import megatron_envpipe
from megatron_envpipe.apps.tiny_data import DEFAULT_VOCAB_SIZE, Batch, ensure_tokenizer
from megatron_envpipe.apps.tiny_parallel import (
    average_over_replicas,
    init_distributed,
    sum_over_replicas,
)
from megatron_envpipe.apps.tiny_records import envpipe_summary, function_name, gather_schedules, write_losses
from megatron_envpipe.apps.tiny_samples import DEFAULT_LENGTH_SIGMA, LengthDistribution, build_dataset
from megatron_envpipe.config import EnvPipeConfig, EnvPipeConfigError, add_envpipe_args
from megatron_envpipe.config.launch_checks import check_output_files
from megatron_envpipe.core.atomic import OutputPathError, check_output
from megatron_envpipe.megatron.compat import check_megatron_installed, cpu_shims, model_parallel_manual_seed
from megatron_envpipe.megatron.host_p2p import host_p2p

# CPU runs have neither Transformer Engine nor apex; Megatron says so once per module.
warnings.filterwarnings("ignore", message=r"(Transformer Engine and )?Apex (is|are) not installed")
warnings.filterwarnings("ignore", message=r"absl\.logging is not installed")
# 0.16's TransformerConfig warns about its own default cuda_graph_scope.
warnings.filterwarnings("ignore", message=r"full scope is deprecated")


# --------------------------------------------------------------------------- arguments


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Tiny GPT on Megatron-core with EnvPipe's pipeline executor.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    g = parser.add_argument_group("model and training (Megatron-style)")
    g.add_argument("--pipeline-model-parallel-size", type=int, default=4)
    g.add_argument("--virtual-pipeline-model-parallel-size", type=int, default=None, metavar="V",
                   help="model chunks per stage (Megatron's interleaved pipeline); default: none")
    g.add_argument("--num-layers", type=int, default=8, help="total, split evenly over the stages")
    g.add_argument("--hidden-size", type=int, default=64)
    g.add_argument("--ffn-hidden-size", type=int, default=None, help="default: 4 x hidden size")
    g.add_argument("--num-attention-heads", type=int, default=4)
    g.add_argument("--seq-length", type=int, default=64)
    g.add_argument("--micro-batch-size", type=int, default=2)
    g.add_argument("--global-batch-size", type=int, default=16,
                   help="samples per iteration; / micro-batch size = micro-batches per iteration (DP = 1)")
    g.add_argument("--optimizer", choices=("adam", "sgd"), default="adam")
    g.add_argument("--lr", type=float, default=3e-3)
    g.add_argument("--train-iters", type=int, default=10)
    g.add_argument("--seed", type=int, default=1234, help="model init (seed + 100 x stage) and data order")
    g.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="cpu: gloo + CPU shims; cuda: NCCL, one GPU per local rank (or gloo with "
                        "--p2p-transport host)")
    g.add_argument("--p2p-transport", choices=("direct", "host"), default="direct",
                   help="direct: the process group's own transport (NCCL on cuda, gloo on cpu); host: gloo "
                        "with every point-to-point tensor staged through host memory, so local ranks may share "
                        "a GPU (rank r on GPU r mod count); EnvPipe then needs --envpipe-gpu simulated:<profile>")
    g.add_argument("--log-interval", type=int, default=1)
    d = parser.add_argument_group("data")
    d.add_argument("--vocab-size", type=int, default=DEFAULT_VOCAB_SIZE, help="SentencePiece BPE vocabulary")
    d.add_argument("--variable-seq-lengths", action="store_true",
                   help="samples of log-normal lengths (at most --seq-length tokens), each micro-batch padded to its "
                        "own longest sample; Megatron exchanges the shapes before every pipeline transfer "
                        "(its variable_seq_lengths)")
    d.add_argument("--variable-seq-length-median", type=float, default=None, metavar="TOKENS",
                   help="median sample length with --variable-seq-lengths (default: --seq-length / 4)")
    d.add_argument("--variable-seq-length-sigma", type=float, default=DEFAULT_LENGTH_SIGMA, metavar="SIGMA",
                   help="standard deviation of the log of the sample length with --variable-seq-lengths")
    d.add_argument("--cache-dir", type=Path, default=None,
                   help="tokenizer cache (default: $MEGATRON_ENVPIPE_CACHE or ~/.cache/megatron-envpipe)")
    d.add_argument("--losses-out", type=Path, default=None,
                   help="write the per-iteration losses and the schedule function each rank ran as JSON "
                        "(from the last stage)")
    parser.add_argument("--no-envpipe", action="store_true",
                        help="stock Megatron-core: never install EnvPipe, run Megatron's own 1F1B "
                             "(the reference for EnvPipe's same-math guarantee); takes no --envpipe-* flags")
    parser.add_argument("--stock-reference-iters", type=int, default=0, metavar="N",
                        help="before installing EnvPipe, train N iterations of a fresh model with Megatron's own "
                             "schedule; --losses-out records them as stock_reference")
    envpipe_actions = [a for a in add_envpipe_args(parser)._actions if a.dest.startswith("envpipe_")]
    args = parser.parse_args(argv)

    def bad(message: str) -> None:
        parser.error(message)

    if args.no_envpipe:
        # A stock run that silently ignored EnvPipe flags would pass for an EnvPipe run.
        given = [a.option_strings[0] for a in envpipe_actions if getattr(args, a.dest) != a.default]
        if given:
            bad(f"--no-envpipe runs Megatron's own schedule: drop {' '.join(given)}")
        if args.stock_reference_iters:
            bad("--stock-reference-iters is for EnvPipe runs: a --no-envpipe run is itself the stock reference")
    if args.stock_reference_iters < 0:
        bad("--stock-reference-iters must be >= 0")
    pp = args.pipeline_model_parallel_size
    if pp < 1:
        bad("--pipeline-model-parallel-size must be >= 1")
    if args.num_layers < pp or args.num_layers % pp:
        bad(f"--num-layers {args.num_layers} must be a positive multiple of the pipeline size {pp}")
    vpp = args.virtual_pipeline_model_parallel_size
    if vpp is not None:
        if vpp < 2 or pp < 3:
            # As Megatron-LM: at 2 stages its batched exchanges would carry two messages between one pair.
            bad(f"--virtual-pipeline-model-parallel-size must be >= 2, with a pipeline of > 2 stages (got {vpp}, "
                f"pipeline size {pp})")
        if args.num_layers % (pp * vpp):
            bad(f"--num-layers {args.num_layers} must be a multiple of pipeline size x virtual size {pp * vpp}")
    if args.hidden_size % args.num_attention_heads:
        bad("--hidden-size must be divisible by --num-attention-heads")
    if args.micro_batch_size < 1 or args.global_batch_size % args.micro_batch_size:
        bad("--global-batch-size must be a positive multiple of --micro-batch-size")
    if args.global_batch_size < args.micro_batch_size:
        bad("--global-batch-size must be >= --micro-batch-size")
    if args.train_iters < 1 or args.log_interval < 1 or args.seq_length < 1:
        bad("--train-iters, --log-interval and --seq-length must be >= 1")
    args.length_distribution = None
    if args.variable_seq_lengths:
        try:
            args.length_distribution = LengthDistribution.default(
                args.seq_length, args.variable_seq_length_median, args.variable_seq_length_sigma)
        except ValueError as exc:
            bad(f"--variable-seq-lengths: {exc} (--seq-length, --variable-seq-length-median, "
                f"--variable-seq-length-sigma)")
    else:
        given = [flag for flag, value, default in (
            ("--variable-seq-length-median", args.variable_seq_length_median, None),
            ("--variable-seq-length-sigma", args.variable_seq_length_sigma, DEFAULT_LENGTH_SIGMA)) if value != default]
        if given:
            bad(f"{' '.join(given)} shape(s) the lengths of --variable-seq-lengths: add that flag or drop them")
    if args.losses_out is not None:  # writable now, none of the run's inputs, not --envpipe-energy-csv
        try:
            if args.no_envpipe:
                check_output(args.losses_out, "--losses-out")
            else:
                check_output_files(EnvPipeConfig.from_args(args), str(args.losses_out))
        except (OutputPathError, EnvPipeConfigError) as exc:
            bad(str(exc))
    args.num_microbatches = args.global_batch_size // args.micro_batch_size
    return args


# --------------------------------------------------------------------------- data


def prepare_data(args: argparse.Namespace) -> Any:
    """Tokenizer and dataset. Local rank 0 trains an uncached tokenizer; the others wait.

    ``ensure_tokenizer`` also locks and renames atomically, so jobs sharing a
    cache directory are safe too; the barrier only saves the other ranks from
    queueing on the lock.
    """
    if int(os.environ.get("LOCAL_RANK", "0")) == 0:
        ensure_tokenizer(args.vocab_size, cache_dir=args.cache_dir)
    if dist.get_backend() == "nccl":
        dist.barrier(device_ids=[torch.cuda.current_device()])
    else:
        dist.barrier()
    return build_dataset(args.seq_length, seed=args.seed, vocab_size=args.vocab_size, cache_dir=args.cache_dir,
                         lengths=args.length_distribution)


# --------------------------------------------------------------------------- model


def build_model(args: argparse.Namespace, vocab_size: int, device: torch.device) -> list[torch.nn.Module]:
    """This rank's stage of the GPT (one module per model chunk): fp32, local spec, untied embeddings,
    seeded per stage; the chunks are built in order from that seed, as Megatron's training does."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig

    config = TransformerConfig(
        num_layers=args.num_layers,
        hidden_size=args.hidden_size,
        ffn_hidden_size=args.ffn_hidden_size,
        num_attention_heads=args.num_attention_heads,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=args.virtual_pipeline_model_parallel_size,
        params_dtype=torch.float32,
        pipeline_dtype=torch.float32,  # dtype of the P2P receive buffers
        # As megatron.training sets it: outputs are pseudo-freed after their send.
        deallocate_pipeline_outputs=True,
        # Same weights on CPU and GPU: initialise on the CPU from the seeded default generator.
        use_cpu_initialization=True,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        # DP = 1 and no DDP wrapper (its buffers are CUDA-only): nothing to finalize.
        finalize_model_grads_func=None,
        # Micro-batches of different lengths: every pipeline transfer first exchanges the tensor's shape.
        variable_seq_lengths=args.variable_seq_lengths,
        # TransformerConfig refuses variable_seq_lengths with the default "allgather" MoE dispatcher even
        # in a dense model like this one, which dispatches nothing: name the one it accepts.
        **({"moe_token_dispatcher_type": "alltoall"} if args.variable_seq_lengths else {}),
    )
    stage = parallel_state.get_pipeline_model_parallel_rank()
    model_parallel_manual_seed(args.seed + 100 * stage)
    chunks: list[int | None] = [None]
    if args.virtual_pipeline_model_parallel_size is not None:
        chunks = list(range(args.virtual_pipeline_model_parallel_size))
    models = []
    for vp in chunks:
        model = GPTModel(
            config=config,
            transformer_layer_spec=get_gpt_layer_local_spec(),  # plain torch: no TE, no apex
            vocab_size=vocab_size,
            max_sequence_length=args.seq_length,
            pre_process=parallel_state.is_pipeline_first_stage(ignore_virtual=vp is None, vp_stage=vp),
            post_process=parallel_state.is_pipeline_last_stage(ignore_virtual=vp is None, vp_stage=vp),
            # Tied embeddings make the last stage copy the embedding with .cuda() and
            # all-reduce it with the first: no CPU path, so keep them separate.
            share_embeddings_and_output_weights=False,
            **({} if vp is None else {"vp_stage": vp}),
        )
        models.append(model.to(device))
    return models


def loss_func(
    loss_mask: torch.Tensor, output_tensor: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """Masked sum of per-token losses, in Megatron's 3-tuple form (loss, num_tokens, report).

    Megatron divides ``loss`` in place by ``num_tokens`` and the micro-batch
    count, so the report holds copies.
    """
    mask = loss_mask.reshape(-1)
    loss = torch.sum(output_tensor.float().reshape(-1) * mask)
    num_tokens = mask.sum().to(torch.int)
    return loss, num_tokens, {"lm loss": loss.detach().clone(), "num_tokens": num_tokens.detach().clone()}


def make_forward_step(device: torch.device) -> Callable[..., Any]:
    def forward_step(
        data_iterator: Iterator[Batch], model: torch.nn.Module
    ) -> tuple[torch.Tensor, Callable[[torch.Tensor], Any]]:
        """One micro-batch through this stage. Stages after the first get their
        input through ``set_input_tensor`` and ignore the tokens; only the last
        uses labels and mask."""
        batch = {key: value.to(device, non_blocking=True) for key, value in next(data_iterator).items()}
        output = model(batch["tokens"], batch["position_ids"], batch["attention_mask"], labels=batch["labels"])
        return output, functools.partial(loss_func, batch["loss_mask"])

    return forward_step


# --------------------------------------------------------------------------- training


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def train(args: argparse.Namespace, device: torch.device, reference_iters: int = 0) -> list[dict[str, Any]]:
    """The training loop; returns one record per iteration on the last stage (empty elsewhere).

    ``reference_iters``: a quiet run of that many iterations (the stock reference) instead.
    """
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import get_forward_backward_func

    tokenizer, dataset = prepare_data(args)
    stage = parallel_state.get_pipeline_model_parallel_rank()
    replica, dp_size = parallel_state.get_data_parallel_rank(), parallel_state.get_data_parallel_world_size()
    is_last = parallel_state.is_pipeline_last_stage()
    models = build_model(args, tokenizer.vocab_size, device)
    params = [p for model in models for p in model.parameters() if p.requires_grad]
    if args.optimizer == "adam":
        optimizer: torch.optim.Optimizer = torch.optim.Adam(params, lr=args.lr)
    else:
        optimizer = torch.optim.SGD(params, lr=args.lr)

    counts: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(counts, sum(p.numel() for p in params))
    train_iters = reference_iters or args.train_iters
    if is_last and not reference_iters:
        import megatron.core

        print(
            f"tiny GPT: {args.num_layers} layers x hidden {args.hidden_size}, {args.num_attention_heads} heads, "
            f"vocab {tokenizer.vocab_size}, seq {args.length_distribution or args.seq_length} | "
            f"{args.pipeline_model_parallel_size} stages"
            + (f" x {len(models)} model chunks" if len(models) > 1 else "") + ", "
            f"parameters per stage {counts} | {args.num_microbatches} micro-batches of {args.micro_batch_size} | "
            f"{len(dataset.tokens)} corpus tokens | megatron-core {megatron.core.__version__}, torch "
            f"{torch.__version__}, {device.type}/{dist.get_backend()}"
            + (" (P2P staged through host memory)" if args.p2p_transport == "host" else "") + " | " + (
                "EnvPipe off: Megatron's own schedule" if args.no_envpipe else
                f"envpipe type {args.envpipe_plan_type}, scheduling {args.envpipe_scheduling}, "
                f"reconfig {args.envpipe_reconfig}"),
            flush=True,
        )

    forward_step = make_forward_step(device)
    # One iterator per model chunk for the whole training, as Megatron-LM's: iteration i pulls the
    # micro-batches of global iteration i * DP + replica (this replica's share).
    iterators = [dataset.iterations(replica, dp_size, train_iters, args.num_microbatches, args.micro_batch_size)
                 for _ in models]
    records: list[dict[str, Any]] = []
    ran: list[str] = []  # the schedule functions this rank called, in order of first use
    for iteration in range(train_iters):
        _sync(device)
        start = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        forward_backward_func = get_forward_backward_func()
        name = function_name(forward_backward_func)
        if name not in ran:
            ran.append(name)
        reports = forward_backward_func(
            forward_step_func=forward_step,
            data_iterator=iterators if len(models) > 1 else iterators[0],
            model=models,
            num_microbatches=args.num_microbatches,
            seq_length=args.seq_length,
            micro_batch_size=args.micro_batch_size,
            decoder_seq_length=None,
            forward_only=False,
        )
        average_over_replicas(params, dp_size)
        optimizer.step()
        _sync(device)
        elapsed = time.perf_counter() - start
        if not is_last:
            continue
        if len(reports) != args.num_microbatches:
            raise RuntimeError(f"stage {stage}: {len(reports)} loss reports for {args.num_microbatches} micro-batches")
        # Per-token mean over the iteration's micro-batches, summed in micro-batch order (and over replicas).
        loss_sum = sum(float(report["lm loss"]) for report in reports)
        tokens = sum(int(report["num_tokens"]) for report in reports)
        loss_sum, tokens = sum_over_replicas(loss_sum, tokens, device, dp_size)
        record = {"iteration": iteration + 1, "lm_loss": loss_sum / tokens, "tokens": tokens, "elapsed_s": elapsed}
        records.append(record)
        if reference_iters:
            continue
        if dist.get_rank() != dist.get_world_size() - 1:  # one line per iteration: the last rank's
            continue
        if (iteration + 1) % args.log_interval == 0 or iteration + 1 == train_iters:
            print(
                f"iteration {iteration + 1}/{train_iters} | lm loss {record['lm_loss']!r} | "
                f"tokens {tokens} | elapsed {elapsed:.3f} s | {tokens / elapsed:.0f} tokens/s",
                flush=True,
            )
    gather_schedules(ran, records)
    # One process reports (the last rank, as Megatron's print_rank_last): losses are averaged over replicas.
    return records if dist.get_rank() == dist.get_world_size() - 1 else []


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    check_megatron_installed()
    envpipe_config = None
    if not args.no_envpipe:
        try:
            envpipe_config = EnvPipeConfig.from_args(args).validate_with_megatron_args(args)
        except EnvPipeConfigError as exc:
            raise SystemExit(f"{Path(sys.argv[0]).name}: error: {exc}") from None
    started = time.perf_counter()
    device = init_distributed(args)
    # EnvPipe logs its plan and reconfiguration steps; show them once, from the last stage.
    rank = dist.get_rank()
    from megatron.core import parallel_state

    # Name the pipeline stage, and the replica when there are several (rank order is Megatron's, not ours).
    where = f"stage {parallel_state.get_pipeline_model_parallel_rank()}"
    if parallel_state.get_data_parallel_world_size() > 1:
        where += f", replica {parallel_state.get_data_parallel_rank()}"
    logging.basicConfig(format=f"[{where}] %(message)s", level=logging.WARNING)
    if rank == dist.get_world_size() - 1 or parallel_state.is_pipeline_last_stage():  # each replica's
        logging.getLogger("megatron_envpipe").setLevel(logging.INFO)
    # 0.19 logs "GPTModel IS DEPRECATED" (use HybridModel); GPTModel still works.
    logging.getLogger("megatron.core.models.gpt.gpt_model").setLevel(logging.ERROR)
    try:
        reference: list[dict[str, Any]] = []
        if args.stock_reference_iters:
            # Before install(): Megatron's own schedule. train() builds model, optimizer and data afresh.
            with cpu_shims(device), host_p2p(args.p2p_transport == "host"):
                reference = train(args, device, reference_iters=args.stock_reference_iters)
            if reference:
                print(f"stock reference (Megatron's own schedule, before EnvPipe was installed): "
                      f"{len(reference)} iterations, lm loss {reference[0]['lm_loss']!r} .. "
                      f"{reference[-1]['lm_loss']!r}", flush=True)
        if envpipe_config is not None:
            megatron_envpipe.install(envpipe_config)
        try:
            # On CPU: route Megatron's CUDA placement/synchronisation to the CPU.
            # On CUDA: a no-op, Megatron runs unmodified. --p2p-transport host: the transport, alike for
            # stock and EnvPipe runs (copies only, never arithmetic).
            with cpu_shims(device), host_p2p(args.p2p_transport == "host"):
                records = train(args, device)
            envpipe_run = envpipe_summary()
        finally:
            if envpipe_config is not None:
                megatron_envpipe.uninstall()
        if records:
            if args.losses_out is not None:
                write_losses(args.losses_out, args, records, envpipe_run, reference)
            print(f"done: {len(records)} iterations, {time.perf_counter() - started:.1f} s since start-up",
                  flush=True)
    finally:
        from megatron.core import parallel_state

        parallel_state.destroy_model_parallel()
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
