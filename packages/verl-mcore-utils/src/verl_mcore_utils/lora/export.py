"""LoRA adapters as Hugging Face PEFT tensors and config: exported in memory or saved to a directory."""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from verl_config.lora import LoraConfig
from verl_mcore_utils.lora.inject import as_lora_config
from verl_mcore_utils.lora.layer import DEFAULT_ADAPTER_NAME, import_peft
from verl_mcore_utils.lora.sites import Site, full_tensor, is_rank0, lora_sites, pp_info, site_meta
from verl_mcore_utils.weights import HFDims, split_gate_up, split_qkv, unwrap_model_chunks

if TYPE_CHECKING:
    from megatron.core.transformer.transformer_config import TransformerConfig

ADAPTER_CONFIG_NAME = "adapter_config.json"
ADAPTER_WEIGHTS_NAME = "adapter_model.safetensors"
_HF_PREFIX = "base_model.model."


@dataclass(frozen=True)
class _QKV:
    num_heads: int
    num_query_groups: int
    head_dim: int


def qkv_dims(hf_config: Any, chunks: Sequence[torch.nn.Module]) -> _QKV:
    if hf_config is not None:
        d = hf_config if isinstance(hf_config, HFDims) else HFDims.from_hf_config(hf_config)
        return _QKV(d.num_heads, d.num_query_groups, d.head_dim)
    tf: TransformerConfig = chunks[0].config
    heads = int(tf.num_attention_heads)
    return _QKV(heads, int(tf.num_query_groups or heads), int(tf.kv_channels))


def _hf_parts(site: Site, full_b: torch.Tensor, dims: _QKV) -> Sequence[torch.Tensor]:
    if site.fusion == "qkv":
        return split_qkv(
            full_b, num_heads=dims.num_heads, num_query_groups=dims.num_query_groups, head_dim=dims.head_dim
        )
    if site.fusion == "gate_up":
        return split_gate_up(full_b)
    return (full_b,)


def hf_key(module: str, which: str) -> str:
    return f"{_HF_PREFIX}{module}.lora_{which}.weight"


def export_adapter(
    model_chunks: torch.nn.Module | Sequence[torch.nn.Module], hf_config: Any, adapter_name: str
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    chunks = unwrap_model_chunks(model_chunks)
    dims = qkv_dims(hf_config, chunks)
    sites = lora_sites(chunks)
    tensors: dict[str, torch.Tensor] = {}
    metas: set[tuple[int, float, float, float]] = set()
    for site in sites:
        if adapter_name not in site.module.lora_A:
            raise ValueError(f"{site.name} has no adapter named {adapter_name!r}")
        metas.add(site_meta(site, adapter_name))
        full_a = full_tensor(site, "A", adapter_name)
        full_b = full_tensor(site, "B", adapter_name)
        for module, b in zip(site.hf_modules, _hf_parts(site, full_b, dims), strict=True):
            tensors[hf_key(module, "A")] = full_a.to("cpu", copy=True).contiguous()
            tensors[hf_key(module, "B")] = b.to("cpu", copy=True).contiguous()
    pp_size, pp_group = pp_info()
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
    return export_adapter(model_chunks, hf_config, adapter_name)[0]


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
    tensors, meta = export_adapter(model_chunks, hf_config, adapter_name)
    if lora is not None:
        lora = as_lora_config(lora)
        if (lora.rank, float(lora.alpha)) != (meta["r"], meta["lora_alpha"]):
            raise ValueError(
                f"the model's adapters have rank {meta['r']}, alpha {meta['lora_alpha']}; lora says rank"
                f" {lora.rank}, alpha {lora.alpha}"
            )
    path = Path(path)
    if is_rank0():
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
    peft = import_peft()
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
    tensors, meta = export_adapter(model_chunks, hf_config, adapter_name)
    config = _peft_config(model_chunks, tensors, meta, hf_config, base_model_name_or_path)
    as_dict = {
        k: sorted(v) if isinstance(v, (set, frozenset)) else v
        for k, v in config.to_dict().items()
        if not callable(v)
    }
    return tensors, json.loads(json.dumps(as_dict, default=str))
