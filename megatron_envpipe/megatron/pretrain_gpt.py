"""Megatron-LM's GPT pre-training with EnvPipe: Megatron-LM's flags, plus ``--envpipe-*``.

    torchrun --nproc-per-node 8 -m megatron_envpipe.megatron.pretrain_gpt <Megatron-LM flags> \\
        --envpipe-type envelope --envpipe-scheduling ours --envpipe-reconfig balanced

What runs:

- with megatron-core >= 0.17 (Python >= 3.12), which ships ``megatron.training``:
  EnvPipe's own GPT model, datasets and forward step (``gpt_provider``), no
  Megatron-LM checkout needed;
- with a Megatron-LM checkout (``--megatron-lm DIR`` or ``$MEGATRON_LM``; it
  wins when given): that checkout's ``pretrain_gpt.py``, unchanged, as
  ``__main__``, with the checkout first on ``sys.path`` (no ``PYTHONPATH``
  needed). megatron-core 0.16.x ships no ``megatron.training`` and needs one.

Around either, three things:

1. EnvPipe's flags, and the Megatron flags its checks need (pipeline size,
   batch sizes), are pre-parsed from the command line and validated with
   ``validate_with_megatron_args``: an impossible setting fails here, in one
   line, before Megatron-LM or torch loads; the namespace Megatron's own
   parser returns is checked again;
2. ``megatron_envpipe.install`` routes Megatron's 1F1B schedule through
   EnvPipe's executor (start-up profiler, plan printout, energy log included);
3. Megatron's own argument parser learns the ``--envpipe-*`` flags, whichever
   way the installed version takes extra arguments: ``pretrain(...,
   extra_args_provider=...)`` up to 0.17, ``parse_and_validate_args(
   extra_args_provider=...)`` from 0.18 on.

``--envpipe-check-args`` stops right after Megatron's own parser and
``validate_args`` accepted the command line and EnvPipe validated its flags:
it prints one ``arguments OK`` line and exits 0, before torch.distributed
starts (no GPU needed; ``WORLD_SIZE`` sets the world size it checks), or one
line per problem and exits 2; Megatron's own output (argument dump, warnings)
only with ``--envpipe-check-args-verbose``.

When Megatron cannot run here it says why, and what to do, in one line:
without a CUDA GPU per rank or NCCL (``preflight``), one line from local rank
0 within seconds, before Megatron loads, and exit 2 on every rank.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib.metadata
import inspect
import io
import logging
import os
import re
import runpy
import sys
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import megatron_envpipe
from megatron_envpipe.config import EnvPipeConfig, EnvPipeConfigError, add_envpipe_args
from megatron_envpipe.errors import EnvPipeError
from megatron_envpipe.megatron.gpt_provider import ARGS_DEFAULTS, CheckoutNeeded, check_supported, pretrain_gpt
from megatron_envpipe.megatron.preflight import CPU_ALTERNATIVES, cpu_build_blocker, report_blocker, training_blocker

PROG = "pretrain_gpt (megatron-envpipe)"
CHECK_FLAG = "--envpipe-check-args"
VERBOSE_CHECK_FLAG = "--envpipe-check-args-verbose"
MEGATRON_LM_URL = "https://github.com/NVIDIA/Megatron-LM"


class EntryError(EnvPipeError, RuntimeError):
    """Why Megatron-LM's pretraining cannot start here (one line)."""


def megatron_core_version() -> str:
    """The installed megatron-core's version, read without importing it (and torch)."""
    try:
        return importlib.metadata.version("megatron-core")
    except importlib.metadata.PackageNotFoundError:
        return "0.19.2"  # none installed: name the release this entry is tested with


def find_pretrain_gpt(megatron_lm: str | None) -> Path | None:
    """``pretrain_gpt.py`` of the Megatron-LM checkout given (``--megatron-lm`` / ``$MEGATRON_LM``), else None."""
    root = megatron_lm or os.environ.get("MEGATRON_LM")
    if not root:
        return None
    path = Path(root).expanduser() / "pretrain_gpt.py"
    if not path.is_file():
        raise EntryError(f"{path} does not exist: pass --megatron-lm (or MEGATRON_LM=) the root of a Megatron-LM "
                         f"checkout, e.g. git clone --branch core_v{megatron_core_version()} {MEGATRON_LM_URL}")
    return path.resolve()


def check_megatron_training(checkout: Path | None = None) -> None:
    """``megatron.training`` must import: from megatron-core >= 0.17, or from the checkout given."""
    try:
        import megatron.training  # noqa: F401
    except ImportError as exc:
        raise EntryError(_why_not(exc, checkout)) from None


def _why_not(exc: ImportError, checkout: Path | None) -> str:
    missing = getattr(exc, "name", "") or ""
    version = megatron_core_version()
    py = f"{sys.version_info.major}.{sys.version_info.minor}"
    if "override" in str(exc):
        return (f"megatron.training (megatron-core {version}) needs Python >= 3.12 (typing.override), this is {py}: "
                f"use Python 3.12, or megatron-core 0.16.x with a Megatron-LM checkout (--megatron-lm DIR)")
    if checkout is not None and missing and not missing.startswith("megatron"):
        return (f"the Megatron-LM checkout {checkout.parent} needs the module {missing!r}: "
                f"pip install 'megatron-envpipe[megatron-lm]' (from this repository: pip install -e '.[megatron-lm]')")
    if missing.startswith("megatron") and checkout is None:
        return (f"megatron-core {version} ships no megatron.training (0.17+ does): in a Python 3.12 environment "
                f"run bash install.sh (it picks megatron-core 0.19.2 on Python 3.12; no checkout needed), or git clone --branch "
                f"core_v{version} {MEGATRON_LM_URL} DIR and pass --megatron-lm DIR")
    return f"megatron.training cannot be imported: {exc}"


def add_entry_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """EnvPipe's flags, plus this entry's own switch (Megatron's parser learns both)."""
    add_envpipe_args(parser)
    parser.add_argument(CHECK_FLAG, dest="envpipe_check_args", action="store_true",
                        help="stop once Megatron's parser and validate_args accepted the command line and EnvPipe "
                             "validated its flags: print 'arguments OK' and exit 0 (no GPU, no training); "
                             "only that line, or one line per problem")
    parser.add_argument(VERBOSE_CHECK_FLAG, dest="envpipe_check_args_verbose", action="store_true",
                        help=f"{CHECK_FLAG}, with Megatron's own output (its argument dump and warnings)")
    return parser


def arguments_ok_line(args: Any) -> str:
    """What the check prints: figures Megatron's parser and validation produced, and EnvPipe's plan settings."""
    config = EnvPipeConfig.from_args(args)
    get = functools.partial(getattr, args)
    return (f"{PROG}: arguments OK: Megatron parsed and validated {get('num_layers', None)} layers, hidden "
            f"{get('hidden_size', None)}, seq {get('seq_length', None)}; world {get('world_size', None)} = TP "
            f"{get('tensor_model_parallel_size', None)} x PP {get('pipeline_model_parallel_size', None)} x DP "
            f"{get('data_parallel_size', None)}; micro-batch {get('micro_batch_size', None)}, global batch "
            f"{get('global_batch_size', None)}; EnvPipe: type {config.plan_type.value}, scheduling "
            f"{config.scheduling.value}, reconfig {config.reconfig.value}, gpu {config.gpu or 'auto'}")


def _envpipe_parser() -> argparse.ArgumentParser:
    # No abbreviations (Megatron's parser allows none): `--num-layers 24` must not be taken
    # for --num-layers-per-virtual-pipeline-stage.
    parser = argparse.ArgumentParser(prog=PROG, add_help=False, allow_abbrev=False)
    add_entry_args(parser)
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
    parser.add_argument("--distributed-backend", default="nccl")
    parser.add_argument("--megatron-lm", default=None)
    return parser


def training_blocker_here(pre: argparse.Namespace, argv: Sequence[str],
                          env: Mapping[str, str] | None = None) -> str | None:
    """Why Megatron's training cannot start on this node (no CUDA GPU per rank, no NCCL), or None.

    Asked before Megatron loads (torch alone, about a second), so that a node
    without what it needs fails in one line within seconds. Not asked for
    ``--envpipe-check-args`` or ``--help``, which need no GPU. ``env``: the
    rank's environment (default ``os.environ``; ``LOCAL_WORLD_SIZE`` is the
    node's rank count).
    """
    env = os.environ if env is None else env
    if pre.envpipe_check_args or pre.envpipe_check_args_verbose or "-h" in argv or "--help" in argv:
        return None
    cpu_build = cpu_build_blocker(env)
    if cpu_build is not None:
        return cpu_build
    import torch

    return training_blocker(torch, env, pre.distributed_backend)


def node_startup_error(argv: Sequence[str], env: Mapping[str, str]) -> str | None:
    """The one line (without the program name) that stops this command on this node before any rank starts.

    What every rank would check first (EnvPipe's flags with the Megatron
    flags they depend on, the checkout, a CUDA GPU per rank and NCCL), asked
    once per node by ``envpipe torchrun``; None when the ranks can start.
    """
    pre, _ = _envpipe_parser().parse_known_args(list(argv))
    # The world the launcher will start (0: not known, e.g. an elastic node range), never a WORLD_SIZE the
    # launching shell happens to export.
    world = env.get("WORLD_SIZE", "")
    pre.world_size = int(world) if world.isdigit() else 0
    try:
        EnvPipeConfig.from_args(pre).validate_with_megatron_args(pre)
        find_pretrain_gpt(pre.megatron_lm or env.get("MEGATRON_LM"))
    except (EntryError, EnvPipeConfigError) as exc:
        return str(exc)
    blocker = training_blocker_here(pre, argv, env)
    return None if blocker is None else f"{blocker}: {CPU_ALTERNATIVES}"


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


def after_validation(args: Any, builtin: bool) -> None:
    """Once Megatron's ``validate_args`` accepted the flags: EnvPipe's checks, then ``--envpipe-check-args``."""
    check_parsed_args(args)
    if builtin:
        try:
            check_supported(args, megatron_core_version())
        except CheckoutNeeded as exc:
            print(f"{PROG}: error: {exc}", file=sys.stderr, flush=True)
            raise SystemExit(2) from None
    if getattr(args, "envpipe_check_args", False) or getattr(args, "envpipe_check_args_verbose", False):
        if int(os.environ.get("RANK", "0")) == 0:
            print(arguments_ok_line(args), flush=True)
        raise SystemExit(0)


def _teach_megatron_parser(add_args: Callable[[argparse.ArgumentParser], argparse.ArgumentParser],
                           builtin: bool = False) -> None:
    """Make Megatron's strict parser accept ``--envpipe-*``, for either API generation.

    ``arguments.parse_args`` is what every parse goes through at call time:
    ``parse_and_validate_args`` (>= 0.18), the in-process-restart pre-parse,
    and ``initialize_megatron``; up to 0.17, ``pretrain(extra_args_provider=...)``
    is wrapped too, for releases whose initialize bound ``parse_args`` at import.
    ``validate_args`` is wrapped where it is looked up at call time (``arguments``
    for ``parse_and_validate_args``, ``initialize`` for ``initialize_megatron``)
    to run :func:`after_validation`; ``builtin``: EnvPipe's own GPT pieces run.
    """
    # megatron.training is imported only once check_megatron_training() said it can be.
    import megatron.training as mtraining
    from megatron.training import arguments as marguments
    from megatron.training import initialize as minitialize

    original_parse = marguments.parse_args

    @functools.wraps(original_parse)
    def parse_args(extra_args_provider: Callable | None = None, *args: Any, **kwargs: Any) -> Any:
        return check_parsed_args(original_parse(_chain(extra_args_provider, add_args), *args, **kwargs))

    marguments.parse_args = parse_args
    for module in (marguments, minitialize):
        original_validate = getattr(module, "validate_args", None)
        if original_validate is not None:
            module.validate_args = _validated(original_validate, builtin)
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


def _validated(validate: Callable, builtin: bool) -> Callable:
    @functools.wraps(validate)
    def validate_args(args: Any, *rest: Any, **kwargs: Any) -> Any:
        result = validate(args, *rest, **kwargs)
        after_validation(args, builtin)
        return result

    return validate_args


def check_arguments(program: str, rest: list[str]) -> None:
    """``--envpipe-check-args``: Megatron's own parse and ``validate_args``, then :func:`after_validation` exits.

    Called directly, not through ``pretrain``: there they come after start-up
    (CUDA is asserted first up to 0.17), and the check must run without a GPU.
    """
    from megatron.training import arguments as marguments

    sys.argv = [program, *rest]
    args = marguments.parse_args()
    try:
        marguments.validate_args(args, dict(ARGS_DEFAULTS))
    except (AssertionError, RuntimeError) as exc:  # Megatron validates with asserts (and asks CUDA for some)
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        where = " (some of its checks ask the GPU: run the check on a GPU node)" if isinstance(exc, RuntimeError) else ""
        print(f"{PROG}: error: Megatron's validate_args refused the command line{where}: {reason}", file=sys.stderr)
        raise SystemExit(2) from None
    raise SystemExit(f"{PROG}: error: {CHECK_FLAG}: Megatron's validate_args returned before the check ran")


@contextlib.contextmanager
def results_only() -> Iterator[None]:
    """Hold back everything Megatron prints while the check runs; then say only the result lines.

    Megatron's imports, parser and ``validate_args`` print its argument dump and
    warnings (about 900 lines); the check's answer is the ``arguments OK`` line
    or the ``error:`` lines (EnvPipe's, argparse's, a refused assertion), which
    go out on the stream they were written to, once Megatron is done.
    ``--envpipe-check-args-verbose`` shows it all.
    """
    out, err = io.StringIO(), io.StringIO()
    logging.disable(logging.CRITICAL)  # Megatron's loggers (handlers may hold the real streams)
    try:
        with warnings.catch_warnings(), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            warnings.simplefilter("ignore")
            yield
    finally:
        logging.disable(logging.NOTSET)
        for captured, stream in ((out, sys.stdout), (err, sys.stderr)):
            for line in captured.getvalue().splitlines():
                if "arguments OK" in line or ": error: " in line or line.startswith("error: "):
                    print(line, file=stream, flush=True)


def _without_megatron_lm(argv: list[str]) -> list[str]:
    """The command line less ``--megatron-lm DIR`` / ``--megatron-lm=DIR`` (Megatron's parser knows neither)."""
    rest, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg == "--megatron-lm":
            skip = True
        elif not arg.startswith("--megatron-lm="):
            rest.append(arg)
    return rest


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    pre, _ = _envpipe_parser().parse_known_args(argv)
    pre.envpipe_check_args = pre.envpipe_check_args or pre.envpipe_check_args_verbose
    try:
        # Flags first: pure Python, and the user's to fix wherever Megatron-LM is missing.
        config = EnvPipeConfig.from_args(pre).validate_with_megatron_args(pre)
        script = find_pretrain_gpt(pre.megatron_lm)
        if script is not None:
            # Before anything imports megatron: the checkout's megatron (and its siblings
            # gpt_builders, model_provider) win over the installed megatron-core.
            sys.path.insert(0, str(script.parent))
        blocker = training_blocker_here(pre, argv)
        if blocker is not None:
            return report_blocker(PROG, blocker)
    except (EntryError, EnvPipeConfigError) as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    if pre.envpipe_check_args and not pre.envpipe_check_args_verbose:
        with results_only():
            return _run(pre, config, script, argv)
    return _run(pre, config, script, argv)


def _run(pre: argparse.Namespace, config: EnvPipeConfig, script: Path | None, argv: list[str]) -> int:
    """Megatron's part: its import, EnvPipe installed, then the check, the checkout's script or the built-in GPT."""
    try:
        check_megatron_training(script)
    except EntryError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    _teach_megatron_parser(add_entry_args, builtin=script is None)
    # Resolved on first use (megatron_envpipe.__getattr__): torch loads only past the checks above.
    megatron_envpipe.install(config)
    rest = _without_megatron_lm(argv)
    try:
        if pre.envpipe_check_args:
            check_arguments(str(script) if script else PROG, rest)
        elif script is not None:
            sys.argv = [str(script), *rest]
            runpy.run_path(str(script), run_name="__main__")
        else:
            sys.argv = [sys.argv[0] if sys.argv and sys.argv[0] else PROG, *rest]
            pretrain_gpt(add_entry_args)
    finally:
        megatron_envpipe.uninstall()
    return 0


if __name__ == "__main__":
    sys.exit(main())
