"""GPU, 2 and 4 ranks, bf16: verl-engine on packed batches with static / dynamic CP vs the no-CP run.

Megatron backend (megatron-core DDP without the distributed optimizer, so every rank holds the full
reduced gradient; megatron optimizer), verl-dyncp attention with torch's varlen flash kernel in bf16,
no Transformer Engine. Model: the "small" Qwen2 preset; batches with lengths 1..800 (length 1, power-of-two
boundaries, a target mask), all-equal lengths, and one long sequence (idle groups).

Tolerance (bf16): CP changes how attention is partitioned, so bf16 rounding differs from the no-CP run;
what must hold is that CP adds no error beyond bf16's own. Each bf16 run is compared with an fp32 no-CP
run on one GPU (TF32 off) and its error must be at most twice the bf16 no-CP run's own error plus 1e-3
(loss, every parameter gradient, log-probs), the same rule as the bf16 weight-parity tests. The direct
bf16 CP vs bf16 no-CP loss difference is also bounded by 1e-2 relative (verl's loss tolerance; NeMo-RL
uses rtol 1e-3 for CP2 vs no CP, and the measured values are printed and recorded in docs/benchmarks.md).
RoPE positions are integers and must equal the no-CP positions exactly. An fp32 run with dynamic CP on
4 GPUs must match the fp32 no-CP run to 1e-4 (only reduction order differs).

Transformer Engine (``megatron.packed_attention_backend=te``, when TE is installed): the same layouts with
TE's fused attention and TE's own ring CP, the CP group switched per micro-batch. TE's attention has no
fp32 path, so its own error is that of the bf16 TE run without CP (one GPU) vs the fp32 reference, and
the same rule applies (CP error <= 2 x own + 1e-3, direct loss difference <= 1e-2, positions exact).
"""

from __future__ import annotations

from typing import Any

import pytest

from engine_workers import max_rel_err
from packed_engine_workers import packed_run
from verl_mcore_utils.testing import run_distributed

LONG = (300, 1, 512, 40, 800, 128, 183, 64)
BATCHES = [(LONG, 21, True), ((96,) * 12, 22, False), ((1000,), 23, False)]
COMMON = ["model.preset=small", "megatron.use_distributed_optimizer=false", "optim.lr=1e-3"]
BF16 = [*COMMON, "megatron.dtype=bfloat16"]
FP32 = [*COMMON, "megatron.dtype=float32"]
DYN = ["megatron.dynamic_context_parallel=true"]
DYN2 = [*DYN, "megatron.max_seqlen_per_dp_cp_rank=512"]  # k: 2 for 800 / 1000 tokens, 1 for the rest
DYN4 = [*DYN, "megatron.max_seqlen_per_dp_cp_rank=256"]  # k: 4 for 800 / 1000, 2 for 512, 1 for the rest
# The CP sizes the planner gives each micro-batch of BATCHES (verl_dyncp.plan._balanced_cp_size). Under dynamic
# CP the engine cuts micro-batches with verl_dyncp.pack_micro_batches: each one is planned at the size its longest
# sequence needs, never raised for memory. The 96-token batch at 4 GPUs (budget 256 per rank): 8 sequences (two
# per rank) then 4 (one per rank), both CP 1; cut by total tokens (10 + 2) the first overflowed at CP 1 (three
# of 96 tokens in a rank's 256) and was raised to CP 2. 800 / 1000 tokens need CP 4.
# (The small preset's workload model: linear 939 per token, so the 300 / 512 / 128 / 64 micro-batch balances
# better split: CP 2 at 2 GPUs, CP 4 at 4: the balance rule.)
DYN_PLANS = {2: [[(2,), (2,)], [(1,), (1,)], [(2,)]], 4: [[(4,), (4,)], [(1,), (1,)], [(4,)]]}
BUDGET = 512  # micro-batch token budget per rank for static layouts
TE = ["megatron.packed_attention_backend=te"]
LAYOUT_IDS = ["static2-w2", "dynamic-w2", "static4-w4", "static2-w4", "dynamic-w4"]
LAYOUTS = [  # each layout needs as many GPUs as its world size, no more
    pytest.param(world, overrides, budget, id=name, marks=pytest.mark.num_gpus(world))
    for name, (world, overrides, budget) in zip(
        LAYOUT_IDS,
        [
            (2, ["megatron.context_parallel_size=2"], BUDGET),
            (2, DYN2, None),
            (4, ["megatron.context_parallel_size=4"], BUDGET),
            (4, ["megatron.context_parallel_size=2"], BUDGET),
            (4, DYN4, None),
        ],
        strict=True,
    )
]


def _run(world: int, overrides: list[str], budget: int | None) -> dict[str, Any]:
    results = run_distributed(
        packed_run, world_size=world, backend="nccl", args=("cuda", overrides, BATCHES, budget), timeout_s=400
    )
    for other in results[1:]:  # every rank reports the same loss and log-probs
        assert other["losses"] == results[0]["losses"]
    return results[0]


@pytest.fixture(scope="module")
def refs() -> dict[str, dict[str, Any]]:
    return {"fp32": _run(1, FP32, 4096), "bf16": _run(1, BF16, 4096)}


def _errors(out: dict[str, Any], ref: dict[str, Any]) -> dict[str, float]:
    loss = max(abs(a - b) / abs(b) for a, b in zip(out["losses"], ref["losses"], strict=True))
    grad = max(max_rel_err(g.float(), ref["grads"][n].float()) for n, g in out["grads"].items())
    return {
        "loss": loss,
        "grad": grad,
        "logp": max_rel_err(out["logp"], ref["logp"]),
        "logp_after": max_rel_err(out["logp_after"], ref["logp_after"]),
    }


def _check_cp_run(
    out: dict[str, Any], ref_bf16: dict[str, Any], fp32: dict[str, Any], world: int, overrides: list[str]
) -> None:
    own = _errors(ref_bf16, fp32)  # bf16's own error, no CP
    cp = _errors(out, fp32)
    direct = _errors(out, ref_bf16)
    print(
        f"\nworld={world} {overrides} attention={out['attention']}: plans={out['plans']}\n"
        f"  bf16 no-CP vs fp32 {own}\n  bf16 CP vs fp32 {cp}\n  bf16 CP vs bf16 no-CP {direct}"
    )
    for key in own:
        assert cp[key] <= 2 * own[key] + 1e-3, (key, cp, own)
    assert direct["loss"] <= 1e-2, direct
    assert out["positions"] == fp32["positions"]
    sizes = {s for step in out["plans"] for mb in step for s in mb}
    if "megatron.dynamic_context_parallel=true" in overrides:
        assert out["plans"] == DYN_PLANS[world], out["plans"]
    else:
        assert sizes == {int(overrides[0].split("=")[1])}


@pytest.mark.gpu
@pytest.mark.parametrize(("world", "overrides", "budget"), LAYOUTS)
def test_bf16_cp_matches_no_cp(refs: dict, world: int, overrides: list[str], budget: int | None) -> None:
    out = _run(world, [*BF16, *overrides], budget)
    assert out["attention"] == ["DynCPCoreAttentionRoPE"], out["attention"]
    _check_cp_run(out, refs["bf16"], refs["fp32"], world, overrides)


@pytest.fixture(scope="module")
def te_ref() -> dict[str, Any]:
    """bf16 with Transformer Engine's attention, no CP, one GPU (TE's own bf16 error)."""
    pytest.importorskip("transformer_engine.pytorch", reason="Transformer Engine is not installed")
    return _run(1, [*BF16, *TE], 4096)


@pytest.mark.num_gpus(1)
def test_transformer_engine_without_cp_is_as_accurate_as_bf16(refs: dict, te_ref: dict) -> None:
    """TE's own error (the baseline of the CP checks below) must itself be bf16-sized, else they prove nothing."""
    own = _errors(refs["bf16"], refs["fp32"])
    te_own = _errors(te_ref, refs["fp32"])
    print(f"\nbf16 no-CP vs fp32: verl-dyncp attention {own}\n  Transformer Engine {te_own}")
    assert te_ref["attention"] == ["TEDynCPCoreAttentionRoPE"], te_ref["attention"]
    for key in own:
        assert te_own[key] <= 2 * own[key] + 1e-3, (key, te_own, own)
    assert te_ref["positions"] == refs["fp32"]["positions"]


@pytest.mark.gpu
@pytest.mark.parametrize(("world", "overrides", "budget"), LAYOUTS)
def test_bf16_transformer_engine_cp_matches_no_cp(
    refs: dict, te_ref: dict, world: int, overrides: list[str], budget: int | None
) -> None:
    out = _run(world, [*BF16, *TE, *overrides], budget)
    assert out["attention"] == ["TEDynCPCoreAttentionRoPE"], out["attention"]
    _check_cp_run(out, te_ref, refs["fp32"], world, overrides)


@pytest.mark.num_gpus(4)
def test_fp32_dynamic_cp_on_gpu_matches_no_cp(refs: dict) -> None:
    out = _run(4, [*FP32, *DYN4], None)
    errs = _errors(out, refs["fp32"])
    print("\nfp32 dynamic CP w4 vs fp32 no CP", errs)
    assert max(errs.values()) <= 1e-4, errs


@pytest.mark.num_gpus(4)
def test_tensor_parallel_2_with_dynamic_cp_matches_no_cp(refs: dict) -> None:
    """TP 2 x a pool of 2 with dynamic CP (alignment 2 x TP x k), bf16: losses and log-probs within the same
    bound as the TP 1 layouts (gradients are TP shards here, compared on CPU in tests/test_engine_packed_cpu.py).
    megatron-core 0.19 initialises TP shards like TP 1 from the same seed, so both runs start equal."""
    out = _run(
        4, [*BF16, *DYN2, "megatron.tensor_model_parallel_size=2", "megatron.sequence_parallel=false"], None
    )
    own = _errors(refs["bf16"], refs["fp32"])
    loss = max(abs(a - b) / abs(b) for a, b in zip(out["losses"], refs["fp32"]["losses"], strict=True))
    logp = max_rel_err(out["logp"], refs["fp32"]["logp"])
    logp_after = max_rel_err(out["logp_after"], refs["fp32"]["logp_after"])
    print(
        f"\nTP2 dynamic CP w4: plans={out['plans']} loss {loss:.2e} logp {logp:.2e} after {logp_after:.2e}; own {own}"
    )
    assert loss <= 2 * own["loss"] + 1e-3 and logp <= 2 * own["logp"] + 1e-3, (loss, logp, own)
    assert logp_after <= 2 * own["logp_after"] + 1e-3, (logp_after, own)
    assert out["positions"] == refs["fp32"]["positions"]
    assert {s for step in out["plans"] for mb in step for s in mb} == {1, 2}, out["plans"]
