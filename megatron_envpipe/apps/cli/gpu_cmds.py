"""``envpipe gpus`` and ``envpipe reset-clocks``: the GPU clock table, and repair after a crash."""

from __future__ import annotations

import argparse
import sys

from megatron_envpipe.core.gpu_specs import load_gpu_table
from megatron_envpipe.gpu.control.repair import reset_all_gpus, reset_clocks_from_state
from megatron_envpipe.gpu.control.safety import REPAIR_HINT
from megatron_envpipe.gpu.control.state_store import StateStoreError
from megatron_envpipe.gpu.devices.base import GpuError, GpuPermissionError

_EXIT_GPU_ERROR = 2
_EXIT_NO_PERMISSION = 3
_EXIT_UNSAFE_STATE_DIR = 4


def cmd_gpus(args: argparse.Namespace) -> int:
    table = load_gpu_table()
    print(f"{'gpu':10}{'max MHz':>8}{'min MHz':>8}{'step':>6}{'profile':>8}{'reconfig':>9}{'P2P W':>8}  NVML names")
    for key, spec in sorted(table.items()):
        p2p = "unknown" if spec.p2p_power_w is None else f"{spec.p2p_power_w:g}"
        high, low = ("unknown" if f is None else f for f in (spec.max_clock_mhz, spec.min_clock_mhz))
        print(
            f"{key:10}{high:>8}{low:>8}{spec.clock_step_mhz:>6g}"
            f"{spec.profile_step_mhz:>8}{spec.reconfig_step_mhz:>9}{p2p:>8}  "
            + ", ".join(spec.nvml_names)
        )
    return 0


def cmd_reset_clocks(args: argparse.Namespace) -> int:
    """Repair GPUs a crashed run (SIGKILL, node failure) left with locked clocks.

    Exit statuses, which scripts (a SLURM epilog) rely on: 0 when every GPU
    recorded on this host was reset, or nothing was recorded; 3 when something
    recorded was not reset for lack of permission; 2 when it was not reset for
    any other reason (no driver, an unusable state file (named, the others are
    still repaired), failed reset, owner still running without ``--force``);
    4 when the state folder itself is refused, nothing in it read: not a
    folder, a symbolic link, owned by another user or writable by others, or
    inside a folder another user could swap it in (docs/clock-state-store.md).
    """
    try:
        if args.all:
            report = reset_all_gpus(args.state_dir)
        else:
            report = reset_clocks_from_state(args.state_dir, force=args.force)
    except StateStoreError as exc:
        print(f"envpipe reset-clocks: error: {exc}", file=sys.stderr)
        return _EXIT_NO_PERMISSION if exc.permission else _EXIT_UNSAFE_STATE_DIR
    except GpuPermissionError as exc:
        print(f"envpipe reset-clocks: error: {exc}", file=sys.stderr)
        return _EXIT_NO_PERMISSION
    except GpuError as exc:
        print(f"envpipe reset-clocks: error: {exc}", file=sys.stderr)
        return _EXIT_GPU_ERROR
    problems = set(report.problems)
    for line in report.lines or ["nothing to reset: no GPU clocks were left locked by megatron-envpipe on this host"]:
        print(line, file=sys.stderr if line in problems else sys.stdout, flush=True)
    if report.ok:
        return 0
    n = len(report.problems)
    summary = f"envpipe reset-clocks: error: {n} recorded GPU(s) or state file(s) not reset, see above"
    if report.no_permission:
        print(f"{summary}; {REPAIR_HINT}", file=sys.stderr)
        return _EXIT_NO_PERMISSION
    print(f"{summary}; each line says what to do", file=sys.stderr)
    return _EXIT_GPU_ERROR
