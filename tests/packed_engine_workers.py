"""Per-rank functions of the packed-batch (static / dynamic CP) engine tests, CPU (gloo) and GPU (NCCL).

Every rank builds the engine from an SFT config given as verl override strings (so the config switch
``megatron.dynamic_context_parallel`` / ``max_seqlen_per_dp_cp_rank`` / ``context_parallel_size`` is what
is tested), gets the same global batch, and reports loss, gradients, log-probs and, after optimizer
steps, the losses of later steps. megatron-core is initialised with context_parallel_size=1: the DP x CP
pool is the whole world (TP = PP = 1 here).
"""

from __future__ import annotations

from typing import Any

import sft_engine_ops as ops
import torch

VOCAB = 256


def packed_batch(lengths: tuple[int, ...], *, seed: int, masked: bool = False) -> Any:
    """The same packed batch on every rank; ``masked``: only the second half of each sequence is a target."""
    from verl_engine.packed import PackedBatch

    g = torch.Generator().manual_seed(seed)
    seqs = [torch.randint(1, VOCAB, (n,), generator=g) for n in lengths]
    masks = None
    if masked:
        masks = [torch.arange(n) >= n // 2 for n in lengths]
    return PackedBatch.from_sequences(seqs, label_masks=masks)


def _engine(
    device: str, overrides: list[str], max_tokens_per_rank: int | None, ckpt: str | None = None
) -> Any:
    from megatron.core import parallel_state

    from verl_config import SFTConfig, load_config
    from verl_engine.build import build_rl_engine
    from verl_engine.micro_batching import MicroBatching
    from verl_mcore_utils.parallel import init_parallel
    from verl_mcore_utils.presets import qwen2_preset

    cfg = load_config(
        SFTConfig,
        overrides=["model.preset=tiny", "optim.lr_warmup_steps=0", "optim.clip_grad=0", *overrides],
    )
    if not parallel_state.model_parallel_is_initialized():  # CP lives in verl-dyncp's groups
        init_parallel(tensor_model_parallel_size=cfg.megatron.tensor_model_parallel_size, device=device)
    hf = qwen2_preset(cfg.model.preset, vocab_size=VOCAB, **cfg.model.override_config)
    dev = torch.device("cuda", torch.cuda.current_device()) if device == "cuda" else torch.device("cpu")
    engine = build_rl_engine(
        engine=cfg.megatron,
        model_path=None,
        optim=cfg.optim,
        micro_batching=MicroBatching(
            use_dynamic_bsz=True,
            # the budget per rank; under dynamic CP it defaults to max_seqlen_per_dp_cp_rank (as CPLayout's)
            max_token_len_per_gpu=max_tokens_per_rank or cfg.megatron.max_seqlen_per_dp_cp_rank or 1 << 30,
        ),
        device=dev,
        hf_config=hf,
        total_training_steps=cfg.trainer.total_training_steps,
        fused_lm_head=cfg.model.use_fused_kernels,
    )
    if ckpt is not None:
        # Seeded initialisation is identical for every DP / CP layout but not across TP sizes on every
        # megatron-core release (0.14 initialises TP shards differently), so TP runs load the reference's
        # initial weights. In place, before any step (the debug backend's AdamW holds these tensors).
        from verl_mcore_utils.weights import load_hf_weights

        load_hf_weights(engine.model, ckpt, hf_config=hf)
    return engine, cfg


def packed_run(
    rank: int,
    world_size: int,
    device: str,
    overrides: list[str],
    batches: list[tuple[tuple[int, ...], int, bool]],
    max_tokens_per_rank: int | None = None,
    ckpt: str | None = None,
) -> dict[str, Any]:
    """Log-probs of batch 0, then one optimizer step per batch; gradients and log-probs of step 1."""
    engine, cfg = _engine(device, overrides, max_tokens_per_rank, ckpt)
    data = [packed_batch(lens, seed=seed, masked=masked) for lens, seed, masked in batches]
    logp = ops.log_probs(engine, data[0])
    losses, grads, plans = [], None, []
    for step, batch in enumerate(data):
        plans.append(_plan_summary(engine, batch))
        loss, tokens = ops.gradients(engine, batch)
        if step == 0 and engine.tp_size == 1:  # under TP each rank holds its own shards
            grads = ops.named_gradients(engine)
        ops.set_lr(engine, cfg.optim.lr)
        engine.optimizer_step()
        losses.append(loss)
    logp_after = ops.log_probs(engine, data[0])
    out = {
        "losses": losses,
        "tokens": tokens,
        "grads": grads,
        "logp": logp,
        "logp_after": logp_after,
        "plans": plans,
        "engine": engine.describe(),
        "positions": _merged_positions(engine, data[0]),
        # which core attention ran (verl-dyncp's own or Transformer Engine's)
        "attention": sorted(
            {type(m).__name__ for n, m in engine.model.named_modules() if n.endswith("core_attention")}
        ),
    }
    engine.close()
    return out


def packed_runs(
    rank: int,
    world_size: int,
    device: str,
    variants: list[tuple[list[str], int | None]],
    batches: list[tuple[tuple[int, ...], int, bool]],
    ckpt: str | None = None,
) -> list[dict[str, Any]]:
    """:func:`packed_run` for several (overrides, budget) layouts in ONE process group (one spawn)."""
    return [packed_run(rank, world_size, device, o, batches, budget, ckpt) for o, budget in variants]


def _plan_summary(engine: Any, batch: Any) -> list[tuple[int, ...]]:
    """The CP size(s) of every micro-batch of ``batch`` (what the planner chose)."""
    return engine.plan_cp_sizes(ops.sft_data(batch))


def _merged_positions(engine: Any, batch: Any) -> list[int]:
    """The RoPE position of every token as each rank holds it, merged back to the original order."""
    from verl_dyncp.planner import dynamic_cp_merge_output

    out: list[int] = [0] * sum(batch.seq_lens)
    cu = batch.cu_seqlens
    for p in ops.plans(engine, batch):
        indices, mb = p.indices, p.split
        merged = dynamic_cp_merge_output(
            mb.batch.position_ids.to(engine.device), micro_batch=mb, groups=engine.cp_groups
        ).tolist()
        offset = 0
        for i in indices:
            n = batch.seq_lens[i]
            out[cu[i] : cu[i] + n] = merged[offset : offset + n]
            offset += n
    return out


def packed_errors(
    rank: int,
    world_size: int,
    overrides: list[str],
    cases: list[list[tuple[int, ...]]],
    max_tokens_per_rank: int | None = None,
) -> list[str]:
    """Train on bad batches (per case: lengths per rank, cycled); return every error message.

    Every rank must raise the same clear error and none may hang; the engine stays usable afterwards
    (a good batch is trained last).
    """
    engine, _ = _engine("cpu", overrides, max_tokens_per_rank)
    messages = []
    for lengths_by_rank in cases:
        batch = packed_batch(lengths_by_rank[rank % len(lengths_by_rank)], seed=5)
        try:
            ops.gradients(engine, batch)
            messages.append("no error")
        except ValueError as err:
            messages.append(str(err))
    loss, _ = ops.gradients(engine, packed_batch((9, 4), seed=1))
    messages.append(f"then trained: {loss:.4f}")
    return messages


def hf_log_probs(ckpt: str, lengths: tuple[int, ...], seed: int) -> torch.Tensor:
    """Reference log-probs from Hugging Face transformers, one sequence at a time, fp32 on CPU."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(ckpt, torch_dtype=torch.float32).eval()
    batch = packed_batch(lengths, seed=seed)
    out = []
    with torch.no_grad():
        for seq in torch.split(batch.input_ids, list(lengths)):
            logits = model(input_ids=seq[None]).logits[0].float()
            lp = torch.log_softmax(logits, dim=-1)[:-1].gather(1, seq[1:, None])[:, 0]
            out.append(torch.cat((torch.zeros(1), lp)))
    return torch.cat(out)


def save_engine_weights(rank: int, world_size: int, overrides: list[str], path: str) -> None:
    """Write the engine's initial weights as a Hugging Face checkpoint (same seed as packed_run)."""
    from verl_mcore_utils.presets import qwen2_preset
    from verl_mcore_utils.weights import save_hf_weights

    engine, cfg = _engine("cpu", overrides, 4096)
    hf = qwen2_preset(cfg.model.preset, vocab_size=VOCAB, **cfg.model.override_config)
    save_hf_weights(engine.model, path, hf_config=hf)
