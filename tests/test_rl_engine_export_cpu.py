"""Weights for rollout (``RLEngine.export_weight_buckets``) on CPU, fp32, gloo.

After one PPO step (so the weights differ from the checkpoint), the engine exports its weights in buckets
under Hugging Face names, gathered over TP and PP; loaded into a transformers Qwen2 model (strict: every
tensor present, none extra) they reproduce the engine's own log-probs (1e-5 relative; transformers runs in
float64). Layouts: TP 1 on one rank, TP 2 and PP 2 on two. Buckets hold at most ``bucket_bytes`` unless a
single tensor is bigger; their concatenation names every tensor once.
"""

from __future__ import annotations

import pytest
import torch
from rl_engine_workers import export_layouts, transformers_log_probs, verl_batch

from verl_mcore_utils.testing import run_distributed

AM = "actor_rollout_ref.actor.megatron"
PROMPTS, RESPONSES = [3, 6, 1, 5, 2], [7, 2, 5, 4, 6]
BUCKET = 40_000  # bytes: the 32 KiB embedding fits, two of them do not


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    from verl_mcore_utils.hf_testing import save_tiny_hf_model

    return str(
        save_tiny_hf_model(
            "qwen2", tmp_path_factory.mktemp("qwen2_export") / "model", seed=11, num_hidden_layers=4
        )
    )


def _layouts(world: int, layouts: list[list[str]]) -> list[list[str]]:
    critic = [f"critic.ppo_micro_batch_size_per_gpu={max(1, 4 // world // 2)}"]
    return [[f"trainer.n_gpus_per_node={world}", *critic, *v] for v in layouts]


def _transformers_log_probs(model_dir: str, weights: dict[str, torch.Tensor], batch: dict) -> torch.Tensor:
    import transformers

    config = transformers.AutoConfig.from_pretrained(model_dir)
    model = transformers.AutoModelForCausalLM.from_config(config, torch_dtype=torch.float64)
    model.load_state_dict({k: v.double() for k, v in weights.items()}, strict=True)
    return transformers_log_probs(model, batch)


def _check(model_dir: str, got: dict, batch: dict, what: str) -> None:
    buckets = got["buckets"]
    assert len(buckets) > 1, what
    for bucket in buckets:
        size = sum(t.numel() * t.element_size() for _, t in bucket)
        assert size <= BUCKET or len(bucket) == 1, (what, size)
    names = [n for b in buckets for n, _ in b]
    assert len(names) == len(set(names)), what
    reference = _transformers_log_probs(model_dir, dict(t for b in buckets for t in b), batch)
    err = float((got["log_probs"].double() - reference).abs().max() / reference.abs().max())
    assert err < 1e-5, (what, err)


def test_exported_weights_reproduce_the_engine_in_transformers(model_dir: str) -> None:
    batch = verl_batch(seed=12, prompt_lens=PROMPTS, response_lens=RESPONSES)
    (one,) = run_distributed(
        export_layouts, world_size=1, args=(model_dir, _layouts(1, [[]]), batch, BUCKET)
    )[0]
    _check(model_dir, one, batch, "tp1")
    two = {
        "tp2": [f"{AM}.tensor_model_parallel_size=2", f"{AM}.sequence_parallel=false"],
        "pp2": [f"{AM}.pipeline_model_parallel_size=2"],
    }
    rank0 = run_distributed(
        export_layouts, world_size=2, args=(model_dir, _layouts(2, list(two.values())), batch, BUCKET)
    )[0]
    for name, got in zip(two, rank0, strict=True):
        _check(model_dir, got, batch, name)
