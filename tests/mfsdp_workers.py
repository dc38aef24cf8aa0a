"""Spawned-rank workers for the Megatron-FSDP GPU tests."""

from __future__ import annotations

from typing import Any

import torch


def adam_config() -> Any:
    """The optimizer of every Megatron-FSDP GPU test (and of its DDP reference runs): Adam lr 3e-3, bf16
    with fp32 main params, distributed, gradients clipped at 1.0."""
    from megatron.core.optimizer import OptimizerConfig

    return OptimizerConfig(
        optimizer="adam",
        lr=3e-3,
        bf16=True,
        params_dtype=torch.bfloat16,
        use_distributed_optimizer=True,
        clip_grad=1.0,
    )


def train_steps(
    rank: int,
    world_size: int,
    backend_kind: str,
    steps: int,
    strategy: str | None,
    path: str | None = None,
    ckpt: str | None = None,
    shape: tuple[int, int, int] = (128, 256, 4),
    override: dict[str, Any] | None = None,
    fused_adam: bool = True,
) -> dict[str, Any]:
    """``steps`` Adam steps of a tiny Qwen2 on fixed data with DDP + distributed optimizer or Megatron-FSDP.

    ``path``: None = our provider with a model of ``shape`` (hidden, intermediate, layers); "provider" /
    "mbridge" / "spec" = the tiny model of that construction path (construction_workers.make_provider).
    ``override``: more override_ddp_config keys for the Megatron-FSDP run. ``peak_bytes``: the most memory
    the training steps allocated on this GPU, beyond what construction left allocated. ``fused_adam``: torch's
    fused Adam kernel (the default) or its foreach one; ``adam_fused`` reports what the param groups ran.
    """
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from megatron_steps import schedule_step
    from verl_mcore_utils.compat import make_megatron_optimizer
    from verl_mcore_utils.ddp import WrapConfig
    from verl_mcore_utils.hf_testing import tiny_hf_config
    from verl_mcore_utils.module import GPTModelProvider, attach_training_hooks, make_megatron_module
    from verl_mcore_utils.offload import inner_torch_optimizer, leaf_optimizers
    from verl_mcore_utils.parallel import init_parallel
    from verl_mcore_utils.transformer_config import hf_to_transformer_config
    from verl_mfsdp.wrap import (
        make_megatron_fsdp_module,
        make_megatron_fsdp_optimizer,
        synchronize_megatron_fsdp_params,
    )

    init_parallel(device="cuda")
    model_parallel_cuda_manual_seed(1234)
    torch.manual_seed(0)
    hidden, intermediate, layers = shape
    hf = tiny_hf_config(
        "qwen2", hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers
    ).to_dict()
    tf = hf_to_transformer_config(hf, dtype="bfloat16")
    provider = GPTModelProvider(hf_config=hf, transformer_config=tf, device="cuda")
    if path is not None:
        from construction_workers import make_provider

        provider = make_provider(path, ckpt=ckpt)
    opt_cfg = adam_config()
    if backend_kind == "fsdp":
        override = {**({"data_parallel_sharding_strategy": strategy} if strategy else {}), **(override or {})}
        chunks = make_megatron_fsdp_module(
            provider, wrap_config=WrapConfig(use_megatron_fsdp=True), override_ddp_config=override
        )
        opt = make_megatron_fsdp_optimizer(opt_cfg, chunks, fused_adam=fused_adam)
    else:
        chunks = make_megatron_module(
            provider,
            wrap_config=WrapConfig(use_distributed_optimizer=True),
            override_ddp_config={"grad_reduce_in_fp32": True},
        )
        opt = make_megatron_optimizer(opt_cfg, chunks, fused_adam=fused_adam)
    attach_training_hooks(chunks, opt)
    gen = torch.Generator("cuda").manual_seed(100 + rank)
    data = [torch.randint(0, 128, (4, 32), device="cuda", generator=gen) for _ in range(2)]
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    results = [schedule_step([chunks], opt, data) for _ in range(steps)]
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - before
    losses = [r.loss for r in results]
    norms = [r.grad_norm for r in results]
    synced = synchronize_megatron_fsdp_params(chunks) if backend_kind == "fsdp" else None
    return {
        "losses": losses,
        "grad_norms": norms,
        "wrapper": type(chunks[0]).__name__,
        "synced": synced,
        "peak_bytes": peak,
        "adam_fused": sorted(
            {
                bool(g.get("fused"))
                for leaf in leaf_optimizers(opt)
                for g in inner_torch_optimizer(leaf).param_groups
            }
        ),
        # q and o (h x h), k and v (GQA: half the heads), gate, up and down: biases and norms left out
        "layer_params": 3 * hidden * hidden + 3 * hidden * intermediate,
    }
