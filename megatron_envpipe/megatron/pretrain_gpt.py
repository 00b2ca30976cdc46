"""Megatron-LM's ``pretrain_gpt.py`` with EnvPipe: same flags, plus ``--envpipe-*``.

    torchrun --nproc-per-node 8 -m megatron_envpipe.megatron.pretrain_gpt <Megatron-LM flags> \\
        --envpipe-type envelope --envpipe-scheduling ours --envpipe-reconfig balanced

It runs the ``pretrain_gpt.py`` of your Megatron-LM checkout (``$MEGATRON_LM``
or ``--megatron-lm DIR``, else found on ``PYTHONPATH``) unchanged, as
``__main__``, after three things:

1. EnvPipe's flags, and the Megatron flags its checks need (pipeline size,
   batch sizes), are pre-parsed from the command line and validated with
   ``validate_with_megatron_args``: an impossible setting, a profile that
   does not fit the pipeline, a wrong-length extra warm-up or a too small
   activation budget fails here, in one line, before Megatron-LM or torch
   loads; the namespace Megatron's own parser returns is checked again;
2. ``megatron_envpipe.install`` routes Megatron's 1F1B schedule through
   EnvPipe's executor (start-up profiler, plan printout, energy log included);
3. Megatron's own argument parser learns the ``--envpipe-*`` flags, whichever
   way the installed version takes extra arguments: ``pretrain(...,
   extra_args_provider=...)`` up to 0.17, ``parse_and_validate_args(
   extra_args_provider=...)`` from 0.18 on.

When ``megatron.training`` cannot run here (not installed, Python < 3.12 with
megatron-core >= 0.17, no Megatron-LM checkout), it says so in one line.
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import inspect
import os
import re
import runpy
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import megatron_envpipe
from megatron_envpipe.config import EnvPipeConfig, EnvPipeConfigError, add_envpipe_args
from megatron_envpipe.errors import EnvPipeError

PROG = "pretrain_gpt (megatron-envpipe)"


class EntryError(EnvPipeError, RuntimeError):
    """Why Megatron-LM's pretraining cannot start here (one line)."""


def find_pretrain_gpt(megatron_lm: str | None) -> Path:
    """``pretrain_gpt.py`` of a Megatron-LM checkout."""
    candidates = []
    root = megatron_lm or os.environ.get("MEGATRON_LM")
    if root:
        candidates.append(Path(root) / "pretrain_gpt.py")
    spec = importlib.util.find_spec("pretrain_gpt")
    if spec is not None and spec.origin:
        candidates.append(Path(spec.origin))
    for path in candidates:
        if path.is_file():
            return path.resolve()
    where = f"{root}/pretrain_gpt.py does not exist" if root else "pretrain_gpt.py is not on PYTHONPATH"
    raise EntryError(
        f"needs a Megatron-LM checkout ({where}): git clone the Megatron-LM tag matching your "
        f"megatron-core and pass --megatron-lm DIR or set MEGATRON_LM=DIR"
    )


def check_megatron_training() -> None:
    """``megatron.training`` must import (it ships with megatron-core >= 0.17 or a checkout)."""
    try:
        import megatron.training  # noqa: F401
    except ImportError as exc:
        missing = getattr(exc, "name", "") or ""
        if "override" in str(exc):
            reason = (f"megatron.training needs Python >= 3.12 (typing.override), this is "
                      f"{sys.version_info.major}.{sys.version_info.minor}")
        elif missing.startswith("megatron"):
            reason = ("megatron.training is not installed (megatron-core < 0.17 ships only megatron.core): "
                      "put a Megatron-LM checkout on PYTHONPATH or install megatron-core >= 0.17")
        else:
            reason = f"megatron.training cannot be imported: {exc}"
        raise EntryError(reason) from None


def _envpipe_parser() -> argparse.ArgumentParser:
    # No abbreviations (Megatron's parser allows none): `--num-layers 24` must not be taken
    # for --num-layers-per-virtual-pipeline-stage.
    parser = argparse.ArgumentParser(prog=PROG, add_help=False, allow_abbrev=False)
    add_envpipe_args(parser)
    # The Megatron flags EnvPipe's start-up checks need (their defaults are Megatron's).
    parser.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    parser.add_argument("--virtual-pipeline-model-parallel-size", type=int, default=None)
    parser.add_argument("--num-layers-per-virtual-pipeline-stage", type=int, default=None)
    parser.add_argument("--num-virtual-stages-per-pipeline-rank", type=int, default=None)
    parser.add_argument("--tensor-model-parallel-size", type=int, default=1)
    parser.add_argument("--context-parallel-size", type=int, default=1)
    parser.add_argument("--micro-batch-size", type=int, default=None)
    parser.add_argument("--global-batch-size", type=int, default=None)
    parser.add_argument("--rampup-batch-size", nargs="*", default=None)
    parser.add_argument("--megatron-lm", default=None)
    return parser


def check_parsed_args(args: Any) -> Any:
    """The start-up checks on the namespace Megatron's own parser returned (one line, exit 2).

    The pre-parse already checked the command line; this catches what only
    Megatron's parse sees (arguments from ``--yaml-cfg``, say).
    """
    try:
        EnvPipeConfig.from_args(args).validate_with_megatron_args(args)
    except EnvPipeConfigError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None
    return args


_STRAY_PERCENT = re.compile(r"(?<!%)%(?![(%])")


def _escape_help(parser: argparse.ArgumentParser) -> None:
    """Escape stray ``%`` in help texts when help is printed, so ``--help`` works.

    argparse %-formats every help string; Megatron-LM core_v0.19.0's own
    ``--moe-paged-stash-buffer-size-factor-cuda`` help says "10%)" and makes
    its ``pretrain_gpt.py --help`` crash. Megatron adds some arguments after
    the extra-args provider ran, so this acts at formatting time. Only help
    text is touched.
    """
    original = parser.format_help

    def format_help() -> str:
        for action in parser._actions:
            if action.help and "%" in action.help:
                action.help = _STRAY_PERCENT.sub("%%", action.help)
        return original()

    parser.format_help = format_help  # type: ignore[method-assign]


def _chain(first: Callable | None, second: Callable) -> Callable:
    """Megatron's provider, then ours (once per parser), then the --help fix."""

    def provider(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        if first is not None:
            parser = first(parser) or parser
        if "--envpipe-type" not in parser._option_string_actions:
            parser = second(parser) or parser
            _escape_help(parser)
        return parser

    return provider


def _teach_megatron_parser(add_args: Callable[[argparse.ArgumentParser], argparse.ArgumentParser]) -> None:
    """Make Megatron's strict parser accept ``--envpipe-*``, for either API generation.

    ``arguments.parse_args`` is what every parse goes through at call time:
    ``parse_and_validate_args`` (>= 0.18), the in-process-restart pre-parse,
    and ``initialize_megatron``; up to 0.17, ``pretrain(extra_args_provider=...)``
    is wrapped too, for releases whose initialize bound ``parse_args`` at import.
    """
    # megatron.training is imported only once check_megatron_training() said it can be.
    import megatron.training as mtraining
    from megatron.training import arguments as marguments

    original_parse = marguments.parse_args

    @functools.wraps(original_parse)
    def parse_args(extra_args_provider: Callable | None = None, *args: Any, **kwargs: Any) -> Any:
        return check_parsed_args(original_parse(_chain(extra_args_provider, add_args), *args, **kwargs))

    marguments.parse_args = parse_args
    original_pretrain = mtraining.pretrain
    if "extra_args_provider" in inspect.signature(original_pretrain).parameters:  # <= 0.17

        @functools.wraps(original_pretrain)
        def pretrain(*args: Any, **kwargs: Any) -> Any:
            kwargs["extra_args_provider"] = _chain(kwargs.get("extra_args_provider"), add_args)
            return original_pretrain(*args, **kwargs)

        mtraining.pretrain = pretrain
        from megatron.training import training as mtraining_training

        if getattr(mtraining_training, "pretrain", None) is original_pretrain:
            mtraining_training.pretrain = pretrain


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    pre, _ = _envpipe_parser().parse_known_args(argv)
    try:
        # Flags first: pure Python, and the user's to fix wherever Megatron-LM is missing.
        config = EnvPipeConfig.from_args(pre).validate_with_megatron_args(pre)
        check_megatron_training()
        script = find_pretrain_gpt(pre.megatron_lm)
    except (EntryError, EnvPipeConfigError) as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    _teach_megatron_parser(add_envpipe_args)
    # Resolved on first use (megatron_envpipe.__getattr__): torch loads only past the checks above.
    megatron_envpipe.install(config)
    # Megatron-LM's entry imports its siblings (gpt_builders, model_provider).
    sys.path.insert(0, str(script.parent))
    rest = [a for a in argv if not a.startswith("--megatron-lm")]
    if "--megatron-lm" in argv:
        i = argv.index("--megatron-lm")
        rest = argv[:i] + argv[i + 2:]
    sys.argv = [str(script), *rest]
    try:
        runpy.run_path(str(script), run_name="__main__")
    finally:
        megatron_envpipe.uninstall()
    return 0


if __name__ == "__main__":
    sys.exit(main())
