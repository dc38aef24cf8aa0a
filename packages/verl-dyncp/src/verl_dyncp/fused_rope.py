"""RoPE rotation as one Triton kernel on CUDA (forward and backward), for the rotate-half layout.

Why: written with torch ops, ``x * cos + rotate_half(x) * sin`` is five kernels over q and k in every
layer (negate, concatenate, two products, a sum) and as many in backward, each reading and writing the
whole tensor. This kernel reads ``x`` once and writes the result once; the angle maths is done in
float32 and rounded once (the torch form rounds after each of its three bf16 operations), so results
agree with :func:`verl_dyncp.rope.apply_rope_tables` to the rounding of the input dtype. Backward is the
inverse rotation (the same kernel with the sine negated). ``cos``/``sin`` are the tables of
:func:`verl_dyncp.rope.rope_tables`, whose two halves are equal by construction.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from verl_mcore_utils.triton_support import have_triton

__all__ = ["fused_rope", "fused_rope_applies"]


@functools.cache
def _kernel() -> Any:
    import triton
    import triton.language as tl

    @triton.jit
    def rope_kernel(
        x_ptr,
        cos_ptr,
        sin_ptr,
        out_ptr,
        stride_xt,
        stride_xh,
        stride_ot,
        stride_oh,
        stride_ct,
        heads,
        HALF: tl.constexpr,
        BLOCK_H: tl.constexpr,
        SIGN: tl.constexpr,
    ):
        t = tl.program_id(0)
        h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)[:, None]
        d = tl.arange(0, HALF)[None, :]
        mask = h < heads
        x_row = x_ptr + t.to(tl.int64) * stride_xt + h * stride_xh
        x1 = tl.load(x_row + d, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(x_row + HALF + d, mask=mask, other=0.0).to(tl.float32)
        c = tl.load(cos_ptr + t.to(tl.int64) * stride_ct + d).to(tl.float32)
        s = tl.load(sin_ptr + t.to(tl.int64) * stride_ct + d).to(tl.float32) * SIGN
        out_row = out_ptr + t.to(tl.int64) * stride_ot + h * stride_oh
        tl.store(out_row + d, (x1 * c - x2 * s).to(out_ptr.dtype.element_ty), mask=mask)
        tl.store(out_row + HALF + d, (x2 * c + x1 * s).to(out_ptr.dtype.element_ty), mask=mask)

    return rope_kernel


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, sign: float) -> torch.Tensor:
    import triton

    if x.stride(-1) != 1:
        x = x.contiguous()
    tokens, heads, dim = x.shape
    out = torch.empty((tokens, heads, dim), dtype=x.dtype, device=x.device)
    block_h = min(triton.next_power_of_2(heads), 16)
    grid = (tokens, triton.cdiv(heads, block_h))
    _kernel()[grid](
        x, cos, sin, out,
        x.stride(0), x.stride(1), out.stride(0), out.stride(1), cos.stride(0), heads,
        HALF=dim // 2, BLOCK_H=block_h, SIGN=sign,
    )  # fmt: skip
    return out


class _FusedRope(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        ctx.save_for_backward(cos, sin)
        return _rotate(x, cos, sin, sign=1.0)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:  # type: ignore[override]
        cos, sin = ctx.saved_tensors
        return _rotate(grad, cos, sin, sign=-1.0), None, None


def fused_rope_applies(x: torch.Tensor, cos: torch.Tensor, *, interleaved: bool) -> bool:
    """True where the kernel computes what apply_rope_tables does: CUDA, rotate-half, the whole head dim
    rotated, a power-of-two head dim, fp16 / bf16 / fp32, and tables of one row per token."""
    dim = x.shape[-1]
    return (
        x.is_cuda
        and not interleaved
        and x.dim() == 3
        and cos.shape[-1] == dim
        and dim >= 16
        and dim & (dim - 1) == 0
        and x.dtype in (torch.float16, torch.bfloat16, torch.float32)
        and cos.dtype == x.dtype
        and cos.is_contiguous()
        and have_triton()
    )


def fused_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` ``[T, heads, dim]`` with ``cos``/``sin`` ``[T, 1, dim]`` (check fused_rope_applies first)."""
    return _FusedRope.apply(x, cos, sin)
