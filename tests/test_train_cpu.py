"""End to end on CPU: config -> megatron-core model -> engine (debug backend) -> falling loss."""

from __future__ import annotations

import json

import pytest

from train_workers import run_train
from verl_mcore_utils.testing import run_distributed


def _overrides(tmp_path, name: str) -> list[str]:
    return [
        "model.preset=tiny",
        "trainer.total_training_steps=25",
        "trainer.device=cpu",
        "trainer.progress_bar=false",
        "data.train_batch_size=16",
        "data.micro_batch_size_per_gpu=4",
        "data.max_length=64",
        "optim.lr=3e-3",
        "optim.lr_warmup_steps=3",
        f"trainer.default_local_dir={tmp_path / name}",
    ]


@pytest.mark.slow
def test_training_reduces_loss_and_writes_metrics(tmp_path) -> None:
    (out,) = run_distributed(run_train, world_size=1, args=(_overrides(tmp_path, "dp1"),))
    assert out["last_loss"] < 0.6 * out["first_loss"], out
    assert len(out["losses"]) == 25
    assert out["backend"].startswith("debug")
    summary = json.loads((tmp_path / "dp1" / "summary.json").read_text())
    assert summary["steps"] == 25 and summary["tokens_per_s"] > 0 and summary["peak_memory_gib"] > 0
    assert summary["engine"]["optimizer"] == ["AdamW"]


@pytest.mark.slow
def test_two_process_training_follows_single_process(tmp_path) -> None:
    """DP=2 over gloo (what torchrun --nproc-per-node 2 does) trains like DP=1 on the same batches."""
    (single,) = run_distributed(run_train, world_size=1, args=(_overrides(tmp_path, "a"),))
    double = run_distributed(run_train, world_size=2, args=(_overrides(tmp_path, "b"),))
    assert double[0]["dp"] == 2 and double[0]["world_size"] == 2
    # Same objective and gradients; fp32 round-off grows slowly through Adam steps.
    for step, (a, b) in enumerate(zip(single["losses"], double[0]["losses"], strict=True)):
        assert abs(a - b) <= 1e-4 * abs(a), (step, a, b)
    assert double[1]["last_loss"] == pytest.approx(
        double[0]["last_loss"], rel=1e-12
    )  # every rank reports the same


@pytest.fixture(scope="module")
def padded_8_steps(tmp_path_factory: pytest.TempPathFactory) -> dict:
    tmp = tmp_path_factory.mktemp("pad")
    (single,) = run_distributed(
        run_train, world_size=1, args=([*_overrides(tmp, "pad"), "trainer.total_training_steps=8"],)
    )
    return single


@pytest.mark.slow
@pytest.mark.parametrize(
    "cp",
    [
        ["megatron.context_parallel_size=2"],
        ["megatron.dynamic_context_parallel=true", "megatron.max_seqlen_per_dp_cp_rank=48"],
    ],
    ids=["static-cp2", "dynamic-cp"],
)
def test_context_parallel_training_follows_padded_single_process(
    tmp_path, padded_8_steps: dict, cp: list[str]
) -> None:
    """`verl-engine train` with CP keys packs the same batches (padding dropped, same loss tokens) and
    splits them over 2 gloo ranks; losses follow the padded single-process run (BSHD model, megatron's
    RoPE) step for step."""
    steps = ["trainer.total_training_steps=8"]
    single = padded_8_steps
    packed = run_distributed(run_train, world_size=2, args=([*_overrides(tmp_path, "cp"), *steps, *cp],))
    summary = json.loads((tmp_path / "cp" / "summary.json").read_text())
    assert "CP" in summary["engine"]["cp_layout"], summary["engine"]
    for step, (a, b) in enumerate(zip(single["losses"], packed[0]["losses"], strict=True)):
        assert abs(a - b) <= 1e-4 * abs(a), (step, a, b)
    assert packed[1]["last_loss"] == packed[0]["last_loss"]
