"""Where LoRA layers sit in a GPTModel, and their adapters' tensor-parallel slices."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from verl_mcore_utils.lora.layer import is_lora_layer
from verl_mcore_utils.weights import LAYER_MODULE_MAP
from verl_mcore_utils.weights.fused import tp_concat, tp_slice

# megatron linear (last name part) -> how its fused rows split into HF modules
# megatron linear (last name part) -> how its fused rows split into HF modules
_FUSION = {"linear_qkv": "qkv", "linear_fc1": "gate_up", "linear_proj": "none", "linear_fc2": "none"}


@dataclass
class Site:
    """One adaptable megatron linear of a decoder layer, by global layer index."""

    layer: int  # global 0-based
    suffix: str  # inside the TransformerLayer, e.g. "self_attention.linear_qkv"
    parent: torch.nn.Module
    attr: str
    # a megatron linear (torch.nn.Module); in lora_sites, peft's LoRA layer (its class is built at run time)
    module: Any

    @property
    def name(self) -> str:
        return f"decoder.layers.{self.layer}.{self.suffix}"

    @property
    def fusion(self) -> str:
        return _FUSION[self.attr]

    @property
    def hf_modules(self) -> tuple[str, ...]:
        return tuple(f"model.layers.{self.layer}.{h}" for h in LAYER_MODULE_MAP[self.suffix])


def all_sites(chunks: Sequence[torch.nn.Module]) -> list[Site]:
    out: list[Site] = []
    for chunk in chunks:
        decoder = getattr(chunk, "decoder", None)
        if decoder is None:
            continue
        for layer in decoder.layers:
            index = int(layer.layer_number) - 1
            for suffix in LAYER_MODULE_MAP:
                parent_path, attr = suffix.rsplit(".", 1)
                try:
                    parent = layer.get_submodule(parent_path)
                except AttributeError:
                    continue
                module = getattr(parent, attr, None)
                if isinstance(module, torch.nn.Module):
                    out.append(Site(index, suffix, parent, attr, module))
    return out


def lora_sites(chunks: Sequence[torch.nn.Module]) -> list[Site]:
    return [s for s in all_sites(chunks) if is_lora_layer(s.module)]


def _tp() -> tuple[int, int, Any]:
    if not parallel_state.model_parallel_is_initialized():
        return 0, 1, None
    return (
        parallel_state.get_tensor_model_parallel_rank(),
        parallel_state.get_tensor_model_parallel_world_size(),
        parallel_state.get_tensor_model_parallel_group(),
    )


def pp_info() -> tuple[int, Any]:
    if not parallel_state.model_parallel_is_initialized():
        return 1, None
    return (
        parallel_state.get_pipeline_model_parallel_world_size(),
        parallel_state.get_pipeline_model_parallel_group(),
    )


def _is_column(layer: Any) -> bool:
    return not layer.is_parallel_a


def _tp_dim(layer: Any, which: str) -> int | None:
    """The dim of lora_A / lora_B split over TP ranks (None: replicated)."""
    if which == "A":
        return None if _is_column(layer) else 1
    return 0 if _is_column(layer) else None


def _shard(full: torch.Tensor, site: Site, which: str, rank: int, size: int) -> torch.Tensor:
    dim = _tp_dim(site.module, which)
    if dim is not None and size > 1 and full.shape[dim] % size:
        raise ValueError(
            f"{site.name} lora_{which}: dim {dim} of {tuple(full.shape)} is not divisible by TP={size}"
        )
    return tp_slice(full, dim=dim, gate_up=site.fusion == "gate_up", rank=rank, size=size)


def _unshard(parts: Sequence[torch.Tensor], site: Site, which: str) -> torch.Tensor:
    return tp_concat(parts, dim=_tp_dim(site.module, which), gate_up=site.fusion == "gate_up")


def full_tensor(site: Site, which: str, adapter: str) -> torch.Tensor:
    """The full (TP-gathered) lora_A / lora_B weight of a site; collective over the TP group."""
    layer = site.module
    weight = (layer.lora_A if which == "A" else layer.lora_B)[adapter].weight.detach()
    _, size, group = _tp()
    if _tp_dim(layer, which) is None or size == 1:
        return weight
    parts = [torch.empty_like(weight) for _ in range(size)]
    dist.all_gather(parts, weight.contiguous(), group=group)
    return _unshard(parts, site, which)


@torch.no_grad()
def set_full(site: Site, which: str, adapter: str, full: torch.Tensor) -> None:
    layer = site.module
    param = (layer.lora_A if which == "A" else layer.lora_B)[adapter].weight
    rank, size, _ = _tp()
    shard = _shard(full, site, which, rank, size)
    if tuple(shard.shape) != tuple(param.shape):
        raise ValueError(
            f"{site.name} lora_{which}: this rank holds shape {tuple(param.shape)} but the TP slice of the full"
            f" tensor {tuple(full.shape)} has {tuple(shard.shape)}"
        )
    param.copy_(shard)


def site_meta(site: Site, adapter: str) -> tuple[int, float, float, float]:
    layer = site.module
    dropout = layer.lora_dropout[adapter]
    p = float(dropout.p) if isinstance(dropout, torch.nn.Dropout) else 0.0
    return int(layer.r[adapter]), float(layer.lora_alpha[adapter]), float(layer.scaling[adapter]), p


def is_rank0() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0
