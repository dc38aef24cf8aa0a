"""Insert LoRA adapters into the targeted linears of GPTModel chunks, and count what trains."""

from __future__ import annotations

import fnmatch
import math
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from megatron.core import tensor_parallel

from verl_config.lora import HF_TO_MCORE, MCORE_LINEAR_MODULES, LoraConfig, translate_target_modules
from verl_mcore_utils.lora.layer import DEFAULT_ADAPTER_NAME, is_lora_layer, lora_layer_class
from verl_mcore_utils.lora.sites import Site, all_sites, lora_sites, set_full
from verl_mcore_utils.weights import unwrap_model_chunks

_INIT_NORMAL_STD = 0.2  # Megatron-Bridge's "normal" LoRA init


def as_lora_config(lora: LoraConfig | Mapping[str, Any]) -> LoraConfig:
    if isinstance(lora, LoraConfig):
        return lora
    if isinstance(lora, Mapping):
        return LoraConfig(**dict(lora))
    raise TypeError(
        f"expected a verl_config.LoraConfig or a mapping of its fields, got {type(lora).__name__}"
    )


def _excluded(site: Site, exclude: Sequence[str]) -> bool:
    for entry in exclude:
        if entry in MCORE_LINEAR_MODULES:
            if site.attr == entry:
                return True
        elif entry in HF_TO_MCORE:
            if site.attr == HF_TO_MCORE[entry]:
                return True
        elif fnmatch.fnmatchcase(site.name, entry):
            return True
    return False


def _check_exclude_names(exclude: Sequence[str]) -> None:
    """HF names in exclude_modules must name whole fused groups (like target_modules)."""
    hf = [e for e in exclude if e in HF_TO_MCORE]
    if hf:
        translate_target_modules(hf, engine="megatron", key="exclude_modules")


def _dtype(name: str | None) -> torch.dtype | None:
    return None if name is None else getattr(torch, name)


def _seed_for(seed: int, name: str) -> int:
    return (seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63)


def _init_full(shape: tuple[int, int], method: str, generator: torch.Generator) -> torch.Tensor:
    t = torch.empty(shape, dtype=torch.float32)
    if method == "zero":
        return t.zero_()
    if method == "xavier":
        return torch.nn.init.xavier_normal_(t, generator=generator)
    if method == "normal":
        return torch.nn.init.normal_(t, mean=0.0, std=_INIT_NORMAL_STD, generator=generator)
    if method == "kaiming":
        return torch.nn.init.kaiming_uniform_(t, a=math.sqrt(5), generator=generator)
    raise ValueError(f"unknown LoRA init method {method!r}; choose xavier, normal, kaiming or zero")


def apply_lora(
    model_chunks: torch.nn.Module | Sequence[torch.nn.Module],
    lora: LoraConfig | Mapping[str, Any],
    *,
    seed: int = 0,
    adapter_name: str = DEFAULT_ADAPTER_NAME,
) -> list[str]:
    """Wrap the targeted linears of (unwrapped or wrapped) GPTModel chunks in LoRA layers; freeze the rest.

    Targets: ``lora.target_modules`` (megatron-core or HF names, or ``all-linear``) minus
    ``lora.exclude_modules`` -- a megatron-core / HF linear name excludes that linear in every layer, any
    other entry is an ``fnmatch`` pattern over global megatron names such as
    ``decoder.layers.3.mlp.linear_fc1`` (``decoder.layers.0.*`` excludes layer 0). Adapters are initialised
    with ``lora.lora_A_init_method`` / ``lora_B_init_method`` on the full tensors (seeded by ``seed`` and the
    module name), stored in ``lora.dtype`` (default: the base weight's dtype; Float16Module later casts them
    to the model's bf16/fp16 anyway). Afterwards only adapter parameters (and a critic's value head) have
    ``requires_grad``. Returns the global names of the adapted modules of this rank.
    """
    lora = as_lora_config(lora)
    if not lora.enabled:
        raise ValueError("lora.rank is 0 (LoRA is off); set lora.rank > 0 to insert adapters")
    if lora.type != "lora":
        raise NotImplementedError(
            f"lora.type={lora.type!r} is not supported with peft on megatron-core: only 'lora' (one adapter per"
            " fused megatron linear). canonical_lora (separate q/k/v adapters) and dora need Megatron-Bridge."
        )
    targets = translate_target_modules(lora.target_modules, engine="megatron")
    _check_exclude_names(lora.exclude_modules)
    by_name = {HF_TO_MCORE.get(e, e) for e in lora.exclude_modules}
    if not [t for t in targets if t not in by_name]:
        # (pattern exclusions are not checked: a pipeline stage may legitimately hold no adapted layer)
        raise ValueError(f"exclude_modules={lora.exclude_modules} removes every target_modules={targets}")
    cls = lora_layer_class()
    chunks = unwrap_model_chunks(model_chunks)
    dtype = _dtype(lora.dtype)
    adapted: list[str] = []
    for site in all_sites(chunks):
        if site.attr not in targets or _excluded(site, lora.exclude_modules):
            continue
        base = site.module
        if is_lora_layer(base):
            raise ValueError(f"{site.name} already has LoRA adapters; apply LoRA once")
        if not isinstance(base, (tensor_parallel.ColumnParallelLinear, tensor_parallel.RowParallelLinear)):
            raise TypeError(
                f"{site.name} is a {type(base).__name__}; LoRA here wraps megatron-core's ColumnParallelLinear /"
                " RowParallelLinear only (the local layer spec). Transformer Engine linears are not supported."
            )
        layer = cls(
            base,
            adapter_name,
            r=lora.rank,
            lora_alpha=lora.alpha,
            lora_dropout=lora.dropout,
            megatron_config=base.config,
            dropout_position=lora.dropout_position,
        )
        setattr(site.parent, site.attr, layer)
        site.module = layer
        for which, method in (("A", lora.lora_A_init_method), ("B", lora.lora_B_init_method)):
            shape = (lora.rank, layer.in_features) if which == "A" else (layer.out_features, lora.rank)
            generator = torch.Generator().manual_seed(_seed_for(seed, f"{site.name}.lora_{which}"))
            set_full(site, which, adapter_name, _init_full(shape, method, generator))
        if dtype is not None:
            layer.lora_A[adapter_name].to(dtype=dtype)
            layer.lora_B[adapter_name].to(dtype=dtype)
        adapted.append(site.name)
    _freeze_base(chunks)
    return adapted


def _freeze_base(chunks: Sequence[torch.nn.Module]) -> None:
    keep: set[int] = {id(p) for _, p in adapter_named_parameters(chunks)}
    for chunk in chunks:
        head = getattr(chunk, "output_layer", None)
        if type(head).__name__ == "ValueHead":  # a critic's fresh value head must train with the adapters
            keep.update(id(p) for p in head.parameters())  # type: ignore[union-attr]  # not None: a ValueHead
    for chunk in chunks:
        for param in chunk.parameters():
            param.requires_grad_(id(param) in keep)


def adapter_named_parameters(
    model_chunks: torch.nn.Module | Sequence[torch.nn.Module],
) -> list[tuple[str, torch.nn.Parameter]]:
    """Every LoRA parameter of this rank's chunks, named by global layer index (unique across chunks).

    E.g. ``decoder.layers.3.self_attention.linear_qkv.lora_A.default.weight``; the tensors are this
    rank's TP shards.
    """
    out: list[tuple[str, torch.nn.Parameter]] = []
    for site in lora_sites(unwrap_model_chunks(model_chunks)):
        for kind in ("lora_A", "lora_B"):
            for adapter, module in getattr(site.module, kind).items():
                for pname, param in module.named_parameters():
                    out.append((f"{site.name}.{kind}.{adapter}.{pname}", param))
    return out


@dataclass(frozen=True)
class AdapterStats:
    """Parameter counts of this rank's chunks (TP shards / PP stage as held here)."""

    adapted_modules: int
    trainable_params: int
    total_params: int

    @property
    def trainable_percent(self) -> float:
        return 100.0 * self.trainable_params / max(self.total_params, 1)

    def __str__(self) -> str:
        return (
            f"LoRA: {self.adapted_modules} adapted linears; trainable params: {self.trainable_params:,} ||"
            f" all params: {self.total_params:,} || trainable%: {self.trainable_percent:.4f} (this rank)"
        )


def adapter_stats(model_chunks: torch.nn.Module | Sequence[torch.nn.Module]) -> AdapterStats:
    """Adapted linears, trainable and total parameter counts of this rank (like peft's print_trainable_parameters)."""
    chunks = unwrap_model_chunks(model_chunks)
    params = {id(p): p for c in chunks for p in c.parameters()}.values()
    return AdapterStats(
        adapted_modules=len(lora_sites(chunks)),
        trainable_params=sum(p.numel() for p in params if p.requires_grad),
        total_params=sum(p.numel() for p in params),
    )
