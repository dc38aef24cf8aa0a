"""Per-rank functions for the cross-package distributed tests (picklable: module level)."""

from __future__ import annotations

from typing import Any

import torch


def engine_step(rank: int, world_size: int, device: str, overrides: list[str]) -> dict[str, Any]:
    """Build the SFT run's engine, run forward_backward_batch(sft_loss) + optimizer_step on global batch 0."""
    import sft_engine_ops as ops

    from verl_config import SFTConfig, load_config
    from verl_engine.apps.demo import ArithmeticDataset, CharTokenizer
    from verl_engine.apps.sft import build_sft_engine
    from verl_engine.losses import sft_loss
    from verl_mcore_utils.parallel import init_parallel

    cfg = load_config(SFTConfig, overrides=["model.preset=tiny", "data.max_length=32", *overrides])
    dims = init_parallel(device="cuda" if device == "cuda" else "cpu")
    cfg.check_world_size(dims.world_size)
    dev = torch.device("cuda", torch.cuda.current_device()) if device == "cuda" else torch.device("cpu")
    engine = build_sft_engine(cfg, device=dev)
    batch = ArithmeticDataset(seq_length=cfg.data.max_length, seed=0, tokenizer=CharTokenizer()).global_batch(
        step=0, batch_size=cfg.data.train_batch_size
    )
    out = engine.forward_backward_batch(batch, sft_loss)
    grads = ops.named_gradients(engine)
    grad_norm = engine.optimizer_step()
    info = engine.describe()
    tokens = int(batch["response_mask"].sum())
    result = {"loss": out["loss"], "tokens": tokens, "grads": grads, "grad_norm": grad_norm, "engine": info}
    result["dp"] = engine.pool_size
    engine.close()
    return result


def max_rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max |b| (a scale-aware error that does not blow up on near-zero entries)."""
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))
