#!/usr/bin/env python3
"""Megatron-LM's GPT pre-training with EnvPipe (Megatron-LM's ``pretrain_gpt.py`` flags, plus ``--envpipe-*``).

The same entry as ``python -m megatron_envpipe.megatron.pretrain_gpt``; see that module. With megatron-core
>= 0.17 (Python 3.12) it needs no Megatron-LM checkout; with 0.16.x pass one (``--megatron-lm DIR``):

    torchrun --nproc-per-node 8 examples/pretrain_gpt.py --pipeline-model-parallel-size 4 --num-layers 24 \\
        --hidden-size 1024 --num-attention-heads 16 --seq-length 1024 --max-position-embeddings 1024 \\
        --micro-batch-size 1 --global-batch-size 64 --train-iters 100 --lr 1e-4 --bf16 --mock-data \\
        --tokenizer-type NullTokenizer --vocab-size 32000 \\
        --envpipe-type envelope --envpipe-scheduling ours --envpipe-reconfig balanced

Add ``--envpipe-check-args`` (and ``WORLD_SIZE=8``, no torchrun) to check the flags on any machine.
"""

import sys

from megatron_envpipe.megatron.pretrain_gpt import main

if __name__ == "__main__":
    sys.exit(main())
