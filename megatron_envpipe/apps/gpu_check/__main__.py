"""``python -m megatron_envpipe.apps.gpu_check`` (what ``bench/gpu_check.sh`` runs): ``envpipe gpu-check``."""

from __future__ import annotations

import sys

from megatron_envpipe.apps.gpu_check.cli import main

if __name__ == "__main__":
    sys.exit(main())
