"""The Triton RoPE kernel against float64 rotation and the torch form (GPU), and where it applies (CPU)."""

from __future__ import annotations

import pytest
import torch

from verl_dyncp.fused_rope import fused_rope, fused_rope_applies
from verl_dyncp.rope import apply_rope_tables, rope_inv_freq, rope_tables


def _rotate64(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x, cos, sin = x.double(), cos.double(), sin.double()
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def test_fused_rope_applies_only_where_it_computes_the_same() -> None:
    x = torch.randn(8, 4, 64)
    cos = torch.randn(8, 1, 64)
    assert not fused_rope_applies(x, cos, interleaved=False)  # CPU: the torch form
    if torch.cuda.is_available():
        xc, cc = x.cuda(), cos.cuda()
        assert fused_rope_applies(xc, cc, interleaved=False)
        assert not fused_rope_applies(xc, cc, interleaved=True)
        assert not fused_rope_applies(xc, cc[..., :32], interleaved=False)  # partial rotary
        assert not fused_rope_applies(xc, cc.half(), interleaved=False)  # table dtype differs


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_fused_rope_matches_float64_rotation_and_its_inverse(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    tokens, heads, groups, dim = 1000, 12, 2, 128
    # q and k as megatron hands them over: views of one fused QKV projection (strided rows)
    qkv = torch.randn(tokens, groups, (heads // groups + 2) * dim, device="cuda", dtype=dtype)
    q = qkv[..., : heads // groups * dim].reshape(tokens, heads, dim)
    k = qkv[..., heads // groups * dim : (heads // groups + 1) * dim]
    assert not k.is_contiguous()
    positions = torch.randint(0, 32768, (tokens,), device="cuda")
    cos, sin = rope_tables(
        positions, rope_inv_freq(head_dim=dim, rotary_base=1e6), dtype=dtype, device="cuda"
    )
    tol = 1e-6 if dtype == torch.float32 else 8e-3  # bf16: one rounding of the output (2^-8 relative)
    for x in (q, k):
        x = x.detach().requires_grad_()
        assert fused_rope_applies(x, cos, interleaved=False)
        out = fused_rope(x, cos, sin)
        ref = _rotate64(x.detach(), cos, sin)
        assert float((out.double() - ref).norm() / ref.norm()) < tol
        torch_form = apply_rope_tables(x.detach(), cos, sin)  # the unfused torch ops
        assert float((out.double() - torch_form.double()).norm() / ref.norm()) < 2 * tol
        assert torch.equal(apply_rope_tables(x.detach(), cos, sin, fused=True), out.detach())
        g = torch.randn_like(out)
        out.backward(g)
        # the rotation is orthogonal: the gradient is the inverse rotation of g (sine negated)
        ref_grad = _rotate64(g, cos, -sin)
        assert float((x.grad.double() - ref_grad).norm() / ref_grad.norm()) < tol
