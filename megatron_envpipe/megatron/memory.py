"""What ``--envpipe-max-inflight auto`` measures on this rank during a 1F1B iteration.

:class:`MemoryProbe`: the memory one micro-batch's forward keeps allocated until its
backward (``torch.cuda.memory_allocated`` before and after each forward; the largest
counts) and the memory still allocatable at the iteration's peak (free device memory
plus what the caching allocator holds unused, less the peak allocated since the
iteration began). With ``--envpipe-sim-memory`` the memory model answers instead, on
any device. :func:`memory_source` tells whether the pipeline can measure at all.

Resetting CUDA's peak-memory statistics at the start of a measured iteration means
Megatron's own "max allocated" report counts from there on.
"""

from __future__ import annotations

import torch

from megatron_envpipe.config.groups import ScheduleSettings
from megatron_envpipe.core.memory import AUTO, MemoryModel, StageMemory
from megatron_envpipe.megatron.groups import StageGroups

__all__ = ["MemoryProbe", "memory_source"]


class MemoryProbe:
    """One stage's memory over one 1F1B iteration (see the module docstring)."""

    def __init__(self, device: torch.device, model: MemoryModel | None = None) -> None:
        self.device = device
        self.model = model
        self.cuda = model is None and device.type == "cuda"
        self.activation_bytes = 0

    def iteration_begin(self) -> None:
        if self.cuda:
            torch.cuda.reset_peak_memory_stats(self.device)

    def forward_begin(self) -> int:
        """Allocated bytes before a forward (host-side bookkeeping: no device sync)."""
        return torch.cuda.memory_allocated(self.device) if self.cuda else 0

    def forward_end(self, before: int) -> None:
        if self.cuda:
            self.activation_bytes = max(self.activation_bytes, torch.cuda.memory_allocated(self.device) - before)

    def result(self) -> StageMemory:
        """The stage's activation bytes per micro-batch and bytes free at the iteration's peak."""
        if self.model is not None:
            return self.model.stage_memory()
        if not self.cuda:
            return StageMemory(0, 0)  # nothing measured: derive_budget leaves the stage unlimited
        free, _total = torch.cuda.mem_get_info(self.device)
        cached = torch.cuda.memory_reserved(self.device) - torch.cuda.max_memory_allocated(self.device)
        return StageMemory(self.activation_bytes, max(0, free + cached))


def memory_source(groups: StageGroups, device: torch.device, config: ScheduleSettings) -> str | None:
    """"cuda" when every stage of the pipeline runs on CUDA and ``auto`` needs it, else None.

    Every stage calls this at the same point (device set-up): it gathers over the pipeline
    unless the flags alone decide, and the flags are the same on every stage.
    """
    if config.max_inflight != AUTO or config.sim_memory is not None:
        return None  # an explicit budget, or the memory model stands in (runtime: "model")
    on_cuda = groups.agree(groups.gather_stages(device.type == "cuda"))
    return "cuda" if all(on_cuda) else None
