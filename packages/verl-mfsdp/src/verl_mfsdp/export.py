"""Full Hugging Face weights of a Megatron-FSDP model, for a rollout engine.

Why: after training, the rollout engine needs every weight in full and in Hugging Face names. Under
Megatron-FSDP each rank holds only a shard of each parameter (a DTensor over the data-parallel and
tensor-parallel mesh), and a multi-chunk model must be synchronised chunk by chunk (verl's first
version stopped after the first chunk and exported stale weights for the rest).

How: :func:`verl_mfsdp.synchronize_megatron_fsdp_params` on every chunk (waits for pending all-gathers
and exposes the DTensor parameters), then per parameter, in the fixed order of
``verl_mcore_utils.weights.param_mappings``, megatron-core's own uneven-DTensor gather
(``uneven_dtensor_to_full_tensor``) builds the full tensor on every rank; it is cast to the compute
dtype of the model (the main weights are fp32; the cast is the one the optimizer step uses to write
the compute weights, so the result equals them bitwise), its tensor-parallel slices are put back in
megatron's full layout, and ``verl_mcore_utils.weights.megatron_to_hf`` splits fused QKV / gate-up and
cuts vocabulary padding. Every rank takes part in every collective, in the same order.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch

from verl_mcore_utils.compat import import_megatron_core
from verl_mfsdp.offload import megatron_fsdp_chunks
from verl_mfsdp.wrap import synchronize_megatron_fsdp_params

__all__ = ["export_megatron_fsdp_hf_weights"]


def _full_tensor(param: torch.Tensor) -> torch.Tensor:
    """The whole tensor of a (possibly unevenly sharded) DTensor parameter; a plain tensor as it is."""
    if type(param).__name__ != "DTensor":
        return param.detach().clone()
    from megatron.core.distributed.fsdp.src.megatron_fsdp.uneven_dtensor import uneven_dtensor_to_full_tensor

    return uneven_dtensor_to_full_tensor(param)  # keeps the shard offsets cached on the parameter


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
    mappings = weights.param_mappings(hf_config=dims)
    absent = [m.megatron_name for m in mappings if m.megatron_name not in local]
    if absent:
        shown = ", ".join(absent[:12]) + (f" ... ({len(absent)} in all)" if len(absent) > 12 else "")
        raise ValueError(f"no model chunk holds megatron parameters {shown}")
    tp_size = parallel_state.get_tensor_model_parallel_world_size()
    for mapping in mappings:
        param = local[mapping.megatron_name][1]
        full = _full_tensor(param).to(_compute_dtype(param))
        if mapping.tp_dim is not None and tp_size > 1:
            # The DTensor's global tensor is the TP slices concatenated in rank order; megatron's full
            # layout differs for fused gate/up, so put it back with the slices' own inverse.
            full = weights.tp_unshard(full.chunk(tp_size, dim=mapping.tp_dim), mapping)
        yield from weights.megatron_to_hf(mapping, full, hf_config=dims)
