"""The base model under LoRA: adapters off or swapped out, and weights exported with adapters merged."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch

from verl_mcore_utils.lora.export import export_adapter, hf_key
from verl_mcore_utils.lora.layer import DEFAULT_ADAPTER_NAME
from verl_mcore_utils.lora.sites import lora_sites
from verl_mcore_utils.weights import export_hf_weights, unwrap_model_chunks


@contextlib.contextmanager
def adapters_disabled(model_chunks: torch.nn.Module | Sequence[torch.nn.Module]) -> Iterator[None]:
    """Run the model without its LoRA adapters (peft's adapter switch), e.g. a reference policy that is
    the actor's base model. Unlike :func:`without_adapters` the parameter names stay those of the LoRA
    model. ``requires_grad`` of every parameter is what it was before, also on error (peft's switch
    changes it).
    """
    chunks = unwrap_model_chunks(model_chunks)
    sites = lora_sites(chunks)
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


@contextlib.contextmanager
def without_adapters(model_chunks: torch.nn.Module | Sequence[torch.nn.Module]) -> Iterator[None]:
    """Temporarily put every LoRA layer's base linear back in its place (adapters stay in memory).

    Inside, the model has exactly the parameter names of the model without LoRA, so
    :func:`verl_mcore_utils.weights.load_hf_weights` / ``export_hf_weights`` / ``save_hf_weights`` work on
    it (e.g. loading the base checkpoint after ``make_megatron_module`` ran the LoRA hook). A forward inside
    runs the base model only. The LoRA layers are restored on exit, also on error.
    """
    swapped = []
    for site in lora_sites(unwrap_model_chunks(model_chunks)):
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
    adapters, meta = export_adapter(model_chunks, hf_config, adapter_name)
    scaling = meta["lora_alpha"] / meta["r"]
    with without_adapters(model_chunks):
        for name, tensor in export_hf_weights(model_chunks, hf_config=hf_config):
            key_a = hf_key(name.removesuffix(".weight"), "A")
            if name.endswith(".weight") and key_a in adapters:
                a = adapters[key_a].to(tensor.device, torch.float32)
                b = adapters[hf_key(name.removesuffix(".weight"), "B")].to(tensor.device, torch.float32)
                tensor = (tensor.float() + scaling * (b @ a)).to(tensor.dtype)
            yield name, tensor
