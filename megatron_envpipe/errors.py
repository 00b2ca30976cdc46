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


class InvalidValueError(EnvPipeError, ValueError):
    """A value the package cannot use, refused where it enters (an argument, a flag's text, a file's
    field); the message says which value and what is allowed. Also a ``ValueError``, so callers'
    ``except ValueError`` clauses keep matching."""


class OutOfOrderError(EnvPipeError, RuntimeError):
    """An object driven out of order (``end()`` before ``begin()``, recording after the end): the
    message names the call. Also a ``RuntimeError``, as it was before it had a class of its own."""
