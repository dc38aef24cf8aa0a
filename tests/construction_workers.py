"""Spawned-rank workers for the GPU construction tests (module level so spawn can import them)."""

from __future__ import annotations

import importlib.util
from typing import Any

import pytest
import torch

# mbridge is an optional extra: tests parametrised over it skip its path, not fail, where it is not installed
MBRIDGE = pytest.param(
    "mbridge",
    marks=pytest.mark.skipif(
        importlib.util.find_spec("mbridge") is None,
        reason="mbridge is not installed (pip install 'verl-mcore-utils[mbridge]')",
    ),
)


def _collectives(fn: Any) -> set[str]:
    """Names of the collectives ``fn`` launches, read from the profiler (CPU ops and NCCL kernels)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    found = set()
    for event in prof.events():
        name = event.name.lower().replace("_", "")
        for kind in ("reducescatter", "allreduce", "allgather"):
            if kind in name:
                found.add(kind)
    return found


def make_provider(path: str, *, ckpt: str | None) -> Any:
    """A tiny Qwen2 through construction path ``path``: provider (ours), mbridge (from ``ckpt``) or plain spec."""
    from verl_mcore_utils.model import local_layer_spec
    from verl_mcore_utils.module import GPTModelProvider, SpecProvider
    from verl_mcore_utils.transformer_config import hf_to_transformer_config

    if path == "mbridge":
        from verl_mcore_utils.bridges import MBridgeProvider

        assert ckpt is not None  # saved by the parent process (as the checkpoint a trainer would load)
        return MBridgeProvider.from_pretrained(ckpt, device="cuda", dtype="bfloat16")
    from verl_mcore_utils.hf_testing import tiny_hf_config

    hf = tiny_hf_config("qwen2").to_dict()
    tf = hf_to_transformer_config(hf, dtype="bfloat16")
    if path == "provider":
        return GPTModelProvider(hf_config=hf, transformer_config=tf, device="cuda")
    return SpecProvider(
        transformer_config=tf,
        layer_spec=local_layer_spec(tf),
        vocab_size=128,
        max_sequence_length=64,
        device="cuda",
    )


def build_and_reduce(
    rank: int, world_size: int, path: str, use_dist_opt: bool, override: dict | None, ckpt: str | None = None
) -> dict:
    """Build a tiny model through ``path``, wrap it with DDP, run one backward and one grad sync."""
    from verl_mcore_utils.ddp import WrapConfig
    from verl_mcore_utils.module import make_megatron_module
    from verl_mcore_utils.parallel import init_parallel

    init_parallel(device="cuda")
    torch.manual_seed(0)
    provider = make_provider(path, ckpt=ckpt)
    chunks = make_megatron_module(
        provider, wrap_config=WrapConfig(use_distributed_optimizer=use_dist_opt), override_ddp_config=override
    )
    model = chunks[0]
    tokens = torch.randint(
        0, 128, (2, 16), device="cuda", generator=torch.Generator("cuda").manual_seed(rank)
    )
    pos = torch.arange(16, device="cuda").expand(2, 16)
    model.zero_grad_buffer()
    loss = model(input_ids=tokens, position_ids=pos, attention_mask=None, labels=tokens).float().mean()
    loss.backward()
    seen = _collectives(model.finish_grad_sync)
    return {
        "wrapper": type(model).__name__,
        "ddp_use_distributed_optimizer": model.ddp_config.use_distributed_optimizer,
        "grad_reduce_in_fp32": model.ddp_config.grad_reduce_in_fp32,
        "collectives": sorted(seen),
    }


def train_with_hooks(rank: int, world_size: int, overlap: bool) -> dict:
    """make_megatron_module + megatron optimizer + attach_training_hooks drive megatron's own schedule."""
    from megatron.core.optimizer import OptimizerConfig

    from megatron_steps import schedule_step
    from verl_mcore_utils.compat import make_megatron_optimizer
    from verl_mcore_utils.ddp import WrapConfig
    from verl_mcore_utils.hf_testing import tiny_hf_config
    from verl_mcore_utils.module import GPTModelProvider, attach_training_hooks, make_megatron_module
    from verl_mcore_utils.parallel import init_parallel
    from verl_mcore_utils.transformer_config import hf_to_transformer_config

    init_parallel(device="cuda")
    torch.manual_seed(0)
    hf = tiny_hf_config("qwen2").to_dict()
    tf = hf_to_transformer_config(hf, dtype="bfloat16")
    override = (
        {"overlap_grad_reduce": True, "overlap_param_gather": True, "align_param_gather": True}
        if overlap
        else {}
    )
    chunks = make_megatron_module(
        GPTModelProvider(hf_config=hf, transformer_config=tf, device="cuda"),
        wrap_config=WrapConfig(use_distributed_optimizer=True),
        override_ddp_config=override,
    )
    opt = make_megatron_optimizer(
        OptimizerConfig(
            optimizer="adam", lr=1e-2, bf16=True, params_dtype=torch.bfloat16, use_distributed_optimizer=True
        ),
        chunks,
    )
    config = attach_training_hooks(chunks, opt)
    gen = torch.Generator("cuda").manual_seed(rank)
    data = [torch.randint(0, 128, (2, 16), device="cuda", generator=gen) for _ in range(2)]
    steps = [schedule_step([chunks], opt, data) for _ in range(3)]
    return {
        "grad_scale_is_optimizer": config.grad_scale_func == opt.scale_loss,
        "finalize_set": config.finalize_model_grads_func is not None,
        "no_sync_set": getattr(config, "no_sync_func", None) is not None,
        "param_sync_set": getattr(config, "param_sync_func", None) is not None,
        "step_ok": all(step.ok for step in steps),
        "grad_norm": steps[-1].grad_norm,
        "losses": [step.loss for step in steps],
    }
