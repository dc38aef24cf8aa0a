"""verl_dyncp: context parallelism for packed (THD) sequences on megatron-core, static and dynamic.

CP groups, the zigzag THD layout, the planner (CP size per micro-batch, split and merge) and megatron-core
core attention for a CP group that may change every call; the package README lists the public API. The
megatron-dependent names are imported lazily, so the torch-only parts (and spawned test ranks) start
without megatron-core.
"""

from importlib import metadata as _metadata

from verl_dyncp.cp_context import CPContext, attach_cp_context
from verl_dyncp.decoder_graph import DecoderGraph, install_decoder_graph
from verl_dyncp.graph_layout import (
    CpGraphInputs,
    GraphSlots,
    graph_cp_packed_seq_params,
    graph_cp_thd_layout,
    graph_packed_seq_params,
    graph_thd_layout,
    pad_cp_layout_to_slots,
    pad_cp_micro_batch_to_slots,
    pad_layout_to_slots,
)
from verl_dyncp.graphed_decoder import GraphedDecoder
from verl_dyncp.groups import CPGroup, CPGroups
from verl_dyncp.layout import thd_packed_seq_params
from verl_dyncp.packing import pack_micro_batches
from verl_dyncp.planner import (
    DEFAULT_LARGER_CP_MIN_GAIN,
    GEMM_ROOFLINE_TOKENS,
    MEASURED_ATTENTION_COST_FACTOR,
    DynamicCPMicroBatch,
    DynamicCPPlan,
    WorkloadModel,
    dynamic_cp_merge_output,
    dynamic_cp_merge_outputs,
    dynamic_cp_size,
    dynamic_cp_split_batch,
    dynamic_cp_take,
    dynamic_cp_take_ahead,
    global_loss_token_count,
    plan_dynamic_cp,
)
from verl_dyncp.te_attention import te_attention_available, te_core_attention
from verl_dyncp.thd import (
    THDBatch,
    THDPackedMeta,
    build_thd_meta,
    postprocess_thd_engine,
    preprocess_thd_engine,
)
from verl_dyncp.thd_attention import thd_attention
from verl_mcore_utils.compat import prepare_megatron_import
from verl_mcore_utils.lazy import lazy_attributes

# Before any module of this package imports megatron-core (Python runs this file first): check the release
# and prepare a GPU-less machine. The modules imported above do not import megatron-core.
prepare_megatron_import()

__version__ = _metadata.version("verl-dyncp")  # single source: pyproject.toml

_LAZY = {
    "DynCPCoreAttention": "verl_dyncp.attention",
    "dyncp_core_attention": "verl_dyncp.attention",
    "thd_layer_spec": "verl_dyncp.model",
    "THDGPTModelProvider": "verl_dyncp.model",
    "build_thd_gpt_model": "verl_dyncp.model",
}

__all__ = [  # the names imported above, then every lazy name
    "CPContext",
    "CpGraphInputs",
    "CPGroup",
    "CPGroups",
    "DecoderGraph",
    "DynamicCPMicroBatch",
    "DynamicCPPlan",
    "GraphSlots",
    "GraphedDecoder",
    "THDBatch",
    "THDPackedMeta",
    "WorkloadModel",
    "DEFAULT_LARGER_CP_MIN_GAIN",
    "GEMM_ROOFLINE_TOKENS",
    "MEASURED_ATTENTION_COST_FACTOR",
    "attach_cp_context",
    "build_thd_meta",
    "dynamic_cp_merge_output",
    "dynamic_cp_merge_outputs",
    "dynamic_cp_size",
    "dynamic_cp_split_batch",
    "dynamic_cp_take",
    "dynamic_cp_take_ahead",
    "global_loss_token_count",
    "graph_cp_packed_seq_params",
    "graph_cp_thd_layout",
    "graph_packed_seq_params",
    "graph_thd_layout",
    "install_decoder_graph",
    "pack_micro_batches",
    "pad_cp_layout_to_slots",
    "pad_cp_micro_batch_to_slots",
    "pad_layout_to_slots",
    "plan_dynamic_cp",
    "postprocess_thd_engine",
    "preprocess_thd_engine",
    "te_attention_available",
    "te_core_attention",
    "thd_attention",
    "thd_packed_seq_params",
    *_LAZY,
]


__getattr__, __dir__ = lazy_attributes(module=__name__, lazy=_LAZY)
