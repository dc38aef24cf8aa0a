"""GPU, NCCL: pipeline stages through megatron-core's own schedules, and MTP under CP 2, against one GPU.

On the CPU the engine runs pipeline stages with its own schedule (``verl_engine.pipeline``); on GPUs it hands
the micro-batches to megatron-core's ``get_forward_backward_func`` (1F1B, interleaved for virtual stages), with
megatron-core's DDP and distributed optimizer. This file checks that path: per layout, log-probs and entropy
(``infer_batch``), one PPO ``train_batch`` through ``forward_backward_batch`` with the engine's PPO loss and
entropy term, the metrics, and every weight after the optimizer step under its Hugging Face name, against the
same on one GPU without stages. Layouts on 4 GPUs: PP 2 (x DP 2), PP 2 x virtual PP 2 (x DP 2), PP 2 x TP 2.

Tolerance (bf16). Pipeline stages change no arithmetic, but DP 2 and TP 2 change reduction order and the split
of the batch, so bf16 rounding differs from the one-GPU bf16 run. Rule (the one of the packed-CP tests): each
layout's error against an fp32 one-GPU run (TF32 off) is at most twice the bf16 one-GPU run's own error plus
1e-3, for log-probs, entropy, the loss, the metrics and the updated weights; a scaling bug (1/DP, 1/number of
micro-batches, a stage's loss counted twice) is off by >= 50% and fails it. The loss and the PPO metrics of bf16
runs are also within 1e-2 relative of the one-GPU bf16 run (verl's loss tolerance).

MTP + CP 2 (the regression of verl before PR #5895, and Megatron-LM #3959: an MTP gradient under-scaled by the
CP size) runs in fp32 on 2 GPUs over NCCL against one GPU: same loss, MTP losses and gradients to 1e-4
relative (reduction order only).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from rl_engine_workers import MTP_ON, mtp_step_layouts, pipeline_layouts, verl_batch

from verl_mcore_utils.testing import run_distributed

A = "actor_rollout_ref.actor"
AM = f"{A}.megatron"
PROMPTS, RESPONSES = [3, 6, 1, 5, 2, 7, 4, 5], [7, 2, 5, 4, 6, 3, 8, 1]
STEP = ["+actor_rollout_ref.actor.optim.override_optimizer_config.adam_eps=1e-3"]
FP32 = [f"{AM}.dtype=float32", "critic.megatron.dtype=float32"]
PP2 = [f"{AM}.pipeline_model_parallel_size=2"]
LAYOUTS = {
    "pp2": PP2,
    "pp2_vpp2": [*PP2, f"{AM}.virtual_pipeline_model_parallel_size=2"],
    "pp2_tp2": [*PP2, f"{AM}.tensor_model_parallel_size=2", f"{AM}.sequence_parallel=false"],
}
PPO_METRICS = ("actor/pg_loss", "actor/entropy_loss", "grad_norm")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    from verl_mcore_utils.hf_testing import save_tiny_hf_model

    path = tmp_path_factory.mktemp("qwen2_pp_gpu") / "model"
    # 4 layers: 2 per stage, 1 per virtual chunk; untied embeddings (the last stage owns the output layer)
    return str(save_tiny_hf_model("qwen2", path, seed=5, num_hidden_layers=4))


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max() / b.double().abs().max())


def _with(world: int, *layouts: list[str]) -> list[list[str]]:
    critic = [f"critic.ppo_micro_batch_size_per_gpu={max(1, 8 // world // 2)}"]
    return [[f"trainer.n_gpus_per_node={world}", *critic, *STEP, *v] for v in layouts]


def _errors(got: dict[str, Any], ref: dict[str, Any]) -> dict[str, float]:
    out = {key: rel_err(got[key], ref[key]) for key in ("log_probs", "entropy", "step_log_probs")}
    out["loss"] = abs(got["loss"] - ref["loss"]) / abs(ref["loss"])
    for name in PPO_METRICS:
        out[name] = abs(got["metrics"][name] - ref["metrics"][name]) / abs(ref["metrics"][name])
    assert got["params"].keys() == ref["params"].keys()
    out["params"] = max(rel_err(got["params"][n], ref["params"][n]) for n in ref["params"])
    out["values"] = rel_err(got["values"], ref["values"])
    return out


@pytest.fixture(scope="module")
def references(model_dir: str) -> dict[str, dict[str, Any]]:
    batch = verl_batch(seed=6, prompt_lens=PROMPTS, response_lens=RESPONSES)
    (refs,) = run_distributed(
        pipeline_layouts,
        world_size=1,
        backend="nccl",
        args=(model_dir, _with(1, FP32, []), batch, "cuda"),
        timeout_s=400,
    )
    return {"fp32": refs[0], "bf16": refs[1], "batch": batch}


@pytest.mark.num_gpus(4)
def test_pipeline_layouts_on_four_gpus_match_one_gpu(model_dir: str, references: dict) -> None:
    fp32, bf16, batch = references["fp32"], references["bf16"], references["batch"]
    own = _errors(bf16, fp32)
    assert bf16["metrics"]["grad_norm"] > 0
    results = run_distributed(
        pipeline_layouts,
        world_size=4,
        backend="nccl",
        args=(model_dir, _with(4, *LAYOUTS.values()), batch, "cuda"),
        timeout_s=500,
    )
    for rank_results in results[1:]:  # every rank reports the same loss (the last stage's, broadcast)
        for got, first in zip(rank_results, results[0], strict=True):
            assert got["loss"] == first["loss"]
    for name, got in zip(LAYOUTS, results[0], strict=True):
        err, direct = _errors(got, fp32), _errors(got, bf16)
        print(f"\n{name}: vs fp32 {err}\n  bf16 1-GPU vs fp32 {own}\n  vs bf16 1-GPU {direct}")
        for key in own:
            assert err[key] <= 2 * own[key] + 1e-3, (name, key, err[key], own[key])
        for key in ("loss", *PPO_METRICS):
            assert direct[key] <= 1e-2, (name, key, direct[key])


@pytest.mark.num_gpus(2)
def test_mtp_with_context_parallel_2_over_nccl_matches_one_gpu(tmp_path) -> None:
    from verl_mcore_utils.hf_testing import save_tiny_hf_model

    model_dir = str(save_tiny_hf_model("qwen2", tmp_path / "model", seed=7, num_nextn_predict_layers=2))
    batch = verl_batch(seed=8, prompt_lens=PROMPTS, response_lens=RESPONSES)
    common = [
        *MTP_ON,
        f"{AM}.dtype=float32",
        f"{AM}.use_distributed_optimizer=false",
    ]  # every rank holds the full gradient
    ((ref,),) = run_distributed(
        mtp_step_layouts,
        world_size=1,
        backend="nccl",
        args=(model_dir, _with(1, common), batch, 0, "cuda"),
        timeout_s=300,
    )
    layouts = {"cp2": [*common, f"{AM}.context_parallel_size=2"], "dp2": common}
    results = run_distributed(
        mtp_step_layouts,
        world_size=2,
        backend="nccl",
        args=(model_dir, _with(2, *layouts.values()), batch, 0, "cuda"),
        timeout_s=300,
    )
    for metric in ("mtp_losses/mtp_1_loss", "mtp_losses/mtp_2_loss"):
        assert ref["metrics"][metric] > 0, metric
    mtp = [n for n in ref["grads"] if n.startswith("mtp.")]
    assert mtp and all(float(ref["grads"][n].abs().max()) > 0 for n in mtp)
    for rank_results in results:
        for name, got in zip(layouts, rank_results, strict=True):
            assert abs(got["loss"] - ref["loss"]) <= 1e-4 * abs(ref["loss"]), (name, got["loss"], ref["loss"])
            for metric, value in ref["metrics"].items():
                if isinstance(value, float) and metric.startswith(("mtp_losses/", "actor/pg_loss")):
                    assert abs(got["metrics"][metric] - value) <= 1e-4 * abs(value) + 1e-7, (name, metric)
            assert got["grads"].keys() == ref["grads"].keys(), name
            worst = max(rel_err(got["grads"][n], ref["grads"][n]) for n in ref["grads"])
            assert worst <= 1e-4, (name, worst)
