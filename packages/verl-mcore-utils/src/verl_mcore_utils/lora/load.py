"""Load a Hugging Face PEFT LoRA adapter into a model that has adapters, fusing q/k/v and gate/up back."""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from verl_mcore_utils.lora.export import ADAPTER_CONFIG_NAME, ADAPTER_WEIGHTS_NAME, qkv_dims
from verl_mcore_utils.lora.layer import DEFAULT_ADAPTER_NAME
from verl_mcore_utils.lora.sites import Site, lora_sites, set_full
from verl_mcore_utils.weights import merge_gate_up, merge_qkv, unwrap_model_chunks

if TYPE_CHECKING:
    from megatron.core.models.gpt import GPTModel

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


def _tensors_by_module(raw: Mapping[str, torch.Tensor], path: Path) -> dict[str, dict[str, torch.Tensor]]:
    """``{HF module name: {"A": lora_A, "B": lora_B}}``; any other key is an error."""
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
    return by_module


def _check_coverage(
    by_module: Mapping[str, Mapping[str, torch.Tensor]],
    sites: Sequence[Site],
    chunks: Sequence[GPTModel],
    path: Path,
) -> None:
    """Every adapted linear here finds its A and B; every adapter module of a layer held here is adapted."""
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


def _fused_adapter(
    site: Site, by_module: Mapping[str, Mapping[str, torch.Tensor]], dims: Any
) -> tuple[torch.Tensor, torch.Tensor]:
    """(lora_A, full lora_B) of a fused megatron linear from its HF modules' adapters (sharing lora_A)."""
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
    return first, full_b


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
    sites = lora_sites(chunks)
    if not sites:
        raise ValueError("the model has no LoRA adapters; apply_lora / peft_pre_wrap_hook before loading one")
    dims = qkv_dims(hf_config, chunks)
    by_module = _tensors_by_module(raw, path)
    _check_coverage(by_module, sites, chunks, path)
    for site in sites:
        layer = site.module
        if int(layer.r[adapter_name]) != r:
            raise ValueError(
                f"adapter rank {r} != the model's LoRA rank {layer.r[adapter_name]} ({site.name})"
            )
        first, full_b = _fused_adapter(site, by_module, dims)
        set_full(site, "A", adapter_name, first)
        set_full(site, "B", adapter_name, full_b)
        layer.lora_alpha[adapter_name] = alpha
        layer.scaling[adapter_name] = alpha / r
