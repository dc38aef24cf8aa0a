"""LoRA on megatron-core GPT models with Hugging Face ``peft``, applied before DDP, saved in HF PEFT format.

:func:`peft_pre_wrap_hook` (a pre-wrap hook for :func:`verl_mcore_utils.module.make_megatron_module`) adapts the
megatron linears named by the LoRA block before Float16Module / DDP, so DDP and the optimizer only see adapter
parameters; :func:`save_hf_adapter` / :func:`load_hf_adapter` write and read Hugging Face PEFT checkpoints across
TP / PP; :func:`without_adapters`, :func:`export_merged_hf_weights`, :func:`adapter_named_parameters`,
:func:`adapter_stats`. peft's own ``LoraParallelLinear`` is built directly (:class:`MegatronLoraParallelLinear`)
because peft's megatron route fails on a GPTModel. The README's design notes give the rules for fused
projections and tensor parallelism, the peft defects worked around, and what is refused.
"""

from __future__ import annotations

import contextlib
import copy
import fnmatch
import functools
import importlib.metadata
import inspect
import json
import math
import os
import re
import zlib
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import parallel_state, tensor_parallel

from verl_config.lora import HF_TO_MCORE, MCORE_LINEAR_MODULES, LoraConfig, translate_target_modules
from verl_mcore_utils.weights import (
    LAYER_MODULE_MAP,
    HFDims,
    export_hf_weights,
    merge_gate_up,
    merge_qkv,
    split_gate_up,
    split_qkv,
    unwrap_model_chunks,
)

__all__ = [
    "DEFAULT_ADAPTER_NAME",
    "VERIFIED_PEFT_VERSIONS",
    "AdapterStats",
    "LoraPreWrapHook",
    "adapter_named_parameters",
    "adapter_stats",
    "adapters_disabled",
    "apply_lora",
    "export_hf_adapter",
    "export_hf_adapter_with_config",
    "export_merged_hf_weights",
    "is_lora_layer",
    "load_hf_adapter",
    "peft_pre_wrap_hook",
    "save_hf_adapter",
    "without_adapters",
]

DEFAULT_ADAPTER_NAME = "default"  # peft's adapter name; HF adapter files carry no name
VERIFIED_PEFT_VERSIONS: tuple[str, ...] = ("0.17.0", "0.18.1", "0.21.2")
_MIN_PEFT = (0, 17)

ADAPTER_CONFIG_NAME = "adapter_config.json"
ADAPTER_WEIGHTS_NAME = "adapter_model.safetensors"
_HF_PREFIX = "base_model.model."
# megatron linear (last name part) -> how its fused rows split into HF modules
_FUSION = {"linear_qkv": "qkv", "linear_fc1": "gate_up", "linear_proj": "none", "linear_fc2": "none"}
_INIT_NORMAL_STD = 0.2  # Megatron-Bridge's "normal" LoRA init


# --------------------------------------------------------------------------------------------------
# peft, imported lazily
# --------------------------------------------------------------------------------------------------


def _import_peft() -> Any:
    try:
        import peft
    except ImportError as err:
        raise ImportError(
            "LoRA on megatron-core needs Hugging Face peft: pip install 'verl-mcore-utils[peft]'"
            f" (peft>={_MIN_PEFT[0]}.{_MIN_PEFT[1]}); import failed with: {err}"
        ) from err
    version = importlib.metadata.version("peft")
    parts = tuple(int(p) for p in re.findall(r"\d+", version)[:2])
    if parts < _MIN_PEFT:
        raise ImportError(
            f"peft {version} is too old for verl_mcore_utils.lora; need peft>={_MIN_PEFT[0]}.{_MIN_PEFT[1]}"
            f" (checked: {', '.join(VERIFIED_PEFT_VERSIONS)})"
        )
    return peft


def _first(output: Any) -> torch.Tensor:
    """megatron's parallel linears return ``(output, bias)``; ``nn.Linear`` returns the tensor."""
    return output[0] if isinstance(output, tuple) else output


@functools.cache
def _lora_layer_class() -> type:
    """Build :class:`MegatronLoraParallelLinear` on first use (so that importing this module needs no peft)."""
    peft = _import_peft()
    from peft.tuners.lora.tp_layer import LoraParallelLinear

    takes_config = "config" in inspect.signature(LoraParallelLinear.__init__).parameters

    class MegatronLoraParallelLinear(LoraParallelLinear):  # type: ignore[misc, valid-type]
        """peft's ``LoraParallelLinear`` with the fixes listed in the module docstring.

        ``lora_A[adapter]`` / ``lora_B[adapter]`` are megatron Row/ColumnParallelLinear or ``nn.Linear``
        modules as peft builds them; ``scaling[adapter] = lora_alpha / r``; ``forward`` returns megatron's
        ``(output, bias)`` pair like the base layer.
        """

        def __init__(
            self,
            base_layer: torch.nn.Module,
            adapter_name: str,
            *,
            r: int,
            lora_alpha: float,
            lora_dropout: float,
            megatron_config: Any,
            dropout_position: str = "pre",
        ) -> None:
            if dropout_position not in ("pre", "post"):
                raise ValueError(f"dropout_position must be 'pre' or 'post'; got {dropout_position!r}")
            # A private copy: peft's update_layer overwrites params_dtype on the config it is given. The
            # adapters are initialised by apply_lora, so megatron's own init is skipped.
            config = copy.copy(megatron_config)
            config.perform_initialization = False
            common = {"backend": tensor_parallel, "r": r, "lora_alpha": lora_alpha, "megatron_config": config}
            if takes_config:  # peft >= 0.19
                peft_config = peft.LoraConfig(
                    r=r, lora_alpha=lora_alpha, lora_dropout=lora_dropout, init_lora_weights=False
                )
                super().__init__(base_layer, adapter_name, config=peft_config, **common)
            else:  # peft 0.17 - 0.18
                super().__init__(
                    base_layer, adapter_name, lora_dropout=lora_dropout, init_lora_weights=False, **common
                )
            self.dropout_position = dropout_position

        def update_layer(self, adapter_name: str, *args: Any, **kwargs: Any) -> None:
            # peft's parallel layer never fills lora_bias, which its shared LoraLayer code reads.
            self.lora_bias[adapter_name] = False
            super().update_layer(adapter_name, *args, **kwargs)

        def forward(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, Any]:
            if kwargs.pop("adapter_names", None) is not None:
                raise ValueError(
                    f"{type(self).__name__} does not support mixed-adapter batches (adapter_names)"
                )
            if self.disable_adapters:
                if self.merged:
                    self.unmerge()
                return self.base_layer(x, *args, **kwargs)
            result, bias = self.base_layer(x, *args, **kwargs)
            if self.merged:
                return result, bias
            result_dtype = result.dtype
            gather = kwargs.get("runtime_gather_output")
            for name in self.active_adapters:
                if name not in self.lora_A:
                    continue
                lora_A, lora_B = self.lora_A[name], self.lora_B[name]
                dropout = self.lora_dropout[name]
                h = x.to(lora_A.weight.dtype)
                if self.dropout_position == "pre":
                    h = dropout(h)
                h = _first(lora_A(h))
                if gather is not None and not self.is_parallel_a:  # lora_B is column-parallel like the base
                    h = _first(lora_B(h, runtime_gather_output=gather))
                else:
                    h = _first(lora_B(h))
                if self.dropout_position == "post":
                    h = dropout(h)
                result = result + h * self.scaling[name]
            return result.to(result_dtype), bias

        def sharded_state_dict(self, *args: Any, **kwargs: Any) -> Any:
            raise NotImplementedError(
                "megatron distributed checkpointing of LoRA-wrapped linears is not supported; save the adapters"
                " with verl_mcore_utils.lora.save_hf_adapter (the base weights are frozen: reload them from the"
                " Hugging Face checkpoint)"
            )

        def __repr__(self) -> str:
            return "megatron_" + super().__repr__()

    MegatronLoraParallelLinear.__module__ = __name__
    MegatronLoraParallelLinear.__qualname__ = "MegatronLoraParallelLinear"
    return MegatronLoraParallelLinear


def __getattr__(name: str) -> Any:
    if name == "MegatronLoraParallelLinear":
        return _lora_layer_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def is_lora_layer(module: torch.nn.Module) -> bool:
    """True for a linear wrapped by :func:`apply_lora` (needs no peft import when there is none)."""
    if type(module).__name__ != "MegatronLoraParallelLinear":
        return False
    return isinstance(module, _lora_layer_class())


# --------------------------------------------------------------------------------------------------
# Where adapters go
# --------------------------------------------------------------------------------------------------


@dataclass
class _Site:
    """One adaptable megatron linear of a decoder layer, by global layer index."""

    layer: int  # global 0-based
    suffix: str  # inside the TransformerLayer, e.g. "self_attention.linear_qkv"
    parent: torch.nn.Module
    attr: str
    module: torch.nn.Module

    @property
    def name(self) -> str:
        return f"decoder.layers.{self.layer}.{self.suffix}"

    @property
    def fusion(self) -> str:
        return _FUSION[self.attr]

    @property
    def hf_modules(self) -> tuple[str, ...]:
        return tuple(f"model.layers.{self.layer}.{h}" for h in LAYER_MODULE_MAP[self.suffix])


def _sites(chunks: Sequence[torch.nn.Module]) -> list[_Site]:
    out: list[_Site] = []
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
                    out.append(_Site(index, suffix, parent, attr, module))
    return out


def _lora_sites(chunks: Sequence[torch.nn.Module]) -> list[_Site]:
    return [s for s in _sites(chunks) if is_lora_layer(s.module)]


def _as_lora_config(lora: LoraConfig | Mapping[str, Any]) -> LoraConfig:
    if isinstance(lora, LoraConfig):
        return lora
    if isinstance(lora, Mapping):
        return LoraConfig(**dict(lora))
    raise TypeError(
        f"expected a verl_config.LoraConfig or a mapping of its fields, got {type(lora).__name__}"
    )


def _excluded(site: _Site, exclude: Sequence[str]) -> bool:
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


# --------------------------------------------------------------------------------------------------
# Process groups and TP slicing
# --------------------------------------------------------------------------------------------------


def _tp() -> tuple[int, int, Any]:
    if not parallel_state.model_parallel_is_initialized():
        return 0, 1, None
    return (
        parallel_state.get_tensor_model_parallel_rank(),
        parallel_state.get_tensor_model_parallel_world_size(),
        parallel_state.get_tensor_model_parallel_group(),
    )


def _pp() -> tuple[int, Any]:
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


def _shard(full: torch.Tensor, site: _Site, which: str, rank: int, size: int) -> torch.Tensor:
    dim = _tp_dim(site.module, which)
    if dim is None or size == 1:
        return full
    if full.shape[dim] % size:
        raise ValueError(
            f"{site.name} lora_{which}: dim {dim} of {tuple(full.shape)} is not divisible by TP={size}"
        )
    if dim == 0 and site.fusion == "gate_up":
        gate, up = split_gate_up(full)
        return merge_gate_up(gate.chunk(size, dim=0)[rank], up.chunk(size, dim=0)[rank])
    return full.chunk(size, dim=dim)[rank]


def _unshard(parts: Sequence[torch.Tensor], site: _Site, which: str) -> torch.Tensor:
    dim = _tp_dim(site.module, which)
    if dim is None or len(parts) == 1:
        return parts[0]
    if dim == 0 and site.fusion == "gate_up":
        halves = [split_gate_up(p) for p in parts]
        return merge_gate_up(torch.cat([h[0] for h in halves]), torch.cat([h[1] for h in halves]))
    return torch.cat(list(parts), dim=dim)


def _full_tensor(site: _Site, which: str, adapter: str) -> torch.Tensor:
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
def _set_full(site: _Site, which: str, adapter: str, full: torch.Tensor) -> None:
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


# --------------------------------------------------------------------------------------------------
# Injection
# --------------------------------------------------------------------------------------------------


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
    lora = _as_lora_config(lora)
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
    cls = _lora_layer_class()
    chunks = unwrap_model_chunks(model_chunks)
    dtype = _dtype(lora.dtype)
    adapted: list[str] = []
    all_sites = _sites(chunks)
    for site in all_sites:
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
            _set_full(site, which, adapter_name, _init_full(shape, method, generator))
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
            keep.update(id(p) for p in head.parameters())
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
    for site in _lora_sites(unwrap_model_chunks(model_chunks)):
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
        adapted_modules=len(_lora_sites(chunks)),
        trainable_params=sum(p.numel() for p in params if p.requires_grad),
        total_params=sum(p.numel() for p in params),
    )


def _is_rank0() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


@dataclass
class LoraPreWrapHook:
    """The pre-wrap hook: ``hook(chunks) -> chunks``; see :func:`peft_pre_wrap_hook`."""

    lora: LoraConfig
    adapter_path: str | os.PathLike[str] | None = None
    hf_config: Any = None
    seed: int = 0
    adapter_name: str = DEFAULT_ADAPTER_NAME
    verbose: bool = True

    def __call__(self, chunks: list[torch.nn.Module]) -> list[torch.nn.Module]:
        apply_lora(chunks, self.lora, seed=self.seed, adapter_name=self.adapter_name)
        path = self.adapter_path if self.adapter_path is not None else self.lora.adapter_path
        if path is not None:
            load_hf_adapter(chunks, path, hf_config=self.hf_config, adapter_name=self.adapter_name)
        if self.verbose and _is_rank0():
            sites = _lora_sites(unwrap_model_chunks(chunks))
            detail = ""
            if sites:
                r, alpha, scaling, _ = _site_meta(sites[0], self.adapter_name)
                detail = f" [rank={r}, alpha={alpha:g}, scale={scaling:g}"
                detail += f", adapter loaded from {os.fspath(path)}]" if path is not None else "]"
            print(f"{adapter_stats(chunks)}{detail}", flush=True)
        return chunks


def peft_pre_wrap_hook(
    lora: LoraConfig | Mapping[str, Any],
    *,
    adapter_path: str | os.PathLike[str] | None = None,
    hf_config: Mapping[str, Any] | Any = None,
    seed: int = 0,
    adapter_name: str = DEFAULT_ADAPTER_NAME,
    verbose: bool = True,
) -> LoraPreWrapHook:
    """A ``make_megatron_module`` pre-wrap hook that inserts LoRA adapters (see :func:`apply_lora`).

    ``lora`` is the canonical LoRA block (``verl_config.LoraConfig``) or a mapping of its fields.
    ``adapter_path`` (default ``lora.adapter_path``) is a Hugging Face PEFT adapter directory loaded after
    insertion (:func:`load_hf_adapter`; ``hf_config`` is only needed there and defaults to the sizes in the
    model's TransformerConfig). On global rank 0 the adapter statistics are printed unless ``verbose=False``.
    ``lora.merge`` is not used here: it concerns weight sync, see :func:`export_merged_hf_weights`.
    """
    return LoraPreWrapHook(
        lora=_as_lora_config(lora),
        adapter_path=adapter_path,
        hf_config=hf_config,
        seed=seed,
        adapter_name=adapter_name,
        verbose=verbose,
    )


# --------------------------------------------------------------------------------------------------
# Hugging Face PEFT format
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _QKV:
    num_heads: int
    num_query_groups: int
    head_dim: int


def _qkv_dims(hf_config: Any, chunks: Sequence[torch.nn.Module]) -> _QKV:
    if hf_config is not None:
        d = hf_config if isinstance(hf_config, HFDims) else HFDims.from_hf_config(hf_config)
        return _QKV(d.num_heads, d.num_query_groups, d.head_dim)
    tf = chunks[0].config
    heads = int(tf.num_attention_heads)
    return _QKV(heads, int(tf.num_query_groups or heads), int(tf.kv_channels))


def _hf_parts(site: _Site, full_b: torch.Tensor, dims: _QKV) -> Sequence[torch.Tensor]:
    if site.fusion == "qkv":
        return split_qkv(
            full_b, num_heads=dims.num_heads, num_query_groups=dims.num_query_groups, head_dim=dims.head_dim
        )
    if site.fusion == "gate_up":
        return split_gate_up(full_b)
    return (full_b,)


def _hf_key(module: str, which: str) -> str:
    return f"{_HF_PREFIX}{module}.lora_{which}.weight"


def _site_meta(site: _Site, adapter: str) -> tuple[int, float, float, float]:
    layer = site.module
    dropout = layer.lora_dropout[adapter]
    p = float(dropout.p) if isinstance(dropout, torch.nn.Dropout) else 0.0
    return int(layer.r[adapter]), float(layer.lora_alpha[adapter]), float(layer.scaling[adapter]), p


def _export(
    model_chunks: torch.nn.Module | Sequence[torch.nn.Module], hf_config: Any, adapter_name: str
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    chunks = unwrap_model_chunks(model_chunks)
    dims = _qkv_dims(hf_config, chunks)
    sites = _lora_sites(chunks)
    tensors: dict[str, torch.Tensor] = {}
    metas: set[tuple[int, float, float, float]] = set()
    for site in sites:
        if adapter_name not in site.module.lora_A:
            raise ValueError(f"{site.name} has no adapter named {adapter_name!r}")
        metas.add(_site_meta(site, adapter_name))
        full_a = _full_tensor(site, "A", adapter_name)
        full_b = _full_tensor(site, "B", adapter_name)
        for module, b in zip(site.hf_modules, _hf_parts(site, full_b, dims), strict=True):
            tensors[_hf_key(module, "A")] = full_a.to("cpu", copy=True).contiguous()
            tensors[_hf_key(module, "B")] = b.to("cpu", copy=True).contiguous()
    pp_size, pp_group = _pp()
    if pp_size > 1:
        gathered: list[Any] = [None] * pp_size
        dist.all_gather_object(gathered, (tensors, metas), group=pp_group)
        tensors, metas = {}, set()
        for stage_tensors, stage_metas in gathered:
            overlap = set(tensors) & set(stage_tensors)
            if overlap:
                raise ValueError(f"adapter tensors held by two pipeline stages: {sorted(overlap)[:4]}")
            tensors.update(stage_tensors)
            metas |= stage_metas
    if not tensors:
        raise ValueError("the model has no LoRA adapters (apply_lora / peft_pre_wrap_hook first)")
    if len(metas) != 1:
        raise ValueError(
            f"adapters differ in (rank, alpha, scaling, dropout) across modules: {sorted(metas)}; the PEFT export"
            " needs one rank and alpha for the whole model"
        )
    r, alpha, scaling, dropout = metas.pop()
    if not math.isclose(scaling, alpha / r, rel_tol=1e-12):
        raise ValueError(
            f"adapter scaling {scaling} is not alpha / r = {alpha / r} (rsLoRA is not supported)"
        )
    layer_of = {k: int(k.split(".")[4]) for k in tensors}
    ordered = dict(sorted(tensors.items(), key=lambda kv: (layer_of[kv[0]], kv[0])))
    return ordered, {"r": r, "lora_alpha": alpha, "lora_dropout": dropout}


def export_hf_adapter(
    model_chunks: torch.nn.Module | Sequence[torch.nn.Module],
    *,
    hf_config: Mapping[str, Any] | Any = None,
    adapter_name: str = DEFAULT_ADAPTER_NAME,
) -> dict[str, torch.Tensor]:
    """The adapter as Hugging Face PEFT tensors (CPU copies) on every rank; a collective over TP and PP.

    Keys as in ``adapter_model.safetensors``: ``base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight``
    etc. q/k/v (gate/up) get the fused module's ``lora_A`` each and their rows of its ``lora_B``.
    ``hf_config`` gives the head layout (default: the model's TransformerConfig).
    """
    return _export(model_chunks, hf_config, adapter_name)[0]


def _target_modules(names: set[str], num_layers: int) -> list[str] | str:
    """A short-name list when every layer has the same adapted projections, else an exact-match regex."""
    short = sorted({n.rsplit(".", 1)[1] for n in names})
    suffixes = {n.split(".", 3)[3] for n in names}
    full = {f"model.layers.{i}.{s}" for i in range(num_layers) for s in suffixes}
    if full == names and len(short) == len(suffixes):
        return short
    return "|".join(re.escape(n) for n in sorted(names))


def save_hf_adapter(
    model_chunks: torch.nn.Module | Sequence[torch.nn.Module],
    path: str | os.PathLike[str],
    *,
    hf_config: Mapping[str, Any] | Any = None,
    lora: LoraConfig | Mapping[str, Any] | None = None,
    base_model_name_or_path: str | None = None,
    adapter_name: str = DEFAULT_ADAPTER_NAME,
) -> Path:
    """Save the adapter in Hugging Face PEFT format; every rank must call, global rank 0 writes.

    Writes ``adapter_config.json`` (peft's own ``LoraConfig`` serialisation; rank, alpha and dropout from
    the model; ``target_modules`` in HF names) and ``adapter_model.safetensors``. ``lora``, when given, is
    checked against the model's rank and alpha. ``base_model_name_or_path`` defaults to the HF config's
    ``_name_or_path``. Returns ``path`` after a barrier. A critic's value head (trainable, see
    :func:`apply_lora`) is not part of the PEFT adapter and is not saved here.
    """
    tensors, meta = _export(model_chunks, hf_config, adapter_name)
    if lora is not None:
        lora = _as_lora_config(lora)
        if (lora.rank, float(lora.alpha)) != (meta["r"], meta["lora_alpha"]):
            raise ValueError(
                f"the model's adapters have rank {meta['r']}, alpha {meta['lora_alpha']}; lora says rank"
                f" {lora.rank}, alpha {lora.alpha}"
            )
    path = Path(path)
    if _is_rank0():
        from safetensors.torch import save_file

        config = _peft_config(model_chunks, tensors, meta, hf_config, base_model_name_or_path)
        path.mkdir(parents=True, exist_ok=True)
        save_file(tensors, str(path / ADAPTER_WEIGHTS_NAME), metadata={"format": "pt"})
        config.save_pretrained(str(path))
    if dist.is_initialized():
        dist.barrier()
    return path


def _peft_config(
    model_chunks: torch.nn.Module | Sequence[torch.nn.Module],
    tensors: Mapping[str, torch.Tensor],
    meta: Mapping[str, Any],
    hf_config: Mapping[str, Any] | Any,
    base_model_name_or_path: str | None,
) -> Any:
    """peft's own ``LoraConfig`` for exported adapter tensors (HF module names, one rank / alpha)."""
    peft = _import_peft()
    chunks = unwrap_model_chunks(model_chunks)
    num_layers = int(chunks[0].config.num_layers)
    modules = {k.removeprefix(_HF_PREFIX).rsplit(".", 2)[0] for k in tensors}
    if base_model_name_or_path is None and hf_config is not None:
        name = getattr(hf_config, "_name_or_path", None)
        if name is None and isinstance(hf_config, Mapping):
            name = hf_config.get("_name_or_path")
        base_model_name_or_path = name or None
    alpha = meta["lora_alpha"]
    return peft.LoraConfig(
        task_type="CAUSAL_LM",
        r=meta["r"],
        lora_alpha=int(alpha) if float(alpha).is_integer() else alpha,
        lora_dropout=meta["lora_dropout"],
        target_modules=_target_modules(modules, num_layers),
        bias="none",
        base_model_name_or_path=base_model_name_or_path,
    )


def export_hf_adapter_with_config(
    model_chunks: torch.nn.Module | Sequence[torch.nn.Module],
    *,
    hf_config: Mapping[str, Any] | Any = None,
    base_model_name_or_path: str | None = None,
    adapter_name: str = DEFAULT_ADAPTER_NAME,
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """:func:`export_hf_adapter` plus the adapter's PEFT config as a JSON-able dict (what
    ``adapter_config.json`` holds): what a rollout engine that serves LoRA (vLLM) needs to load the adapter
    without a file. A collective over TP and PP like :func:`export_hf_adapter`.
    """
    tensors, meta = _export(model_chunks, hf_config, adapter_name)
    config = _peft_config(model_chunks, tensors, meta, hf_config, base_model_name_or_path)
    as_dict = {
        k: sorted(v) if isinstance(v, (set, frozenset)) else v
        for k, v in config.to_dict().items()
        if not callable(v)
    }
    return tensors, json.loads(json.dumps(as_dict, default=str))


@contextlib.contextmanager
def adapters_disabled(model_chunks: torch.nn.Module | Sequence[torch.nn.Module]) -> Iterator[None]:
    """Run the model without its LoRA adapters (peft's adapter switch), e.g. a reference policy that is
    the actor's base model. Unlike :func:`without_adapters` the parameter names stay those of the LoRA
    model. ``requires_grad`` of every parameter is what it was before, also on error (peft's switch
    changes it).
    """
    chunks = unwrap_model_chunks(model_chunks)
    sites = _lora_sites(chunks)
    trainable = {id(p): p.requires_grad for c in chunks for p in c.parameters()}
    for site in sites:
        site.module.enable_adapters(False)
    try:
        yield
    finally:
        for site in sites:
            site.module.enable_adapters(True)
        for chunk in chunks:
            for p in chunk.parameters():
                p.requires_grad_(trainable[id(p)])


_KEY = re.compile(r"^(?:base_model\.model\.)?(model\.layers\.(\d+)\..+)\.lora_([AB])(?:\.[^.]+)?\.weight$")


def _read_adapter(path: Path) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    config_file = path / ADAPTER_CONFIG_NAME
    weights_file = path / ADAPTER_WEIGHTS_NAME
    if not config_file.exists():
        raise FileNotFoundError(
            f"{str(config_file)!r} does not exist (not a Hugging Face PEFT adapter directory?)"
        )
    if not weights_file.exists():
        other = sorted(p.name for p in path.glob("adapter_model.*"))
        raise FileNotFoundError(
            f"{str(weights_file)!r} does not exist"
            + (f" (found {other}; only safetensors is read)" if other else "")
        )
    from safetensors.torch import load_file

    return json.loads(config_file.read_text()), load_file(str(weights_file))


def _check_adapter_config(config: Mapping[str, Any], path: Path) -> tuple[int, float]:
    problems = []
    if config.get("peft_type", "LORA") != "LORA":
        problems.append(f"peft_type={config.get('peft_type')!r} (only LORA)")
    for key, ok in (
        ("use_dora", False),
        ("use_rslora", False),
        ("fan_in_fan_out", False),
    ):
        if bool(config.get(key, ok)) != ok:
            problems.append(f"{key}={config.get(key)!r}")
    if config.get("bias", "none") != "none":
        problems.append(f"bias={config.get('bias')!r} (only 'none')")
    for key in ("rank_pattern", "alpha_pattern"):
        if config.get(key):
            problems.append(f"{key}={config.get(key)!r} (one rank and alpha for every module)")
    if config.get("modules_to_save"):
        problems.append(f"modules_to_save={config.get('modules_to_save')!r}")
    if problems:
        raise ValueError(
            f"adapter {str(path)!r} cannot be loaded into a megatron LoRA model: {'; '.join(problems)}"
        )
    return int(config["r"]), float(config["lora_alpha"])


@torch.no_grad()
def load_hf_adapter(
    model_chunks: torch.nn.Module | Sequence[torch.nn.Module],
    path: str | os.PathLike[str],
    *,
    hf_config: Mapping[str, Any] | Any = None,
    adapter_name: str = DEFAULT_ADAPTER_NAME,
) -> None:
    """Load a Hugging Face PEFT LoRA adapter into a model that already has adapters (:func:`apply_lora`).

    The inverse of :func:`save_hf_adapter`: q/k/v (gate/up) are fused back, which needs their ``lora_A``
    to be identical (a fused megatron linear has ONE ``lora_A``); otherwise a ValueError explains why.
    Strict: each adapted linear of this rank must find all its HF tensors, and an HF tensor of a layer held
    here must belong to an adapted linear. The adapter's rank must equal the model's; its alpha replaces the
    model's (scaling = alpha / r). Each rank reads the files and keeps its own TP slices (no communication).
    """
    path = Path(path)
    config, raw = _read_adapter(path)
    r, alpha = _check_adapter_config(config, path)
    chunks = unwrap_model_chunks(model_chunks)
    sites = _lora_sites(chunks)
    if not sites:
        raise ValueError("the model has no LoRA adapters; apply_lora / peft_pre_wrap_hook before loading one")
    dims = _qkv_dims(hf_config, chunks)
    by_module: dict[str, dict[str, torch.Tensor]] = {}
    bad_keys = []
    for key, tensor in raw.items():
        match = _KEY.match(key)
        if match is None:
            bad_keys.append(key)
            continue
        by_module.setdefault(match.group(1), {})[match.group(3)] = tensor
    if bad_keys:
        raise ValueError(
            f"adapter {str(path)!r} has tensors that are not LoRA A/B of decoder layers: {bad_keys[:6]}"
        )
    local_layers = {layer.layer_number - 1 for c in chunks for layer in getattr(c, "decoder", c).layers}
    expected = {m for s in sites for m in s.hf_modules}
    unexpected = sorted(m for m in by_module if int(m.split(".")[2]) in local_layers and m not in expected)
    missing = sorted(f"{m}.lora_{w}" for m in expected for w in "AB" if w not in by_module.get(m, {}))
    if unexpected or missing:
        parts = []
        if missing:
            parts.append(f"missing: {missing[:6]}" + (f" ... ({len(missing)})" if len(missing) > 6 else ""))
        if unexpected:
            parts.append(
                f"adapters for linears that have no LoRA here: {unexpected[:6]}"
                + (f" ... ({len(unexpected)})" if len(unexpected) > 6 else "")
            )
        raise ValueError(f"adapter {str(path)!r} does not match the model's LoRA layers: {'; '.join(parts)}")
    for site in sites:
        layer = site.module
        if int(layer.r[adapter_name]) != r:
            raise ValueError(
                f"adapter rank {r} != the model's LoRA rank {layer.r[adapter_name]} ({site.name})"
            )
        a_parts = [by_module[m]["A"] for m in site.hf_modules]
        b_parts = [by_module[m]["B"] for m in site.hf_modules]
        first = a_parts[0]
        if any(a.shape != first.shape or not torch.equal(a, first) for a in a_parts[1:]):
            names = ", ".join(m.rsplit(".", 1)[1] for m in site.hf_modules)
            raise ValueError(
                f"{site.name}: the adapter's {names} (layer {site.layer}) have different lora_A. megatron-core fuses"
                f" them into one {site.attr} with ONE lora_A, so it can only hold Hugging Face adapters whose"
                f" {names} share lora_A (as adapters written by save_hf_adapter do). This adapter was probably"
                " trained on the separate Hugging Face projections; merge it into the base weights instead"
                " (peft merge_and_unload) or train it on megatron."
            )
        if site.fusion == "qkv":
            full_b = merge_qkv(
                *b_parts,
                num_heads=dims.num_heads,
                num_query_groups=dims.num_query_groups,
                head_dim=dims.head_dim,
            )
        elif site.fusion == "gate_up":
            full_b = merge_gate_up(*b_parts)
        else:
            (full_b,) = b_parts
        _set_full(site, "A", adapter_name, first)
        _set_full(site, "B", adapter_name, full_b)
        layer.lora_alpha[adapter_name] = alpha
        layer.scaling[adapter_name] = alpha / r


# --------------------------------------------------------------------------------------------------
# Base weights with LoRA in the model
# --------------------------------------------------------------------------------------------------


@contextlib.contextmanager
def without_adapters(model_chunks: torch.nn.Module | Sequence[torch.nn.Module]) -> Iterator[None]:
    """Temporarily put every LoRA layer's base linear back in its place (adapters stay in memory).

    Inside, the model has exactly the parameter names of the model without LoRA, so
    :func:`verl_mcore_utils.weights.load_hf_weights` / ``export_hf_weights`` / ``save_hf_weights`` work on
    it (e.g. loading the base checkpoint after ``make_megatron_module`` ran the LoRA hook). A forward inside
    runs the base model only. The LoRA layers are restored on exit, also on error.
    """
    swapped = []
    for site in _lora_sites(unwrap_model_chunks(model_chunks)):
        setattr(site.parent, site.attr, site.module.base_layer)
        swapped.append(site)
    try:
        yield
    finally:
        for site in swapped:
            setattr(site.parent, site.attr, site.module)


def export_merged_hf_weights(
    model_chunks: torch.nn.Module | Sequence[torch.nn.Module],
    *,
    hf_config: Mapping[str, Any] | Any,
    adapter_name: str = DEFAULT_ADAPTER_NAME,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Like ``export_hf_weights`` but with the adapter merged: ``W + scaling * B @ A`` per HF projection.

    For a rollout engine that takes full weights (``lora.merge``). The model is never modified: the merge
    happens on the exported tensors (computed in fp32, returned in the weight's dtype), so repeated syncs
    do not drift. Collective like ``export_hf_weights`` (every rank iterates to the end); while iterating,
    the model runs without its adapters (see :func:`without_adapters`).
    """
    adapters, meta = _export(model_chunks, hf_config, adapter_name)
    scaling = meta["lora_alpha"] / meta["r"]
    with without_adapters(model_chunks):
        for name, tensor in export_hf_weights(model_chunks, hf_config=hf_config):
            key_a = _hf_key(name.removesuffix(".weight"), "A")
            if name.endswith(".weight") and key_a in adapters:
                a = adapters[key_a].to(tensor.device, torch.float32)
                b = adapters[_hf_key(name.removesuffix(".weight"), "B")].to(tensor.device, torch.float32)
                tensor = (tensor.float() + scaling * (b @ a)).to(tensor.dtype)
            yield name, tensor
