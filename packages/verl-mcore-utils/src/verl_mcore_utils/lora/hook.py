"""The ``make_megatron_module`` pre-wrap hook that inserts LoRA adapters (and loads a saved adapter)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from verl_config.lora import LoraConfig
from verl_mcore_utils.lora.inject import adapter_stats, apply_lora, as_lora_config
from verl_mcore_utils.lora.layer import DEFAULT_ADAPTER_NAME
from verl_mcore_utils.lora.load import load_hf_adapter
from verl_mcore_utils.lora.sites import is_rank0, lora_sites, site_meta
from verl_mcore_utils.weights import unwrap_model_chunks


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
        if self.verbose and is_rank0():
            sites = lora_sites(unwrap_model_chunks(chunks))
            detail = ""
            if sites:
                r, alpha, scaling, _ = site_meta(sites[0], self.adapter_name)
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
        lora=as_lora_config(lora),
        adapter_path=adapter_path,
        hf_config=hf_config,
        seed=seed,
        adapter_name=adapter_name,
        verbose=verbose,
    )
