"""``envpipe gpus`` and ``envpipe reset-clocks``: the GPU clock table, and repair after a crash."""

from __future__ import annotations

import argparse
import sys

from megatron_envpipe.core.gpu_specs import load_gpu_table
from megatron_envpipe.gpu.base import GpuError, GpuPermissionError
from megatron_envpipe.gpu.repair import reset_all_gpus, reset_clocks_from_state

EXIT_GPU_ERROR = 2
EXIT_NO_PERMISSION = 3


def cmd_gpus(args: argparse.Namespace) -> int:
    table = load_gpu_table()
    print(f"{'gpu':9}{'max MHz':>8}{'min MHz':>8}{'step':>6}{'profile':>8}{'reconfig':>9}{'P2P W':>7}  NVML names")
    for key, spec in sorted(table.items()):
        print(
            f"{key:9}{spec.max_clock_mhz:>8}{spec.min_clock_mhz:>8}{spec.clock_step_mhz:>6g}"
            f"{spec.profile_step_mhz:>8}{spec.reconfig_step_mhz:>9}{spec.p2p_power_w:>7g}  "
            + ", ".join(spec.nvml_names)
        )
    return 0


def cmd_reset_clocks(args: argparse.Namespace) -> int:
    """Repair GPUs a crashed run (SIGKILL, node failure) left with locked clocks.

    Its own exit statuses, which scripts rely on: 3 without permission, 2 for
    another GPU error.
    """
    try:
        if args.all:
            lines = reset_all_gpus(args.state_dir)
        else:
            lines = reset_clocks_from_state(args.state_dir, force=args.force)
    except GpuPermissionError as exc:
        print(f"envpipe reset-clocks: error: {exc}", file=sys.stderr)
        return EXIT_NO_PERMISSION
    except GpuError as exc:
        print(f"envpipe reset-clocks: error: {exc}", file=sys.stderr)
        return EXIT_GPU_ERROR
    for line in lines or ["nothing to reset: no GPU clocks were left locked by megatron-envpipe on this host"]:
        print(line)
    return 0
