"""Stream a GPTModel as Hugging Face tensors (TP gathered, PP broadcast), and bucket the stream."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from verl_mcore_utils.weights.chunks import (
    full_shape,
    local_megatron_params,
    model_parallel_groups,
    unwrap_model_chunks,
)
from verl_mcore_utils.weights.experts import expert_groups
from verl_mcore_utils.weights.fused import megatron_to_hf, tp_unshard
from verl_mcore_utils.weights.names import TIED_OUTPUT, as_dims, few_names, param_mappings


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return dtype


@torch.no_grad()
def export_hf_weights(
    model_chunks: torch.nn.Module | Sequence[torch.nn.Module],
    *,
    hf_config: Mapping[str, Any] | Any,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(hugging_face_name, full_tensor)`` for the whole model, one tensor at a time, on every rank.

    One tensor at a time so that a weight sync to a rollout engine never holds a second copy of the model.
    Each megatron parameter is all-gathered over the TP group by the stage that owns it and broadcast from
    that stage over the PP group, so every rank receives every tensor (an expert is first broadcast from the
    expert-parallel rank that holds it); fused QKV and gate/up are split back
    and vocabulary padding is cut off. With ``tie_word_embeddings`` no ``lm_head.weight`` is yielded
    (Hugging Face re-ties it to ``model.embed_tokens.weight`` on load).

    The order is fixed (embedding, layers in order, final norm, lm_head, then the MTP layers a config declares,
    as GLM-4.5's ``model.layers.<num_hidden_layers + k>.*`` without the shared embedding / head) on every rank.
    Collectives run inside the generator: every rank of the model must iterate it to the end, in step.
    Tensors keep the parameters' dtype and device and may share memory with the parameters or with each
    other: clone before modifying, and copy before the next optimizer step if you keep them.
    """
    dims = as_dims(hf_config)
    chunks = unwrap_model_chunks(model_chunks)
    groups = model_parallel_groups()
    experts = expert_groups()
    local = {
        name: entry
        for name, entry in local_megatron_params(chunks, dims).items()
        if entry[0] is not TIED_OUTPUT
    }
    device = next(p for c in chunks for p in c.parameters()).device
    owned = {
        name: (full_shape(param, mapping, experts.for_param(name, groups).tp_size), str(param.dtype))
        for name, (mapping, param) in local.items()
    }
    owned = experts.with_other_ranks_experts(owned)
    # Which PP stage holds what: one object all-gather, so every rank can post matching broadcasts.
    if groups.pp_size > 1:
        by_stage: list[Any] = [None] * groups.pp_size
        dist.all_gather_object(by_stage, owned, group=groups.pp_group)
    else:
        by_stage = [owned]
    owners: dict[str, tuple[int, tuple[int, ...], str]] = {}
    for stage, stage_owned in enumerate(by_stage):
        for name, (shape, dtype) in stage_owned.items():
            if name in owners:
                raise ValueError(
                    f"megatron parameter {name!r} is held by PP stages {owners[name][0]} and {stage}"
                )
            owners[name] = (stage, shape, dtype)
    # the MTP layers when the model has them (every rank knows from ``owners``) and the config maps them
    mappings = param_mappings(hf_config=dims, mtp=any(name.startswith("mtp.") for name in owners))
    absent = [m.megatron_name for m in mappings if m.megatron_name not in owners]
    if absent:
        raise ValueError(f"no pipeline stage holds megatron parameters {few_names(absent)}")

    for mapping in mappings:
        stage, shape, dtype = owners[mapping.megatron_name]
        ep_owner = experts.owner(mapping.megatron_name, num_experts=dims.num_experts)
        if stage == groups.pp_rank and ep_owner not in (None, experts.rank):
            full = torch.empty(shape, dtype=_dtype(dtype), device=device)
        elif stage == groups.pp_rank:
            param = local[mapping.megatron_name][1].detach()
            tp = experts.for_param(mapping.megatron_name, groups)
            if mapping.tp_dim is not None and tp.tp_size > 1:
                # Plain torch.distributed, not megatron's tensor_parallel gather helpers: those allocate
                # on torch.cuda.current_device(), which breaks gloo on CPU hosts.
                parts = [torch.empty_like(param) for _ in range(tp.tp_size)]
                dist.all_gather(parts, param.contiguous(), group=tp.tp_group)
                full = tp_unshard(parts, mapping)
            else:
                full = param
        else:
            full = torch.empty(shape, dtype=_dtype(dtype), device=device)
        if stage == groups.pp_rank and ep_owner is not None:
            full = experts.broadcast(full, owner=ep_owner)
        if groups.pp_size > 1:
            full = full.contiguous()
            dist.broadcast(full, src=dist.get_global_rank(groups.pp_group, stage), group=groups.pp_group)
        for name, tensor in megatron_to_hf(mapping, full, hf_config=dims):
            yield name, tensor


def bucket_tensors(
    pairs: Iterable[tuple[str, torch.Tensor]], *, bucket_bytes: int, owned: bool = False
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Group ``(name, tensor)`` pairs into lists of at most ``bucket_bytes`` (a bigger tensor alone), each
    tensor cloned so that the bucket owns it (the source may reuse or share memory), unless ``owned``: the
    source yields fresh tensors nobody else holds (a second copy would cost one more largest tensor)."""
    if isinstance(bucket_bytes, bool) or not isinstance(bucket_bytes, int) or bucket_bytes < 1:
        raise ValueError(f"bucket_bytes must be a positive int (bytes per bucket), got {bucket_bytes!r}")
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, tensor in pairs:
        nbytes = tensor.numel() * tensor.element_size()
        if bucket and size + nbytes > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, tensor.detach() if owned else tensor.detach().clone()))
        size += nbytes
    if bucket:
        yield bucket
