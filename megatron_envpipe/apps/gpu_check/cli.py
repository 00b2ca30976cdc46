"""The flags of ``envpipe gpu-check`` (also ``python -m megatron_envpipe.apps.gpu_check`` and
``bash bench/gpu_check.sh``), shared by both entry points."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from megatron_envpipe.apps.gpu_check.runner import DEFAULT_OUT, CheckOptions, parse_steps, run_check
from megatron_envpipe.apps.gpu_check.steps import STEPS
from megatron_envpipe.core.file_numbers import one_line
from megatron_envpipe.errors import EnvPipeError, UsageError

__all__ = ["add_gpu_check_args", "cmd_gpu_check", "main"]

EXIT_USAGE = 2
_MAX_DEVICE_INDEX = 255  # far above any node's GPU count; keeps a 10**30 typo out of NVML and CUDA calls


def _index(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a CUDA device index (0, 1, ...), got {text!r}") from None
    if not 0 <= value <= _MAX_DEVICE_INDEX:
        raise argparse.ArgumentTypeError(f"a CUDA device index is 0-{_MAX_DEVICE_INDEX} (one of this node's GPUs), "
                                         f"got {text}")
    return value


def add_gpu_check_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", default=DEFAULT_OUT, metavar="DIR",
                   help=f"folder for the at most 8 files (default {DEFAULT_OUT}); new, empty or an earlier check's")
    p.add_argument("--device-index", type=_index, default=0, metavar="N", help="local CUDA device (default 0)")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                   help="cuda (default): the GPU; cpu: CI, the same steps on CPU tensors against a simulated GPU")
    p.add_argument("--steps", metavar="LIST",
                   help="run only these steps, by number or name, e.g. 1,2,preset (default all: "
                        + ",".join(s.name for s in STEPS) + "); the others are skipped")
    p.add_argument("--state-dir", metavar="DIR",
                   help="where locked clocks are recorded for `envpipe reset-clocks` (default $ENVPIPE_STATE_DIR "
                        "or /var/lib/megatron-envpipe/locked-clocks)")


def cmd_gpu_check(args: argparse.Namespace) -> int:
    selected = parse_steps(args.steps) if args.steps is not None else None
    return run_check(CheckOptions(out_dir=Path(args.out), device=args.device, device_index=args.device_index,
                                  selected=selected, state_dir=args.state_dir))


class _OneLineParser(argparse.ArgumentParser):
    """A bad flag on one line, escaped, exit 2 (no usage block), as every envpipe command reports it."""

    def error(self, message: str):  # type: ignore[override]
        self.exit(EXIT_USAGE, f"{self.prog}: error: {one_line(message)} (see '{self.prog} --help')\n")


def main(argv: Sequence[str] | None = None) -> int:
    parser = _OneLineParser(prog="envpipe gpu-check",
                            description="What only a GPU can tell, in under 8 minutes (docs/gpu-probe.md).")
    add_gpu_check_args(parser)
    args = parser.parse_args(argv)
    try:
        return cmd_gpu_check(args)
    except KeyboardInterrupt:
        print("envpipe gpu-check: interrupted", file=sys.stderr)
        return 130
    except EnvPipeError as exc:
        print(f"envpipe gpu-check: error: {one_line(exc)}", file=sys.stderr)
        return EXIT_USAGE if isinstance(exc, UsageError) else 1
