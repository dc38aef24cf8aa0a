"""THD zigzag pre/post-processing: layout (pure, every rank computed locally) and gloo round trips (2 and 4 ranks)."""

from __future__ import annotations

import pytest
import torch
from dyncp_workers import SEQ_LENS, packed_tokens, reference_labels, reference_positions, results

from verl_dyncp.thd import build_thd_meta, postprocess_thd_engine, preprocess_thd_engine, thd_alignment

CASES = [(cp, tp) for cp in (1, 2, 4) for tp in (1, 2)]


def test_alignment_rule() -> None:
    assert [thd_alignment(cp_size=cp, tp_size=tp) for cp, tp in CASES] == [1, 2, 4, 8, 8, 16]
    with pytest.raises(ValueError, match="cp_size must be a positive int, got 0"):
        thd_alignment(cp_size=0)


@pytest.mark.parametrize(("cp", "tp"), CASES)
def test_zigzag_layout_matches_no_cp_run(cp: int, tp: int) -> None:
    lens = SEQ_LENS
    tokens = packed_tokens(lens, seed=1)
    ref_pos, ref_labels = reference_positions(lens), reference_labels(tokens, lens)
    align = thd_alignment(cp_size=cp, tp_size=tp)
    covered = torch.zeros(sum(lens), dtype=torch.int64)
    for r in range(cp):
        b = preprocess_thd_engine(tokens, seq_lens=lens, cp_size=cp, cp_rank=r, tp_size=tp)
        m = b.meta
        assert all(p % align == 0 and p >= n for p, n in zip(m.padded_lens, lens, strict=True))
        assert m.padded_lens == tuple(-(-n // align) * align for n in lens)
        real = ~m.is_padding
        covered.index_add_(0, m.source_index[real], torch.ones(int(real.sum()), dtype=torch.int64))
        # true positions, labels and tokens of every real local token equal the no-CP run's
        assert torch.equal(b.position_ids[real], ref_pos[m.source_index[real]])
        assert torch.equal(b.labels[real], ref_labels[m.source_index[real]])
        assert torch.equal(b.input_ids[real], tokens[m.source_index[real]])
        assert torch.equal(b.loss_mask, b.labels != -100)
        assert bool((b.labels[m.is_padding] == -100).all()) and bool((b.input_ids[m.is_padding] == 0).all())
        # the zigzag chunks: [r*h, (r+1)*h) then [P-(r+1)*h, P-r*h) of every sequence
        expect = []
        for i, p in enumerate(m.padded_lens):
            start = int(m.cu_seqlens_padded[i])
            if cp == 1:
                expect.append(torch.arange(start, start + p))
            else:
                h = p // (2 * cp)
                expect += [
                    torch.arange(start + r * h, start + (r + 1) * h),
                    torch.arange(start + p - (r + 1) * h, start + p - r * h),
                ]
        assert torch.equal(m.global_index, torch.cat(expect))
        assert torch.equal(
            m.position_ids,
            m.global_index
            - m.cu_seqlens_padded.long()[
                torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(m.padded_lens) // cp)
            ],
        )
        # attention metadata: chunk offsets, q/kv extents and dtypes
        assert m.cu_seqlens.dtype == m.cu_seqlens_padded.dtype == m.cu_seqlens_q_first.dtype == torch.int32
        assert torch.equal(m.cu_seqlens.long(), torch.cumsum(torch.tensor([0, *lens]), 0))
        assert torch.equal(
            m.local_cu_seqlens.long(), torch.cumsum(torch.tensor([0, *m.padded_lens]) // cp, 0)
        )
        assert torch.equal(m.first_chunk_offsets, m.local_cu_seqlens[:-1].long())
        q = torch.cat([m.q_index_first, m.q_index_second]).sort().values
        assert torch.equal(q, torch.arange(m.local_tokens))
        for i, p in enumerate(m.padded_lens):
            h = p // (2 * cp) if cp > 1 else p
            kv1 = int(m.cu_seqlens_kv_first[i + 1] - m.cu_seqlens_kv_first[i])
            kv2 = int(m.cu_seqlens_kv_second[i + 1] - m.cu_seqlens_kv_second[i])
            assert kv1 == ((r + 1) * h if cp > 1 else p) and kv2 == (p - r * h if cp > 1 else 0)
            assert int(m.cu_seqlens_q_first[i + 1] - m.cu_seqlens_q_first[i]) == h
            # every query's own key is the last key it sees (bottom-right causal alignment)
            first_q = m.global_index[m.q_index_first][
                int(m.cu_seqlens_q_first[i]) : int(m.cu_seqlens_q_first[i + 1])
            ]
            first_kv = m.kv_index_first[int(m.cu_seqlens_kv_first[i]) : int(m.cu_seqlens_kv_first[i + 1])]
            assert int(first_q[-1]) == int(first_kv[-1])
            if cp > 1:
                second_q = m.global_index[m.q_index_second][
                    int(m.cu_seqlens_q_second[i]) : int(m.cu_seqlens_q_second[i + 1])
                ]
                second_kv = m.kv_index_second[
                    int(m.cu_seqlens_kv_second[i]) : int(m.cu_seqlens_kv_second[i + 1])
                ]
                assert int(second_q[-1]) == int(second_kv[-1])
    assert bool((covered == 1).all()), "every real token is held by exactly one CP rank"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64, torch.int32, torch.bool])
def test_preprocess_keeps_dtype(dtype: torch.dtype) -> None:
    x = (torch.arange(sum(SEQ_LENS)) % 3).to(dtype)
    b = preprocess_thd_engine(
        x, seq_lens=SEQ_LENS, cp_size=2, cp_rank=1, tp_size=2, pad_value=0, ignore_index=0
    )
    assert b.input_ids.dtype == dtype and b.labels.dtype == dtype
    assert b.position_ids.dtype == torch.int64 and b.loss_mask.dtype == torch.bool


def test_label_mask_selects_targets() -> None:
    lens = [4, 3]
    tokens = packed_tokens(lens, seed=2)
    target = torch.tensor([False, False, True, True, False, True, True])
    b = preprocess_thd_engine(tokens, seq_lens=lens, cp_size=1, cp_rank=0, label_mask=target)
    # label of token t is token t+1: trained where token t+1 is a target and in the same sequence
    assert b.loss_mask.tolist() == [False, True, True, False, True, True, False]


def test_single_rank_postprocess_roundtrip_with_grad() -> None:
    x = torch.randn(sum(SEQ_LENS), 2)
    b = preprocess_thd_engine(x, seq_lens=SEQ_LENS, cp_size=1, cp_rank=0, tp_size=2)
    local = b.input_ids.clone().requires_grad_()
    out = postprocess_thd_engine(local, meta=b.meta, cp_group=None)
    assert torch.equal(out, x)
    out.sum().backward()
    assert local.grad is not None and torch.equal(
        local.grad, (~b.meta.is_padding).float()[:, None].expand(-1, 2)
    )


def test_errors_are_precise() -> None:
    with pytest.raises(ValueError, match="seq_lens is empty"):
        build_thd_meta(seq_lens=[], cp_size=2, cp_rank=0)
    with pytest.raises(
        ValueError, match=r"at least one token; \(index, length\) of the bad ones: \[\(1, 0\)\]"
    ):
        build_thd_meta(seq_lens=[3, 0], cp_size=2, cp_rank=0)
    with pytest.raises(ValueError, match=r"cp_rank must be an int in \[0, 2\), got 2"):
        build_thd_meta(seq_lens=[3], cp_size=2, cp_rank=2)
    with pytest.raises(ValueError, match="expected a packed tensor with 3 tokens in dim 0, got shape"):
        preprocess_thd_engine(torch.zeros(4), seq_lens=[3], cp_size=1, cp_rank=0)
    meta = build_thd_meta(seq_lens=[3], cp_size=2, cp_rank=0)
    with pytest.raises(ValueError, match="dim 0 must be 2"):
        postprocess_thd_engine(torch.zeros(5), meta=meta, cp_group=None)
    with pytest.raises(ValueError, match="a process group is needed to gather over 2 ranks"):
        postprocess_thd_engine(torch.zeros(meta.local_tokens), meta=meta, cp_group=None)


@pytest.mark.parametrize("world", [2, 4])
def test_gloo_roundtrip_any_dtype_and_gradients(world: int) -> None:
    """Pre- then post-processing on every CP rank (cp in the sizes the world allows, tp 1 and 2) returns the
    input bit-exactly in its own dtype (fp32, bf16, int64, bool); the gradient of a loss on the
    postprocessed output reaches each rank's local tensor and equals the no-CP gradient slice."""
    cps = [1, 2, 4][: world.bit_length()]
    for rank, res in enumerate(results(world)):
        thd = res["thd"]
        for cp in cps:
            for tp in (1, 2):
                for name in ("float32", "bfloat16", "int64", "bool"):
                    assert thd[f"roundtrip/cp{cp}/tp{tp}/{name}"] == (True, True), (rank, cp, tp, name)
                assert thd[f"grad/cp{cp}/tp{tp}"] <= 1e-6, (rank, cp, tp)


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("cp", [1, 2, 3, 4, 8])
def test_the_closed_form_gathered_index_is_the_layouts_map(cp: int, tp: int) -> None:
    """The merge's map of every real token into the gathered buffer (``_gathered_index``) equals the full
    layout's ``unpadded_to_gathered`` and ``local_tokens``, for every CP rank's layout, with lengths around
    every alignment boundary."""
    from verl_dyncp.thd import _gathered_index

    gen = torch.Generator().manual_seed(cp * 10 + tp)
    align = thd_alignment(cp_size=cp, tp_size=tp)
    for lens in (
        [1],
        [n for n in (align - 1, align, align + 1) if n >= 1],
        [int(n) for n in torch.randint(1, 300, (17,), generator=gen)],
        list(SEQ_LENS),
    ):
        local, index = _gathered_index(seq_lens=lens, cp_size=cp, tp_size=tp)
        for rank in range(cp):
            meta = build_thd_meta(seq_lens=lens, cp_size=cp, cp_rank=rank, tp_size=tp)
            assert local == meta.local_tokens
            assert torch.equal(index, meta.unpadded_to_gathered), (lens, rank)
