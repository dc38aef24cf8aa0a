"""End-to-end parity (issue 5): a tiny GPT on one packed batch, static CP 2 / 4 and dynamic CP vs no CP.

Real megatron-core on gloo, fp32, CPU. One spawn per world size (2 and 4 processes) runs every case; the
workers are in model_parity_workers.py, whose docstring states the loss / gradient bookkeeping: every
rank's loss is the sum of its own label tokens' cross entropy over the GLOBAL label-token count, and the
full gradient is the SUM over all ranks of the local gradients (weights are replicated). Both are
compared with a single-process no-CP run (megatron-core's standard GPTModel with its own RoPE, each
sequence alone, BSHD) on the same weights: max|a-b| / max|b| <= 1e-5 for the loss and for EVERY
parameter gradient.

Batch edge cases: a sequence of length 1 (no label token at all, shorter than every alignment), lengths
exactly at a power-of-two / alignment boundary (16, 32: no padding), a single sequence (fewer sequences
than groups: idle groups run a dummy sequence, take part in every collective and contribute zero). A
batch whose only sequence has length 1 is left out: it has no label token, so the no-CP mean loss is 0/0.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

TOL = 1e-5
MIXED = (37, 1, 16, 9, 24, 5)  # a length-1 sequence, a power-of-two length, odd lengths, longest 37
SINGLE = (32,)  # one sequence, exactly at a power-of-two boundary

CASES_2: list[tuple[str, tuple[int, ...], dict[str, Any]]] = [
    ("static_cp2", MIXED, {"static_cp_size": 2}),
    ("static_cp2_single", SINGLE, {"static_cp_size": 2}),
    (
        "dynamic_k1_2ranks",
        MIXED,
        {"max_seqlen_per_dp_cp_rank": 40, "larger_cp_min_gain": None},
    ),  # k=1: two groups of one rank
    (
        "dynamic_single_idle_2ranks",
        SINGLE,
        {"max_seqlen_per_dp_cp_rank": 32, "larger_cp_min_gain": None},
    ),  # k=1, one idle rank
]
CASES_4: list[tuple[str, tuple[int, ...], dict[str, Any]]] = [
    ("static_cp4", MIXED, {"static_cp_size": 4}),
    ("static_cp4_single", SINGLE, {"static_cp_size": 4}),
    ("dynamic_k1", MIXED, {"max_seqlen_per_dp_cp_rank": 40, "larger_cp_min_gain": None}),  # 4 groups of 1
    ("dynamic_k2", MIXED, {"max_seqlen_per_dp_cp_rank": 20, "larger_cp_min_gain": None}),  # 2 groups of 2
    ("dynamic_k4", MIXED, {"max_seqlen_per_dp_cp_rank": 10, "larger_cp_min_gain": None}),  # 1 group of 4
    (
        "dynamic_single_k1_3idle",
        SINGLE,
        {"max_seqlen_per_dp_cp_rank": 32, "larger_cp_min_gain": None},
    ),  # 3 idle groups of 1
    (
        "dynamic_single_k2_1idle",
        SINGLE,
        {"max_seqlen_per_dp_cp_rank": 16, "larger_cp_min_gain": None},
    ),  # 1 idle group of 2
]

# expected plan shape per case: (CP sizes, number of dummy ranks)
EXPECTED = {
    "static_cp2": ((2,), 0),
    "static_cp2_single": ((2,), 0),
    "dynamic_k1_2ranks": ((1,), 0),
    "dynamic_single_idle_2ranks": ((1,), 1),
    "static_cp4": ((4,), 0),
    "static_cp4_single": ((4,), 0),
    "dynamic_k1": ((1,), 0),
    "dynamic_k2": ((2,), 0),
    "dynamic_k4": ((4,), 0),
    "dynamic_single_k1_3idle": ((1,), 3),
    "dynamic_single_k2_1idle": ((2,), 2),
}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from verl_mcore_utils.hf_testing import save_tiny_hf_model

    # 2 layers, hidden 64, 4 query / 2 KV heads, vocab 128, qkv bias (qwen2), fp32
    return save_tiny_hf_model("qwen2", tmp_path_factory.mktemp("parity") / "qwen2")


def _check(results: dict[str, Any], cases: list[tuple[str, tuple[int, ...], dict[str, Any]]]) -> None:
    assert set(results) == {name for name, _, _ in cases}
    for name, lengths, _ in cases:
        r = results[name]
        print(
            f"{name}: lengths {lengths} CP sizes {r['k']} blocks {r['blocks']} dummy ranks {r['dummy_ranks']}"
            f" label tokens per rank {r['local_counts']}: loss {r['loss']:.6f} (ref {r['ref_loss']:.6f},"
            f" rel err {r['loss_rel']:.2e}), worst grad rel err {r['grad_rel']:.2e} ({r['worst_param']},"
            f" {r['num_params']} parameters)"
        )
        sizes, dummies = EXPECTED[name]
        assert r["k"] == sizes, (name, r["k"])
        assert len(r["dummy_ranks"]) == dummies, (name, r["dummy_ranks"])
        assert r["count"] == sum(n - 1 for n in lengths) == sum(r["local_counts"]), name
        assert not r["zero_ref_grads"], (name, r["zero_ref_grads"])
        assert r["loss_rel"] <= TOL, (name, r["loss_rel"])
        assert r["grad_rel"] <= TOL, (name, r["worst_param"], r["grad_rel"])


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [2, 4])
def test_tiny_gpt_cp_loss_and_grads_match_no_cp(world_size: int, checkpoint: Path) -> None:
    from model_parity_workers import parity_worker

    from verl_mcore_utils.testing import run_distributed

    cases = CASES_2 if world_size == 2 else CASES_4
    results = run_distributed(
        parity_worker, world_size=world_size, args=(str(checkpoint), cases), timeout_s=300
    )
    _check(results[0], cases)
