"""Expert parallelism in the name table: which global expert a rank's local expert is, and who owns which.

megatron-core numbers the experts of an MoE layer locally (``mlp.experts.local_experts.{i}``); with expert
parallelism EP rank ``r`` of ``EP`` holds ``E / EP`` of the ``E`` experts, local expert ``i`` being global
expert ``r * E / EP + i`` (``MoELayer.local_expert_indices``). The name table (:mod:`.names`) is written in
global indices, so loading needs only the renaming, and exporting a global expert means broadcasting it from
the EP rank that holds it. With expert tensor parallelism (ETP) an expert's fc1 / fc2 are split like TP's, over
the expert-TP group instead of the TP group (:meth:`ExpertGroups.for_param`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import parallel_state

__all__ = ["ExpertGroups", "expert_groups", "expert_index"]

_EXPERT = re.compile(r"^(.*\.mlp\.experts\.local_experts\.)(\d+)(\..+)$")


@dataclass(frozen=True)
class ExpertGroups:
    """This rank's place in the expert-model-parallel group (size 1: every expert is local)."""

    rank: int
    size: int
    group: Any
    tp_rank: int = 0
    tp_size: int = 1
    tp_group: Any = None

    def global_name(self, name: str, *, num_experts: int) -> str:
        """``name`` with a local expert index replaced by the global one (other names unchanged)."""
        match = _EXPERT.match(name)
        if match is None or self.size == 1:
            return name
        local = num_experts // self.size
        return f"{match.group(1)}{self.rank * local + int(match.group(2))}{match.group(3)}"

    def owner(self, global_name: str, *, num_experts: int) -> int | None:
        """The EP rank holding expert parameter ``global_name`` (None: not an expert, or EP 1)."""
        index = expert_index(global_name)
        if index is None or self.size == 1:
            return None
        return index // (num_experts // self.size)

    def for_param(self, global_name: str, groups: Any) -> Any:
        """``groups`` (a ``ModelParallelGroups``) with the TP fields of the expert-TP group for an expert
        parameter, unchanged for any other."""
        if expert_index(global_name) is None or self.tp_group is None:
            return groups
        return replace(groups, tp_rank=self.tp_rank, tp_size=self.tp_size, tp_group=self.tp_group)

    def with_other_ranks_experts(self, owned: dict[str, Any]) -> dict[str, Any]:
        """``owned`` (global name -> what the exporter knows of it) with the entries of this EP group's other
        ranks added: every rank then walks every expert of its stage (one object all-gather)."""
        if self.size == 1:
            return owned
        by_rank: list[Any] = [None] * self.size
        dist.all_gather_object(by_rank, owned, group=self.group)
        merged: dict[str, Any] = {}
        for rank_owned in by_rank:
            merged.update(rank_owned)
        return merged

    def broadcast(self, tensor: torch.Tensor, *, owner: int) -> torch.Tensor:
        """``tensor`` of EP rank ``owner`` on every rank of the group (filled in place elsewhere)."""
        tensor = tensor.contiguous()
        dist.broadcast(tensor, src=dist.get_global_rank(self.group, owner), group=self.group)
        return tensor


def expert_index(name: str) -> int | None:
    """The expert index in a parameter name (None: not an expert parameter)."""
    match = _EXPERT.match(name)
    return None if match is None else int(match.group(2))


def expert_groups() -> ExpertGroups:
    """megatron-core's expert-model-parallel and expert-TP ranks, sizes and groups (sizes 1 when it is not
    initialised)."""
    if not parallel_state.model_parallel_is_initialized():
        return ExpertGroups(0, 1, None)
    size = parallel_state.get_expert_model_parallel_world_size()
    return ExpertGroups(
        rank=parallel_state.get_expert_model_parallel_rank() if size > 1 else 0,
        size=size,
        group=parallel_state.get_expert_model_parallel_group() if size > 1 else None,
        tp_rank=parallel_state.get_expert_tensor_parallel_rank(),
        tp_size=parallel_state.get_expert_tensor_parallel_world_size(),
        tp_group=parallel_state.get_expert_tensor_parallel_group(),
    )
