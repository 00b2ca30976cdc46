#!/usr/bin/env bash
# One-command set-up on a fresh machine: megatron-envpipe with its test, plot,
# Megatron and NVML extras. torch is pinned first: an unpinned `torch` can pull
# a multi-GB CUDA build, and 2.13.0 resolves to the local CPU wheel here.
# On a GPU machine, install your CUDA torch first and run with TORCH_SPEC="".
set -euo pipefail
cd "$(dirname "$0")"
PY=${PYTHON:-python3}
TORCH_SPEC=${TORCH_SPEC-torch==2.13.0}
MCORE_SPEC=${MCORE_SPEC:-megatron-core==0.16.1}
if [ -n "$TORCH_SPEC" ]; then
    "$PY" -m pip install --quiet "$TORCH_SPEC"
fi
"$PY" -m pip install --quiet "$MCORE_SPEC" sentencepiece nvidia-ml-py highspy
"$PY" -m pip install --quiet -e '.[test,plot]'
"$PY" - <<'PY'
import megatron_envpipe, torch, megatron.core
print(f"megatron-envpipe {megatron_envpipe.__version__}, torch {torch.__version__}, "
      f"megatron-core {megatron.core.__version__}: ready")
PY
