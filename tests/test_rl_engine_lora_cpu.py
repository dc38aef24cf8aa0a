"""LoRA in the RL engine on CPU (fp32, gloo, the debug backend), with real peft and transformers.

``actor_rollout_ref.model.lora.rank > 0`` inserts peft LoRA adapters before wrapping; only they train.

* Surface (TP 1 on one rank, TP 2 on two), after one PPO step: only ``lora_A`` / ``lora_B`` train;
  ``disable_adapter()`` gives the reference engine's log-probs (the base model; 1e-6) while the adapter's
  differ; the merged weight buckets loaded into a transformers model, the adapter-only buckets with their PEFT
  config applied by peft to the base model, ``save_hf`` (a PEFT directory, ``PeftModel.from_pretrained``) and
  ``save_hf(merged=True)`` (``from_pretrained``) all reproduce the engine's log-probs (1e-5 relative;
  transformers in float64).
* Checkpoints are adapter-only: exact resume at DP 2 (4 steps vs 2 + save + fresh processes + 2: losses and
  adapter parameters bitwise), the rank files hold adapter tensors only; saved at TP 2 and loaded at TP 1
  from the PEFT copy, the same log-probs (1e-6); a LoRA checkpoint into an engine without LoRA is an error.
* Offload / onload of a LoRA engine is bitwise (frozen base, adapters, their gradients and AdamW state).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from rl_engine_workers import (
    checkpoint_run,
    lora_surface,
    offload_round_trip,
    ppo_overrides,
    transformers_log_probs,
    verl_batch,
)

from verl_mcore_utils.testing import DistributedRunError, run_distributed

AM = "actor_rollout_ref.actor.megatron"
LORA = ["actor_rollout_ref.model.lora.rank=4", "actor_rollout_ref.model.lora.alpha=8"]
RM = "actor_rollout_ref.ref.megatron"
TP2 = [f"{m}.{k}" for m in (AM, RM) for k in ("tensor_model_parallel_size=2", "sequence_parallel=false")]
PROMPTS, RESPONSES = [3, 6, 1, 5, 2, 4, 2, 3], [7, 2, 5, 4, 6, 3, 5, 2]
BUCKET = 40_000


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    from verl_mcore_utils.hf_testing import save_tiny_hf_model

    return str(save_tiny_hf_model("qwen2", tmp_path_factory.mktemp("qwen2_lora") / "model", seed=23))


def _overrides(world: int, extra: list[str]) -> list[str]:
    return ppo_overrides(world, [*LORA, *extra])


def _base(model_dir: str) -> torch.nn.Module:
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float64)


def _close(got: torch.Tensor, want: torch.Tensor, tol: float, what: str) -> None:
    err = float((got.double() - want.double()).abs().max() / want.double().abs().max())
    assert err < tol, (what, err)


@pytest.mark.parametrize("layout", ["tp1", "tp2"])
def test_lora_engine_surface(model_dir: str, tmp_path: Path, layout: str) -> None:
    import peft
    import transformers
    from peft import set_peft_model_state_dict

    world = 2 if layout == "tp2" else 1
    batch = verl_batch(seed=31, prompt_lens=PROMPTS, response_lens=RESPONSES)
    got = run_distributed(
        lora_surface,
        world_size=world,
        args=(model_dir, _overrides(world, TP2 if world == 2 else []), batch, str(tmp_path), BUCKET),
    )[0]
    assert got["trainable"] and all(".lora_A." in n or ".lora_B." in n for n in got["trainable"])
    assert got["still_trainable"] == got["trainable"]
    _close(got["off"], got["ref"], 1e-6, "disable_adapter = reference policy")
    assert float((got["lora"] - got["ref"]).abs().max()) > 1e-4  # the trained adapter changes the policy
    assert torch.equal(got["again"], got["lora"])  # adapters are back after the context

    merged = dict(t for b in got["merged"] for t in b)
    for bucket in got["merged"]:
        assert sum(t.numel() * t.element_size() for _, t in bucket) <= BUCKET or len(bucket) == 1
    config = transformers.AutoConfig.from_pretrained(model_dir)
    hf = transformers.AutoModelForCausalLM.from_config(config, torch_dtype=torch.float64)
    hf.load_state_dict({k: v.double() for k, v in merged.items()}, strict=True)
    _close(got["lora"], transformers_log_probs(hf, batch), 1e-5, "merged buckets")

    adapter = got["adapter"]
    assert adapter and all(".lora_A." in n or ".lora_B." in n for n in adapter)
    assert got["peft_config"]["r"] == 4 and got["peft_config"]["lora_alpha"] == 8
    fields = {
        k: v
        for k, v in got["peft_config"].items()
        if k in ("r", "lora_alpha", "target_modules", "lora_dropout")
    }
    from_buckets = peft.get_peft_model(_base(model_dir), peft.LoraConfig(task_type="CAUSAL_LM", **fields))
    result = set_peft_model_state_dict(from_buckets, {k: v.double() for k, v in adapter.items()})
    assert not result.unexpected_keys
    _close(got["lora"], transformers_log_probs(from_buckets, batch), 1e-5, "adapter buckets + peft config")

    saved = peft.PeftModel.from_pretrained(_base(model_dir), str(tmp_path / "adapter"))
    _close(got["lora"], transformers_log_probs(saved, batch), 1e-5, "save_hf adapter directory")
    full = transformers.AutoModelForCausalLM.from_pretrained(
        str(tmp_path / "merged"), torch_dtype=torch.float64
    )
    _close(got["lora"], transformers_log_probs(full, batch), 1e-5, "save_hf(merged=True)")


@pytest.fixture(scope="module")
def batches() -> list[dict]:
    return [verl_batch(seed=50 + s, prompt_lens=PROMPTS, response_lens=RESPONSES) for s in range(4)]


def test_lora_checkpoint_exact_resume_is_adapter_only(
    model_dir: str, batches: list[dict], tmp_path: Path
) -> None:
    from safetensors import safe_open

    overrides = _overrides(2, [])
    full = run_distributed(
        checkpoint_run, world_size=2, args=(model_dir, overrides, batches, str(tmp_path / "a"), [1, 2, 3, 4])
    )
    root = tmp_path / "b"
    first = run_distributed(
        checkpoint_run, world_size=2, args=(model_dir, overrides, batches, str(root), [1, 2], 2)
    )
    resumed = run_distributed(
        checkpoint_run, world_size=2, args=(model_dir, overrides, batches, str(root), [3, 4], None, True)
    )
    for rank in range(2):
        assert first[rank]["losses"] + resumed[rank]["losses"] == full[rank]["losses"]
        assert set(resumed[rank]["params"]) == set(full[rank]["params"])
        assert all(".lora_" in n for n in full[rank]["params"])
        for name, value in full[rank]["params"].items():
            assert torch.equal(resumed[rank]["params"][name], value), name
        assert torch.equal(resumed[rank]["log_probs"], full[rank]["log_probs"])
    step = root / "global_step_2"
    meta = json.loads((step / "meta.json").read_text())
    assert meta["lora"] == {"rank": 4, "alpha": 8.0} and meta["has_adapter"] and not meta["has_hf"]
    with safe_open(str(step / "rank_00000.safetensors"), framework="pt") as f:
        params = [k for k in f.keys() if k.startswith("param/")]
    assert params and all(".lora_" in k for k in params)
    assert (step / "lora_adapter" / "adapter_model.safetensors").is_file() and not (step / "hf").exists()


def test_lora_checkpoint_at_another_layout(model_dir: str, batches: list[dict], tmp_path: Path) -> None:
    root = str(tmp_path / "tp2")
    saved = run_distributed(
        checkpoint_run, world_size=2, args=(model_dir, _overrides(2, TP2), batches, root, [1, 2], 2)
    )
    (tp1,) = run_distributed(
        checkpoint_run,
        world_size=1,
        args=(model_dir, _overrides(1, []), batches, root, [], None, True, False),
    )
    _close(tp1["log_probs"], saved[0]["log_probs"], 1e-6, "TP2 -> TP1 through the PEFT copy")
    plain = [o for o in _overrides(1, []) if o not in LORA]
    with pytest.raises(DistributedRunError, match="saved with LoRA"):
        run_distributed(
            checkpoint_run, world_size=1, args=(model_dir, plain, batches, root, [], None, True, False)
        )


def test_lora_offload_round_trip_is_bitwise(model_dir: str, batches: list[dict]) -> None:
    overrides = _overrides(2, [])
    (got, _) = run_distributed(offload_round_trip, world_size=2, args=(model_dir, overrides, batches[0]))
    (plain, _) = run_distributed(
        offload_round_trip, world_size=2, args=(model_dir, overrides, batches[0], False)
    )
    assert got["mismatched"] == [] and "already offloaded" in got["twice"]
    assert any(k.startswith("grad/") and ".lora_" in k for k in got["keys"])
    assert any(k.startswith("optim/") for k in got["keys"])
    assert not any(k.startswith("grad/") and ".lora_" not in k for k in got["keys"])  # the base is frozen
    assert got["loss_after"] == plain["loss_after"]
    assert all(torch.equal(got["params_after"][k], v) for k, v in plain["params_after"].items())
