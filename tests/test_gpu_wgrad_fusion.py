"""GPU: weight gradients accumulated into megatron DDP's fp32 main_grad inside the GEMM, without apex.

Run on a GPU host with ``python -m pytest -m gpu tests/test_gpu_wgrad_fusion.py -v``; skipped without CUDA.

``verl_mcore_utils.wgrad_fusion`` gives megatron-core's ``gradient_accumulation_fusion`` a torch
``addmm(out_dtype=float32)`` in place of apex's extension, and the engine turns it on by default for a
training role under megatron DDP. Here one PPO forward/backward over two micro-batches of a small
Qwen2-shaped bf16 model with tied embeddings (the output layer and the embedding share one ``main_grad``:
the case megatron-core guards with ``zero_out_wgrad``) runs with the default and with the override
``gradient_accumulation_fusion=false``; every parameter's gradient must agree.

Tolerance: 1e-2 of each gradient's norm. The unfused path rounds every micro-batch's weight gradient to
bf16 (relative error <= 2^-9 per element) before adding it to fp32; the fused one accumulates in fp32. The
two runs also use different cuBLAS kernels for the weight GEMM. Both differences are a few tenths of a
percent; a lost micro-batch, a lost embedding gradient or a double count is >= 30%.
"""

from __future__ import annotations

import pytest
import torch

from verl_mcore_utils.testing import run_distributed

HF = {
    "model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], "hidden_size": 256,
    "intermediate_size": 1024, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "vocab_size": 1024, "tie_word_embeddings": True,
    "max_position_embeddings": 1024, "rms_norm_eps": 1e-6, "rope_theta": 1e6, "hidden_act": "silu",
    "torch_dtype": "bfloat16",
}  # fmt: skip
TOL = 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("fused_head", [False, True])
def test_fused_wgrad_accumulation_gives_the_unfused_gradients(fused_head: bool) -> None:
    from rl_engine_workers import gpu_wgrad_fusion_grads

    # each in a fresh process: the fused path must not depend on an earlier unfused engine, and back
    ((fused,),) = run_distributed(
        gpu_wgrad_fusion_grads, world_size=1, args=(HF, fused_head, ["default"]), backend="nccl"
    )
    ((unfused,),) = run_distributed(
        gpu_wgrad_fusion_grads, world_size=1, args=(HF, fused_head, ["off"]), backend="nccl"
    )
    assert abs(fused["loss"] - unfused["loss"]) <= 1e-6 * abs(unfused["loss"])  # same forward
    assert fused["flag"] and fused["available"], "the default must turn the fusion on on CUDA"
    assert not unfused["flag"], "gradient_accumulation_fusion=false must be kept"
    assert fused["grads"].keys() == unfused["grads"].keys()
    for name, ref in unfused["grads"].items():
        got = fused["grads"][name]
        assert float(ref.norm()) > 0, name
        err = float((got - ref).norm() / ref.norm())
        assert err <= TOL, (name, err)


@pytest.mark.gpu
def test_wgrad_gemm_accumulates_in_fp32_in_place() -> None:
    from verl_mcore_utils.wgrad_fusion import wgrad_gemm_accum_fp32

    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(4096, 512, device="cuda", generator=g).bfloat16()
    dy = torch.randn(4096, 384, device="cuda", generator=g).bfloat16()
    main_grad = torch.randn(384, 512, device="cuda", generator=g)
    expected = main_grad.double() + dy.double().t() @ x.double()
    ptr = main_grad.data_ptr()
    wgrad_gemm_accum_fp32(x, dy, main_grad)
    wgrad_gemm_accum_fp32(x, dy, main_grad)  # twice: accumulates, never overwrites
    expected += dy.double().t() @ x.double()
    assert main_grad.data_ptr() == ptr and main_grad.dtype == torch.float32
    # fp32 accumulation of 2 x 4096 exact products into sums of magnitude ~100: measured 2e-3 at most;
    # a bf16 result (the failure this guards against) would be off by ~0.3
    torch.testing.assert_close(main_grad.double(), expected, rtol=1e-5, atol=1e-2)
