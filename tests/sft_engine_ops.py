"""Test helpers: SFT operations (log-probs, gradients, plans) of a packed batch through the one engine.

The packed CP tests were written against packed batches (:class:`verl_engine.packed.PackedBatch`); the engine
takes verl's layout. These helpers convert (each sequence's first token is the prompt, the rest the response,
the batch's label mask the response mask) and read what the tests compare: log-probs in packed order,
reduced gradients by name, the planner's CP sizes and the RoPE positions each rank used.
"""

from __future__ import annotations

from typing import Any

import torch

from verl_engine.losses import sft_loss


def sft_data(batch: Any) -> dict[str, torch.Tensor]:
    """A packed batch in verl's layout: prompt = the first token, response = the rest (right-padded)."""
    lens = list(batch.seq_lens)
    width = max(lens, default=1)
    ids = torch.zeros((len(lens), width), dtype=torch.long)
    mask = torch.zeros_like(ids)
    targets = batch.target_mask if batch.label_mask is not None else None
    response_mask = torch.zeros((len(lens), width - 1), dtype=torch.long)
    for i, (seq, n) in enumerate(zip(torch.split(batch.input_ids, lens), lens, strict=True)):
        ids[i, :n] = seq
        mask[i, :n] = 1
        tgt = targets[batch.cu_seqlens[i] : batch.cu_seqlens[i] + n] if targets is not None else None
        response_mask[i, : n - 1] = 1 if tgt is None else tgt[1:].long()
    return {"input_ids": ids, "attention_mask": mask, "response_mask": response_mask}


def log_probs(engine: Any, batch: Any) -> torch.Tensor:
    """float32 ``[total tokens]`` in packed order: entry t is log p(x_t | x_<t), 0 for each first token."""
    out = engine.infer_batch(sft_data(batch))["model_output"]["log_probs"].float()
    rows = [torch.cat((torch.zeros(1), out[i, : n - 1].cpu())) for i, n in enumerate(batch.seq_lens)]
    return torch.cat(rows)


def gradients(engine: Any, batch: Any) -> tuple[float, int]:
    """Forward + backward of the packed batch with ``sft_loss``; (global mean token loss, loss tokens)."""
    engine.optimizer_zero_grad()
    data = sft_data(batch)
    out = engine.forward_backward_batch(data, sft_loss)
    return float(out["loss"]), int(data["response_mask"].sum())


def named_gradients(engine: Any) -> dict[str, torch.Tensor]:
    """Reduced gradients by parameter name (``main_grad`` under megatron DDP), as fp32 CPU copies."""
    out: dict[str, torch.Tensor] = {}
    for name, p in engine.model.named_parameters():
        grad = engine.backend.gradient(p)
        if grad is not None:
            out[name.removeprefix("module.").removeprefix("module.")] = grad.detach().float().cpu().clone()
    return out


def set_lr(engine: Any, lr: float) -> None:
    for group in engine.optimizer.param_groups:
        group["lr"] = lr


def plans(engine: Any, batch: Any) -> list[Any]:
    """The engine's planned micro-batches of ``batch`` (what the planner chose)."""
    from verl_engine.rl_batch import RLBatch

    return engine._plan(RLBatch.from_data(sft_data(batch)))
