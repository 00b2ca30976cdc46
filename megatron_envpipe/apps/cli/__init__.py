"""The ``envpipe`` command line: plan, frontier, show, simulate, schedule, programs, reset-clocks, demo, gpus.

``parser`` defines the flags; ``planning_cmds`` (plan, frontier, show),
``pipeline_cmds`` (simulate, schedule, programs), ``gpu_cmds`` (gpus,
reset-clocks) and ``demo_cmd`` run the commands; ``render`` shapes their JSON
and text; ``common`` holds what they share (profiles, GPUs, plan files, the
planner config built from the flags); ``outputs`` checks ``--out``/``--csv``/
``--plot`` before any work and writes them last, all or none.

Errors: every error the package raises on purpose is an
:class:`~megatron_envpipe.errors.EnvPipeError`; :func:`main` prints it as one
line, ``envpipe <command>: error: <message>``, and returns 2 for a
:class:`~megatron_envpipe.errors.UsageError` (input the user can fix) or 1
for any other. A bad flag (argparse) is one such line too, exit status 2.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from megatron_envpipe.apps.cli.common import CliError
from megatron_envpipe.apps.cli.parser import build_parser
from megatron_envpipe.apps.cli.render import result_to_dict
from megatron_envpipe.errors import EnvPipeError, UsageError

EXIT_USAGE = 2  # bad input the user can fix (argparse uses 2 for bad flags too)
EXIT_FAILURE = 1  # any other EnvPipeError

__all__ = ["EXIT_FAILURE", "EXIT_USAGE", "CliError", "build_parser", "main", "result_to_dict"]


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except EnvPipeError as exc:
        print(f"envpipe {args.command}: error: {exc}", file=sys.stderr)
        return EXIT_USAGE if isinstance(exc, UsageError) else EXIT_FAILURE
    except BrokenPipeError:  # e.g. `envpipe plan ... | head`
        return 0
