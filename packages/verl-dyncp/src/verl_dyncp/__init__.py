"""verl_dyncp: context parallelism for packed (THD) sequences on megatron-core, static and dynamic.

Public API:

* groups: :class:`CPGroups` (aligned power-of-two sub-groups of the DP x CP ranks, sizes 1..n, created once).
* layout: :func:`preprocess_thd_engine` / :func:`postprocess_thd_engine` (zigzag split, alignment tp*cp*2,
  true positions, labels patched at chunk borders, dtype kept, gradients only through the local slot).
* planning: :func:`dynamic_cp_split_batch` / :func:`dynamic_cp_merge_output` (CP size per micro-batch from
  ``max_seqlen_per_dp_cp_rank``, workload-balanced groups, idle groups still in every collective),
  :func:`global_loss_token_count` for the loss; static CP is the same with a fixed size.
* attention: :class:`DynCPCoreAttention` / :func:`dyncp_core_attention` (megatron-core core attention for THD +
  a CP group that may change on every call, RoPE from true positions, no Transformer Engine),
  :func:`attach_cp_context`, :func:`thd_layer_spec`, :func:`build_thd_gpt_model` and its model provider
  :class:`THDGPTModelProvider` (for verl-mcore-utils' ``make_megatron_module``).
* Transformer Engine (optional): :func:`te_core_attention` (TE's fused attention and ring CP on the same
  batches and groups, ``kernel="te"`` in thd_layer_spec / build_thd_gpt_model), :func:`te_attention_available`.

The megatron-dependent names are imported lazily, so the torch-only parts (groups, layout, planner,
attention math) can be used, and spawned test ranks start, without importing megatron-core.
"""

from importlib import metadata as _metadata
from typing import Any

from verl_dyncp.groups import CPGroup, CPGroups
from verl_dyncp.planner import (
    DEFAULT_LARGER_CP_MIN_GAIN,
    MEASURED_ATTENTION_COST_FACTOR,
    DynamicCPMicroBatch,
    DynamicCPPlan,
    WorkloadModel,
    dynamic_cp_merge_output,
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
from verl_dyncp.thd_attention import CPContext, attach_cp_context, thd_attention, thd_packed_seq_params
from verl_mcore_utils.compat import prepare_megatron_import

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
    "CPGroup",
    "CPGroups",
    "DynamicCPMicroBatch",
    "DynamicCPPlan",
    "THDBatch",
    "THDPackedMeta",
    "WorkloadModel",
    "DEFAULT_LARGER_CP_MIN_GAIN",
    "MEASURED_ATTENTION_COST_FACTOR",
    "attach_cp_context",
    "build_thd_meta",
    "dynamic_cp_merge_output",
    "dynamic_cp_size",
    "dynamic_cp_split_batch",
    "dynamic_cp_take",
    "dynamic_cp_take_ahead",
    "global_loss_token_count",
    "plan_dynamic_cp",
    "postprocess_thd_engine",
    "preprocess_thd_engine",
    "te_attention_available",
    "te_core_attention",
    "thd_attention",
    "thd_packed_seq_params",
    *_LAZY,
]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'verl_dyncp' has no attribute {name!r}")
