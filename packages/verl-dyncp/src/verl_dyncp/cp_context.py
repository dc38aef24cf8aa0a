"""The context-parallel group of a packed micro-batch, carried on its ``packed_seq_params``.

The group may change on every micro-batch (dynamic CP), so it travels with the batch instead of living in
megatron-core's static parallel state; the README's design notes say where it is looked up.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["CPContext", "attach_cp_context", "get_cp_context"]

_CONTEXT_ATTR = "verl_cp_context"
# where verl_dyncp.layout caches the attention's layout of a micro-batch; reset with every new context
LAYOUT_CACHE_ATTR = "_verl_thd_layout_cache"


@dataclasses.dataclass(frozen=True)
class CPContext:
    """How one packed micro-batch is split over context-parallel ranks.

    ``cp_group`` None means CP size 1. ``position_ids`` (``[local tokens]``) overrides the RoPE positions
    derived from the zigzag layout; leave it None unless positions are not ``0..len-1`` per sequence.
    """

    cp_group: dist.ProcessGroup | None = None
    position_ids: torch.Tensor | None = None

    @property
    def size(self) -> int:
        return 1 if self.cp_group is None else dist.get_world_size(group=self.cp_group)

    @property
    def rank(self) -> int:
        return 0 if self.cp_group is None else dist.get_rank(group=self.cp_group)


def attach_cp_context(
    packed_seq_params: Any, *, cp_group: dist.ProcessGroup | None, position_ids: torch.Tensor | None = None
) -> Any:
    """Attach the CP group (and optional RoPE positions) of this micro-batch to ``packed_seq_params``.

    Returns the same object. Where PackedSeqParams has ``local_cp_size`` / ``cp_group`` (megatron-core
    >= 0.16) they are filled too, so megatron's Transformer Engine attention sees the same group; for CP
    size 1 that is ``cp_group=None, local_cp_size=1``, which switches TE's CP off (with
    ``local_cp_size=None`` TE would keep the previous micro-batch's group).
    """
    context = CPContext(cp_group=cp_group, position_ids=position_ids)
    object.__setattr__(packed_seq_params, _CONTEXT_ATTR, context)
    object.__setattr__(packed_seq_params, LAYOUT_CACHE_ATTR, {})
    from verl_mcore_utils.compat import packed_seq_params_fields  # megatron-core only when used

    if "cp_group" in packed_seq_params_fields():
        packed_seq_params.cp_group = cp_group
        packed_seq_params.local_cp_size = context.size
    return packed_seq_params


def get_cp_context(packed_seq_params: Any, *, static_cp_group: dist.ProcessGroup | None = None) -> CPContext:
    """The CPContext of a batch: attached one, else PackedSeqParams.cp_group, else ``static_cp_group``."""
    context = getattr(packed_seq_params, _CONTEXT_ATTR, None)
    if context is not None:
        return context
    group = getattr(packed_seq_params, "cp_group", None)
    if group is not None:
        return CPContext(cp_group=group)
    return CPContext(cp_group=static_cp_group)
