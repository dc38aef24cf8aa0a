"""LoRA on megatron-core GPT models with Hugging Face ``peft``, applied before DDP, saved in HF PEFT format.

:func:`peft_pre_wrap_hook` (a pre-wrap hook for :func:`verl_mcore_utils.module.make_megatron_module`) adapts
the linears named by the LoRA block before Float16Module / DDP, so DDP and the optimizer only see adapter
parameters; :func:`save_hf_adapter` / :func:`load_hf_adapter` write and read Hugging Face PEFT checkpoints
across TP / PP. The package README gives the rules for fused projections and tensor parallelism, the peft
defects worked around, and what is refused.
"""

from typing import Any

from verl_mcore_utils.lora.export import (
    ADAPTER_CONFIG_NAME,
    ADAPTER_WEIGHTS_NAME,
    export_hf_adapter,
    export_hf_adapter_with_config,
    save_hf_adapter,
)
from verl_mcore_utils.lora.hook import LoraPreWrapHook, peft_pre_wrap_hook
from verl_mcore_utils.lora.inject import AdapterStats, adapter_named_parameters, adapter_stats, apply_lora
from verl_mcore_utils.lora.layer import (
    DEFAULT_ADAPTER_NAME,
    VERIFIED_PEFT_VERSIONS,
    is_lora_layer,
    lora_layer_class,
)
from verl_mcore_utils.lora.load import load_hf_adapter
from verl_mcore_utils.lora.merge import adapters_disabled, export_merged_hf_weights, without_adapters

__all__ = [
    "ADAPTER_CONFIG_NAME",
    "ADAPTER_WEIGHTS_NAME",
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


def __getattr__(name: str) -> Any:
    # The peft layer class is built on first use, so that importing this package needs no peft.
    if name == "MegatronLoraParallelLinear":
        return lora_layer_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
