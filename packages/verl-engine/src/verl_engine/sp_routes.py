"""Router replay's routes under sequence parallelism: each TP rank routes its own shard of the tokens.

With SP megatron-core scatters the packed (THD) sequence of a rank over its TP group before the first layer
(``scatter_to_sequence_parallel_region``: TP rank ``r`` holds rows ``r * T / TP`` to ``(r + 1) * T / TP``), and
every router sees that shard. Replay targets (one row per token of the rank's sequence) are cut the same way;
recorded routes (one row per token of the shard) are gathered over TP in rank order, back to the rank's whole
sequence, before verl-dyncp merges them over the CP group. T divides by TP: verl-dyncp aligns every packed
sequence to TP (2 x CP x TP with CP).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["sp_gather_rows", "sp_shard_rows"]


def _tp() -> tuple[int, int, dist.ProcessGroup | None]:
    from megatron.core import parallel_state as ps

    return (
        ps.get_tensor_model_parallel_world_size(),
        ps.get_tensor_model_parallel_rank(),
        ps.get_tensor_model_parallel_group(),
    )


def sp_shard_rows(rows: torch.Tensor, *, on: bool) -> torch.Tensor:
    """This TP rank's rows of ``rows`` (the whole sequence of the rank) under SP (``on``), else ``rows``."""
    size, rank, _ = _tp()
    if not on or size == 1:
        return rows
    if rows.shape[0] % size:
        raise RuntimeError(f"router replay: {rows.shape[0]} rows do not split over TP {size} (THD alignment)")
    n = rows.shape[0] // size
    return rows[rank * n : (rank + 1) * n]


def sp_gather_rows(rows: torch.Tensor, *, on: bool) -> torch.Tensor:
    """Every TP rank's ``rows`` (its shard) concatenated in rank order under SP (``on``), else ``rows``."""
    size, _, group = _tp()
    if not on or size == 1:
        return rows
    parts = [torch.empty_like(rows) for _ in range(size)]
    dist.all_gather(parts, rows.contiguous(), group=group)
    return torch.cat(parts)
