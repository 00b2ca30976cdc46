"""``install()`` / ``uninstall()``: route Megatron-core's 1F1B through EnvPipe.

Megatron's ``get_forward_backward_func`` reads
``schedules.forward_backward_pipelining_without_interleaving`` from the module
globals at call time, so rebinding that one name redirects every caller
(``megatron.training`` included). ``megatron.training.training`` binds
``get_forward_backward_func`` at import; where it exists we also wrap it, so
a training loop that already imported it sees the executor too.

Flags are checked before anything is rebound: ``install(config, megatron_args=args)``
(or, without ``megatron_args``, the namespace ``megatron.training`` parsed in this
process, if it did) runs :meth:`EnvPipeConfig.validate_with_megatron_args`;
what cannot be checked here (no Megatron flags at all) the run-time checks at
its first call, before any rank runs a unit.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

from megatron_envpipe.config import EnvPipeConfig
from megatron_envpipe.core.hooks import ExecutionHooks
from megatron_envpipe.megatron.executor import envpipe_forward_backward
from megatron_envpipe.megatron.runtime import EnvPipeRuntime
from megatron_envpipe.megatron.state import STATE

log = logging.getLogger("megatron_envpipe")

_saved: dict[str, Any] = {}


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
        config.validate_with_megatron_args(megatron_args)
    runtime = EnvPipeRuntime(config)  # reads --envpipe-profile: a bad one fails before anything is rebound
    # Megatron-core is imported here, not at module level: this module loads with torch alone.
    from megatron.core.pipeline_parallel import schedules

    if "schedule" not in _saved:
        _saved["schedule"] = schedules.forward_backward_pipelining_without_interleaving
        schedules.forward_backward_pipelining_without_interleaving = envpipe_forward_backward
        try:  # megatron.training (>= 0.17 in the wheel, or a Megatron-LM checkout)
            from megatron.training import training as mtraining
        except Exception:  # noqa: BLE001 - absent or not importable here (e.g. Python 3.11 + 0.19)
            mtraining = None
        if mtraining is not None and hasattr(mtraining, "get_forward_backward_func"):
            original_gffb = mtraining.get_forward_backward_func
            _saved["training_gffb"] = original_gffb
            original_schedule = _saved["schedule"]

            def get_forward_backward_func(*args: Any, **kwargs: Any) -> Any:
                # Today this already resolves through `schedules`; the wrapper keeps
                # the routing if a release ever binds the schedule at import time.
                func = original_gffb(*args, **kwargs)
                return envpipe_forward_backward if func is original_schedule else func

            mtraining.get_forward_backward_func = get_forward_backward_func
    STATE.configure(runtime, _saved["schedule"], hooks)
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
    if "training_gffb" in _saved:
        from megatron.training import training as mtraining

        mtraining.get_forward_backward_func = _saved.pop("training_gffb")
    STATE.reset()


def is_installed() -> bool:
    return "schedule" in _saved
