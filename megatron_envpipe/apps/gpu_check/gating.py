"""What the machine offers the steps of ``envpipe gpu-check``, judged without loading torch or CUDA.

The runner asks before it starts a step: a step whose needs are not met is skipped with the reason
and never started. ``gpu`` is an NVML device (opened in the runner, which also resets its clocks
after every step); ``cuda`` is torch with CUDA (the runner only checks that torch is installed; step
1's child reports whether it has CUDA); ``clock_control`` is step 1's lock proof (ok or unverified);
``megatron`` is megatron-core, found without importing it. With ``--device cpu`` (CI) the steps run
on CPU tensors against a simulated GPU, so ``gpu``, ``cuda`` and ``clock_control`` stand for that.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megatron_envpipe.apps.gpu_check.step_api import Step

__all__ = ["Machine", "unmet_needs"]


def _find_module(name: str) -> bool:
    """Whether ``name`` (a top-level module, or ``megatron.core``) is installed, without importing it."""
    top, _, rest = name.partition(".")
    try:
        spec = importlib.util.find_spec(top)
    except (ImportError, ValueError):
        return False
    if spec is None:
        return False
    if not rest:
        return True
    locations = list(spec.submodule_search_locations or [])
    return any((Path(p) / rest.replace(".", "/")).is_dir() or (Path(p) / f"{rest}.py").is_file() for p in locations)


@dataclass(frozen=True)
class Machine:
    """Why each need cannot be met on this machine (None: it can), as the runner saw before any step."""

    device: str                     # "cuda" or "cpu"
    no_gpu: str | None              # e.g. "no GPU (NVML cannot start ...)"
    no_torch: str | None
    no_megatron: str | None

    @classmethod
    def probe(cls, device: str, no_gpu: str | None) -> "Machine":
        torch = None if _find_module("torch") else "torch is not installed"
        megatron = None if _find_module("megatron.core") else "megatron-core is not installed"
        return cls(device, no_gpu, torch, megatron)


def _facts(earlier: Mapping[str, Mapping[str, Any]], steps_run: Mapping[str, str]) -> tuple[Mapping[str, Any] | None, str]:
    facts = earlier.get("facts")
    if facts is not None:
        return facts, ""
    return None, steps_run.get("facts", "not run")


def unmet_needs(step: Step, machine: Machine, earlier: Mapping[str, Mapping[str, Any]],
                steps_run: Mapping[str, str]) -> list[str]:
    """The reasons ``step`` cannot run now (empty: it can). ``earlier``: figures of the steps that ended
    ok; ``steps_run``: for the steps that did not, one phrase each (e.g. ``"failed: ..."``)."""
    why: list[str] = []
    needs = step.needs
    if "gpu" in needs and machine.no_gpu:
        return [machine.no_gpu]  # nothing else matters without a GPU
    facts, facts_state = _facts(earlier, steps_run)
    if "clock_control" in needs:  # on CPU too: the simulated GPU's proof stands for it
        if facts is None:
            why.append(f"clock control not proven (step 1 facts {facts_state})")
        elif facts.get("lock") not in ("ok", "unverified"):
            why.append(f"clock lock {facts.get('lock', 'unknown')} in step 1: {facts.get('lock_detail', '')}".strip())
    if machine.device == "cuda":
        if "cuda" in needs:
            if machine.no_torch:
                why.append(machine.no_torch)
            elif facts is not None and facts.get("cuda_available") is False:
                why.append(f"torch without CUDA ({facts.get('cuda_detail', 'torch.cuda.is_available() is False')})")
    if "megatron" in needs and machine.no_megatron:
        why.append(machine.no_megatron)
    if "cuda" in needs and machine.device == "cpu" and machine.no_torch:
        why.append(machine.no_torch)  # CPU tensors need torch too
    return why
