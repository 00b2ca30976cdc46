"""``envpipe demo``: train the tiny GPT with and without EnvPipe (see :mod:`megatron_envpipe.apps.demo`)."""

from __future__ import annotations

import argparse

from megatron_envpipe.apps.cli.common import CliError
from megatron_envpipe.apps.demo import DemoError, run_demo


def cmd_demo(args: argparse.Namespace) -> int:
    try:
        return run_demo(args.out, args.config, args.gpu)
    except DemoError as exc:  # reported like bad input: one line, exit status 2
        raise CliError(str(exc)) from None
