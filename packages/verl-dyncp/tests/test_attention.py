"""DynCPCoreAttention: THD + context parallelism (zigzag, group chosen per call) against per-sequence SDPA.

CPU tests run real megatron-core modules on gloo processes in fp32; the reference is PyTorch SDPA on
each whole sequence, without CP. GPU tests (marked) compare the varlen flash kernel with the SDPA path.
"""

from __future__ import annotations

import functools
import importlib.util
import itertools
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from verl_mcore_utils.testing import run_distributed  # torch-only: the spawned ranks import no megatron-core

# No verl_mcore_utils / megatron import at module level: the CP workers below import only torch and
# verl_dyncp.thd_attention, which keeps 4 spawned processes cheap on a small CPU machine.

HEADS, GROUPS, DIM = 4, 2, 8
ROPE_BASE = 10000.0
# true lengths: a length-1 sequence, one shorter than every alignment, one at a power of two, one odd
LENGTHS = (5, 16, 1, 11, 3)


def _padded(length: int, align: int) -> int:
    return -(-length // align) * align


def _make_inputs(
    seed: int, lengths: tuple[int, ...], dtype: torch.dtype = torch.float32
) -> list[dict[str, Any]]:
    """Per-sequence q, k, v and upstream gradient (true lengths, no padding)."""
    gen = torch.Generator().manual_seed(seed)
    seqs = []
    for n in lengths:
        seqs.append(
            {
                "q": torch.randn(n, HEADS, DIM, generator=gen).to(dtype),
                "k": torch.randn(n, GROUPS, DIM, generator=gen).to(dtype),
                "v": torch.randn(n, GROUPS, DIM, generator=gen).to(dtype),
                "g": torch.randn(n, HEADS * DIM, generator=gen).to(dtype),
            }
        )
    return seqs


def _zigzag_rows(padded: int, cp: int, rank: int) -> torch.Tensor:
    """Rows of a padded sequence held by CP rank ``rank`` (test-local copy of the zigzag split)."""
    if cp == 1:
        return torch.arange(padded)
    h = padded // (2 * cp)
    return torch.cat(
        (torch.arange(rank * h, (rank + 1) * h), torch.arange(padded - (rank + 1) * h, padded - rank * h))
    )


def _pack_local(
    seqs: list[dict[str, Any]], *, cp: int, rank: int, align: int, pad_seed: int
) -> tuple[dict[str, torch.Tensor], torch.Tensor, torch.Tensor]:
    """This rank's packed tensors (padding filled with noise) and the global cu_seqlens (true, padded)."""
    gen = torch.Generator().manual_seed(pad_seed)
    out: dict[str, list[torch.Tensor]] = {name: [] for name in ("q", "k", "v", "g")}
    true, padded = [0], [0]
    for seq in seqs:
        n = seq["q"].shape[0]
        p = _padded(n, align)
        rows = _zigzag_rows(p, cp, rank)
        for name, t in seq.items():
            noise = torch.randn((p - n, *t.shape[1:]), generator=gen).to(t.dtype)
            out[name].append(torch.cat((t, noise))[rows])
        true.append(true[-1] + n)
        padded.append(padded[-1] + p)
    packed = {name: torch.cat(parts) for name, parts in out.items()}
    return packed, torch.tensor(true, dtype=torch.int32), torch.tensor(padded, dtype=torch.int32)


def _packed_seq_params(cu_true: torch.Tensor, cu_padded: torch.Tensor, device: str = "cpu") -> Any:
    from verl_mcore_utils.compat import make_packed_seq_params

    lens = (cu_padded[1:] - cu_padded[:-1]).max().item()
    return make_packed_seq_params(
        qkv_format="thd",
        cu_seqlens_q=cu_true.to(device),
        cu_seqlens_kv=cu_true.to(device),
        cu_seqlens_q_padded=cu_padded.to(device),
        cu_seqlens_kv_padded=cu_padded.to(device),
        max_seqlen_q=int(lens),
        max_seqlen_kv=int(lens),
    )


def _make_attention(*, rope: bool, kernel: str = "sdpa") -> Any:
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    from verl_dyncp.attention import dyncp_core_attention

    config = TransformerConfig(
        num_layers=1,
        hidden_size=HEADS * DIM,
        num_attention_heads=HEADS,
        num_query_groups=GROUPS,
        kv_channels=DIM,
        attention_dropout=0.0,  # megatron's default is 0.1
        use_cpu_initialization=True,
    )
    cls = dyncp_core_attention(rotary_base=ROPE_BASE if rope else None, kernel=kernel)
    return cls(config=config, layer_number=1, attn_mask_type=AttnMaskType.causal)


def _run_local(
    seqs: list[dict[str, Any]],
    *,
    group: Any,
    cp: int,
    rank: int,
    align: int,
    rope: bool,
    kernel: str = "sdpa",
    device: str = "cpu",
    module: bool = False,
) -> dict[str, torch.Tensor]:
    """Forward + backward of this rank's share; returns local output and input gradients.

    ``module``: through the megatron-core module (DynCPCoreAttention + PackedSeqParams), else through
    the functional core it calls (no megatron import, for the spawned CP workers).
    """
    packed, cu_true, cu_padded = _pack_local(seqs, cp=cp, rank=rank, align=align, pad_seed=1234 + rank)
    q, k, v = (packed[n].to(device).requires_grad_(True) for n in ("q", "k", "v"))
    if module:
        from verl_dyncp.attention import attach_cp_context

        params = attach_cp_context(_packed_seq_params(cu_true, cu_padded, device), cp_group=group)
        out = _make_attention(rope=rope, kernel=kernel)(q, k, v, None, packed_seq_params=params)
    else:
        from verl_dyncp.layout import build_thd_layout
        from verl_dyncp.rope import rope_inv_freq
        from verl_dyncp.thd_attention import thd_attention

        layout = build_thd_layout(
            cu_seqlens=cu_true, cu_seqlens_padded=cu_padded, cp_size=cp, cp_rank=rank, device=device
        )
        inv = rope_inv_freq(head_dim=DIM, rotary_base=ROPE_BASE) if rope else None
        out = thd_attention(q, k, v, layout=layout, cp_group=group, inv_freq=inv, kernel=kernel)
    out.backward(packed["g"].to(device))
    return {"out": out.detach().cpu(), "dq": q.grad.cpu(), "dk": k.grad.cpu(), "dv": v.grad.cpu()}


def _as_numpy(result: dict[str, Any]) -> dict[str, Any]:
    """Tensors -> numpy arrays: results cross the process boundary by value (no shared-memory handles)."""
    return {k: _as_numpy(v) if isinstance(v, dict) else v.float().numpy() for k, v in result.items()}


def _as_torch(result: dict[str, Any]) -> dict[str, Any]:
    return {k: _as_torch(v) if isinstance(v, dict) else torch.from_numpy(v) for k, v in result.items()}


def _reference(seqs: list[dict[str, Any]], *, rope: bool) -> list[dict[str, torch.Tensor]]:
    """Per-sequence BSHD causal SDPA without CP (RoPE with positions 0..n-1 when ``rope``)."""
    from verl_dyncp.rope import apply_rope, rope_inv_freq

    inv = rope_inv_freq(head_dim=DIM, rotary_base=ROPE_BASE)
    results = []
    for seq in seqs:
        q, k, v = (seq[n].clone().requires_grad_(True) for n in ("q", "k", "v"))
        qr, kr = q, k
        if rope:
            pos = torch.arange(q.shape[0])
            qr, kr = (
                apply_rope(q, position_ids=pos, inv_freq=inv),
                apply_rope(k, position_ids=pos, inv_freq=inv),
            )
        reps = HEADS // GROUPS
        qb, kb, vb = (
            t.transpose(0, 1).unsqueeze(0)
            for t in (qr, kr.repeat_interleave(reps, dim=1), v.repeat_interleave(reps, dim=1))
        )
        out = F.scaled_dot_product_attention(qb, kb, vb, is_causal=True).squeeze(0).transpose(0, 1)
        out = out.reshape(out.shape[0], -1)
        out.backward(seq["g"])
        results.append({"out": out.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad})
    return results


def _unzigzag(
    per_rank: list[dict[str, torch.Tensor]],
    lengths: tuple[int, ...],
    *,
    cp: int,
    align: int,
    padding_is_zero: bool = True,
) -> list[dict[str, torch.Tensor]]:
    """Reassemble whole sequences (true length) from every rank's local tensors.

    ``padding_is_zero``: also check that the attention output and gradients of padding rows are zero.
    """
    seqs: list[dict[str, torch.Tensor]] = []
    offsets = [0] * cp
    for n in lengths:
        p = _padded(n, align)
        seq: dict[str, torch.Tensor] = {}
        for name in per_rank[0]:
            full = torch.zeros((p, *per_rank[0][name].shape[1:]), dtype=per_rank[0][name].dtype)
            for r in range(cp):
                full[_zigzag_rows(p, cp, r)] = per_rank[r][name][offsets[r] : offsets[r] + p // cp]
            if padding_is_zero:
                assert torch.count_nonzero(full[n:]) == 0, f"{name}: padding rows must be zero"
            seq[name] = full[:n]
        offsets = [o + p // cp for o in offsets]
        seqs.append(seq)
    return seqs


def _max_rel_err(got: list[dict[str, torch.Tensor]], ref: list[dict[str, torch.Tensor]]) -> dict[str, float]:
    errs: dict[str, float] = {}
    for name in ref[0]:
        num = max(float((g[name] - r[name]).abs().max()) for g, r in zip(got, ref, strict=True))
        den = max(float(r[name].abs().max()) for r in ref)
        errs[name] = num / den
    return errs


# ----------------------------------------------------------------------------------------------
# single process


def test_thd_cp1_matches_per_sequence_sdpa() -> None:
    seqs = _make_inputs(0, LENGTHS)
    for align in (1, 4):  # no padding (tp=1, cp=1) and padded sequences
        local = _run_local(seqs, group=None, cp=1, rank=0, align=align, rope=False, module=True)
        errs = _max_rel_err(_unzigzag([local], LENGTHS, cp=1, align=align), _reference(seqs, rope=False))
        print(f"cp=1 align={align}: {errs}")
        assert max(errs.values()) < 1e-6, errs


def test_thd_cp1_rope_matches_reference() -> None:
    seqs = _make_inputs(1, LENGTHS)
    local = _run_local(seqs, group=None, cp=1, rank=0, align=2, rope=True, module=True)
    errs = _max_rel_err(_unzigzag([local], LENGTHS, cp=1, align=2), _reference(seqs, rope=True))
    assert max(errs.values()) < 1e-6, errs


@pytest.mark.parametrize("cp", [2, 4])
def test_layout_positions_and_rotation_equal_no_cp(cp: int) -> None:
    """Local position ids and rotated q/k on every CP rank are the no-CP ones, sliced."""
    from verl_dyncp.attention import thd_layout
    from verl_dyncp.rope import apply_rope, rope_inv_freq

    align = 2 * cp
    lengths = (1, 7, 2 * cp, 33)
    padded = [_padded(n, align) for n in lengths]
    cu_true = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    cu_padded = torch.tensor([0, *torch.tensor(padded).cumsum(0).tolist()], dtype=torch.int32)
    params = _packed_seq_params(cu_true, cu_padded)
    inv = rope_inv_freq(head_dim=DIM, rotary_base=ROPE_BASE)
    full_pos = torch.cat([torch.arange(p) for p in padded])  # the no-CP run's positions
    full_q = torch.randn(len(full_pos), HEADS, DIM, generator=torch.Generator().manual_seed(3))
    full_rot = apply_rope(full_q, position_ids=full_pos, inv_freq=inv)
    starts = cu_padded[:-1].tolist()
    for rank in range(cp):
        layout = thd_layout(params, cp_size=cp, cp_rank=rank, device="cpu")
        rows = torch.cat([s + _zigzag_rows(p, cp, rank) for s, p in zip(starts, padded, strict=True)])
        assert torch.equal(layout.position_ids, full_pos[rows])
        assert torch.equal(
            layout.valid,
            torch.cat([_zigzag_rows(p, cp, rank) < n for n, p in zip(lengths, padded, strict=True)]),
        )
        local_rot = apply_rope(full_q[rows], position_ids=layout.position_ids, inv_freq=inv)
        assert torch.equal(local_rot, full_rot[rows])


def _emulated_varlen(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: torch.Tensor, cu_k: torch.Tensor
) -> torch.Tensor:
    """What varlen_attn computes with window (-1, 0): per segment, causal aligned bottom-right (GQA)."""
    outs = []
    for i in range(len(cu_q) - 1):
        qs, ks = q[cu_q[i] : cu_q[i + 1]], k[cu_k[i] : cu_k[i + 1]]
        vs = v[cu_k[i] : cu_k[i + 1]]
        nq, nk = qs.shape[0], ks.shape[0]
        mask = torch.arange(nk)[None, :] <= torch.arange(nq)[:, None] + (nk - nq)
        out = F.scaled_dot_product_attention(
            qs.transpose(0, 1), ks.transpose(0, 1), vs.transpose(0, 1), attn_mask=mask, enable_gqa=True
        )
        outs.append(out.transpose(0, 1))
    return torch.cat(outs)


@pytest.mark.parametrize("cp", [1, 2, 4])
def test_varlen_key_stream_layout_matches_sdpa_path(cp: int) -> None:
    """The CUDA path's segments (cu_seqlens_q/k, stream_index) give the SDPA path's result on CPU."""
    from verl_dyncp.kernels import _sdpa_attention
    from verl_dyncp.layout import build_thd_layout

    seqs = _make_inputs(50, LENGTHS)
    align = 2 * cp
    locals_ = [_pack_local(seqs, cp=cp, rank=r, align=align, pad_seed=r) for r in range(cp)]
    gathered_k = torch.cat([loc[0]["k"] for loc in locals_])  # what the all-gather returns (rank-major)
    gathered_v = torch.cat([loc[0]["v"] for loc in locals_])
    for rank in range(cp):
        packed, cu_true, cu_padded = locals_[rank]
        layout = build_thd_layout(
            cu_seqlens=cu_true, cu_seqlens_padded=cu_padded, cp_size=cp, cp_rank=rank, device="cpu"
        )
        if cp == 1:
            k_stream, v_stream, k_full, v_full = packed["k"], packed["v"], packed["k"], packed["v"]
            cu_k = layout.cu_seqlens_q
        else:
            k_stream, v_stream = gathered_k[layout.stream_index], gathered_v[layout.stream_index]
            k_full, v_full = gathered_k[layout.full_index], gathered_v[layout.full_index]
            cu_k = layout.cu_seqlens_k
        assert int(cu_k[-1]) == k_stream.shape[0]
        assert max(int(x) for x in cu_k.diff()) == layout.max_seqlen_k
        emulated = _emulated_varlen(packed["q"], k_stream, v_stream, layout.cu_seqlens_q, cu_k)
        reference = _sdpa_attention(packed["q"], k_full, v_full, layout=layout, scale=None, dropout_p=0.0)
        valid = layout.valid[:, None, None]
        torch.testing.assert_close(emulated * valid, reference * valid, rtol=1e-6, atol=1e-6)


def test_varlen_keywords_are_read_once_from_this_torch() -> None:
    """The varlen call reads varlen_attn's keywords once per process (it runs per layer and micro-batch): the
    cached names are the installed torch's, and causality is spelt the way this release takes it."""
    from verl_dyncp import kernels

    if not kernels.varlen_kernel_available():
        pytest.skip("this torch has no torch.nn.attention.varlen")
    import inspect

    names = kernels._varlen_params()
    assert names == frozenset(inspect.signature(kernels._varlen_fn()).parameters)
    assert "scale" in names and ("window_size" in names or "is_causal" in names)
    assert kernels._varlen_params() is names  # cached, not read again


def test_bad_layouts_are_clear_errors() -> None:
    from verl_dyncp.attention import thd_layout

    params = _packed_seq_params(
        torch.tensor([0, 5], dtype=torch.int32), torch.tensor([0, 6], dtype=torch.int32)
    )
    with pytest.raises(ValueError, match="multiple of 2 x cp_size = 4"):
        thd_layout(params, cp_size=2, cp_rank=0, device="cpu")
    params = _packed_seq_params(
        torch.tensor([0, 9], dtype=torch.int32), torch.tensor([0, 8], dtype=torch.int32)
    )
    with pytest.raises(ValueError, match="inconsistent"):
        thd_layout(params, cp_size=1, cp_rank=0, device="cpu")


# ----------------------------------------------------------------------------------------------
# 4 gloo processes: the (stateless) attention core under CP groups that change from call to call


def _dynamic_cp_worker(rank: int, world_size: int) -> dict[str, Any]:
    import torch.distributed as dist

    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    out: dict[str, Any] = {}
    for rope in (False, True):
        # CP 2 on two groups at once, each with its own batch (seed = group index)
        seqs = _make_inputs(10 + rank // 2, LENGTHS)
        out[f"cp2_rope{rope}"] = _run_local(
            seqs, group=pairs[rank // 2], cp=2, rank=rank % 2, align=4, rope=rope
        )
        # CP 4 on the whole world, alignment 8 (tp=1): lengths 1, 3, 5 are shorter than it
        seqs = _make_inputs(20, LENGTHS)
        out[f"cp4_rope{rope}"] = _run_local(seqs, group=dist.group.WORLD, cp=4, rank=rank, align=8, rope=rope)
    # CP 1 with alignment tp=2 on each rank alone
    out["cp1"] = _run_local(_make_inputs(30 + rank, LENGTHS), group=None, cp=1, rank=0, align=2, rope=True)
    return _as_numpy(out)


def test_dynamic_cp_matches_no_cp_on_4_ranks() -> None:
    results = [_as_torch(r) for r in run_distributed(_dynamic_cp_worker, world_size=4, timeout_s=240)]
    errors: dict[str, dict[str, float]] = {}
    for rope in (False, True):
        for pair in range(2):
            got = _unzigzag(
                [results[2 * pair][f"cp2_rope{rope}"], results[2 * pair + 1][f"cp2_rope{rope}"]],
                LENGTHS,
                cp=2,
                align=4,
            )
            errors[f"cp2 group{pair} rope={rope}"] = _max_rel_err(
                got, _reference(_make_inputs(10 + pair, LENGTHS), rope=rope)
            )
        got = _unzigzag([r[f"cp4_rope{rope}"] for r in results], LENGTHS, cp=4, align=8)
        errors[f"cp4 rope={rope}"] = _max_rel_err(got, _reference(_make_inputs(20, LENGTHS), rope=rope))
    for rank in range(4):
        got = _unzigzag([results[rank]["cp1"]], LENGTHS, cp=1, align=2)
        errors[f"cp1 rank{rank}"] = _max_rel_err(got, _reference(_make_inputs(30 + rank, LENGTHS), rope=True))
    worst = max(max(e.values()) for e in errors.values())
    print(f"max relative errors vs no-CP SDPA: {errors}")
    assert worst < 1e-5, errors


# ----------------------------------------------------------------------------------------------
# whole tiny GPTModel: THD + CP 2 vs the no-CP BSHD model (megatron's own RoPE)


def _model_worker(rank: int, world_size: int, ckpt: str, lengths: tuple[int, ...]) -> dict[str, Any]:
    """THD + CP over all ranks through GPTModel; rank 0 also runs the no-CP BSHD model (megatron's RoPE)."""
    import torch.distributed as dist
    from transformers import AutoConfig

    from verl_dyncp.attention import attach_cp_context
    from verl_dyncp.model import build_thd_gpt_model
    from verl_mcore_utils.model import build_gpt_model
    from verl_mcore_utils.parallel import init_parallel
    from verl_mcore_utils.transformer_config import hf_to_transformer_config
    from verl_mcore_utils.weights import load_hf_weights

    init_parallel(device="cpu")
    hf = AutoConfig.from_pretrained(ckpt)
    tf = hf_to_transformer_config(hf, dtype="float32")
    model = build_thd_gpt_model(hf_config=hf, tf_config=tf, device="cpu").eval()
    load_hf_weights(model, ckpt, hf_config=hf)
    align = 2 * world_size
    gen = torch.Generator().manual_seed(7)
    seqs = [torch.randint(0, hf.vocab_size, (n,), generator=gen) for n in lengths]
    ids, true, padded = [], [0], [0]
    for seq in seqs:
        n, p = len(seq), _padded(len(seq), align)
        ids.append(torch.cat((seq, torch.zeros(p - n, dtype=torch.long)))[_zigzag_rows(p, world_size, rank)])
        true.append(true[-1] + n)
        padded.append(padded[-1] + p)
    params = attach_cp_context(
        _packed_seq_params(torch.tensor(true, dtype=torch.int32), torch.tensor(padded, dtype=torch.int32)),
        cp_group=dist.group.WORLD,
    )
    # a fixed linear "loss" on the logits of real tokens: d loss / d logits = weights
    weights = torch.randn(padded[-1], hf.vocab_size, generator=torch.Generator().manual_seed(11))
    local_w = []
    for i, seq in enumerate(seqs):
        p = padded[i + 1] - padded[i]
        w = weights[padded[i] : padded[i + 1]].clone()
        w[len(seq) :] = 0.0
        local_w.append(w[_zigzag_rows(p, world_size, rank)])
    logits = model(
        input_ids=torch.cat(ids)[None], position_ids=None, attention_mask=None, packed_seq_params=params
    )
    (logits[0] * torch.cat(local_w)).sum().backward()
    grads = {}
    for name, param in model.named_parameters():
        grad = param.grad.clone()
        dist.all_reduce(grad)  # sum over the CP group, as the DP/CP gradient reduction does
        grads[name] = grad
    out: dict[str, Any] = {"logits": logits[0].detach()}
    if rank == 0:
        # the same model instance, next call: CP size 1 (no group), whole batch, alignment 1
        lens = torch.tensor([0, *lengths]).cumsum(0).to(torch.int32)
        params_cp1 = attach_cp_context(_packed_seq_params(lens, lens), cp_group=None)
        with torch.no_grad():
            cp1_logits = model(
                input_ids=torch.cat(seqs)[None],
                position_ids=None,
                attention_mask=None,
                packed_seq_params=params_cp1,
            )[0]
        for i in range(len(seqs)):
            out[f"cp1_{i}"] = cp1_logits[int(lens[i]) : int(lens[i + 1])]
        reference = build_gpt_model(hf_config=hf, tf_config=tf, device="cpu").eval()
        load_hf_weights(reference, ckpt, hf_config=hf)
        for i, seq in enumerate(seqs):
            pos = torch.arange(len(seq))[None]
            ref_logits = reference(input_ids=seq[None], position_ids=pos, attention_mask=None)[0]
            (ref_logits * weights[padded[i] : padded[i] + len(seq)]).sum().backward()
            out[f"ref{i}"] = ref_logits.detach()
        ref_grads = dict(reference.named_parameters())
        assert set(ref_grads) == set(grads), sorted(set(ref_grads) ^ set(grads))
        out["grad_rel_err"] = torch.tensor(
            max(
                float((grads[n] - ref_grads[n].grad).abs().max()) / float(ref_grads[n].grad.abs().max())
                for n in grads
            )
        )
    return _as_numpy(out)


@pytest.mark.slow
def test_tiny_gpt_thd_cp2_matches_no_cp_model(tmp_path: Path) -> None:
    from verl_mcore_utils.hf_testing import save_tiny_hf_model

    ckpt = save_tiny_hf_model("qwen2", tmp_path / "qwen2")
    lengths = (9, 1, 20)
    per_rank = [
        _as_torch(r)
        for r in run_distributed(_model_worker, world_size=2, args=(str(ckpt), lengths), timeout_s=240)
    ]
    got = _unzigzag(
        [{"logits": r["logits"]} for r in per_rank], lengths, cp=2, align=4, padding_is_zero=False
    )
    reference = [per_rank[0][f"ref{i}"] for i in range(len(lengths))]
    num = max(float((g["logits"] - r).abs().max()) for g, r in zip(got, reference, strict=True))
    den = max(float(r.abs().max()) for r in reference)
    cp1_num = max(float((per_rank[0][f"cp1_{i}"] - r).abs().max()) for i, r in enumerate(reference))
    assert cp1_num / den < 1e-5, cp1_num / den
    grad_err = float(per_rank[0]["grad_rel_err"])
    print(
        f"tiny qwen2 vs no-CP: THD+CP2 logits rel err {num / den:.3e}, worst parameter-grad rel err"
        f" {grad_err:.3e}; same model, next call THD+CP1 logits rel err {cp1_num / den:.3e}"
    )
    assert num / den < 1e-5, num / den
    assert grad_err < 1e-5, grad_err


# ----------------------------------------------------------------------------------------------
# GPU: the varlen flash kernel against the SDPA path (bf16)


def _gpu_worker(rank: int, world_size: int, long: bool = False) -> dict[str, Any]:
    import torch.distributed as dist

    from verl_dyncp.kernels import varlen_kernel_available

    if not varlen_kernel_available():
        return {"skip": "torch.nn.attention.varlen is not available"}
    group = dist.group.WORLD if world_size > 1 else None
    # long: sequences past DENSE_MIN_TOKENS take the dense (cuDNN) path under "cudnn", with windows that reach
    # into the next sequence (2300 -> 2304) and one cut by the row's end (the last); the rest go through varlen
    lengths = (2300, 5, 130, 2048, 1, 77, 2100) if long else (5, 130, 1, 77, 256)
    seqs = _make_inputs(40, lengths, dtype=torch.bfloat16)
    run = {"group": group, "cp": world_size, "rank": rank, "align": 2 * world_size, "rope": True}
    run |= {"device": "cuda", "module": True}
    res = {kernel: _run_local(seqs, kernel=kernel, **run) for kernel in ("cudnn", "varlen", "sdpa")}
    return _as_numpy(res)


@pytest.mark.num_gpus(1)
def test_gpu_varlen_matches_sdpa_cp1() -> None:
    _check_gpu(1)


@pytest.mark.num_gpus(1)
def test_gpu_dense_segments_match_sdpa_cp1() -> None:
    _check_gpu(1, long=True)


@pytest.mark.num_gpus(2)
def test_gpu_varlen_matches_sdpa_cp2() -> None:
    _check_gpu(2)


def _check_gpu(world_size: int, long: bool = False) -> None:
    worker = functools.partial(_gpu_worker, long=long)
    raw = run_distributed(worker, world_size=world_size, backend="nccl", timeout_s=300)
    if "skip" in raw[0]:
        pytest.skip(raw[0]["skip"])
    results = [_as_torch(r) for r in raw]
    for kernel in ("cudnn", "varlen"):
        for name in ("out", "dq", "dk", "dv"):
            for r in results:
                got, ref = r[kernel][name].float(), r["sdpa"][name].float()
                # bf16: the kernels round differently; 2e-2 of the tensor's scale (verl's loss anchor is 1e-2)
                err = float((got - ref).abs().max()) / float(ref.abs().max())
                print(f"{kernel} vs sdpa, bf16, cp={world_size}, {name}: {err:.3e}")
                assert err < 2e-2, (kernel, name, err)


def test_cp1_segment_plan_splits_long_sequences_from_runs_of_short_ones() -> None:
    """CP 1 under "cudnn": each sequence of >= DENSE_MIN_TOKENS alone (window rounded up inside the row), runs of
    shorter sequences together with their own offsets."""
    from verl_dyncp.kernels import (
        DENSE_MIN_TOKENS,
        DENSE_WINDOW_MULTIPLE,
        _DenseSegment,
        _segment_plan,
        _VarlenSegment,
    )
    from verl_dyncp.layout import build_thd_layout

    assert (DENSE_MIN_TOKENS, DENSE_WINDOW_MULTIPLE) == (2048, 256)
    lens = [100, 30, 2300, 5, 2048, 7, 2100]
    cu = torch.tensor([0, *itertools.accumulate(lens)], dtype=torch.int32)
    layout = build_thd_layout(cu_seqlens=cu, cu_seqlens_padded=None, cp_size=1, cp_rank=0, device="cpu")
    assert not layout.has_padding
    plan = _segment_plan(layout)
    assert _segment_plan(layout) is plan  # once per micro-batch
    kinds = [type(seg).__name__ for seg in plan]
    assert kinds == [
        "_VarlenSegment",
        "_DenseSegment",
        "_VarlenSegment",
        "_DenseSegment",
        "_VarlenSegment",
        "_DenseSegment",
    ]
    first, dense1, _, dense2, _, last = plan
    assert isinstance(first, _VarlenSegment) and (first.start, first.end, first.max_seqlen) == (0, 130, 100)
    assert first.cu_seqlens.tolist() == [0, 100, 130]
    assert isinstance(dense1, _DenseSegment) and (dense1.start, dense1.length, dense1.window) == (
        130,
        2300,
        2304,
    )
    assert isinstance(dense2, _DenseSegment) and (dense2.length, dense2.window) == (2048, 2048)
    total = sum(lens)
    assert isinstance(last, _DenseSegment) and last.start + last.window == total  # cut at the row's end
    padded = build_thd_layout(
        cu_seqlens=cu, cu_seqlens_padded=torch.tensor([0, *itertools.accumulate(n + 1 for n in lens)]), cp_size=1,
        cp_rank=0, device="cpu",
    )  # fmt: skip
    assert padded.has_padding


@pytest.mark.skipif(
    importlib.util.find_spec("transformer_engine") is not None,
    reason="checks the error without Transformer Engine",
)
def test_te_kernel_without_transformer_engine_is_a_clear_error() -> None:
    from verl_dyncp.te_attention import te_attention_available, te_core_attention

    assert not te_attention_available()
    with pytest.raises(
        ImportError,
        match=r"needs Transformer Engine .*pip install 'transformer-engine\[pytorch\]'.*kernel 'auto'",
    ):
        te_core_attention(rotary_base=10000.0)
    with pytest.raises(ValueError, match="cp_comm_type must be one of p2p, all_gather, a2a"):
        te_core_attention(rotary_base=10000.0, cp_comm_type="ring")


def test_attach_cp_context_switches_te_cp_off_for_cp_size_1() -> None:
    """megatron >= 0.16 reads PackedSeqParams.cp_group / local_cp_size in its TE attention: for a k = 1 micro-batch
    they must say "no CP" (cp_group None, local_cp_size 1); local_cp_size None would keep the previous group."""
    from verl_dyncp.cp_context import attach_cp_context, get_cp_context
    from verl_mcore_utils.compat import make_packed_seq_params, packed_seq_params_fields

    cu = torch.tensor([0, 3, 8], dtype=torch.int32)
    params = attach_cp_context(
        make_packed_seq_params(
            qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=5, max_seqlen_kv=5
        ),
        cp_group=None,
    )
    assert get_cp_context(params).size == 1
    if "cp_group" in packed_seq_params_fields():
        assert params.cp_group is None and params.local_cp_size == 1


def test_layout_built_with_the_packed_seq_params_equals_the_one_the_forward_would_build() -> None:
    """thd_packed_seq_params builds the attention layout up front (no sync or host work mid-forward);
    at CP 1 it is a view of the meta and must equal build_thd_layout's, padded or not."""
    import dataclasses

    from verl_dyncp.layout import build_thd_layout, thd_layout, thd_packed_seq_params
    from verl_dyncp.thd import build_thd_meta

    for tp in (1, 4):  # tp 4: sequences padded to the alignment
        meta = build_thd_meta(seq_lens=[5, 130, 1, 77], cp_size=1, cp_rank=0, tp_size=tp, device="cpu")
        params = thd_packed_seq_params(meta, cp_group=None)
        cached = thd_layout(params, cp_size=1, cp_rank=0, device="cpu")
        assert thd_layout(params, cp_size=1, cp_rank=0, device="cpu") is cached
        fresh = build_thd_layout(
            cu_seqlens=meta.cu_seqlens,
            cu_seqlens_padded=meta.cu_seqlens_padded,
            cp_size=1,
            cp_rank=0,
            device="cpu",
        )
        assert cached.has_padding == (tp > 1)
        for f in dataclasses.fields(fresh):
            if not f.compare:
                continue
            a, b = getattr(cached, f.name), getattr(fresh, f.name)
            if isinstance(b, torch.Tensor):
                assert a is not None and a.dtype == b.dtype and torch.equal(a, b), f.name
            else:
                assert a == b, f.name


def test_a_layout_cached_ahead_of_the_attention_is_the_one_it_reads() -> None:
    """Writers ahead of the forward (thd_packed_seq_params, the graph builders) and the attention's thd_layout
    share one cache key: the prebuilt layout itself is read (no second build), for a device given as a string or
    a torch.device, and another CP rank's key is not confused with it."""
    from verl_dyncp.cp_context import LAYOUT_CACHE_ATTR
    from verl_dyncp.layout import build_thd_layout, cache_layout, thd_layout, thd_packed_seq_params
    from verl_dyncp.thd import build_thd_meta

    meta = build_thd_meta(seq_lens=[8, 132, 4, 80], cp_size=1, cp_rank=0, tp_size=1, device="cpu")
    params = thd_packed_seq_params(meta, cp_group=None)
    (prebuilt,) = getattr(params, LAYOUT_CACHE_ATTR).values()
    assert thd_layout(params, cp_size=1, cp_rank=0, device="cpu") is prebuilt
    assert thd_layout(params, cp_size=1, cp_rank=0, device=torch.device("cpu")) is prebuilt
    other = build_thd_layout(
        cu_seqlens=meta.cu_seqlens,
        cu_seqlens_padded=meta.cu_seqlens_padded,
        cp_size=2,
        cp_rank=1,
        device="cpu",
    )
    cache_layout(params, other)
    assert thd_layout(params, cp_size=2, cp_rank=1, device="cpu") is other
    assert thd_layout(params, cp_size=1, cp_rank=0, device="cpu") is prebuilt
