"""GPU: the Triton SwiGLU against the torch form, forward and backward.

Run on a GPU host with ``python -m pytest -m gpu packages/verl-mcore-utils/tests/test_gpu_swiglu.py``.
Tolerances: float32 inputs 1e-6 relative (same formula, float32 throughout); bf16 inputs one bf16
rounding step (rtol 2^-7), because the torch form rounds ``silu(gate)`` (and in backward ``grad * up``) to
bf16 before the next operation while the kernel rounds once at the end; against a float64 reference the
kernel must be at least as close as the torch form.
"""

from __future__ import annotations

import pytest
import torch

from verl_mcore_utils.swiglu import fused_swiglu, fused_swiglu_applies

pytestmark = pytest.mark.gpu


def _torch_form(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


def _run(fn, x0: torch.Tensor, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    x = x0.clone().requires_grad_()
    y = fn(x)
    y.backward(grad)
    return y.detach(), x.grad


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(4096, 2 * 8960), (3, 5, 2 * 1000), (1, 2 * 7)])
def test_matches_the_torch_form(dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    g = torch.Generator(device="cuda").manual_seed(0)
    x0 = (4 * torch.randn(shape, device="cuda", generator=g)).to(dtype)
    grad = torch.randn((*shape[:-1], shape[-1] // 2), device="cuda", generator=g).to(dtype)
    assert fused_swiglu_applies(x0)
    y, dx = _run(fused_swiglu, x0, grad)
    y_ref, dx_ref = _run(_torch_form, x0, grad)
    assert y.dtype == dtype and dx.dtype == dtype and dx.shape == x0.shape
    if dtype == torch.float32:
        torch.testing.assert_close(y, y_ref, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(dx, dx_ref, rtol=1e-5, atol=1e-5)
        return
    torch.testing.assert_close(y.float(), y_ref.float(), rtol=2**-7, atol=1e-5)
    torch.testing.assert_close(dx.float(), dx_ref.float(), rtol=2**-7, atol=1e-4)
    y64, dx64 = _run(_torch_form, x0.double(), grad.double())
    assert (y.double() - y64).abs().mean() <= (y_ref.double() - y64).abs().mean() * 1.05
    assert (dx.double() - dx64).abs().mean() <= (dx_ref.double() - dx64).abs().mean() * 1.05
