"""CPU: the apex-free weight-gradient accumulation and when the engine turns it on.

The fused GEMM itself (bf16 in, fp32 accumulated in place) and its gradients inside a megatron-core model
are checked on a GPU in tests/test_gpu_wgrad_fusion.py; here: the CPU fallback's arithmetic and the
decision table of ``with_wgrad_fusion`` (never on where it cannot run, never silently off when asked).
"""

from __future__ import annotations

import pytest
import torch

from verl_mcore_utils.wgrad_fusion import (
    enable_wgrad_accumulation_fusion,
    torch_wgrad_accumulation,
    with_wgrad_fusion,
)

CPU = torch.device("cpu")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_accumulates_the_weight_gradient_into_main_grad(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 12, generator=g).to(dtype)
    dy = torch.randn(64, 8, generator=g).to(dtype)
    main_grad = torch.randn(8, 12, generator=g)
    expected = main_grad.double() + 2 * (dy.double().t() @ x.double())
    ext = torch_wgrad_accumulation()
    ext.wgrad_gemm_accum_fp32(x, dy, main_grad)
    ext.wgrad_gemm_accum_fp32(x, dy, main_grad)
    assert main_grad.dtype == torch.float32
    torch.testing.assert_close(main_grad.double(), expected, rtol=1e-5, atol=1e-5)


def test_bf16_main_grad_accumulates_too() -> None:
    x, dy = torch.ones(4, 3, dtype=torch.bfloat16), torch.ones(4, 2, dtype=torch.bfloat16)
    main_grad = torch.ones(2, 3, dtype=torch.bfloat16)
    torch_wgrad_accumulation().wgrad_gemm_accum_fp16(x, dy, main_grad)
    assert main_grad.eq(5).all()


def test_not_enabled_on_cpu() -> None:
    assert enable_wgrad_accumulation_fusion(CPU) is False


def test_unset_is_off_on_cpu_and_without_ddp() -> None:
    given = {"recompute_granularity": "full"}
    assert with_wgrad_fusion(given, device=CPU, megatron_ddp=True) == {
        "recompute_granularity": "full",
        "gradient_accumulation_fusion": False,
    }
    assert with_wgrad_fusion(given, device=CPU, megatron_ddp=False) == given


def test_an_explicit_false_is_kept() -> None:
    assert with_wgrad_fusion({"gradient_accumulation_fusion": False}, device=CPU, megatron_ddp=True) == {
        "gradient_accumulation_fusion": False
    }


def test_an_explicit_true_that_cannot_run_names_the_key() -> None:
    with pytest.raises(ValueError, match=r"override_transformer_config\.gradient_accumulation_fusion=true"):
        with_wgrad_fusion({"gradient_accumulation_fusion": True}, device=CPU, megatron_ddp=True)
