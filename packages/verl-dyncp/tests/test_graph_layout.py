"""Fixed-shape CP-1 layouts for CUDA graphs (verl_dyncp.graph_layout): padding, fit checks, the layout a
graph's forward builds. The graphed decoder itself (replays against eager) is tested on GPUs:
test_gpu_graph_layout.py."""

from __future__ import annotations

import pytest
import torch

from verl_dyncp.graph_layout import (
    GraphSlots,
    graph_cp_thd_layout,
    graph_packed_seq_params,
    graph_thd_layout,
    pad_cp_layout_to_slots,
    pad_cp_micro_batch_to_slots,
    pad_layout_to_slots,
)
from verl_dyncp.layout import build_thd_layout
from verl_dyncp.thd_attention import thd_attention


def _layout(lens: list[int], *, padded: list[int] | None = None, cp_size: int = 1):
    def cu(values: list[int]) -> torch.Tensor:
        return torch.tensor([0, *torch.tensor(values).cumsum(0).tolist()], dtype=torch.int32)

    return build_thd_layout(
        cu_seqlens=cu(lens),
        cu_seqlens_padded=None if padded is None else cu(padded),
        cp_size=cp_size,
        cp_rank=0,
        device="cpu",
    )


def test_a_micro_batch_is_followed_by_one_padding_sequence_then_empty_slots() -> None:
    cu, positions, valid = pad_layout_to_slots(_layout([3, 2]), slots=GraphSlots(tokens=8, sequences=5))
    assert cu.dtype == torch.int32
    assert cu.tolist() == [0, 3, 5, 8, 8, 8]  # sequences, padding [5, 8), then empty
    assert positions.tolist() == [0, 1, 2, 0, 1, 0, 1, 2]
    assert valid.tolist() == [True] * 5 + [False] * 3


def test_alignment_padding_inside_the_micro_batch_stays_invalid() -> None:
    # true lengths 3 and 1, padded to 4 and 2 (alignment): the layout's own padding rows stay masked
    layout = _layout([3, 1], padded=[4, 2])
    cu, positions, valid = pad_layout_to_slots(layout, slots=GraphSlots(tokens=8, sequences=4))
    assert cu.tolist() == [0, 4, 6, 8, 8]
    assert positions[:6].tolist() == layout.position_ids.tolist()
    assert valid.tolist() == [True, True, True, False, True, False, False, False]


def test_a_micro_batch_filling_the_budget_needs_no_padding_slot() -> None:
    cu, _, valid = pad_layout_to_slots(_layout([4, 4]), slots=GraphSlots(tokens=8, sequences=2))
    assert cu.tolist() == [0, 4, 8]
    assert bool(valid.all())


@pytest.mark.parametrize(
    ("lens", "slots"),
    [([5, 4], GraphSlots(tokens=8, sequences=4)), ([2, 2, 2], GraphSlots(tokens=8, sequences=3))],
    ids=["tokens", "sequences"],
)
def test_a_micro_batch_that_does_not_fit_is_refused_with_its_numbers(lens, slots) -> None:
    n = sum(lens)
    with pytest.raises(ValueError, match=rf"micro-batch of {n} tokens in {len(lens)} sequences does not fit"):
        pad_layout_to_slots(_layout(lens), slots=slots)


def test_only_cp_1_layouts_are_padded() -> None:
    with pytest.raises(ValueError, match="CP-1 only: .* CP size 2"):
        pad_layout_to_slots(_layout([8, 4], cp_size=2), slots=GraphSlots(tokens=16, sequences=4))


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"tokens": 0, "sequences": 1}, "GraphSlots.tokens must be a positive int, got 0"),
        ({"tokens": 4, "sequences": True}, "GraphSlots.sequences must be a positive int, got True"),
        ({"tokens": 4, "sequences": 5}, "sequences=5 exceeds tokens=4"),
    ],
)
def test_graph_slots_are_validated(kwargs, match) -> None:
    with pytest.raises(ValueError, match=match):
        GraphSlots(**kwargs)


def test_the_graph_layout_has_fixed_shapes_and_no_host_lengths() -> None:
    slots = GraphSlots(tokens=8, sequences=4)
    cu, positions, valid = pad_layout_to_slots(_layout([3, 2]), slots=slots)
    layout = graph_thd_layout(cu_seqlens=cu, position_ids=positions, valid=valid, slots=slots)
    assert layout.graph_safe and layout.has_padding
    assert (layout.num_local_tokens, layout.max_seqlen_q, layout.max_seqlen_k) == (8, 8, 8)
    assert layout.padded_lens == () and layout.cu_seqlens_q is cu and layout.position_ids is positions
    with pytest.raises(ValueError, match=r"cu_seqlens must be int32 of shape \(5,\)"):
        graph_thd_layout(cu_seqlens=cu[:4], position_ids=positions, valid=valid, slots=slots)
    with pytest.raises(ValueError, match=r"valid must have shape \(8,\)"):
        graph_thd_layout(cu_seqlens=cu, position_ids=positions, valid=valid[:5], slots=slots)


def test_graph_packed_seq_params_carry_the_layout_to_the_attention() -> None:
    from verl_dyncp.layout import thd_layout

    slots = GraphSlots(tokens=8, sequences=4)
    cu, positions, valid = pad_layout_to_slots(_layout([3, 2]), slots=slots)
    params = graph_packed_seq_params(cu_seqlens=cu, position_ids=positions, valid=valid, slots=slots)
    assert params.qkv_format == "thd" and params.max_seqlen_q == 8
    layout = thd_layout(params, cp_size=1, cp_rank=0, device=torch.device("cpu"))
    assert layout.graph_safe and layout.cu_seqlens_q is cu


def test_a_graph_layout_refuses_every_path_but_varlen() -> None:
    # on the CPU (fp32) the attention would pick the per-sequence SDPA path, which needs host lengths
    slots = GraphSlots(tokens=8, sequences=4)
    cu, positions, valid = pad_layout_to_slots(_layout([3, 2]), slots=slots)
    layout = graph_thd_layout(cu_seqlens=cu, position_ids=positions, valid=valid, slots=slots)
    q = torch.randn(8, 2, 4)
    with pytest.raises(
        ValueError, match="graph layout .* needs the varlen kernel, but kernel='auto' chose 'sdpa'"
    ):
        thd_attention(q, q, q, layout=layout, cp_group=None)


def test_a_ddp_wrapped_decoder_whose_hooks_were_not_moved_is_refused_with_the_reason() -> None:
    from verl_dyncp.graphed_decoder import GraphedDecoder

    decoder = torch.nn.Linear(2, 2)
    decoder.weight.main_grad = torch.zeros(2, 2)  # what megatron-core's DDP gives every parameter it wraps
    with pytest.raises(
        ValueError,
        match="parameter 'weight' has main_grad .*cudaErrorStreamCaptureImplicit.*ddp_hooks_on_parameters",
    ):
        GraphedDecoder(decoder, slots=GraphSlots(tokens=8, sequences=2), hidden_size=2, dtype=torch.float32)


def _varlen_causal(q, k, v, cu_q, cu_k):  # type: ignore[no-untyped-def]
    """What the varlen kernel computes: each query chunk over its key stream, causal from the bottom right."""
    out = torch.zeros_like(q)
    for i in range(cu_q.numel() - 1):
        q0, q1, k0, k1 = int(cu_q[i]), int(cu_q[i + 1]), int(cu_k[i]), int(cu_k[i + 1])
        m, n = q1 - q0, k1 - k0
        if m == 0:
            continue
        scores = q[q0:q1] @ k[k0:k1].T
        allowed = torch.arange(n)[None, :] <= torch.arange(m)[:, None] + (n - m)
        out[q0:q1] = scores.masked_fill(~allowed, float("-inf")).softmax(-1) @ v[k0:k1]
    return out


@pytest.mark.parametrize("cp_size", [2, 4])
def test_a_cp_micro_batch_in_fixed_shapes_attends_as_each_sequence_alone(cp_size: int) -> None:
    """The CP-k graph inputs (padding sequence, slots) give every true token the causal attention of its own
    sequence, whatever the lengths, and the same shapes for every micro-batch of the slots."""
    torch.manual_seed(0)
    slots, align = GraphSlots(tokens=24, sequences=5), 2 * cp_size
    shapes = set()
    for seq_lens in ([5, 9, 2], [17], [3, 3, 3, 4]):
        padded = [-(-n // align) * align for n in seq_lens]
        per_rank = [
            pad_cp_micro_batch_to_slots(
                seq_lens=seq_lens, padded_lens=padded, cp_size=cp_size, cp_rank=r, slots=slots, device="cpu"
            )
            for r in range(cp_size)
        ]
        layouts = [
            graph_cp_thd_layout(x, cp_size=cp_size, cp_rank=r, slots=slots) for r, x in enumerate(per_rank)
        ]
        shapes.add(tuple(tuple(t.shape) for x in per_rank for t in vars(x).values()))
        full_index = per_rank[0].full_index
        assert all(torch.equal(x.full_index, full_index) for x in per_rank)  # one global row map
        total = cp_size * slots.tokens
        q, k, v = (torch.randn(total, 8, dtype=torch.float64) for _ in range(3))  # the padded batch, in order
        gathered = [torch.empty_like(t).index_copy_(0, full_index, t) for t in (q, k, v)]  # rank-major rows
        out = torch.cat([
            _varlen_causal(
                gathered[0][r * slots.tokens : (r + 1) * slots.tokens],
                gathered[1][lay.stream_index],
                gathered[2][lay.stream_index],
                lay.cu_seqlens_q,
                lay.cu_seqlens_k,
            )
            for r, lay in enumerate(layouts)
        ])[full_index]  # fmt: skip
        start = 0
        for n, p in zip(seq_lens, padded, strict=True):
            s = slice(start, start + n)
            expected = _varlen_causal(q[s], k[s], v[s], torch.tensor([0, n]), torch.tensor([0, n]))
            torch.testing.assert_close(out[s], expected, rtol=1e-12, atol=1e-12)
            start += p
        valid = torch.cat([x.valid for x in per_rank])[full_index]  # the valid flag of each padded token
        expected_valid = torch.zeros(total, dtype=torch.bool)
        start = 0
        for n, p in zip(seq_lens, padded, strict=True):
            expected_valid[start : start + n] = True
            start += p
        assert torch.equal(valid, expected_valid)
    assert len(shapes) == 1


def test_a_cp_micro_batch_that_does_not_fit_is_refused_with_its_numbers() -> None:
    slots = GraphSlots(tokens=8, sequences=3)
    with pytest.raises(ValueError, match="CP-2 micro-batch of 20 padded tokens in 1 sequences does not fit"):
        pad_cp_micro_batch_to_slots(
            seq_lens=[20], padded_lens=[20], cp_size=2, cp_rank=0, slots=slots, device="cpu"
        )
    with pytest.raises(
        ValueError, match="in 3 sequences does not fit"
    ):  # no slot left for the padding sequence
        pad_cp_micro_batch_to_slots(
            seq_lens=[4, 4, 4], padded_lens=[4, 4, 4], cp_size=2, cp_rank=0, slots=slots, device="cpu"
        )
    with pytest.raises(ValueError, match="must be even under CP"):
        pad_cp_micro_batch_to_slots(
            seq_lens=[4],
            padded_lens=[4],
            cp_size=2,
            cp_rank=0,
            slots=GraphSlots(tokens=7, sequences=3),
            device="cpu",
        )
    with pytest.raises(ValueError, match="CP size >= 2"):
        pad_cp_micro_batch_to_slots(
            seq_lens=[4], padded_lens=[4], cp_size=1, cp_rank=0, slots=slots, device="cpu"
        )
    inputs = pad_cp_micro_batch_to_slots(
        seq_lens=[4], padded_lens=[4], cp_size=2, cp_rank=0, slots=slots, device="cpu"
    )
    with pytest.raises(ValueError, match=r"full_index must have shape \(32,\) for CP 4"):
        graph_cp_thd_layout(inputs, cp_size=4, cp_rank=0, slots=slots)


@pytest.mark.parametrize("cp_size", [2, 4])
def test_a_cp_micro_batch_padded_from_its_own_layout_equals_the_one_from_its_lengths(cp_size: int) -> None:
    """What the graphed decoder replays (built from the micro-batch's cached layout, which has no true lengths)
    equals the inputs built from the true lengths: same index tensors, same valid rows."""
    slots = GraphSlots(tokens=24, sequences=5)
    seq_lens = [5, 9, 2]
    padded = [-(-n // (2 * cp_size)) * 2 * cp_size for n in seq_lens]
    for rank in range(cp_size):
        layout = build_thd_layout(
            cu_seqlens=torch.tensor([0, *torch.tensor(seq_lens).cumsum(0).tolist()], dtype=torch.int32),
            cu_seqlens_padded=torch.tensor([0, *torch.tensor(padded).cumsum(0).tolist()], dtype=torch.int32),
            cp_size=cp_size,
            cp_rank=rank,
            device="cpu",
        )
        got = pad_cp_layout_to_slots(layout, slots=slots)
        want = pad_cp_micro_batch_to_slots(
            seq_lens=seq_lens, padded_lens=padded, cp_size=cp_size, cp_rank=rank, slots=slots, device="cpu"
        )
        for name in ("valid", "full_index", "stream_index", "cu_seqlens_q", "cu_seqlens_k"):
            assert torch.equal(getattr(got, name), getattr(want, name)), (rank, name)
        used = (
            layout.num_local_tokens
        )  # positions of true tokens (past a true length only masked rows read them)
        assert torch.equal(got.position_ids[:used][layout.valid], want.position_ids[:used][layout.valid])


def test_the_cp_fit_rule_counts_the_whole_group_and_needs_even_slots() -> None:
    slots = GraphSlots(tokens=8, sequences=3)
    assert slots.fit(tokens=16, sequences=3, cp_size=2)  # fills the group: no padding slot needed
    assert not slots.fit(tokens=12, sequences=3, cp_size=2)  # the padding sequence needs a fourth slot
    assert slots.fit(tokens=12, sequences=2, cp_size=2)
    assert not slots.fit(tokens=20, sequences=1, cp_size=2)
    assert not GraphSlots(tokens=7, sequences=3).fit(tokens=8, sequences=1, cp_size=2)
    with pytest.raises(ValueError, match="needs a CP >= 2 micro-batch's own layout"):
        pad_cp_layout_to_slots(_layout([3, 2]), slots=slots)


@pytest.mark.parametrize("cp_size", [1, 2, 4])
def test_holds_is_the_fit_rule_over_a_layouts_padded_lengths_on_every_rank(cp_size: int) -> None:
    """The dispatcher's one fit rule: decided by the whole micro-batch's padded lengths, so every rank of a CP
    group gets the same answer (it replays with its group or runs eagerly with it)."""
    unit = 2 * cp_size if cp_size > 1 else 1
    for lens in ([5, 9, 2], [8 * cp_size], [1] * 7):
        padded = [-(-n // unit) * unit for n in lens]
        for slots in (GraphSlots(tokens=8, sequences=3), GraphSlots(tokens=16, sequences=8)):
            want = slots.fit(tokens=sum(padded), sequences=len(padded), cp_size=cp_size)
            answers = set()
            for rank in range(cp_size):
                layout = build_thd_layout(
                    cu_seqlens=torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32),
                    cu_seqlens_padded=torch.tensor([0, *torch.tensor(padded).cumsum(0).tolist()], dtype=torch.int32),
                    cp_size=cp_size, cp_rank=rank, device="cpu",
                )  # fmt: skip
                answers.add(slots.holds(layout))
            assert answers == {want}, (lens, slots)
