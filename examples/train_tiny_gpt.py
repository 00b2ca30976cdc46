#!/usr/bin/env python3
"""Train a tiny Megatron-core GPT with pipeline parallelism under EnvPipe's executor.

    torchrun --nproc-per-node 4 examples/train_tiny_gpt.py --pipeline-model-parallel-size 4 \\
        --envpipe-type envelope --envpipe-scheduling ours --envpipe-reconfig balanced \\
        --device cpu --train-iters 3
    torchrun --nproc-per-node 4 examples/train_tiny_gpt.py --pipeline-model-parallel-size 4 \\
        --no-envpipe --device cpu --train-iters 3     # stock Megatron: EnvPipe never installed

With ``--losses-out FILE`` both write the same losses, bit for bit, and the
schedule function each rank ran. The training loop ships inside the package
(``megatron_envpipe.apps.train_tiny_gpt``, also runnable as
``torchrun ... -m megatron_envpipe.apps.train_tiny_gpt``) so that
``envpipe demo`` and the SLURM scripts work from an installed package; this
file is the example's entry point. ``--help`` lists every flag.
"""

import sys

from megatron_envpipe.apps.train_tiny_gpt import main

if __name__ == "__main__":
    sys.exit(main())
