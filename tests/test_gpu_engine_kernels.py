"""GPU: one engine step with our Triton kernels gives the gradients of the same step through torch's ops.

Run on a GPU host with ``python -m pytest -m gpu tests/test_gpu_engine_kernels.py -v``; skipped without CUDA.

The kernels' own tests (``packages/verl-engine/tests/test_gpu_vocab_kernels.py``, the SwiGLU and RoPE tests)
check each kernel against its torch form on tensors the test makes. This one checks them where the engine
uses them: one PPO forward/backward of a small bf16 Qwen2-shaped model on one GPU, with the entropy bonus on
(so the entropy's gradient flows), once as the engine runs it and once with the vocabulary kernels
(log-probs, entropy, their gradient; the fused LM head) and the SwiGLU kernel switched to their torch paths.
What it guards: the layout of what the engine hands the kernels. At 28e7597 the engine merged log-probs and
entropy as two columns of one tensor, the entropy's gradient reached the vocabulary kernel as a stride-2
view, and the kernel read other rows' values; only multi-GPU parity tests saw it.

Tolerance: 1e-2 of each gradient's norm, as in ``test_gpu_wgrad_fusion.py``. Both paths compute the
softmax statistics and the logits' gradient in float32 and round it to bf16 once (so they differ by one bf16
rounding step, 2^-8 relative per element, and the summation order); the SwiGLU forms differ likewise. Those
differences are a few tenths of a percent of a gradient's norm after the backward; a misread row, a lost
entropy term or a wrong temperature is several percent or more.
"""

from __future__ import annotations

import pytest
from rl_engine_workers import SMALL_QWEN2 as HF

from verl_mcore_utils.testing import run_distributed

OVERRIDES = ("actor_rollout_ref.actor.entropy_coeff=0.01",)
TOL = 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("fused_head", [False, True])
def test_an_engine_step_with_the_kernels_gives_the_torch_paths_gradients(fused_head: bool) -> None:
    from rl_engine_workers import gpu_wgrad_fusion_grads

    ((kernels, torch_paths),) = run_distributed(
        gpu_wgrad_fusion_grads,
        world_size=1,
        args=(HF, fused_head, ["default", "torch_kernels"], OVERRIDES),
        backend="nccl",
    )
    # the same loss: both paths compute the statistics in float32 from the same bf16 logits
    assert abs(kernels["loss"] - torch_paths["loss"]) <= 1e-4 * abs(torch_paths["loss"]) + 1e-6
    assert kernels["grads"].keys() == torch_paths["grads"].keys()
    for name, ref in torch_paths["grads"].items():
        got = kernels["grads"][name]
        assert float(ref.norm()) > 0, name
        err = float((got - ref).norm() / ref.norm())
        assert err <= TOL, (name, err)
