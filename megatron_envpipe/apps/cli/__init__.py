"""The ``envpipe`` command line: plan, frontier, menu, show, simulate, schedule, programs, reset-clocks, demo, gpus, gpu-check,
torchrun.

``parser`` defines the flags; ``planning_cmds`` (plan, frontier, show),
``pipeline_cmds`` (simulate, schedule, programs), ``gpu_cmds`` (gpus,
reset-clocks) and ``demo_cmd`` run the commands; ``render`` shapes their JSON
and text; ``common`` holds what they share (profiles, GPUs, plan files, the
planner config built from the flags); ``outputs`` checks ``--out``/``--csv``/
``--plot`` before any work and writes them last, all or none. ``torchrun``
hands its arguments to :mod:`megatron_envpipe.megatron.launch` unparsed.

Errors: every error the package raises on purpose is an
:class:`~megatron_envpipe.errors.EnvPipeError`; :func:`main` prints it as one
line, ``envpipe <command>: error: <message>``, and returns 2 for a
:class:`~megatron_envpipe.errors.UsageError` (input the user can fix) or 1
for any other. A bad flag (argparse) is one such line too, exit status 2.
Ctrl-C prints ``envpipe <command>: interrupted`` and returns 130 (128 +
SIGINT, as shells report it), no traceback; outputs are committed all or
none, so an interrupted command leaves none of them (or all, if it came
during the final writes).
"""

from __future__ import annotations

import signal
import sys
import threading
from collections.abc import Sequence

from megatron_envpipe.apps.cli.common import CliError
from megatron_envpipe.apps.cli.parser import build_parser
from megatron_envpipe.apps.cli.render import result_to_dict
from megatron_envpipe.errors import EnvPipeError, UsageError
from megatron_envpipe.megatron.launch import main as torchrun_main

EXIT_USAGE = 2  # bad input the user can fix (argparse uses 2 for bad flags too)
EXIT_FAILURE = 1  # any other EnvPipeError
EXIT_INTERRUPTED = 128 + signal.SIGINT  # 130, what a shell reports for a command stopped by Ctrl-C

__all__ = ["EXIT_FAILURE", "EXIT_INTERRUPTED", "EXIT_USAGE", "CliError", "build_parser", "main", "result_to_dict"]


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["torchrun"]:  # torchrun's arguments, not ours: handed over unparsed
        return torchrun_main(argv[1:])
    command = ""
    try:
        args = build_parser().parse_args(argv)
        command = args.command
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        _say_interrupted(command)
        return EXIT_INTERRUPTED
    except EnvPipeError as exc:
        print(f"envpipe {command}: error: {exc}", file=sys.stderr)
        return EXIT_USAGE if isinstance(exc, UsageError) else EXIT_FAILURE
    except BrokenPipeError:  # e.g. `envpipe plan ... | head`
        return 0


def _say_interrupted(command: str) -> None:
    """The one line for Ctrl-C; a second Ctrl-C while it is printed must not bring a traceback."""
    main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN) if main_thread else None
    try:
        print(f"envpipe{' ' + command if command else ''}: interrupted", file=sys.stderr)
    finally:
        if previous is not None:
            signal.signal(signal.SIGINT, previous)
