"""Per-rank work of test_model_parity.py: a tiny GPT trained on packed batches under static and dynamic CP.

Every rank holds the whole packed micro-batch (tokens and lengths), splits it with
:func:`verl_dyncp.planner.dynamic_cp_split_batch`, runs forward + backward of its own THD share through
:func:`verl_dyncp.model.build_thd_gpt_model` with its CP group attached to the PackedSeqParams, and
sums the parameter gradients over all ranks. Rank 0 also runs the reference: megatron-core's standard
GPTModel (its own RoPE, BSHD, no CP), one sequence at a time, on the same weights.

Loss / gradient bookkeeping (the same on both sides):

* labels are the next token of the same sequence; a sequence's last token (and padding) has none;
* per-token loss = cross entropy of the logits against the label, fp32;
* every rank's loss = SUM of the per-token losses of ITS OWN real label tokens / GLOBAL number of
  label tokens (local loss masks summed over all ranks; dummy / idle ranks hold 0 of them); the
  reference loss = sum over all label tokens / the same count;
* the weights are replicated on every rank, so the gradient of the whole micro-batch is the SUM over all
  ranks of their local gradients (all-reduce SUM of every ``.grad``, what megatron's DDP does with
  per-token loss; megatron DDP itself needs CUDA, so it is done by hand here); the logged loss is the
  sum of the ranks' losses.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

IGNORE = -100


def _tokens(lengths: tuple[int, ...], vocab: int, seed: int) -> torch.Tensor:
    return torch.randint(0, vocab, (sum(lengths),), generator=torch.Generator().manual_seed(seed))


def _reference(
    model: Any, tokens: torch.Tensor, lengths: tuple[int, ...]
) -> tuple[float, dict[str, torch.Tensor]]:
    """No-CP loss and gradients: each sequence alone through the BSHD model (positions 0..n-1)."""
    model.zero_grad(set_to_none=True)
    count = sum(n - 1 for n in lengths)
    total = torch.zeros(())
    for seq in torch.split(tokens, list(lengths)):
        n = seq.shape[0]
        logits = model(input_ids=seq[None], position_ids=torch.arange(n)[None], attention_mask=None)[0]
        labels = torch.cat((seq[1:], torch.tensor([IGNORE])))
        ce = F.cross_entropy(logits.float(), labels, ignore_index=IGNORE, reduction="sum")
        total = total + ce
    loss = total / count
    loss.backward()
    grads = {name: p.grad.detach().clone() for name, p in model.named_parameters() if p.grad is not None}
    return float(loss.detach()), grads


def _cp_step(
    model: Any, tokens: torch.Tensor, lengths: tuple[int, ...], groups: Any, **plan: Any
) -> tuple[float, dict[str, torch.Tensor], dict[str, Any]]:
    """One planned micro-batch on this rank: local loss, backward, gradients summed over all ranks."""
    import torch.distributed as dist

    from verl_dyncp.layout import thd_packed_seq_params
    from verl_dyncp.planner import dynamic_cp_split_batch, global_loss_token_count

    model.zero_grad(set_to_none=True)
    mb = dynamic_cp_split_batch(tokens, seq_lens=lengths, groups=groups, **plan)
    b, meta = mb.batch, mb.batch.meta
    params = thd_packed_seq_params(meta, cp_group=mb.group.process_group if mb.group.size > 1 else None)
    logits = model(
        input_ids=b.input_ids[None], position_ids=None, attention_mask=None, packed_seq_params=params
    )
    per_token = F.cross_entropy(logits[0].float(), b.labels.clamp(min=0), reduction="none")
    count = global_loss_token_count(b.loss_mask, group=groups.full_group)
    loss = torch.where(b.loss_mask, per_token, 0.0).sum() / count
    loss.backward()
    grads = {}
    for name, p in model.named_parameters():
        # idle ranks still produce (zero) gradients and enter every reduction
        g = p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p)
        dist.all_reduce(g, group=groups.full_group)
        grads[name] = g
    info = {
        "k": tuple(sorted({blk.size for blk in mb.plan.blocks}, reverse=True)),
        "blocks": tuple(blk.sequences for blk in mb.plan.blocks),
        "dummy": bool(mb.is_dummy),
        "local_count": int(b.loss_mask.sum()),
        "count": int(count),
    }
    value = loss.detach().clone()
    dist.all_reduce(value, group=groups.full_group)
    return float(value), grads, info


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    den = float(b.abs().max())
    num = float((a - b).abs().max())
    return num / den if den > 0 else num


def parity_worker(
    rank: int, world_size: int, ckpt: str, cases: list[tuple[str, tuple[int, ...], dict[str, Any]]]
) -> dict[str, Any]:
    """Run every case; rank 0 returns per case the loss / worst-gradient relative errors and the plan."""
    torch.set_num_threads(1)
    import torch.distributed as dist
    from transformers import AutoConfig

    from verl_dyncp.groups import CPGroups
    from verl_dyncp.model import build_thd_gpt_model
    from verl_mcore_utils.model import build_gpt_model
    from verl_mcore_utils.parallel import init_parallel
    from verl_mcore_utils.transformer_config import hf_to_transformer_config
    from verl_mcore_utils.weights import load_hf_weights

    init_parallel(device="cpu")  # megatron state: TP = PP = CP = 1; the CP groups below are verl-dyncp's
    hf = AutoConfig.from_pretrained(ckpt)
    tf = hf_to_transformer_config(hf, dtype="float32")
    model = build_thd_gpt_model(hf_config=hf, tf_config=tf, device="cpu").eval()
    load_hf_weights(model, ckpt, hf_config=hf)
    groups = CPGroups()
    reference = None
    if rank == 0:
        reference = build_gpt_model(hf_config=hf, tf_config=tf, device="cpu").eval()
        load_hf_weights(reference, ckpt, hf_config=hf)
    ref_cache: dict[tuple[int, ...], tuple[float, dict[str, torch.Tensor]]] = {}
    out: dict[str, Any] = {}
    for name, lengths, plan in cases:
        tokens = _tokens(lengths, hf.vocab_size, seed=sum(lengths))
        loss, grads, info = _cp_step(model, tokens, lengths, groups, **plan)
        infos: list[Any] = [None] * world_size
        dist.all_gather_object(infos, info)
        if rank != 0:
            continue
        assert reference is not None
        if lengths not in ref_cache:
            ref_cache[lengths] = _reference(reference, tokens, lengths)
        ref_loss, ref_grads = ref_cache[lengths]
        assert set(ref_grads) == set(grads), sorted(set(ref_grads) ^ set(grads))
        grad_errs = {n: _rel(grads[n], ref_grads[n]) for n in ref_grads}
        worst = max(grad_errs, key=grad_errs.__getitem__)
        out[name] = {
            "loss": loss,
            "ref_loss": ref_loss,
            "loss_rel": abs(loss - ref_loss) / abs(ref_loss),
            "grad_rel": grad_errs[worst],
            "worst_param": worst,
            "num_params": len(grad_errs),
            "zero_ref_grads": sorted(n for n, g in ref_grads.items() if float(g.abs().max()) == 0.0),
            "k": info["k"],
            "blocks": info["blocks"],
            "dummy_ranks": [r for r, i in enumerate(infos) if i["dummy"]],
            "local_counts": [i["local_count"] for i in infos],
            "count": info["count"],
        }
    return out
