"""argparse types of the ``--envpipe-*`` flags and the ``envpipe`` command: text in, checked value out."""

from __future__ import annotations

import argparse
import math

from megatron_envpipe.core.memory import MaxInflight, MemoryModel, parse_max_inflight


def fraction(text: str) -> float:
    """argparse type of the fraction flags: ``0.05`` or ``5%`` -> 0.05; finite and >= 0.

    Shared by ``--envpipe-max-slowdown`` and the ``envpipe`` command's ``--max-slowdown``.
    """
    body = text.strip()
    percent = body.endswith("%")
    try:
        value = float(body[:-1]) / 100 if percent else float(body)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected a fraction like 0.05 or a percentage like 5%, got {text!r}") from None
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(
            f"must be a finite fraction >= 0 (0.05 or 5% for 5%), got {text!r}")
    return value


def int_list(text: str) -> list[int]:
    """argparse type: ``4,3,1,0`` -> ``[4, 3, 1, 0]``."""
    try:
        return [int(x) for x in text.replace(" ", "").split(",") if x]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def max_inflight_arg(text: str) -> MaxInflight:
    """argparse type of the activation-budget flags: ``auto``, ``none``/``unlimited``, ``8``, ``4,3,2,2``."""
    try:
        return parse_max_inflight(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def memory_model_arg(text: str) -> MemoryModel:
    """argparse type of ``--envpipe-sim-memory``: ``GIB_FREE,MIB_PER_MICROBATCH``."""
    try:
        return MemoryModel.parse(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
