"""Pipeline parallelism in the RL engine on CPU (fp32, gloo): every layout equals the one-stage run.

A tiny random Qwen2 model with 4 layers is loaded through ``model.path`` (untied embeddings: megatron-core
copies a tied output weight to CUDA when it builds the last stage, see build_rl). Per layout the engine
computes log-probs and entropy (``infer_batch``), then one PPO ``train_batch``; the reference is the same
on one rank without pipeline stages. Layouts: PP 2, PP 2 x virtual PP 2 (interleaved chunks), PP 2 x TP 2,
PP 2 x static CP 2 and PP 2 x dynamic CP (4 ranks). Bound: 1e-5 relative (fp32, the same arithmetic in
another grouping); parameters after the optimizer step are compared under their Hugging Face names,
gathered over TP and PP.
"""

from __future__ import annotations

import pytest
import torch
from rl_engine_workers import pipeline_layouts, verl_batch

from verl_mcore_utils.testing import run_distributed

A = "actor_rollout_ref.actor"
AM = f"{A}.megatron"
PROMPTS, RESPONSES = [3, 6, 1, 5, 2], [7, 2, 5, 4, 6]
# a larger Adam epsilon keeps one step a smooth function of the gradient (see test_rl_engine_cpu.py)
STEP = ["+actor_rollout_ref.actor.optim.override_optimizer_config.adam_eps=1e-3"]
PP2 = [f"{AM}.pipeline_model_parallel_size=2"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    from verl_mcore_utils.hf_testing import save_tiny_hf_model

    path = tmp_path_factory.mktemp("qwen2_pp") / "model"
    return str(save_tiny_hf_model("qwen2", path, seed=5, num_hidden_layers=4))


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max() / b.double().abs().max())


def _layouts(world: int, layouts: dict[str, list[str]]) -> list[list[str]]:
    # the (unused) critic section keeps its defaults (DP = world size): its micro-batch must divide 4 / world
    critic = [f"critic.ppo_micro_batch_size_per_gpu={max(1, 4 // world // 2)}"]
    return [[f"trainer.n_gpus_per_node={world}", *critic, *STEP, *v] for v in layouts.values()]


def _same(got: dict, ref: dict, what: str) -> None:
    for key in ("log_probs", "entropy", "step_log_probs"):
        assert rel_err(got[key], ref[key]) < 1e-5, (what, key, rel_err(got[key], ref[key]))
    assert abs(got["loss"] - ref["loss"]) <= 1e-5 * abs(ref["loss"]) + 1e-7, (what, got["loss"], ref["loss"])
    for name in ("actor/pg_loss", "grad_norm", "actor/entropy_loss"):
        a, b = got["metrics"][name], ref["metrics"][name]
        assert abs(a - b) <= 1e-5 * abs(b) + 1e-7, (what, name, a, b)
    assert got["params"].keys() == ref["params"].keys(), what
    worst = max(rel_err(got["params"][n], ref["params"][n]) for n in ref["params"])
    assert worst < 1e-5, (what, "params", worst)


def test_pipeline_stages_equal_one_stage(model_dir: str) -> None:
    batch = verl_batch(seed=6, prompt_lens=PROMPTS, response_lens=RESPONSES)
    (ref,) = run_distributed(
        pipeline_layouts, world_size=1, args=(model_dir, _layouts(1, {"pp1": []}), batch)
    )[0]
    assert ref["metrics"]["grad_norm"] > 0
    two = {
        "pp2": PP2,
        "pp2_vpp2": [*PP2, f"{AM}.virtual_pipeline_model_parallel_size=2"],
        "pp2_mb1": [*PP2, f"{A}.ppo_micro_batch_size_per_gpu=1"],
        # megatron-core's uneven split: 1 layer on the first stage, 3 on the last
        "pp2_uneven": [*PP2, f"+{AM}.override_transformer_config.num_layers_in_first_pipeline_stage=1"],
        "pp2_critic": [*PP2, "critic.megatron.pipeline_model_parallel_size=2"],
    }
    for rank_results in run_distributed(
        pipeline_layouts, world_size=2, args=(model_dir, _layouts(2, two), batch)
    ):
        for name, got in zip(two, rank_results, strict=True):
            _same(got, ref, name)
            if name == "pp2_critic":  # a value model's values come from the last stage's value head
                assert rel_err(got["values"], ref["values"]) < 1e-5, rel_err(got["values"], ref["values"])


def test_pipeline_with_tensor_and_context_parallelism(model_dir: str) -> None:
    batch = verl_batch(seed=6, prompt_lens=PROMPTS, response_lens=RESPONSES)
    (ref,) = run_distributed(
        pipeline_layouts, world_size=1, args=(model_dir, _layouts(1, {"pp1": []}), batch)
    )[0]
    four = {
        "pp2_tp2": [*PP2, f"{AM}.tensor_model_parallel_size=2", f"{AM}.sequence_parallel=false"],
        "pp2_cp2": [*PP2, f"{AM}.context_parallel_size=2"],
        "pp2_dynamic_cp": [*PP2, f"{AM}.dynamic_context_parallel=true", f"{AM}.max_seqlen_per_dp_cp_rank=8"],
    }
    for rank_results in run_distributed(
        pipeline_layouts, world_size=4, args=(model_dir, _layouts(4, four), batch)
    ):
        for name, got in zip(four, rank_results, strict=True):
            _same(got, ref, name)
