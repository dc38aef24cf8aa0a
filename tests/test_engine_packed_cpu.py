"""CPU, gloo, fp32: verl-engine on packed batches with static and dynamic CP equals the no-CP run.

The layouts are switched by the verl config keys (``megatron.context_parallel_size``,
``megatron.dynamic_context_parallel``, ``megatron.max_seqlen_per_dp_cp_rank``). Reference: the same engine
on ONE process without CP (every sequence whole), and for log-probs also Hugging Face transformers on
the engine's initial weights (an independent RoPE / position check). Compared, with 1e-5 relative
tolerance (fp32; only reduction order differs): the loss of three optimizer steps, every parameter
gradient of step 1, log-probs before and after training, and the RoPE position of every token.

Batches: a mixed one (lengths 1, 5, 16, 23, 37, 64, 100: a length-1 sequence, lengths at power-of-two
boundaries of the budget, target mask on half the tokens), all sequences of equal length, and one
sequence (fewer sequences than CP groups: idle groups run dummy work).
"""

from __future__ import annotations

from typing import Any

import pytest

from engine_workers import max_rel_err
from packed_engine_workers import hf_log_probs, packed_errors, packed_run, packed_runs, save_engine_weights
from verl_mcore_utils.testing import run_distributed

TOL = 1e-5
MIXED = (37, 1, 64, 5, 100, 16, 23)
BATCHES = [(MIXED, 11, True), ((20,) * 6, 12, False), ((90,), 13, False)]
DYN = ["megatron.dynamic_context_parallel=true"]
TP2 = ["megatron.tensor_model_parallel_size=2", "megatron.sequence_parallel=false"]
FUSED = ["model.use_fused_kernels=true"]  # loss from the hidden states, LM head inside the chunk loop


@pytest.fixture(scope="module")
def reference() -> dict[str, Any]:
    (ref,) = run_distributed(packed_run, world_size=1, args=("cpu", [], BATCHES, 4096))
    return ref


def _check(out: dict[str, Any], ref: dict[str, Any]) -> None:
    assert len(out["losses"]) == len(ref["losses"]) == 3
    for got, want in zip(out["losses"], ref["losses"], strict=True):
        assert abs(got - want) <= TOL * abs(want), (out["losses"], ref["losses"])
    if out["grads"] is not None:  # None under TP (sharded); the later steps' losses cover them
        assert out["grads"].keys() == ref["grads"].keys() and len(ref["grads"]) > 10
        for name, g in out["grads"].items():
            assert max_rel_err(g, ref["grads"][name]) <= TOL, name
    assert max_rel_err(out["logp"], ref["logp"]) <= TOL
    assert max_rel_err(out["logp_after"], ref["logp_after"]) <= TOL
    assert out["positions"] == ref["positions"]


@pytest.fixture(scope="module")
def initial_weights(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The reference engine's initial weights as a Hugging Face checkpoint."""
    path = tmp_path_factory.mktemp("engine_init")
    run_distributed(save_engine_weights, world_size=1, args=([], str(path)))
    return str(path)


def test_reference_log_probs_and_positions_match_transformers(reference: dict, initial_weights: str) -> None:
    hf = hf_log_probs(initial_weights, MIXED, seed=11)
    assert max_rel_err(reference["logp"], hf) <= TOL, max_rel_err(reference["logp"], hf)
    expected_positions = [p for n in MIXED for p in range(n)]
    assert reference["positions"] == expected_positions
    # training moved the weights: the parity below is not between two untrained copies
    assert max_rel_err(reference["logp_after"], reference["logp"]) > 1e-3
    assert reference["losses"][2] != reference["losses"][0]


# (overrides, micro-batch budget per rank, expected CP sizes per micro-batch of each step or None = static).
# Every rank here holds fewer tokens than the planner's floor (GEMM_ROOFLINE_TOKENS), so the balance rule never
# raises a size; under dynamic CP the engine packs micro-batches (verl_dyncp.pack_micro_batches) so that the size
# their longest sequence needs holds them within budget: the six 20-token sequences at 4 ranks (budget 32 per
# rank) run as 4 + 2 at CP 1, where cut by total tokens (one micro-batch of 6) they overflowed CP 1 and ran at CP 2.
LAYOUTS = {
    2: [
        (["megatron.context_parallel_size=2"], 64, None),
        ([*DYN, "megatron.max_seqlen_per_dp_cp_rank=64"], None, [[(2,), (1,)], [(1,)], [(2,)]]),
        ([*DYN, "megatron.max_seqlen_per_dp_cp_rank=64", *FUSED], None, [[(2,), (1,)], [(1,)], [(2,)]]),
    ],
    4: [
        (["megatron.context_parallel_size=4"], 64, None),
        (["megatron.context_parallel_size=2"], 64, None),
        # CP 4 for the micro-batches holding a 64- or 90-token sequence, CP 2 for the one whose longest is 37,
        # CP 1 for the 20-token ones
        ([*DYN, "megatron.max_seqlen_per_dp_cp_rank=32"], None, [[(4,), (2,)], [(1,), (1,)], [(4,)]]),
    ],
    # TP 2 x a DP x CP pool of 2 (alignment tp * cp * 2); sequence parallel needs CUDA buffers, so off
    "tp2": [
        (
            [*DYN, "megatron.max_seqlen_per_dp_cp_rank=64", *TP2],
            None,
            [[(2,), (1,)], [(1,)], [(2,)]],
        ),
        (
            [*DYN, "megatron.max_seqlen_per_dp_cp_rank=64", *TP2, *FUSED],
            None,
            [[(2,), (1,)], [(1,)], [(2,)]],
        ),
    ],
}


@pytest.mark.parametrize("world", [2, 4, "tp2"])
def test_cp_layouts_match_no_cp(reference: dict, initial_weights: str, world: int | str) -> None:
    """Static CP 2 / 4 and dynamic CP (k per micro-batch from max_seqlen_per_dp_cp_rank), one spawn per world."""
    layouts = LAYOUTS[world]
    variants = [(overrides, budget) for overrides, budget, _ in layouts]
    size = 4 if world == "tp2" else int(world)
    ckpt = initial_weights if world == "tp2" else None  # TP runs start from the reference's weights
    per_rank = run_distributed(
        packed_runs, world_size=size, args=("cpu", variants, BATCHES, ckpt), timeout_s=400
    )
    for i, (overrides, _, plans) in enumerate(layouts):
        results = [rank_results[i] for rank_results in per_rank]
        for out in results:
            _check(out, reference)
        plan = results[0]["plans"]
        if plans is not None:
            assert plan == plans, overrides
        else:
            k = int(overrides[0].split("=")[1])
            assert {s for step in plan for mb in step for s in mb} == {k}
        assert "CP" in results[0]["engine"]["cp_layout"]


def test_bad_batches_are_clear_errors_on_every_rank() -> None:
    cases = [
        [(70, 10)],  # one sequence longer than max_seqlen_per_dp_cp_rank x (DP x CP) = 32 x 2
        [()],  # empty batch
        [(9, 4), (9, 5)],  # ranks given different batches
    ]
    results = run_distributed(
        packed_errors,
        world_size=2,
        args=([*DYN, "megatron.max_seqlen_per_dp_cp_rank=32"], cases),
        timeout_s=240,
    )
    for messages in results:
        too_long, empty, mismatch, after = messages
        assert "70" in too_long and "max_seqlen_per_dp_cp_rank" in too_long and "64" in too_long, too_long
        assert "empty batch" in empty, empty
        assert "different batches" in mismatch, mismatch
        assert after.startswith("then trained")
    assert len({tuple(m) for m in results}) == 1  # the same errors everywhere
