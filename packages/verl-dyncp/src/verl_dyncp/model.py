"""GPT layer spec and model whose attention handles THD batches under any (dynamic) CP size.

How RoPE moves out of megatron-core (0.14 to 0.19 alike): the GPTModel is built with
``position_embedding_type="none"``, so GPTModel._preprocess makes no ``rotary_pos_emb`` and
``Attention.forward`` skips its RoPE (it only rotates when ``rotary_pos_emb`` is not None, and it is the
step that would slice frequencies with the static CP group and ``cu_seqlens``). The core attention of
:func:`thd_layer_spec` then rotates q and k (after megatron's optional q/k layernorm, the same order as
megatron's own RoPE) with the true position of every local token. The embedding adds no learned position
table for "none", ``position_ids`` passed to GPTModel.forward are ignored, and the checkpoint is unchanged
(RoPE has no parameters), so Hugging Face weights load as for the standard model.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from megatron.core.models.gpt import GPTModel
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_config import TransformerConfig

from verl_dyncp.attention import dyncp_core_attention
from verl_mcore_utils.model import build_gpt_model, local_layer_spec, rope_theta, rotary_percent

__all__ = ["THDGPTModelProvider", "build_thd_gpt_model", "thd_layer_spec"]


def thd_layer_spec(
    tf_config: TransformerConfig,
    *,
    rotary_base: float | None,
    rotary_percent: float = 1.0,
    kernel: str = "auto",
) -> ModuleSpec:
    """megatron-core's local GPT layer spec with DynCPCoreAttention, or with Transformer Engine's attention.

    ``kernel``: "auto" / "varlen" / "cudnn" / "sdpa" pick DynCPCoreAttention's kernel (no Transformer Engine);
    "te" uses :func:`verl_dyncp.te_attention.te_core_attention` (TE's fused attention and TE's own CP,
    ImportError naming the fix when TE is missing). RoPE is applied inside the attention when
    ``rotary_base`` is set (build the model with ``position_embedding_type="none"``, as
    :func:`build_thd_gpt_model` does).
    """
    if kernel == "te":
        from verl_dyncp.te_attention import te_core_attention

        core_attention: type = te_core_attention(rotary_base=rotary_base, rotary_percent=rotary_percent)
    else:
        core_attention = dyncp_core_attention(
            rotary_base=rotary_base, rotary_percent=rotary_percent, kernel=kernel
        )
    return local_layer_spec(tf_config, core_attention=core_attention)


def build_thd_gpt_model(
    *,
    hf_config: Mapping[str, Any] | Any,
    tf_config: TransformerConfig,
    device: torch.device | str,
    pre_process: bool = True,
    post_process: bool = True,
    vocab_size: int | None = None,
    vp_stage: int | None = None,
    kernel: str = "auto",
    mtp_num_layers: int = 0,
) -> GPTModel:
    """A GPTModel for ``hf_config`` that takes THD batches with a per-batch CP group (see module docstring).

    Plain RoPE only: scaled variants are refused rather than silently built unscaled.
    ``mtp_num_layers`` > 0 attaches megatron-core's MTP block (same layer spec) as ``model.mtp`` on the
    chunk that has the output layer, and on a last stage without the word embedding a copy of it as
    ``model.mtp_embedding``; the model's own forward runs neither (see verl_mcore_utils.mtp).
    """
    partial = rotary_percent(hf_config)  # transformers 5 keeps it in rope_parameters
    spec = thd_layer_spec(tf_config, rotary_base=rope_theta(hf_config), rotary_percent=partial, kernel=kernel)
    model = build_gpt_model(
        hf_config=hf_config,
        tf_config=tf_config,
        device=device,
        pre_process=pre_process,
        post_process=post_process,
        layer_spec=spec,
        vocab_size=vocab_size,
        vp_stage=vp_stage,
        position_embedding_type="none",
    )
    if mtp_num_layers and post_process:
        from verl_mcore_utils.mtp import build_mtp_block, build_mtp_embedding

        model.mtp = build_mtp_block(
            tf_config=tf_config,
            layer_spec=spec,
            num_layers=mtp_num_layers,
            vp_stage=vp_stage,
            device=device,
            pg_collection=getattr(model, "pg_collection", None),  # megatron-core 0.19: EP groups included
        )
        if not pre_process:  # pipeline stages: the MTP inputs need a copy of the first stage's embedding
            model.mtp_embedding = build_mtp_embedding(model, tf_config=tf_config).to(device)
    return model


@dataclass
class THDGPTModelProvider:
    """verl-mcore-utils model provider (``make_megatron_module``) of :func:`build_thd_gpt_model`'s model.

    Sits beside verl-mcore-utils' GPTModelProvider / SpecProvider / MBridgeProvider: the same wrapping
    (Float16Module, DDP or Megatron-FSDP, value head, LoRA hooks) then applies to the packed-sequence model.
    Pipeline stages and virtual-pipeline chunks are built as ``make_megatron_module`` asks.
    """

    hf_config: Mapping[str, Any] | Any
    transformer_config: TransformerConfig
    device: torch.device | str = "cuda"
    kernel: str = "auto"
    ddp_defaults: Mapping[str, Any] = field(default_factory=dict)
    mtp_num_layers: int = 0

    def provide(self, *, pre_process: bool, post_process: bool, vp_stage: int | None = None) -> GPTModel:
        return build_thd_gpt_model(
            hf_config=self.hf_config,
            tf_config=self.transformer_config,
            device=self.device,
            pre_process=pre_process,
            post_process=post_process,
            vp_stage=vp_stage,
            kernel=self.kernel,
            mtp_num_layers=self.mtp_num_layers,
        )
