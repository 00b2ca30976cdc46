"""The one exception root of megatron-envpipe.

Every error the package raises on purpose derives from :class:`EnvPipeError`,
so a caller (the ``envpipe`` command, a training script) catches one class.
:class:`UsageError` marks input the user can fix (a bad profile, flag,
schedule or GPU table): the CLI prints it as one line and exits with status 2.
Subclasses keep their historical builtin base too (``ValueError``,
``RuntimeError``, ``ImportError``) so existing ``except`` clauses still match.
"""

from __future__ import annotations


class EnvPipeError(Exception):
    """Root of every megatron-envpipe error."""


class UsageError(EnvPipeError):
    """Bad input the user can fix: reported as one line, CLI exit status 2."""
