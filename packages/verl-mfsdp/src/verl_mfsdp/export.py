"""Full Hugging Face weights of a Megatron-FSDP model, for a rollout engine.

Why: after training, the rollout engine needs every weight in full and in Hugging Face names. Under
Megatron-FSDP each rank holds only a shard of each parameter (a DTensor over the data-parallel and
tensor-parallel mesh), and a multi-chunk model must be synchronised chunk by chunk (verl's first
version stopped after the first chunk and exported stale weights for the rest).

How: :func:`verl_mfsdp.synchronize_megatron_fsdp_params` on every chunk (waits for pending all-gathers
and exposes the DTensor parameters), then per parameter, in the fixed order of
``verl_mcore_utils.weights.param_mappings``, the local shard is cast to the compute dtype of the model
(the main weights are fp32; the cast is the one the optimizer step uses to write the compute weights, so
the result equals them bitwise) and gathered with megatron-core's uneven-DTensor offsets into the full
tensor on every rank (cast first: one compute-dtype copy of the largest tensor, not three fp32 ones), its
tensor-parallel slices are put back in
megatron's full layout, and ``verl_mcore_utils.weights.megatron_to_hf`` splits fused QKV / gate-up and
cuts vocabulary padding. Every rank takes part in every collective, in the same order.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, cast

import torch

from verl_mcore_utils.compat import import_megatron_core
from verl_mfsdp.offload import megatron_fsdp_chunks
from verl_mfsdp.wrap import synchronize_megatron_fsdp_params

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor

__all__ = ["export_megatron_fsdp_hf_weights"]


def _full_tensor(param: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The whole tensor of a (possibly unevenly sharded) DTensor parameter, in ``dtype``; a fresh tensor.

    The local shard is cast to ``dtype`` (the compute dtype) BEFORE it is gathered: gathering the fp32 main
    weights and casting afterwards (megatron-core's ``uneven_dtensor_to_full_tensor``) held three fp32
    copies of the largest tensor at once (gather buffers, concatenation, reassembly), 3.4 GB for a 150k x 896
    embedding where the exported bf16 tensor is 0.27 GB. Here the extra memory is the gathered tensor plus
    this rank's cast shard; when the shards are consecutive row-major pieces (Megatron-FSDP's layout) the
    gather buffer already is the full tensor.
    """
    if type(param).__name__ != "DTensor":
        return param.detach().to(dtype, copy=True)
    import torch.distributed as dist
    from megatron.core.distributed.fsdp.src.megatron_fsdp.uneven_dtensor import (
        update_uneven_dtensor_chunk_metadata,
    )
    from torch.distributed.tensor import Replicate

    if not hasattr(param._local_tensor, "__create_chunk_list__"):  # type: ignore[attr-defined]
        update_uneven_dtensor_chunk_metadata(param)  # cached on the parameter
    (meta,) = param.__create_chunk_list__()  # type: ignore[attr-defined]
    local = (
        cast("DTensor", param).to_local().detach().to(dtype, copy=True).contiguous()
    )  # a DTensor (checked above)
    chunks = [(tuple(local.shape), tuple(getattr(meta, "offsets", [0] * param.dim())))]
    flat = local.view(-1)
    for mesh_dim, placement in enumerate(cast("DTensor", param).placements):
        if isinstance(placement, Replicate):
            continue
        group = cast("DTensor", param).device_mesh.get_group(mesh_dim)
        if dist.get_world_size(group) == 1:
            continue
        infos: list[Any] = [None] * dist.get_world_size(group)
        dist.all_gather_object(infos, chunks, group=group)
        sizes = [sum(math.prod(shape) for shape, _ in info) for info in infos]
        gathered = torch.empty(sum(sizes), dtype=dtype, device=local.device)
        dist.all_gather(list(gathered.split(sizes)), flat, group=group)
        del local
        chunks = [chunk for info in infos for chunk in info]
        flat = gathered
    return _assemble(flat, chunks, shape=tuple(param.shape))


def _assemble(
    flat: torch.Tensor, chunks: list[tuple[tuple[int, ...], tuple[int, ...]]], *, shape: tuple[int, ...]
) -> torch.Tensor:
    """The full tensor from gathered row-major chunks: a view of ``flat`` when they are consecutive."""
    ordered = sorted(range(len(chunks)), key=lambda i: chunks[i][1])
    strides = [math.prod(shape[d + 1 :]) for d in range(len(shape))]
    position, consecutive = 0, ordered == list(range(len(chunks)))
    for i in ordered:
        chunk_shape, offset = chunks[i]
        start = sum(o * st for o, st in zip(offset, strides, strict=True))
        # a chunk is one consecutive range when it spans every dimension after its first
        whole_rows = tuple(chunk_shape[1:]) == tuple(shape[1:]) and all(o == 0 for o in offset[1:])
        if start != position or not whole_rows:
            consecutive = False
            break
        position += math.prod(chunk_shape)
    if consecutive and position == math.prod(shape):
        return flat.view(shape)
    full = torch.empty(shape, dtype=flat.dtype, device=flat.device)
    start = 0
    for chunk_shape, offset in chunks:
        size = math.prod(chunk_shape)
        index = tuple(slice(o, o + n) for o, n in zip(offset, chunk_shape, strict=True))
        full[index] = flat[start : start + size].view(chunk_shape)
        start += size
    return full


def _compute_dtype(param: torch.Tensor) -> torch.dtype:
    """The dtype the model computes with: that of the original (unsharded) parameter when known."""
    orig = getattr(param, "orig_param", None)
    return orig.dtype if isinstance(orig, torch.Tensor) else param.dtype


@torch.no_grad()
def export_megatron_fsdp_hf_weights(
    model_chunks: torch.nn.Module | Sequence[torch.nn.Module],
    *,
    hf_config: Mapping[str, Any] | Any,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(hugging_face_name, full_tensor)`` for the whole model on every rank, one tensor at a time.

    ``model_chunks`` are Megatron-FSDP chunks (:func:`verl_mfsdp.make_megatron_fsdp_module`). Tensors
    are in the model's compute dtype (e.g. bf16), on the GPU, and are fresh copies. Collectives run
    inside the generator: every rank must iterate it to the end, in step (``dict(...)`` does).
    With ``tie_word_embeddings`` no ``lm_head.weight`` is yielded, as verl_mcore_utils' exporter does.
    """
    import_megatron_core()
    from megatron.core import parallel_state

    from verl_mcore_utils import weights

    chunks = megatron_fsdp_chunks(model_chunks)
    if parallel_state.get_pipeline_model_parallel_world_size() > 1:
        raise ValueError(
            "Megatron-FSDP does not support pipeline parallelism; pipeline_model_parallel_size must be 1"
        )
    dims = weights.HFDims.from_hf_config(hf_config)
    # Every chunk, not just the first: a stale later chunk would be exported silently otherwise.
    synchronize_megatron_fsdp_params(chunks)
    local = weights.local_megatron_params(weights.unwrap_model_chunks(chunks), dims)
    mappings = weights.param_mappings(hf_config=dims, mtp=any(name.startswith("mtp.") for name in local))
    absent = [m.megatron_name for m in mappings if m.megatron_name not in local]
    if absent:
        shown = ", ".join(absent[:12]) + (f" ... ({len(absent)} in all)" if len(absent) > 12 else "")
        raise ValueError(f"no model chunk holds megatron parameters {shown}")
    tp_size = parallel_state.get_tensor_model_parallel_world_size()
    for mapping in mappings:
        param = local[mapping.megatron_name][1]
        full = _full_tensor(param, _compute_dtype(param))
        if mapping.tp_dim is not None and tp_size > 1:
            # The DTensor's global tensor is the TP slices concatenated in rank order; megatron's full
            # layout differs for fused gate/up, so put it back with the slices' own inverse.
            full = weights.tp_unshard(full.chunk(tp_size, dim=mapping.tp_dim), mapping)
        yield from weights.megatron_to_hf(mapping, full, hf_config=dims)
