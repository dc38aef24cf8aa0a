"""Fixed-shape CP-1 layouts for CUDA graphs (verl_dyncp.graph_layout): padding, fit checks, the layout a
graph's forward builds. The graphed decoder itself (replays against eager) is tested on GPUs:
test_gpu_graph_layout.py."""

from __future__ import annotations

import pytest
import torch

from verl_dyncp.graph_layout import GraphSlots, graph_packed_seq_params, graph_thd_layout, pad_layout_to_slots
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
