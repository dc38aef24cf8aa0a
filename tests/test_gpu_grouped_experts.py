"""GPU: grouped experts (``torch._grouped_mm``, CUTLASS on Hopper for bf16) against megatron-core's sequential
experts holding the same weights.

Run on a GPU host with ``python -m pytest -m gpu tests/test_gpu_grouped_experts.py -v``; skipped without CUDA.

16 experts of hidden 512 / FFN 256 (gated SiLU), uneven token counts with one expert getting none, routing
probabilities in (0, 1). Checked: the output and the gradients of the input, the probabilities and both
stacked weights.

* bf16: both implementations are compared with an fp32 ``SequentialMLP`` of the same weights (TF32 off).
  bf16 rounds inputs, the intermediate activation and every result to 8 mantissa bits (2^-9 relative), and
  the two implementations accumulate in different orders (different kernels), so their difference to each
  other says little; what must hold is that grouped experts are as accurate as sequential ones: the grouped
  error (max abs. difference / max abs. of the fp32 reference) is at most twice the sequential one plus
  1e-3 (a few bf16 ulps). A wrong expert slice, a missed probability scale or a lost gradient is O(1).
* fp32 (TF32 off): equal to the sequential experts within 1e-5 relative (order of accumulation only).
* an expert without tokens has an exactly zero weight gradient in both dtypes.
"""

from __future__ import annotations

import pytest
import torch

from verl_mcore_utils.testing import run_distributed

COUNTS = [40, 0, 17, 96, 8, 33, 64, 1, 120, 5, 72, 24, 48, 3, 88, 16]
HIDDEN, FFN = 512, 256


def _rel(got: torch.Tensor, ref: torch.Tensor) -> float:
    return float((got.double() - ref.double()).abs().max() / ref.double().abs().max())


def _step(module, x, probs, counts, grad) -> dict[str, torch.Tensor]:
    x = x.clone().requires_grad_(True)
    probs = probs.clone().requires_grad_(True)
    out, _ = module(x, counts, probs)
    out.backward(grad.to(out.dtype))
    if hasattr(module, "linear_fc1_weight"):
        d1, d2 = module.linear_fc1_weight.grad, module.linear_fc2_weight.grad
    else:
        d1 = torch.stack([e.linear_fc1.weight.grad for e in module.local_experts])
        d2 = torch.stack([e.linear_fc2.weight.grad for e in module.local_experts])
    values = (out, x.grad, probs.grad, d1, d2)
    return {
        k: v.detach().float().cpu()
        for k, v in zip(("out", "dx", "dprobs", "dfc1", "dfc2"), values, strict=True)
    }


def _worker(rank: int, world_size: int) -> dict[str, dict[str, float]]:
    import torch.nn.functional as F
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.mlp import MLPSubmodules
    from megatron.core.transformer.moe.experts import SequentialMLP
    from megatron.core.transformer.transformer_config import TransformerConfig

    from verl_mcore_utils.grouped_experts import GroupedExperts
    from verl_mcore_utils.parallel import init_parallel

    init_parallel(device="cuda")
    # megatron-core initialises GPU weights under its RNG tracker
    tensor_parallel.model_parallel_cuda_manual_seed(0)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.manual_seed(0)
    sub = MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear)
    pgs = ProcessGroupCollection.use_mpu_process_groups()

    def build(dtype: torch.dtype):
        config = TransformerConfig(
            num_layers=1, hidden_size=HIDDEN, num_attention_heads=8, ffn_hidden_size=FFN,
            moe_ffn_hidden_size=FFN, num_moe_experts=len(COUNTS), moe_router_topk=2, gated_linear_unit=True,
            activation_func=F.silu, add_bias_linear=False, bias_activation_fusion=False,
            gradient_accumulation_fusion=False, bf16=dtype == torch.bfloat16, params_dtype=dtype,
            use_cpu_initialization=False, init_method_std=0.05,
        )  # fmt: skip
        return SequentialMLP(len(COUNTS), config, submodules=sub, pg_collection=pgs), GroupedExperts(
            len(COUNTS), config
        )

    ref32, grp32 = build(torch.float32)
    seq16, grp16 = build(torch.bfloat16)
    with torch.no_grad():
        fc1 = torch.stack([e.linear_fc1.weight for e in ref32.local_experts])
        fc2 = torch.stack([e.linear_fc2.weight for e in ref32.local_experts])
        grp32.linear_fc1_weight.copy_(fc1)
        grp32.linear_fc2_weight.copy_(fc2)
        grp16.linear_fc1_weight.copy_(fc1)
        grp16.linear_fc2_weight.copy_(fc2)
        for e, expert in enumerate(seq16.local_experts):
            expert.linear_fc1.weight.copy_(fc1[e])
            expert.linear_fc2.weight.copy_(fc2[e])
    rows = sum(COUNTS)
    x = torch.randn(rows, HIDDEN, device="cuda")
    probs = torch.rand(rows, device="cuda")
    grad = torch.randn(rows, HIDDEN, device="cuda")
    counts_cpu = torch.tensor(COUNTS)
    counts_gpu = counts_cpu.cuda()
    x16 = x.bfloat16()
    ref = _step(ref32, x16.float(), probs, counts_cpu, grad.bfloat16().float())
    results = {
        "fp32_grouped": _step(grp32, x16.float(), probs, counts_gpu, grad.bfloat16().float()),
        "bf16_sequential": _step(seq16, x16, probs, counts_cpu, grad),
        "bf16_grouped": _step(grp16, x16, probs, counts_gpu, grad),
    }
    empty = COUNTS.index(0)
    out = {
        name: {k: _rel(v, ref[k]) for k, v in res.items()} | {"empty_wgrad": float(res["dfc1"][empty].abs().max() + res["dfc2"][empty].abs().max())}
        for name, res in results.items()
    }  # fmt: skip
    parallel_state.destroy_model_parallel()
    return out


@pytest.mark.gpu
def test_grouped_experts_on_gpu_match_sequential_experts() -> None:
    (errs,) = run_distributed(_worker, world_size=1, backend="nccl")
    print(f"\nrelative errors vs fp32 sequential experts: {errs}")
    for key, err in errs["fp32_grouped"].items():
        assert err <= 1e-5, ("fp32", key, err)
    for key in ("out", "dx", "dprobs", "dfc1", "dfc2"):
        seq, grp = errs["bf16_sequential"][key], errs["bf16_grouped"][key]
        assert grp <= 2 * seq + 1e-3, (key, grp, seq)
    assert errs["bf16_grouped"]["empty_wgrad"] == 0.0
