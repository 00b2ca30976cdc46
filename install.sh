#!/usr/bin/env bash
# One-command set-up on a fresh machine: megatron-envpipe with its test, plot,
# Megatron and NVML extras, pip-installed into the current Python (nothing else).
# torch is pinned to the version the tests ran with (2.13.0). The pin picks the
# version, not the build: from PyPI on Linux torch 2.13.0 IS the CUDA build (GBs
# of nvidia-* wheels, which also run on CPU); you get the CPU build only where pip
# is configured with a CPU wheel source (a local wheelhouse, or
# PIP_INDEX_URL=https://download.pytorch.org/whl/cpu). To keep the torch you
# have (e.g. your own CUDA build), run with TORCH_SPEC="".
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
