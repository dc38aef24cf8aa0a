"""megatron-core's multi-token-prediction (MTP) layers, built and stepped without GPTModel's MTP path.

Why not GPTModel's own MTP: GPTModel.forward rolls ``input_ids`` / labels by one position over the
whole local tensor to find "the next token" (0.14 to 0.16 refuse packed sequences outright; 0.17+ roll
within the static CP group only), and it scales the MTP gradient through a process-global autograd
scaler that the pipeline schedule sets (Megatron-LM PR #3959: that scale omits the CP size in every
release of our matrix). A packed batch split over a per-micro-batch (dynamic) CP group needs the next
tokens of every local token taken from the full sequence before the split, so the caller computes them
and this module only runs the layers: the block is megatron-core's ``MultiTokenPredictionBlock`` (same
parameters and names, ``mtp.layers.<i>.*``), attached to the last pipeline stage's GPTModel, which is
built without ``mtp_num_layers`` so its forward never touches it.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from verl_mcore_utils.compat import import_megatron_core, mcore_version

import_megatron_core()
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_mtp_block_spec  # noqa: E402
from megatron.core.transformer.multi_token_prediction import MultiTokenPredictionBlock  # noqa: E402
from megatron.core.transformer.spec_utils import ModuleSpec  # noqa: E402
from megatron.core.transformer.transformer_config import TransformerConfig  # noqa: E402

__all__ = ["build_mtp_block", "mtp_layer_forward"]


def build_mtp_block(
    *, tf_config: TransformerConfig, layer_spec: ModuleSpec, num_layers: int, vp_stage: int | None = None
) -> MultiTokenPredictionBlock:
    """megatron-core's MTP block of ``num_layers`` layers, each a copy of ``layer_spec``'s decoder layer.

    Build it on the last pipeline stage only (where the decoder's final hidden states are).
    ``tf_config`` is the model's config; the block gets a copy with ``mtp_num_layers`` set.
    """
    if num_layers < 1:
        raise ValueError(f"num_layers must be >= 1 for an MTP block, got {num_layers}")
    config = dataclasses.replace(tf_config, mtp_num_layers=num_layers)
    spec = get_gpt_mtp_block_spec(config, layer_spec, use_transformer_engine=False, vp_stage=vp_stage)
    if spec is None:
        raise ValueError(
            "megatron-core builds no MTP layers on this pipeline stage; build the MTP block on the last stage only"
        )
    return MultiTokenPredictionBlock(config=config, spec=spec, vp_stage=vp_stage)


def mtp_layer_forward(
    layer: torch.nn.Module,
    *,
    hidden_states: torch.Tensor,
    decoder_input: torch.Tensor,
    packed_seq_params: Any,
) -> torch.Tensor:
    """One MTP depth: norm(embedding of token t+k) ++ norm(hidden of depth k-1) -> projection -> layer -> norm.

    ``decoder_input`` is the word embedding of the token each local position must see at this depth
    (taken by the caller within its sequence); ``hidden_states`` the previous depth's output ([s, b, h]).
    megatron-core 0.14 to 0.19 all have ``_proj_and_transformer_layer`` with these keywords; its public
    ``forward`` is not used because it re-derives the next tokens by rolling the local tensor.
    """
    step = getattr(layer, "_proj_and_transformer_layer", None)
    if step is None:
        raise NotImplementedError(
            f"megatron-core {mcore_version()}: MultiTokenPredictionLayer has no _proj_and_transformer_layer;"
            " MTP is supported with megatron-core 0.14 to 0.19"
        )
    return step(
        hidden_states=hidden_states,
        decoder_input=decoder_input,
        attention_mask=None,
        packed_seq_params=packed_seq_params,
    )
