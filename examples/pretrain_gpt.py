#!/usr/bin/env python3
"""Megatron-LM's GPT pre-training with EnvPipe (same flags as Megatron-LM's
``pretrain_gpt.py``, plus ``--envpipe-*``). Needs a Megatron-LM checkout:
``--megatron-lm DIR`` or ``MEGATRON_LM=DIR``. Installed as
``python -m megatron_envpipe.megatron.pretrain_gpt``; see that module for details.

    torchrun --nproc-per-node 8 examples/pretrain_gpt.py --megatron-lm ~/Megatron-LM \\
        <Megatron-LM flags> --envpipe-type envelope --envpipe-scheduling ours --envpipe-reconfig balanced
"""

import sys

from megatron_envpipe.megatron.pretrain_gpt import main

if __name__ == "__main__":
    sys.exit(main())
