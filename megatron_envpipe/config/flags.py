"""The ``--envpipe-*`` command-line flags: ``add_envpipe_args(parser)`` adds them to any argparse
parser (Megatron's included); :meth:`~megatron_envpipe.config.settings.EnvPipeConfig.from_args` reads them.
Pure Python.
"""

from __future__ import annotations

import argparse
from enum import StrEnum

from megatron_envpipe.config.flag_table import FIELDS
from megatron_envpipe.config.settings import EnvPipeConfig

__all__ = ["add_envpipe_args"]


def add_envpipe_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the ``--envpipe-*`` flags; returns the parser (Megatron's extra_args_provider shape).

    Generated from the one field table (config/flag_table.py: flag, help, type, when it acts); each
    default is EnvPipeConfig's (a vocabulary member as its plain name: argparse lists choices with
    repr()), or None where None means "not given"."""
    d = EnvPipeConfig()
    g = parser.add_argument_group("EnvPipe", "energy-saving pipeline schedule and GPU clock plan")
    for field in FIELDS:
        default = None if field.unset_default else getattr(d, field.name)
        g.add_argument(field.flag, default=str(default) if isinstance(default, StrEnum) else default,
                       **field.argparse_kwargs())
    return parser
