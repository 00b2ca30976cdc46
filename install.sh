#!/usr/bin/env bash
# One-command set-up on a fresh machine: megatron-envpipe with its test, plot,
# Megatron and NVML extras, pip-installed into the current Python (nothing else).
#
# megatron-core follows the Python it installs into (it says which):
#   Python 3.12+: megatron-core==0.19.2 (>= 0.17, the version the tests ran with), which ships megatron.training,
#                 so the Megatron-LM entry runs with no Megatron-LM checkout;
#   Python 3.11:  megatron-core==0.16.1 (0.17+ needs 3.12); Megatron-LM's pretrain_gpt
#                 then needs a checkout (--megatron-lm DIR).
# MCORE_SPEC overrides the choice (e.g. MCORE_SPEC='megatron-core>=0.17' for the newest).
#
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
PY_MINOR=$("$PY" -c 'import sys; print(sys.version_info[1] if sys.version_info[0] == 3 else 0)')
if [ "$PY_MINOR" -lt 11 ]; then
    echo "install.sh: error: $("$PY" -V 2>&1) is too old: megatron-envpipe needs Python >= 3.11 (set PYTHON=/path/to/python3.12)" >&2
    exit 2
fi
if [ -n "${MCORE_SPEC:-}" ]; then
    why="MCORE_SPEC"
elif [ "$PY_MINOR" -ge 12 ]; then
    MCORE_SPEC='megatron-core==0.19.2'
    why="Python 3.$PY_MINOR: ships megatron.training, the Megatron-LM entry needs no checkout"
else
    MCORE_SPEC='megatron-core==0.16.1'
    why="Python 3.$PY_MINOR: 0.17+ needs 3.12; Megatron-LM's pretrain_gpt then needs --megatron-lm DIR"
fi
echo "install.sh: installing $MCORE_SPEC ($why)"
if [ -n "$TORCH_SPEC" ]; then
    "$PY" -m pip install --quiet "$TORCH_SPEC"
fi
"$PY" -m pip install --quiet "$MCORE_SPEC" sentencepiece nvidia-ml-py highspy
"$PY" -m pip install --quiet -e '.[test,plot]'
"$PY" - <<'PY'
import sys
import warnings
warnings.filterwarnings("ignore")  # megatron-core's import-time notes (no Transformer Engine/Apex on CPU)
import megatron_envpipe, torch, megatron.core
try:
    import megatron.training  # noqa: F401
    entry = "the Megatron-LM entry runs without a checkout"
except Exception:  # noqa: BLE001 - 0.16.x has none; 0.17+ on 3.11 cannot import it
    entry = "the Megatron-LM entry needs --megatron-lm DIR (a Megatron-LM checkout)"
print(f"megatron-envpipe {megatron_envpipe.__version__}, torch {torch.__version__}, "
      f"megatron-core {megatron.core.__version__} on Python {sys.version.split()[0]}: ready ({entry})")
PY
