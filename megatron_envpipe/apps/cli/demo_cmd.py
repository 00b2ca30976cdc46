"""``envpipe demo``: train the tiny GPT with and without EnvPipe (see :mod:`megatron_envpipe.apps.demo`)."""

from __future__ import annotations

import argparse

from megatron_envpipe.apps.cli.common import CliError
from megatron_envpipe.apps.demo import run_demo
from megatron_envpipe.apps.demo_errors import DemoError
from megatron_envpipe.core.atomic import check_writable


def cmd_demo(args: argparse.Namespace) -> int:
    for flag, value in (("--out", args.out), ("--config", args.config)):
        if value is not None and not value.strip():
            raise CliError(f"{flag}: empty path: give a path or drop {flag}")
    check_writable(args.out, "--out", directory=True)  # named by its flag here; run_demo checks it again
    try:
        return run_demo(args.out, args.config, args.gpu)
    except DemoError as exc:  # reported like bad input: one line, exit status 2
        raise CliError(str(exc)) from None
