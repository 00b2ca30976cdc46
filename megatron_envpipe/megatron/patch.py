"""``install()`` / ``uninstall()``: route Megatron-core's 1F1B through EnvPipe.

Megatron's ``get_forward_backward_func`` reads
``schedules.forward_backward_pipelining_without_interleaving`` from the module
globals at call time, so rebinding that one name redirects every caller
(``megatron.training`` included). ``megatron.training.training`` binds
``get_forward_backward_func`` at import; where it exists we also wrap it, so
a training loop that already imported it sees the executor too.

Megatron's interleaved schedule (virtual pipelines) is rebound to EnvPipe's
executor for model chunks when ``--envpipe-scheduling interleaved``; with any
other scheduling, and for the no-pipelining schedule (PP = 1), it is rebound to
a pass-through that logs once that EnvPipe is not running, instead of being
silently ignored.

Flags are checked before anything is rebound: ``install(config, megatron_args=args)``
(or, without ``megatron_args``, the namespace ``megatron.training`` parsed in this
process, if it did) runs :meth:`EnvPipeConfig.validate_with_megatron_args`;
what cannot be checked here (no Megatron flags at all) the run-time checks at
its first call, before any rank runs a unit.
"""

from __future__ import annotations

import functools
import logging
import sys
from collections.abc import Callable
from typing import Any

from megatron_envpipe.config import EnvPipeConfig
from megatron_envpipe.core.hooks import ExecutionHooks
from megatron_envpipe.core.kinds import scheduling_kind
from megatron_envpipe.megatron.executor import envpipe_forward_backward, envpipe_interleaved_forward_backward
from megatron_envpipe.megatron.reporting import summarize
from megatron_envpipe.megatron.state import STATE
from megatron_envpipe.megatron.training_run import TrainingRun

log = logging.getLogger("megatron_envpipe")

_saved: dict[str, Any] = {}

INTERLEAVED = "forward_backward_pipelining_with_interleaving"

# Megatron's schedules EnvPipe does not replace -> why, logged once per install() when one runs.
_NOT_REPLACED = {
    INTERLEAVED:
        "virtual pipeline: Megatron's interleaved schedule runs (EnvPipe runs model chunks only with "
        "--envpipe-scheduling interleaved), without EnvPipe's order, clocks or energy reports",
    "forward_backward_no_pipelining":
        "no pipeline parallelism (pipeline-model-parallel size 1): Megatron's no-pipelining schedule runs, "
        "without EnvPipe's order, clocks or energy reports",
}


def _logged_once(original: Callable[..., Any], reason: str) -> Callable[..., Any]:
    """``original``, logging ``reason`` the first time it runs after each ``install()``."""

    @functools.wraps(original)
    def schedule(*args: Any, **kwargs: Any) -> Any:
        if STATE.warn_once(reason):
            log.warning("EnvPipe: %s", reason)
        return original(*args, **kwargs)

    return schedule


def _parsed_megatron_args() -> Any:
    """The namespace ``megatron.training`` parsed in this process, or None (never imports it)."""
    global_vars = sys.modules.get("megatron.training.global_vars")
    get_args = getattr(global_vars, "get_args", None)
    if get_args is None:
        return None
    try:
        return get_args()
    except Exception:  # noqa: BLE001 - asserts while Megatron has not parsed its arguments
        return None


def install(config: EnvPipeConfig | None = None, hooks: ExecutionHooks | None = None,
            megatron_args: Any = None) -> None:
    """Install (or re-configure) EnvPipe's executor. Idempotent; undone by :func:`uninstall`.

    Raises :class:`~megatron_envpipe.config.EnvPipeConfigError` (nothing installed) when
    ``config`` is impossible, or impossible with ``megatron_args`` (Megatron's parsed
    flags; default: those ``megatron.training`` parsed in this process, if any).
    """
    config = (config or EnvPipeConfig()).validate()
    if megatron_args is None:
        megatron_args = _parsed_megatron_args()
    if megatron_args is not None:
        config = config.validate_with_megatron_args(megatron_args)  # follows Megatron's --log-interval
    run = TrainingRun(config)  # reads --envpipe-profile: a bad one fails before anything is rebound
    # Megatron-core is imported here, not at module level: this module loads with torch alone.
    from megatron.core.pipeline_parallel import schedules

    if "schedule" not in _saved:
        _saved["schedule"] = schedules.forward_backward_pipelining_without_interleaving
        schedules.forward_backward_pipelining_without_interleaving = envpipe_forward_backward
        replacements = {_saved["schedule"]: envpipe_forward_backward}  # Megatron's function -> ours
        _saved["replacements"] = replacements
        for name, reason in _NOT_REPLACED.items():
            original = getattr(schedules, name, None)
            if original is not None:  # get_forward_backward_func looks them up at call time too
                _saved[name] = original
                replacements[original] = _logged_once(original, reason)
                setattr(schedules, name, replacements[original])
        try:  # megatron.training (>= 0.17 in the wheel, or a Megatron-LM checkout)
            from megatron.training import training as mtraining
        except Exception:  # noqa: BLE001 - absent or not importable here (e.g. Python 3.11 + 0.19)
            mtraining = None
        if mtraining is not None and hasattr(mtraining, "get_forward_backward_func"):
            original_gffb = mtraining.get_forward_backward_func
            _saved["training_gffb"] = original_gffb

            def get_forward_backward_func(*args: Any, **kwargs: Any) -> Any:
                # Today this already resolves through `schedules`; the wrapper keeps
                # the routing if a release ever binds the schedules at import time.
                func = original_gffb(*args, **kwargs)
                return replacements.get(func, func)

            mtraining.get_forward_backward_func = get_forward_backward_func
    if INTERLEAVED in _saved:  # re-bound at every install(): the scheduling may have changed
        original = _saved[INTERLEAVED]
        ours = (envpipe_interleaved_forward_backward if scheduling_kind(config.scheduling).replaces == INTERLEAVED
                else _logged_once(original, _NOT_REPLACED[INTERLEAVED]))
        _saved["replacements"][original] = ours
        setattr(schedules, INTERLEAVED, ours)
    STATE.configure(run, _saved["schedule"], hooks, original_interleaved=_saved.get(INTERLEAVED))
    log.info(
        "EnvPipe installed: type %s, scheduling %s, reconfig %s%s",
        config.plan_type, config.scheduling, config.reconfig,
        f", profile {config.profile}" if config.profile else "",
    )


def uninstall() -> None:
    """Restore Megatron's own schedule. Safe to call when not installed."""
    if "schedule" in _saved:
        from megatron.core.pipeline_parallel import schedules  # installed: megatron is loaded

        schedules.forward_backward_pipelining_without_interleaving = _saved.pop("schedule")
        _saved.pop("replacements", None)
        for name in _NOT_REPLACED:
            if name in _saved:
                setattr(schedules, name, _saved.pop(name))
    if "training_gffb" in _saved:
        from megatron.training import training as mtraining

        mtraining.get_forward_backward_func = _saved.pop("training_gffb")
    summarize(STATE.run)  # the run's energy summary, once, on the last rank
    STATE.reset()


def is_installed() -> bool:
    return "schedule" in _saved
