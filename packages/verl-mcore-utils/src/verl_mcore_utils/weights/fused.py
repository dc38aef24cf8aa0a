"""Fused q/k/v and gate/up tensors and tensor-parallel slices, between Hugging Face and megatron layouts."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from verl_mcore_utils.weights.names import ParamMapping, as_dims


def _check_groups(num_heads: int, num_query_groups: int) -> int:
    if num_query_groups <= 0 or num_heads % num_query_groups:
        raise ValueError(f"num_heads={num_heads} is not a multiple of num_query_groups={num_query_groups}")
    return num_heads // num_query_groups


def merge_qkv(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    num_heads: int,
    num_query_groups: int,
    head_dim: int,
) -> torch.Tensor:
    """Fuse q/k/v projections (weights or biases, rows = output features) into megatron's ``linear_qkv`` rows.

    megatron computes all heads of one query group from one contiguous block ``[q heads of the group, k, v]``
    so that a TP rank owning whole groups needs no communication; that is why the rows are interleaved
    per group rather than concatenated. Also valid on one TP shard if given per-partition head counts.
    """
    per_group = _check_groups(num_heads, num_query_groups)
    rest = q.shape[1:]
    expected = ((num_heads * head_dim, *rest), (num_query_groups * head_dim, *rest))
    if tuple(q.shape) != expected[0] or tuple(k.shape) != expected[1] or tuple(v.shape) != expected[1]:
        raise ValueError(
            f"q/k/v shapes {tuple(q.shape)}/{tuple(k.shape)}/{tuple(v.shape)} do not match "
            f"num_heads={num_heads}, num_query_groups={num_query_groups}, head_dim={head_dim}"
        )
    return torch.cat(
        (
            q.reshape(num_query_groups, per_group * head_dim, *rest),
            k.reshape(num_query_groups, head_dim, *rest),
            v.reshape(num_query_groups, head_dim, *rest),
        ),
        dim=1,
    ).reshape(-1, *rest)


def split_qkv(
    fused: torch.Tensor, *, num_heads: int, num_query_groups: int, head_dim: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inverse of :func:`merge_qkv`: megatron ``linear_qkv`` rows -> (q, k, v) in Hugging Face row order."""
    per_group = _check_groups(num_heads, num_query_groups)
    rows = num_query_groups * (per_group + 2) * head_dim
    if fused.shape[0] != rows:
        raise ValueError(
            f"fused QKV has {fused.shape[0]} rows; num_heads={num_heads}, num_query_groups={num_query_groups},"
            f" head_dim={head_dim} need {rows}"
        )
    rest = fused.shape[1:]
    grouped = fused.reshape(num_query_groups, (per_group + 2) * head_dim, *rest)
    q, k, v = torch.split(grouped, [per_group * head_dim, head_dim, head_dim], dim=1)
    return q.reshape(-1, *rest), k.reshape(-1, *rest), v.reshape(-1, *rest)


def merge_gate_up(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """Fuse gate_proj / up_proj into megatron's ``linear_fc1`` rows ``[gate; up]`` (SwiGLU splits it in half).

    On TP shards apply it per rank to the rank's gate and up slices: a shard is ``[gate_r; up_r]``, not a
    slice of the full fused tensor.
    """
    if gate.shape != up.shape:
        raise ValueError(f"gate {tuple(gate.shape)} and up {tuple(up.shape)} shapes differ")
    return torch.cat((gate, up), dim=0)


def split_gate_up(fused: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of :func:`merge_gate_up`: ``linear_fc1`` rows -> (gate, up)."""
    if fused.shape[0] % 2:
        raise ValueError(f"fused gate/up has an odd number of rows ({fused.shape[0]})")
    gate, up = torch.chunk(fused, 2, dim=0)
    return gate, up


def hf_to_megatron(
    mapping: ParamMapping, tensors: Sequence[torch.Tensor], *, hf_config: Mapping[str, Any] | Any
) -> torch.Tensor:
    """The full megatron tensor of ``mapping`` from its Hugging Face tensors (in ``mapping.hf_names`` order)."""
    d = as_dims(hf_config)
    if mapping.fusion == "qkv":
        q, k, v = tensors
        return merge_qkv(
            q, k, v, num_heads=d.num_heads, num_query_groups=d.num_query_groups, head_dim=d.head_dim
        )
    if mapping.fusion == "gate_up":
        gate, up = tensors
        return merge_gate_up(gate, up)
    (tensor,) = tensors
    return tensor


def megatron_to_hf(
    mapping: ParamMapping, full: torch.Tensor, *, hf_config: Mapping[str, Any] | Any
) -> list[tuple[str, torch.Tensor]]:
    """Hugging Face (name, tensor) pairs of a full megatron tensor; vocabulary padding is cut off."""
    d = as_dims(hf_config)
    if mapping.fusion == "qkv":
        parts: Sequence[torch.Tensor] = split_qkv(
            full, num_heads=d.num_heads, num_query_groups=d.num_query_groups, head_dim=d.head_dim
        )
    elif mapping.fusion == "gate_up":
        parts = split_gate_up(full)
    elif mapping.vocab_parallel:
        parts = (full[: d.vocab_size],)
    else:
        parts = (full,)
    return list(zip(mapping.hf_names, parts, strict=True))


def tp_slice(full: torch.Tensor, *, dim: int | None, gate_up: bool, rank: int, size: int) -> torch.Tensor:
    """TP rank ``rank``'s slice of ``full`` along ``dim`` (None: replicated, the whole tensor).

    A ``gate_up`` tensor split on dim 0 is sliced per half: each rank holds ``[gate shard; up shard]``.
    """
    if dim is None or size == 1:
        return full
    if dim == 0 and gate_up:
        gate, up = split_gate_up(full)
        return merge_gate_up(gate.chunk(size, dim=0)[rank], up.chunk(size, dim=0)[rank])
    return full.chunk(size, dim=dim)[rank]


def tp_concat(parts: Sequence[torch.Tensor], *, dim: int | None, gate_up: bool) -> torch.Tensor:
    """Inverse of :func:`tp_slice` over the TP ranks' slices, in rank order."""
    if dim is None or len(parts) == 1:
        return parts[0]
    if dim == 0 and gate_up:
        halves = [split_gate_up(p) for p in parts]
        return merge_gate_up(torch.cat([h[0] for h in halves]), torch.cat([h[1] for h in halves]))
    return torch.cat(list(parts), dim=dim)


def tp_shard(full: torch.Tensor, mapping: ParamMapping, rank: int, size: int) -> torch.Tensor:
    """This TP rank's slice of a full megatron tensor."""
    return tp_slice(full, dim=mapping.tp_dim, gate_up=mapping.fusion == "gate_up", rank=rank, size=size)


def tp_unshard(parts: Sequence[torch.Tensor], mapping: ParamMapping) -> torch.Tensor:
    """Inverse of :func:`tp_shard` over the TP ranks' slices, in rank order (public: wrappers that gather
    TP slices themselves, e.g. verl_mfsdp's Megatron-FSDP export, put them back in megatron's layout)."""
    return tp_concat(parts, dim=mapping.tp_dim, gate_up=mapping.fusion == "gate_up")
