"""Router replay across pipeline stages: which MoE layer each stage's router is, and the recorded routes of
every stage joined.

``routed_experts`` holds every MoE layer of the model (``[tokens, moe_layers, k]``, verl's layout); a pipeline
stage (or a virtual chunk of one) holds only some of the layers. Each router is identified by its global
layer number (megatron-core numbers layers over the whole model), its column in the routes by the rank of that
number among the MoE layers of all stages (:func:`moe_layer_ordinals`). Replay reads that column; recording
keeps each layer's column per sequence and :func:`join_stage_routes` gathers the columns of all stages, so that
every stage returns the routes of all layers, as one stage does. Expert parallelism changes nothing here: a
router routes its rank's own tokens before any dispatch, whatever the EP size.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from megatron.core.transformer.moe.router import TopKRouter

__all__ = ["chunk_of", "decoder_routers", "join_stage_routes", "moe_layer_ordinals", "stage_problems"]


def stage_problems(tf_config: Any) -> list[str]:
    """What replay cannot do with pipeline stages: activation recompute. A micro-batch's targets stay set
    until the next micro-batch's forward sets its own, which covers the backward's recompute only when that
    backward follows its own forward (one stage); the pipeline schedules run later forwards in between."""
    pp = getattr(tf_config, "pipeline_model_parallel_size", 1)
    recompute = getattr(tf_config, "recompute_granularity", None)
    if pp > 1 and recompute:
        return [
            f"recompute_granularity={recompute} with megatron.pipeline_model_parallel_size={pp}: the backward's"
            " recompute of a micro-batch runs after later micro-batches' forwards and would replay their routes;"
            " turn activation recompute off or use pipeline_model_parallel_size=1"
        ]
    return []


def _gathered(value: Any, group: Any) -> list[Any]:
    """``value`` of every rank of ``group`` (rank order); just ``[value]`` without a group."""
    if group is None or dist.get_world_size(group=group) == 1:
        return [value]
    out: list[Any] = [None] * dist.get_world_size(group=group)
    dist.all_gather_object(out, value, group=group)
    return out


def moe_layer_ordinals(layer_numbers: Sequence[int], *, group: Any) -> tuple[list[int], int]:
    """Each local router's column in the routes (its layer number's rank among the MoE layers of every stage
    of the pipeline ``group``) and the number of MoE layers of the model."""
    every = sorted({n for numbers in _gathered(list(layer_numbers), group) for n in numbers})
    return [every.index(n) for n in layer_numbers], len(every)


def chunk_of(chunks: Sequence[torch.nn.Module], model: torch.nn.Module) -> int:
    """The index of ``model`` among this rank's model chunks (virtual pipeline stages)."""
    for i, chunk in enumerate(chunks):
        if chunk is model:
            return i
    raise RuntimeError("router replay: the forward's model is none of the engine's model chunks")


def join_stage_routes(
    per_layer: Mapping[int, Sequence[torch.Tensor | None]], *, total: int, size: int, group: Any
) -> list[torch.Tensor]:
    """Per sequence ``[n, total, k]``: the recorded columns (``per_layer[column][sequence]``, ``[n, k]``) of this
    rank's layers and of the other stages of ``group`` (every rank gets all of them)."""
    columns: dict[int, Sequence[torch.Tensor | None]] = {}
    for part in _gathered(dict(per_layer), group):
        columns.update(part)
    missing = sorted(set(range(total)) - set(columns))
    if missing:
        raise RuntimeError(f"router replay (record): MoE layers {missing} recorded no routes on any stage")
    out = []
    for i in range(size):
        pieces = [columns[c][i] for c in range(total)]
        if any(p is None for p in pieces):
            raise RuntimeError(f"router replay (record): sequence {i} was not routed by every MoE layer")
        out.append(torch.stack(pieces, dim=1))  # type: ignore[arg-type]
    return out


def decoder_routers(chunks: Sequence[torch.nn.Module]) -> list[TopKRouter]:
    """The decoder's TopKRouters in layer order (MTP layers' routers excluded: the routes carry no rows for them)."""
    from megatron.core.transformer.moe.router import TopKRouter

    from verl_mcore_utils.module import unwrap_model

    out = []
    for chunk in chunks:
        gpt = unwrap_model(chunk)
        out += [m for m in getattr(gpt, "decoder", gpt).modules() if isinstance(m, TopKRouter)]
    return out
