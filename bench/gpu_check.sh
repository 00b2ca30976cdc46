#!/usr/bin/env bash
# envpipe gpu-check from a checkout, installed or not: what only a GPU can tell, in under 8 minutes.
#   bash bench/gpu_check.sh --out out/gpu-check        (flags: python3 -m megatron_envpipe.apps.gpu_check --help)
# Each step runs in a child process with a hard limit; GPU clocks are reset after every step and at exit.
# After a SIGKILL: envpipe reset-clocks. See docs/gpu-probe.md.
set -euo pipefail

PYTHON="${PYTHON:-}"
if [ -z "$PYTHON" ]; then
    PYTHON="$(command -v python3 || command -v python || true)"
fi
if [ -z "$PYTHON" ]; then
    echo "gpu_check.sh: error: no python3 on PATH: install Python 3.11+ (README.md) or set PYTHON" >&2
    exit 2
fi
if ! command -v "$PYTHON" >/dev/null 2>&1 || ! "$PYTHON" -c "import sys; sys.exit(sys.version_info < (3, 11))" >/dev/null 2>&1; then
    printf 'gpu_check.sh: error: PYTHON=%q is not a Python 3.11+ interpreter: set PYTHON to one (or unset it)\n' "$PYTHON" >&2
    exit 2
fi
if ! "$PYTHON" -c "import megatron_envpipe" >/dev/null 2>&1; then
    repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
    export PYTHONPATH="${repo}${PYTHONPATH:+:${PYTHONPATH}}"
fi
exec "$PYTHON" -m megatron_envpipe.apps.gpu_check "$@"
