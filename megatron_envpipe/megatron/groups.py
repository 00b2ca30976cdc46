"""This rank's place in the parallel layout, and the small collectives the executor runs on it.

Megatron hands the schedule a process-group collection; :class:`StageGroups`
reads the stage, pipeline size and tensor/context-parallel sizes from it once
per iteration, gathers picklable Python objects over the pipeline, and makes
the model-parallel peers of the stage and the data-parallel replicas of the
pipeline agree on them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

__all__ = ["StageGroups"]


def _size(pg_collection: Any, name: str) -> int:
    group = getattr(pg_collection, name, None)  # a collection may leave a group unset
    return group.size() if group is not None else 1


@dataclass(frozen=True)
class StageGroups:
    """Stage index and sizes from Megatron's ``pg_collection``, plus gathers over them."""

    pg_collection: Any
    stage: int
    num_stages: int
    tp_size: int
    cp_size: int
    model_parallel: tuple[Any, ...]  # the stage's TP and CP groups of more than one rank
    replicas: Any = None  # the data-parallel group of this rank, when it has more than one rank

    @classmethod
    def of(cls, pg_collection: Any) -> "StageGroups":
        pp = pg_collection.pp
        model_parallel = tuple(
            g for g in (getattr(pg_collection, name, None) for name in ("tp", "cp"))
            if g is not None and g.size() > 1
        )
        # "dp" where the collection has it (Megatron >= 0.19's default), else "dp_cp": CP peers
        # already agree, so broadcasting over DP x CP from its first rank gives the same result.
        replicas = next((g for g in (getattr(pg_collection, name, None) for name in ("dp", "dp_cp"))
                         if g is not None), None)
        return cls(pg_collection, pp.rank(), pp.size(), _size(pg_collection, "tp"), _size(pg_collection, "cp"),
                   model_parallel, replicas if replicas is not None and replicas.size() > 1 else None)

    @property
    def pp_group(self) -> Any:
        return self.pg_collection.pp

    @property
    def first(self) -> bool:
        return self.stage == 0

    @property
    def last(self) -> bool:
        return self.stage == self.num_stages - 1

    def gather_stages(self, value: Any) -> list[Any]:
        """Every stage's ``value``, in stage order (all-gather over the pipeline group)."""
        everyone: list[Any] = [None] * self.num_stages
        dist.all_gather_object(everyone, value, group=self.pp_group)
        return everyone

    def agree(self, value: Any) -> Any:
        """Make every rank use the data of the first TP/CP rank of data-parallel replica 0.

        Tensor-parallel peers must run the same schedule and clocks, or their
        collectives inside forward/backward would hang; data-parallel replicas
        should too, or each would plan from its own measurements and the replicas
        would run different clocks (and the slowest would set everyone's pace).
        Feeding identical data to the deterministic run-time guarantees one plan.
        TP/CP first, so each replica's first ranks hold its data before the
        replicas take replica 0's. A collective: every rank of the layout calls it.
        """
        groups = self.model_parallel + ((self.replicas,) if self.replicas is not None else ())
        for group in groups:
            box = [value]
            dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0), group=group)
            value = box[0]
        return value
