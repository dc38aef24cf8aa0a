"""GPU: torch's fused Adam inside megatron-core's optimizer (no Transformer Engine, no Apex).

Run on a GPU host with ``python -m pytest -m gpu tests/test_gpu_fused_adam.py -v``; skipped without CUDA.
For the mixed-precision optimizer and the distributed optimizer (bf16 model, fp32 master weights): two
identical training states, one built by ``make_megatron_optimizer`` (fused by default), one with torch's
foreach implementation; three ``optimizer.step()`` calls with the same gradients written into both gradient
buffers (a backward pass on GPU is not bitwise reproducible, and Adam's first steps amplify the difference). The fused one
must really be fused (every param group) and its fp32 master weights must equal the foreach one's to the
rounding of the same update: |diff| <= 1e-6 |w| + 1e-5 lr (a few ulps of the weight, plus 1e-5 of one step:
the two kernels round the bias-corrected update differently; measured 4.6e-9 at lr 1e-3).
"""

from __future__ import annotations

from typing import Any

import pytest

from verl_mcore_utils.testing import run_distributed

VOCAB, SEQ, MICRO, LR = 256, 64, 2, 1e-3


def _state(*, dist_opt: bool, fused: bool) -> tuple[list[Any], Any]:
    import torch
    from megatron.core.optimizer import OptimizerConfig

    from verl_mcore_utils.compat import make_megatron_optimizer
    from verl_mcore_utils.ddp import WrapConfig
    from verl_mcore_utils.module import GPTModelProvider, attach_training_hooks, make_megatron_module
    from verl_mcore_utils.presets import qwen2_preset
    from verl_mcore_utils.transformer_config import hf_to_transformer_config

    hf = qwen2_preset("tiny", vocab_size=VOCAB)
    torch.manual_seed(0)
    chunks = make_megatron_module(
        GPTModelProvider(
            hf_config=hf,
            transformer_config=hf_to_transformer_config(hf, dtype="bfloat16"),
            device=torch.device("cuda", torch.cuda.current_device()),
        ),
        wrap_config=WrapConfig(use_distributed_optimizer=dist_opt),
    )
    config = OptimizerConfig(
        optimizer="adam", lr=LR, clip_grad=1.0, bf16=True, params_dtype=torch.bfloat16,
        use_distributed_optimizer=dist_opt,
    )  # fmt: skip
    optimizer = make_megatron_optimizer(config, chunks, fused_adam=fused)
    attach_training_hooks(chunks, optimizer)
    return chunks, optimizer


def _case(dist_opt: bool) -> dict[str, Any]:
    import torch

    from verl_mcore_utils.offload import inner_torch_optimizer, leaf_optimizers, master_params

    runs = {}
    for fused in (True, False):
        chunks, optimizer = _state(dist_opt=dist_opt, fused=fused)
        start = [p.detach().clone() for p in chunks[0].parameters()]
        gen = torch.Generator(device="cuda").manual_seed(1)
        for _ in range(3):  # the same gradients for both: only the Adam implementation differs
            for buffer in chunks[0].buffers:
                buffer.grad_data.copy_(
                    torch.randn(buffer.grad_data.shape, generator=gen, device="cuda") * 1e-2
                )
            update_successful, _, _ = optimizer.step()
            assert update_successful
        groups = [g for leaf in leaf_optimizers(optimizer) for g in inner_torch_optimizer(leaf).param_groups]
        runs[fused] = {
            "fused_flags": sorted({bool(g.get("fused")) for g in groups}),
            "masters": [t.detach().float().clone() for t in master_params(optimizer)],
            "start": start,
        }
        del chunks, optimizer
        torch.cuda.empty_cache()
    a, b = runs[True]["masters"], runs[False]["masters"]
    same_start = all(
        torch.equal(x, y) for x, y in zip(runs[True]["start"], runs[False]["start"], strict=True)
    )
    excess = max(
        float(((x - y).abs() - (1e-6 * y.abs() + 1e-5 * LR)).max()) for x, y in zip(a, b, strict=True)
    )
    return {
        "fused_flags": runs[True]["fused_flags"],
        "foreach_flags": runs[False]["fused_flags"],
        "n_masters": len(a),
        "same_start": same_start,
        "max_abs_diff": max(float((x - y).abs().max()) for x, y in zip(a, b, strict=True)),
        "excess_over_bound": excess,
    }


def _worker(rank: int, world_size: int) -> dict[str, Any]:
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from verl_mcore_utils.parallel import init_parallel

    init_parallel(device="cuda")
    model_parallel_cuda_manual_seed(0)
    return {dist_opt: _case(dist_opt) for dist_opt in (False, True)}


@pytest.mark.gpu
def test_fused_adam_matches_foreach_in_megatron_optimizers() -> None:
    (results,) = run_distributed(_worker, world_size=1, backend="nccl", timeout_s=300)
    for dist_opt, out in results.items():
        assert out["fused_flags"] == [True] and out["foreach_flags"] == [False], (dist_opt, out)
        assert out["n_masters"] > 0 and out["same_start"], (dist_opt, out)  # control: identical starts
        assert out["excess_over_bound"] <= 0, (dist_opt, out)
