"""SDPACoreAttention against a plain softmax(QK^T)V reference (fp32, CPU)."""

from __future__ import annotations

import math

import pytest
import torch
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.transformer_config import TransformerConfig

from verl_mcore_utils.attention import SDPACoreAttention


def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> torch.Tensor:
    sq, b, nh, d = q.shape
    reps = nh // k.shape[2]
    k = k.repeat_interleave(reps, dim=2)
    v = v.repeat_interleave(reps, dim=2)
    scores = torch.einsum("qbhd,kbhd->bhqk", q, k) / math.sqrt(d)
    if causal:
        scores = scores.masked_fill(torch.ones(sq, k.shape[0], dtype=torch.bool).triu(1), float("-inf"))
    out = torch.einsum("bhqk,kbhd->qbhd", scores.softmax(-1), v)
    return out.reshape(sq, b, nh * d)


@pytest.mark.parametrize("groups", [4, 2, 1])
@pytest.mark.parametrize("mask_type", [AttnMaskType.causal, AttnMaskType.no_mask])
def test_matches_reference_with_gqa(groups: int, mask_type: AttnMaskType) -> None:
    cfg = TransformerConfig(
        num_layers=1,
        hidden_size=32,
        num_attention_heads=4,
        num_query_groups=groups,
        attention_dropout=0.0,
        use_cpu_initialization=True,
    )
    attn = SDPACoreAttention(config=cfg, layer_number=1, attn_mask_type=mask_type, attention_type="self")
    g = torch.Generator().manual_seed(0)
    q = torch.randn(9, 2, 4, 8, generator=g, requires_grad=True)
    k = torch.randn(9, 2, groups, 8, generator=g, requires_grad=True)
    v = torch.randn(9, 2, groups, 8, generator=g, requires_grad=True)
    out = attn(q, k, v, attention_mask=None)
    ref = _reference(q, k, v, causal=mask_type == AttnMaskType.causal)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
    grads = torch.autograd.grad(out.square().sum(), (q, k, v))
    ref_grads = torch.autograd.grad(ref.square().sum(), (q, k, v))
    for a, r in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(a, r, rtol=1e-5, atol=1e-5)


def test_packed_sequences_are_refused_clearly() -> None:
    cfg = TransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=4, use_cpu_initialization=True)
    attn = SDPACoreAttention(config=cfg, layer_number=1, attn_mask_type=AttnMaskType.causal)
    x = torch.zeros(4, 1, 4, 8)
    with pytest.raises(ValueError, match="THD"):
        attn(x, x, x, attention_mask=None, packed_seq_params=object())
