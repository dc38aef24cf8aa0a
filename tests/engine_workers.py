"""Per-rank functions for the cross-package distributed tests (picklable: module level)."""

from __future__ import annotations

from typing import Any

import torch


def engine_step(rank: int, world_size: int, device: str, overrides: list[str]) -> dict[str, Any]:
    """Build an engine, run compute_gradients + optimizer_step on global batch 0, report everything."""
    from megatron.core import parallel_state

    from verl_config import SFTConfig, load_config
    from verl_engine.demo import ArithmeticDataset, CharTokenizer
    from verl_engine.engine import build_engine
    from verl_mcore_utils.parallel import init_parallel
    from verl_mcore_utils.presets import qwen2_preset

    cfg = load_config(SFTConfig, overrides=["model.preset=tiny", "data.max_length=32", *overrides])
    dims = init_parallel(device="cuda" if device == "cuda" else "cpu")
    dp = cfg.check_world_size(dims.world_size)
    tok = CharTokenizer()
    hf = qwen2_preset(cfg.model.preset, vocab_size=tok.padded_vocab_size(128))
    dev = torch.device("cuda", torch.cuda.current_device()) if device == "cuda" else torch.device("cpu")
    engine = build_engine(cfg, hf_config=hf, dims=dims, device=dev)
    batch = ArithmeticDataset(seq_length=cfg.data.max_length, seed=0, tokenizer=tok).global_batch(
        step=0, batch_size=cfg.data.train_batch_size
    )
    local = batch.shard(rank=parallel_state.get_data_parallel_rank(), num_shards=dp)
    loss, tokens = engine.compute_gradients(local.micro_batches(cfg.data.micro_batch_size_per_gpu))
    grads = engine.named_gradients()
    grad_norm = engine.optimizer_step()
    info = engine.describe()
    return {"loss": loss, "tokens": tokens, "grads": grads, "grad_norm": grad_norm, "engine": info, "dp": dp}


def max_rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max |b| (a scale-aware error that does not blow up on near-zero entries)."""
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))
