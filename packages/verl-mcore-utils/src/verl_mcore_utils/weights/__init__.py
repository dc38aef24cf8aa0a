"""Hugging Face weights <-> megatron-core GPTModel (dense Qwen2 / Qwen3 / Llama): load, export, save.

One name table (:mod:`.names`) says which Hugging Face tensors each megatron parameter holds, so that the
loader, the exporter and the LoRA adapter exporter agree; the layout conventions are in the package README.
"""

from verl_mcore_utils.weights.chunks import local_megatron_params, unwrap_model_chunks
from verl_mcore_utils.weights.export import bucket_tensors, export_hf_weights
from verl_mcore_utils.weights.fused import (
    hf_to_megatron,
    megatron_to_hf,
    merge_gate_up,
    merge_qkv,
    split_gate_up,
    split_qkv,
    tp_unshard,
)
from verl_mcore_utils.weights.load import load_hf_weights
from verl_mcore_utils.weights.names import (
    LAYER_MODULE_MAP,
    Fusion,
    HFDims,
    ParamMapping,
    hf_tensor_shapes,
    layer_param_mappings,
    mtp_param_mappings,
    param_mappings,
)
from verl_mcore_utils.weights.save import save_hf_weights

__all__ = [
    "LAYER_MODULE_MAP",
    "Fusion",
    "HFDims",
    "ParamMapping",
    "bucket_tensors",
    "export_hf_weights",
    "hf_tensor_shapes",
    "hf_to_megatron",
    "layer_param_mappings",
    "load_hf_weights",
    "local_megatron_params",
    "megatron_to_hf",
    "merge_gate_up",
    "merge_qkv",
    "mtp_param_mappings",
    "param_mappings",
    "save_hf_weights",
    "split_gate_up",
    "split_qkv",
    "tp_unshard",
    "unwrap_model_chunks",
]
