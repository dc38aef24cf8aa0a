"""Weight-gradient accumulation fused into the GEMM, without apex.

megatron-core's linear layers can write each weight gradient straight into the fp32 ``main_grad`` buffer of
its DDP (``gradient_accumulation_fusion``): one GEMM ``main_grad += grad_out^T @ input`` per layer instead
of a bf16 ``grad_weight`` GEMM, then an autograd hook that adds it to ``main_grad`` (an extra kernel reading
and writing both, plus a Python hook per parameter on the backward's critical path). megatron-core
takes that GEMM from apex's compiled ``fused_weight_gradient_mlp_cuda`` extension and refuses the flag
without it. torch's ``addmm`` with ``out_dtype=float32`` does the same accumulation in one cuBLAS call
(bf16 inputs, fp32 accumulate and output, ``beta = 1`` into the output itself), so the extension is not
needed: :func:`enable_wgrad_accumulation_fusion` hands megatron-core an object with the extension's two
functions built on it.

Numerics: the same as megatron-core with apex (fp32 accumulation of bf16 products into fp32 main_grad);
the unfused path instead rounds each micro-batch's weight gradient to bf16 before adding it, so the fused
one is, if anything, closer to the fp32 reference.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import SimpleNamespace
from typing import Any

import torch

__all__ = [
    "enable_wgrad_accumulation_fusion",
    "torch_wgrad_accumulation",
    "wgrad_gemm_accum_fp32",
    "with_wgrad_fusion",
]


def wgrad_gemm_accum_fp32(
    total_input: torch.Tensor, grad_output: torch.Tensor, main_grad: torch.Tensor
) -> None:
    """``main_grad += grad_output^T @ total_input`` with fp32 accumulation (apex's function of that name).

    ``total_input`` is ``[tokens, in]``, ``grad_output`` ``[tokens, out]``, ``main_grad`` ``[out, in]``
    float32. On CUDA with half-precision inputs one cuBLAS call accumulates in place; elsewhere (CPU,
    fp32 inputs) the product is formed in fp32 and added (same result, no fusion).
    """
    if total_input.dtype == torch.float32:
        main_grad.addmm_(grad_output.t(), total_input)
    elif main_grad.is_cuda:
        torch.addmm(main_grad, grad_output.t(), total_input, out_dtype=torch.float32, out=main_grad)
    else:
        main_grad.add_(grad_output.t().float() @ total_input.float())


def _wgrad_gemm_accum_fp16(
    total_input: torch.Tensor, grad_output: torch.Tensor, main_grad: torch.Tensor
) -> None:
    """The same into a bf16 / fp16 ``main_grad`` (DDP with ``grad_reduce_in_fp32=False``)."""
    main_grad.addmm_(grad_output.t(), total_input)


def torch_wgrad_accumulation() -> Any:
    """An object with the two functions megatron-core calls on apex's extension."""
    return SimpleNamespace(
        wgrad_gemm_accum_fp32=wgrad_gemm_accum_fp32, wgrad_gemm_accum_fp16=_wgrad_gemm_accum_fp16
    )


def _addmm_out_dtype_works(device: torch.device) -> bool:
    """Whether this torch build has the fp32-output ``addmm`` on ``device`` (CUDA kernels since torch 2.8)."""
    try:
        out = torch.zeros(2, 2, device=device)
        a = torch.ones(3, 2, device=device, dtype=torch.bfloat16)
        torch.addmm(out, a.t(), a, out_dtype=torch.float32, out=out)
    except (RuntimeError, TypeError, NotImplementedError):
        return False
    return bool(out.eq(3.0).all())


def enable_wgrad_accumulation_fusion(device: torch.device) -> bool:
    """Let megatron-core's ``gradient_accumulation_fusion`` run on ``device``; True when it can.

    Where apex's extension is installed megatron-core already uses it and nothing changes. Otherwise,
    on CUDA with torch's fp32-output ``addmm``, megatron-core's linear-layer module is given
    :func:`torch_wgrad_accumulation` in its place and told it is available. False (nothing changed)
    on CPU or an older torch: the caller keeps ``gradient_accumulation_fusion=False``.
    """
    from megatron.core.tensor_parallel import layers

    if getattr(layers, "_grad_accum_fusion_available", False):
        return True  # apex's extension, or an earlier call
    if device.type != "cuda" or not _addmm_out_dtype_works(device):
        return False
    layers.fused_weight_gradient_mlp_cuda = torch_wgrad_accumulation()
    layers._grad_accum_fusion_available = True
    return True


def with_wgrad_fusion(
    overrides: Mapping[str, Any], *, device: torch.device, megatron_ddp: bool
) -> dict[str, Any]:
    """TransformerConfig overrides with ``gradient_accumulation_fusion`` decided for this model.

    Unset (verl's default): on where it applies, i.e. the chunks are wrapped in megatron-core's DDP (its
    ``main_grad`` buffers receive the GEMM; Megatron-FSDP and unwrapped forward-only models do not have
    them) and :func:`enable_wgrad_accumulation_fusion` succeeds on ``device``; off otherwise. ``False``:
    kept off. ``True``: kept on, and an error naming the key when this device cannot run it (instead of
    megatron-core's message asking for apex).
    """
    out = dict(overrides)
    asked = out.get("gradient_accumulation_fusion")
    if asked is False or (asked is None and not megatron_ddp):
        return out
    available = enable_wgrad_accumulation_fusion(device)
    if asked and not available:
        raise ValueError(
            "override_transformer_config.gradient_accumulation_fusion=true needs apex's"
            " fused_weight_gradient_mlp_cuda or CUDA with torch's fp32-output addmm (torch >= 2.8); on"
            f" {device.type} set it to false (or leave it unset: it is then chosen per device)"
        )
    out["gradient_accumulation_fusion"] = available
    return out
