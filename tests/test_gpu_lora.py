"""GPU: LoRA applied as a pre-wrap hook, then megatron-core DDP and the megatron optimizer.

Run on a GPU host with ``python -m pytest -m gpu tests/test_gpu_lora.py -v``; skipped without CUDA.
verl's rule: adapters are inserted BEFORE DDP wrapping, so that DDP's gradient buffers and the optimizer
hold only the trainable adapter parameters. For bf16 (Float16Module) and fp32 models, with and without the
distributed optimizer, this checks that the frozen base parameters are in no DDP buffer / bucket, have no
main_grad and are not referenced by the optimizer (model parameter groups, main-parameter groups, state),
that the adapter parameters are, and that one training step through megatron's schedule changes every
adapter parameter and not a single bit of the base model.
"""

from __future__ import annotations

from typing import Any

import pytest

from verl_mcore_utils.testing import run_distributed

CASES = [("bfloat16", True), ("bfloat16", False), ("float32", True), ("float32", False)]
VOCAB, SEQ, MICRO = 128, 16, 2


def _model_params_of_optimizer(optimizer: Any) -> tuple[list[Any], list[Any], list[Any]]:
    """(model params the optimizer updates, params of its torch optimizers, tensors keyed in their state)."""
    model_params: list[Any] = []
    inner_params: list[Any] = []
    state_keys: list[Any] = []
    for leaf in getattr(optimizer, "chained_optimizers", None) or [optimizer]:
        groups = []
        for attr in ("model_float16_groups", "model_fp32_groups", "float16_groups", "fp32_from_fp32_groups"):
            groups.extend(getattr(leaf, attr, None) or [])
        inner = leaf.optimizer
        params = [p for group in inner.param_groups for p in group["params"]]
        model_params.extend(p for group in groups for p in group)
        if not groups:  # FP32Optimizer: the torch optimizer holds the model parameters themselves
            model_params.extend(params)
        inner_params.extend(params)
        state_keys.extend(inner.state.keys())
    return model_params, inner_params, state_keys


def _train_step(chunks: list[Any], optimizer: Any) -> float:
    import torch

    from megatron_steps import schedule_step

    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, VOCAB, (MICRO, SEQ + 1), generator=gen).cuda()
    step = schedule_step([chunks], optimizer, [tokens], shift_labels=True)
    assert step.ok, "optimizer step was skipped"
    assert step.grad_norm is not None
    return step.grad_norm


def _case(dtype: str, use_dist_opt: bool) -> dict[str, Any]:
    import torch
    from megatron.core.optimizer import OptimizerConfig

    from verl_mcore_utils.compat import make_megatron_optimizer
    from verl_mcore_utils.ddp import WrapConfig
    from verl_mcore_utils.lora import adapter_named_parameters, peft_pre_wrap_hook
    from verl_mcore_utils.module import (
        GPTModelProvider,
        attach_training_hooks,
        make_megatron_module,
        unwrap_model,
    )
    from verl_mcore_utils.presets import qwen2_preset
    from verl_mcore_utils.transformer_config import hf_to_transformer_config

    hf = qwen2_preset("tiny", vocab_size=VOCAB)
    tf = hf_to_transformer_config(hf, dtype=dtype)
    torch.manual_seed(0)
    chunks = make_megatron_module(
        GPTModelProvider(
            hf_config=hf, transformer_config=tf, device=torch.device("cuda", torch.cuda.current_device())
        ),
        wrap_config=WrapConfig(use_distributed_optimizer=use_dist_opt),
        pre_wrap_hooks=[
            peft_pre_wrap_hook({"rank": 8, "alpha": 16, "lora_B_init_method": "normal"}, verbose=False)
        ],
    )
    (ddp,) = chunks
    model = unwrap_model(ddp)
    adapters = {id(p): n for n, p in adapter_named_parameters(chunks)}
    named = dict(model.named_parameters())
    base = {id(p): n for n, p in named.items() if id(p) not in adapters}

    buffer_params = {id(p) for buf in [*ddp.buffers, *ddp.expert_parallel_buffers] for p in buf.params}
    bucket_params = {id(p) for p in ddp.param_to_bucket_group}
    with_main_grad = {id(p) for p in named.values() if getattr(p, "main_grad", None) is not None}

    optimizer = make_megatron_optimizer(
        OptimizerConfig(
            optimizer="adam",
            lr=1e-2,
            clip_grad=1.0,
            bf16=dtype == "bfloat16",
            params_dtype=getattr(torch, dtype),
            use_distributed_optimizer=use_dist_opt,
        ),
        chunks,
    )
    attach_training_hooks(chunks, optimizer)
    model_params, inner_params, _ = _model_params_of_optimizer(optimizer)
    before = {n: p.detach().clone() for n, p in named.items()}
    grad_norm = _train_step(chunks, optimizer)
    _, _, state_keys = _model_params_of_optimizer(optimizer)
    after = dict(model.named_parameters())
    changed = {n for n in named if not torch.equal(before[n], after[n].detach())}
    adapter_numel = sum(named[n].numel() for n in adapters.values())
    return {
        "wrapper": type(ddp).__name__,
        "dist_opt": ddp.ddp_config.use_distributed_optimizer,
        "n_adapters": len(adapters),
        "n_base": len(base),
        "adapters_all_trainable": all(named[n].requires_grad for n in adapters.values()),
        "base_all_frozen": not any(named[n].requires_grad for n in base.values()),
        "adapter_dtypes": sorted({str(named[n].dtype) for n in adapters.values()}),
        "base_in_buffers": sorted(base[i] for i in buffer_params & base.keys()),
        "base_in_buckets": sorted(base[i] for i in bucket_params & base.keys()),
        "base_with_main_grad": sorted(base[i] for i in with_main_grad & base.keys()),
        "buffers_are_adapters": buffer_params == adapters.keys(),
        "buckets_are_adapters": bucket_params == adapters.keys(),
        "optimizer_model_params_are_adapters": {id(p) for p in model_params} == adapters.keys(),
        "base_in_optimizer": sorted(base[id(p)] for p in [*model_params, *inner_params] if id(p) in base),
        "optimizer_numel": sum(p.numel() for p in inner_params),
        "adapter_numel": adapter_numel,
        "state_in_optimizer_params": {id(k) for k in state_keys} <= {id(p) for p in inner_params},
        "state_len": len(state_keys),
        "grad_norm": grad_norm,
        "changed_base": sorted(n for n in changed if n not in adapters.values()),
        "unchanged_adapters": sorted(n for n in adapters.values() if n not in changed),
    }


def _worker(rank: int, world_size: int) -> dict[str, Any]:
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from verl_mcore_utils.parallel import init_parallel

    init_parallel(device="cuda")
    model_parallel_cuda_manual_seed(0)
    return {f"{dtype}-{'distopt' if d else 'allreduce'}": _case(dtype, d) for dtype, d in CASES}


@pytest.mark.gpu
def test_lora_before_ddp_only_adapters_are_trained() -> None:
    pytest.importorskip("peft")
    (results,) = run_distributed(_worker, world_size=1, backend="nccl", timeout_s=300)
    for (dtype, dist_opt), (key, out) in zip(CASES, results.items(), strict=True):
        assert out["wrapper"] == "DistributedDataParallel" and out["dist_opt"] is dist_opt, key
        assert out["n_adapters"] == 2 * 4 * 2 and out["n_base"] > 0, key  # layers x linears x (A, B)
        assert out["adapters_all_trainable"] and out["base_all_frozen"], key
        assert out["adapter_dtypes"] == [f"torch.{dtype}"], key
        # DDP: frozen base parameters have no gradient buffer, bucket or main_grad
        assert out["base_in_buffers"] == [] and out["base_in_buckets"] == [], (key, out)
        assert out["base_with_main_grad"] == [], (key, out)
        assert out["buffers_are_adapters"] and out["buckets_are_adapters"], key
        # optimizer: model groups are exactly the adapters; its own params (fp32 main copies / shards) cover
        # exactly the adapters' elements (one DP rank: the shard is everything); its state keys are those
        assert out["optimizer_model_params_are_adapters"] and out["base_in_optimizer"] == [], (key, out)
        assert out["optimizer_numel"] == out["adapter_numel"], (key, out)
        assert out["state_in_optimizer_params"] and out["state_len"] > 0, (key, out)
        # one step: every adapter parameter moved, no base bit did
        assert out["grad_norm"] > 0, key
        assert out["changed_base"] == [], (key, out["changed_base"])
        assert out["unchanged_adapters"] == [], (key, out["unchanged_adapters"])
