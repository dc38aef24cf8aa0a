"""Building a megatron-core GPTModel from a locally built Qwen2 config (CPU, gloo)."""

from __future__ import annotations

import pytest
import torch

from verl_mcore_utils.presets import PRESETS, qwen2_preset
from verl_mcore_utils.testing import run_distributed
from verl_mcore_utils.transformer_config import hf_to_transformer_config


def test_presets_are_valid_transformers_qwen2_configs() -> None:
    transformers = pytest.importorskip("transformers")
    for name in PRESETS:
        hf = transformers.Qwen2Config(**qwen2_preset(name, vocab_size=256))
        assert hf.model_type == "qwen2" and hf.num_key_value_heads < hf.num_attention_heads  # GQA


def test_transformer_config_mapping() -> None:
    hf = qwen2_preset("tiny", vocab_size=128)
    tf = hf_to_transformer_config(hf, dtype="float32")
    assert (tf.num_layers, tf.hidden_size, tf.ffn_hidden_size) == (2, 64, 192)
    assert (tf.num_attention_heads, tf.num_query_groups, tf.kv_channels) == (4, 2, 16)
    assert (
        tf.normalization == "RMSNorm" and tf.gated_linear_unit and tf.add_qkv_bias and not tf.add_bias_linear
    )
    with pytest.raises(ValueError, match="override_transformer_config key 'hiden_size'"):
        hf_to_transformer_config(hf, overrides={"hiden_size": 3})
    from megatron.core.transformer.enums import AttnBackend

    assert (
        hf_to_transformer_config(hf, overrides={"attention_backend": "flash"}).attention_backend
        == AttnBackend.flash
    )
    with pytest.raises(ValueError, match="attention_backend 'flashy' is not one of flash"):
        hf_to_transformer_config(hf, overrides={"attention_backend": "flashy"})
    with pytest.raises(ValueError, match="model_type 'gpt2' is not supported"):
        hf_to_transformer_config({**hf, "model_type": "gpt2"})


def _forward_backward(rank: int, world_size: int) -> dict[str, object]:
    from verl_mcore_utils.model import build_gpt_model
    from verl_mcore_utils.parallel import init_parallel

    init_parallel(device="cpu")
    hf = qwen2_preset("tiny", vocab_size=128)
    torch.manual_seed(0)
    model = build_gpt_model(
        hf_config=hf, tf_config=hf_to_transformer_config(hf, dtype="float32"), device="cpu"
    )
    tokens = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(1))
    positions = torch.arange(12).expand(2, 12)
    logits = model(input_ids=tokens, position_ids=positions, attention_mask=None)
    per_token = model(input_ids=tokens, position_ids=positions, attention_mask=None, labels=tokens)
    per_token.mean().backward()
    ref = torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), tokens.reshape(-1), reduction="none"
    )
    return {
        "logits_shape": tuple(logits.shape),
        "loss_shape": tuple(per_token.shape),
        "ce_max_err": float((ref.reshape(2, 12) - per_token).abs().max()),
        "all_grads": all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters()),
    }


def test_gpt_model_forward_backward_on_cpu() -> None:
    (out,) = run_distributed(_forward_backward, world_size=1)
    assert out["logits_shape"] == (2, 12, 128)
    assert out["loss_shape"] == (2, 12)
    assert out["ce_max_err"] < 1e-5  # the labels path is the cross entropy of the logits path
    assert out["all_grads"]
