"""What every rank does in the distributed verl-dyncp tests, and no-CP references shared with the pure tests.

One spawn per world size (2 and 4) runs every distributed check (groups, THD round trips and gradients,
planner split/merge and loss/gradient parity) and returns plain Python results; the test modules assert
on them. :func:`results` caches the run so the three test modules share it.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

SEQ_LENS = [1, 5, 8, 16, 3, 33, 2]  # length 1, shorter than every alignment, power-of-two boundaries
VOCAB = 11
HIDDEN = 4


def reference_positions(lens: list[int]) -> torch.Tensor:
    return torch.cat([torch.arange(n) for n in lens])


def reference_labels(tokens: torch.Tensor, lens: list[int], ignore: int = -100) -> torch.Tensor:
    """The no-CP labels: the next token of the same sequence, ``ignore`` on the last one."""
    out = []
    for chunk in torch.split(tokens, lens):
        nxt = torch.roll(chunk, -1, 0).clone()
        nxt[-1] = ignore
        out.append(nxt)
    return torch.cat(out)


def packed_tokens(lens: list[int], seed: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (sum(lens),), generator=torch.Generator().manual_seed(seed))


def _features(seed: int = 7) -> torch.Tensor:
    return torch.randn(VOCAB, HIDDEN, generator=torch.Generator().manual_seed(seed))


def reference_model(tokens: torch.Tensor, lens: list[int]) -> tuple[float, torch.Tensor, torch.Tensor]:
    """Single-process no-CP tiny linear LM: mean CE over label tokens; returns loss, dW, per-token log-prob."""
    w = torch.randn(HIDDEN, VOCAB, generator=torch.Generator().manual_seed(3)).requires_grad_()
    labels = reference_labels(tokens, lens)
    logp = torch.log_softmax(_features()[tokens] @ w, -1)
    tok_logp = logp.gather(1, labels.clamp(min=0)[:, None])[:, 0]
    mask = labels != -100
    loss = -(tok_logp[mask]).mean()
    loss.backward()
    assert w.grad is not None
    return float(loss.detach()), w.grad.clone(), torch.where(mask, tok_logp, 0.0).detach()


def _group_checks(rank: int, world: int) -> dict[str, Any]:
    import torch.distributed as dist

    from verl_dyncp.groups import CPGroups

    out: dict[str, Any] = {}
    groups = CPGroups()
    out["sizes"] = list(groups.sizes)
    out["membership"] = {
        s: (groups.group(s).index, groups.group(s).rank, groups.group(s).ranks) for s in groups.sizes
    }
    out["same_object"] = all(groups.group(s) is groups.group(s) for s in groups.sizes)
    sums, gathers = {}, {}
    for s in groups.sizes:
        g = groups.group(s)
        t = torch.tensor([float(rank + 1)])
        dist.all_reduce(t, group=g.process_group)
        sums[s] = float(t)
        bufs = [torch.zeros(1, dtype=torch.int64) for _ in range(s)]
        dist.all_gather(bufs, torch.tensor([rank]), group=g.process_group)
        gathers[s] = [int(b) for b in bufs]
    out["sums"], out["gathers"] = sums, gathers
    full = torch.tensor([1])
    dist.all_reduce(full, group=groups.full_group)
    out["full_sum"] = int(full)
    try:
        groups.group(3)
    except ValueError as err:
        out["bad_size_error"] = str(err)
    if world == 4:  # a TP=2 layout: DP x CP lists [0, 2] and [1, 3]
        tp = CPGroups(rank_lists=[[0, 2], [1, 3]])
        g = tp.group(2)
        t = torch.tensor([float(rank)])
        dist.all_reduce(t, group=g.process_group)
        out["tp_membership"] = (tp.ranks, g.index, g.rank, g.ranks, float(t), tp.group(1).ranks)
        collected = CPGroups.from_local_ranks([0, 2] if rank % 2 == 0 else [1, 3])
        out["from_local_ranks"] = (collected.ranks, collected.group(2).rank)
    return out


def _thd_checks(rank: int, world: int) -> dict[str, Any]:
    from verl_dyncp.groups import CPGroups
    from verl_dyncp.thd import build_thd_meta, postprocess_thd_engine

    groups = CPGroups()
    out: dict[str, Any] = {}
    lens = SEQ_LENS
    total = sum(lens)
    gen = torch.Generator().manual_seed(11)
    payloads = {
        "float32": torch.randn(total, 3, generator=gen),
        "bfloat16": torch.randn(total, 2, generator=gen).to(torch.bfloat16),
        "int64": torch.randint(-(2**40), 2**40, (total,), generator=gen),
        "bool": torch.rand(total, generator=gen) > 0.5,
    }
    coeff = torch.randn(total, 3, generator=gen)
    for cp in groups.sizes:
        g = groups.group(cp)
        for tp in (1, 2):
            meta = build_thd_meta(seq_lens=lens, cp_size=cp, cp_rank=g.rank, tp_size=tp)
            for name, x in payloads.items():
                back = postprocess_thd_engine(meta.take(x), meta=meta, cp_group=g.process_group)
                out[f"roundtrip/cp{cp}/tp{tp}/{name}"] = (back.dtype == x.dtype, bool(torch.equal(back, x)))
            # gradients: loss on the postprocessed output reaches only the local tensor, as the no-CP slice
            x = payloads["float32"]
            ref_x = x.clone().requires_grad_()
            (torch.tanh(ref_x * 3.0) * coeff).sum().backward()
            assert ref_x.grad is not None
            local = meta.take(x).requires_grad_()
            full = postprocess_thd_engine(local * 3.0, meta=meta, cp_group=g.process_group)
            (torch.tanh(full) * coeff).sum().backward()
            assert local.grad is not None
            expected = meta.take(ref_x.grad)
            out[f"grad/cp{cp}/tp{tp}"] = float((local.grad - expected).abs().max())
    return out


def _planner_checks(rank: int, world: int) -> dict[str, Any]:
    from verl_dyncp.groups import CPGroups

    groups = CPGroups()
    cases = {
        "dynamic_k1": dict(
            seq_lens=[30, 5, 12, 7, 1, 16, 9, 3], max_seqlen_per_dp_cp_rank=32, larger_cp_min_gain=None
        ),
        "dynamic_k2": dict(
            seq_lens=[30, 5, 12, 7, 1, 16, 9, 3], max_seqlen_per_dp_cp_rank=16, larger_cp_min_gain=None
        ),
        "dynamic_tp2": dict(
            seq_lens=[30, 5, 12, 7, 1, 16, 9, 3],
            max_seqlen_per_dp_cp_rank=16,
            tp_size=2,
            larger_cp_min_gain=None,
        ),
        "few_seqs": dict(seq_lens=[6], max_seqlen_per_dp_cp_rank=8, larger_cp_min_gain=None),
        "equal_lens": dict(seq_lens=[8, 8, 8, 8, 8], max_seqlen_per_dp_cp_rank=4, larger_cp_min_gain=None),
        "static": dict(seq_lens=[17, 4, 1, 9, 2], static_cp_size=world),
    }
    out: dict[str, Any] = {
        name: _planner_case(name, dict(case), groups=groups) for name, case in cases.items()
    }
    out.update(_planner_merge_checks(groups))
    return out


def _planner_case(name: str, case: dict[str, Any], *, groups: Any) -> dict[str, Any]:
    """Split one micro-batch, take a loss on the local tokens and on the merged outputs: values vs no CP."""
    from verl_dyncp.planner import dynamic_cp_merge_output, dynamic_cp_split_batch, global_loss_token_count

    lens = case.pop("seq_lens")
    tokens = packed_tokens(lens, seed=len(name))
    ref_loss, ref_grad, ref_logp = reference_model(tokens, lens)
    mb = dynamic_cp_split_batch(tokens, seq_lens=lens, groups=groups, **case)
    w = torch.randn(HIDDEN, VOCAB, generator=torch.Generator().manual_seed(3)).requires_grad_()
    b = mb.batch
    logp = torch.log_softmax(_features()[b.input_ids] @ w, -1)
    tok_logp = logp.gather(1, b.labels.clamp(min=0)[:, None])[:, 0]
    count = global_loss_token_count(b.loss_mask, group=groups.full_group)
    # each rank: the sum of its own token losses / the global count; the ranks' sum is the mean
    loss = torch.where(b.loss_mask, -tok_logp, 0.0).sum() / count
    loss.backward()
    assert w.grad is not None
    grad = w.grad.clone()
    torch.distributed.all_reduce(grad, group=groups.full_group)
    value = loss.detach().clone()
    torch.distributed.all_reduce(value, group=groups.full_group)
    merged = dynamic_cp_merge_output(
        torch.where(b.loss_mask, tok_logp, 0.0).detach(), micro_batch=mb, groups=groups
    )
    # the merge path: every rank computes the whole mean on merged outputs, back-propagates its own slot
    w2 = w.detach().clone().requires_grad_()
    logp2 = torch.log_softmax(_features()[b.input_ids] @ w2, -1).gather(1, b.labels.clamp(min=0)[:, None])[
        :, 0
    ]
    merged2 = dynamic_cp_merge_output(torch.where(b.loss_mask, logp2, 0.0), micro_batch=mb, groups=groups)
    mask = reference_labels(tokens, lens) != -100
    (-(merged2[mask]).mean()).backward()
    assert w2.grad is not None
    grad2 = w2.grad.clone()
    torch.distributed.all_reduce(grad2, group=groups.full_group)
    return {
        "k": mb.block.size,
        "assignments": tuple(blk.sequences for blk in mb.plan.blocks),
        "blocks": tuple((blk.offset, blk.size) for blk in mb.plan.blocks),
        "is_dummy": mb.is_dummy,
        "local_loss": float(loss.detach()),
        "loss_rel": abs(float(value) - ref_loss) / abs(ref_loss),
        "grad_rel": float((grad - ref_grad).norm() / ref_grad.norm()),
        "merge_max_err": float((merged - ref_logp).abs().max()),
        "merge_dtype": str(merged.dtype),
        "merge_grad_rel": float((grad2 - ref_grad).norm() / ref_grad.norm()),
        "dummy_grad_zero": bool(torch.count_nonzero(w.grad) == 0) if mb.is_dummy else None,
    }


def _planner_merge_checks(groups: Any) -> dict[str, Any]:
    from verl_dyncp.planner import dynamic_cp_merge_output, dynamic_cp_split_batch, dynamic_cp_take

    out: dict[str, Any] = {}
    # the size-by-need rule is pinned in _planner_checks (larger_cp_min_gain=None) so each case covers its k; the default
    # doubles k while that balances better: one 6-token sequence takes the whole pool instead of idling it
    lens = [6]
    mb = dynamic_cp_split_batch(
        packed_tokens(lens, 1), seq_lens=lens, groups=groups, max_seqlen_per_dp_cp_rank=8
    )
    out["few_seqs_balanced_k"] = mb.block.size
    # bf16 and int64 outputs survive the merge bit-exactly
    lens = [9, 2, 5]
    mb = dynamic_cp_split_batch(
        packed_tokens(lens, 0), seq_lens=lens, groups=groups, max_seqlen_per_dp_cp_rank=5
    )
    local_ids = mb.batch.input_ids
    merged_ids = dynamic_cp_merge_output(local_ids, micro_batch=mb, groups=groups)
    merged_bf16 = dynamic_cp_merge_output(local_ids.to(torch.bfloat16), micro_batch=mb, groups=groups)
    values = torch.randn(sum(lens), 2, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    merged_values = dynamic_cp_merge_output(
        dynamic_cp_take(values, micro_batch=mb), micro_batch=mb, groups=groups
    )
    out["take_roundtrip"] = merged_values.dtype == torch.bfloat16 and bool(torch.equal(merged_values, values))
    out["merge_exact"] = (
        bool(torch.equal(merged_ids, packed_tokens(lens, 0))),
        merged_bf16.dtype == torch.bfloat16
        and bool(torch.equal(merged_bf16, packed_tokens(lens, 0).to(torch.bfloat16))),
    )
    out["joint_merge"] = _joint_merge_check(mb, groups, total=sum(lens))
    return out


def _joint_merge_check(mb: Any, groups: Any, *, total: int) -> dict[str, bool]:
    """dynamic_cp_merge_outputs (one gather per dtype) against one dynamic_cp_merge_output per tensor."""
    from verl_dyncp.planner import dynamic_cp_merge_output, dynamic_cp_merge_outputs, dynamic_cp_take

    gen = torch.Generator().manual_seed(7)
    full = {"a": torch.randn(total, generator=gen), "b": torch.randn(total, 3, generator=gen)}
    weights = torch.randn(total, 4, generator=gen)

    def run(joint: bool) -> tuple[dict[str, torch.Tensor], list[torch.Tensor]]:
        a = dynamic_cp_take(full["a"], micro_batch=mb).requires_grad_()
        b = dynamic_cp_take(full["b"], micro_batch=mb).requires_grad_()
        outs = {"a": a, "ids": mb.batch.input_ids, "b": b}
        if joint:
            merged = dynamic_cp_merge_outputs(outs, micro_batch=mb, groups=groups)
        else:
            merged = {k: dynamic_cp_merge_output(v, micro_batch=mb, groups=groups) for k, v in outs.items()}
        (merged["a"] * weights[:, 0] + (merged["b"] * weights[:, 1:]).sum(-1)).sum().backward()
        return merged, [a.grad, b.grad]

    joint, joint_grads = run(True)
    apart, apart_grads = run(False)
    return {
        "order": list(joint) == ["a", "ids", "b"],
        "values": all(torch.equal(joint[k], apart[k]) and joint[k].dtype == apart[k].dtype for k in apart),
        "grads": all(torch.equal(x, y) for x, y in zip(joint_grads, apart_grads, strict=True)),
        "roundtrip": bool(torch.equal(joint["a"], full["a"]) and torch.equal(joint["b"], full["b"])),
    }


def all_checks(rank: int, world: int) -> dict[str, Any]:
    torch.set_num_threads(1)  # several ranks share 2 cores
    return {
        "groups": _group_checks(rank, world),
        "thd": _thd_checks(rank, world),
        "planner": _planner_checks(rank, world),
    }


@functools.cache
def results(world: int) -> list[dict[str, Any]]:
    # verl_mcore_utils.testing imports no megatron-core: the spawned ranks stay torch-only
    from verl_mcore_utils.testing import run_distributed

    return run_distributed(all_checks, world_size=world, timeout_s=180)
