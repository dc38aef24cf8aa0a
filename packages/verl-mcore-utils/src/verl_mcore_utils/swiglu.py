"""SwiGLU as one Triton kernel per direction on CUDA, and megatron-core's MLP that uses it.

Why: without Transformer Engine (and with ``bias_activation_fusion`` off, because megatron-core's fused
version is a compiled function that recompiles for every new packed length), megatron-core's MLP computes
``silu(gate) * up`` from ``torch.chunk`` of the fc1 output with separate kernels: silu, the product, and
in backward silu's backward, two products and a ``cat`` of the two halves' gradients.
Here forward reads fc1's output once and writes the product once; backward reads fc1's output and the
incoming gradient once and writes both halves' gradients straight into one ``[..., 2F]`` tensor (no
``cat``). Autograd keeps only fc1's output (the torch form also keeps ``silu(gate)``).

Numerics: every value is computed in float32 from the bf16 inputs and rounded once; the torch form rounds
``silu(gate)`` to bf16 before the product. Results agree to one bf16 rounding step (GPU tests).
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any

import torch
import torch.nn.functional as F
from megatron.core.transformer.mlp import MLP

from verl_mcore_utils.triton_support import KernelSwitch, triton_runs_on

__all__ = ["FusedSwiGLUMLP", "fused_swiglu", "fused_swiglu_applies", "torch_form_only"]

_BLOCK = 1024
_SWITCH = KernelSwitch()


def torch_form_only() -> contextlib.AbstractContextManager[None]:
    """Within the block :class:`FusedSwiGLUMLP` runs megatron-core's forward on CUDA too (A/B benchmarks)."""
    return _SWITCH.off()


def fused_swiglu_applies(x: torch.Tensor) -> bool:
    """Whether the kernel can take ``x`` (``[..., 2F]``, CUDA, contiguous, half or float)."""
    return (
        triton_runs_on(x)
        and x.is_contiguous()
        and x.shape[-1] % 2 == 0
        and x.dtype in (torch.bfloat16, torch.float16, torch.float32)
    )


@functools.cache
def _kernels() -> tuple[Any, Any]:
    import triton
    import triton.language as tl

    @triton.jit
    def swiglu_fwd(x_ptr, out_ptr, half, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < half
        gate = tl.load(x_ptr + row * 2 * half + cols, mask=mask, other=0.0).to(tl.float32)
        up = tl.load(x_ptr + row * 2 * half + half + cols, mask=mask, other=0.0).to(tl.float32)
        silu = gate / (1.0 + tl.exp(-gate))
        tl.store(out_ptr + row * half + cols, (silu * up).to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def swiglu_bwd(x_ptr, grad_ptr, dx_ptr, half, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < half
        gate = tl.load(x_ptr + row * 2 * half + cols, mask=mask, other=0.0).to(tl.float32)
        up = tl.load(x_ptr + row * 2 * half + half + cols, mask=mask, other=0.0).to(tl.float32)
        g = tl.load(grad_ptr + row * half + cols, mask=mask, other=0.0).to(tl.float32)
        sig = 1.0 / (1.0 + tl.exp(-gate))
        silu = gate * sig
        d_gate = g * up * sig * (1.0 + gate * (1.0 - sig))
        tl.store(dx_ptr + row * 2 * half + cols, d_gate.to(dx_ptr.dtype.element_ty), mask=mask)
        tl.store(dx_ptr + row * 2 * half + half + cols, (g * silu).to(dx_ptr.dtype.element_ty), mask=mask)

    return swiglu_fwd, swiglu_bwd


def _grid(rows: int, half: int) -> tuple[int, int]:
    return rows, (half + _BLOCK - 1) // _BLOCK


class _SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        rows = x.numel() // x.shape[-1]
        out = torch.empty((*x.shape[:-1], half), dtype=x.dtype, device=x.device)
        if rows:
            _kernels()[0][_grid(rows, half)](x, out, half, BLOCK=_BLOCK, num_warps=4)
        ctx.save_for_backward(x)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        (x,) = ctx.saved_tensors
        half = x.shape[-1] // 2
        rows = x.numel() // x.shape[-1]
        grad = grad.contiguous()
        dx = torch.empty_like(x)
        if rows:
            _kernels()[1][_grid(rows, half)](x, grad, dx, half, BLOCK=_BLOCK, num_warps=4)
        return dx


def fused_swiglu(x: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` of ``x = [gate, up]`` along the last dimension (megatron-core's GLU layout).

    One Triton kernel on CUDA (see the module doc); elsewhere the torch form.
    """
    if not fused_swiglu_applies(x):
        gate, up = torch.chunk(x, 2, dim=-1)
        return F.silu(gate) * up
    return _SwiGLU.apply(x)


class FusedSwiGLUMLP(MLP):
    """megatron-core's MLP with :func:`fused_swiglu` between fc1 and fc2 where it applies.

    It applies to the gated SiLU MLP of Llama / Qwen (``gated_linear_unit``, ``activation_func=F.silu``,
    no clamp, no linear offset, megatron-core's own fused activation and Transformer Engine's off) on
    CUDA. Anything else (CPU, other activations, per-token scales of MoE experts) runs megatron-core's
    forward unchanged. Parameters, state dicts and sharded checkpoints are MLP's own.
    """

    def _fused(self, x: torch.Tensor, per_token_scale: Any) -> bool:
        config = self.config
        return (
            _SWITCH.enabled
            and per_token_scale is None
            and config.gated_linear_unit
            and config.activation_func is F.silu
            and not config.bias_activation_fusion
            and not getattr(config, "use_te_activation_func", False)
            and getattr(config, "activation_func_clamp_value", None) is None
            and not getattr(config, "glu_linear_offset", 0.0)
            and triton_runs_on(x)
        )

    def forward(  # type: ignore[override]
        self, hidden_states: torch.Tensor, per_token_scale: torch.Tensor | None = None, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        # kwargs: what megatron-core's layer passes to every MLP (0.19: MoE's padding_mask); the dense MLP
        # ignores them
        if not self._fused(hidden_states, per_token_scale):
            return super().forward(hidden_states, per_token_scale, **kwargs)
        intermediate, bias = self.linear_fc1(hidden_states)
        if bias is not None:
            intermediate = intermediate + bias
        return self.linear_fc2(fused_swiglu(intermediate.contiguous()))
