"""Settings of verl 0.9.1's engine sections whose effect shows only in the built engine (CPU, fp32, gloo).

The evidence of verl_engine.config_support.RULES for keys no other test covers:

* ``actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu`` / ``log_prob_use_dynamic_bsz`` /
  ``log_prob_max_token_len_per_gpu``: the reference policy's compute_log_prob runs one model forward per
  micro-batch of that many sequences, or of at most that many tokens; the log-probs do not depend on the split.
* ``megatron.seed`` (actor, ref, critic): what is not loaded from ``model.path`` is initialised from it (the
  whole model built from ``hf_config`` alone, the critic's value head): same seed, bitwise the same engine;
  another seed, another one.
* ``megatron.forward_only`` (actor, critic): true builds no optimizer and no schedule, freezes every
  parameter and refuses ``train_batch`` (verl's engine builds no optimizer and its worker asserts); the
  forward is unchanged. The reference policy is always forward only (its ``false`` is refused at build).
* ``megatron.override_ddp_config.grad_reduce_in_fp32``: unset, the actor's DDP reduces gradients in fp32 as verl
  0.9.1's does (its DDP defaults sit below override_ddp_config; megatron-core's own default is bf16 reduction);
  set, it wins.
* ``critic.model.lora.*``: the critic gets its own LoRA adapters (the actor has none): only they and the value
  head train, a value step changes nothing else.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from rl_engine_workers import verl_batch
from settings_workers import (
    critic_lora_step,
    forward_only_engines,
    gradient_reduction_dtypes,
    ref_micro_batches,
    seeded_builds,
)

from verl_engine.packed import split_packed_micro_batches
from verl_mcore_utils.testing import run_distributed

REF = "actor_rollout_ref.ref"
AM, RM, CM = "actor_rollout_ref.actor.megatron", f"{REF}.megatron", "critic.megatron"
ONE = ["trainer.n_gpus_per_node=1"]
PROMPTS, RESPONSES = [3, 6, 1, 5, 2, 4], [7, 2, 5, 4, 6, 3]
LENS = [p + r for p, r in zip(PROMPTS, RESPONSES, strict=True)]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    from verl_mcore_utils.hf_testing import save_tiny_hf_model

    return str(save_tiny_hf_model("qwen2", tmp_path_factory.mktemp("qwen2_settings") / "model", seed=5))


@pytest.fixture(scope="module")
def batch() -> dict:
    return verl_batch(seed=7, prompt_lens=PROMPTS, response_lens=RESPONSES)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max() / b.double().abs().max())


def test_ref_log_prob_micro_batching_splits_the_reference_call(model_dir: str, batch: dict) -> None:
    layouts = {
        "mbs1": [f"{REF}.log_prob_micro_batch_size_per_gpu=1"],
        "mbs4": [f"{REF}.log_prob_micro_batch_size_per_gpu=4"],
        "dyn16": [f"{REF}.log_prob_use_dynamic_bsz=true", f"{REF}.log_prob_max_token_len_per_gpu=16"],
        "dyn32": [f"{REF}.log_prob_use_dynamic_bsz=true", f"{REF}.log_prob_max_token_len_per_gpu=32"],
    }
    got = dict(
        zip(
            layouts,
            run_distributed(
                ref_micro_batches,
                world_size=1,
                args=(model_dir, [[*ONE, *v] for v in layouts.values()], batch),
            )[0],
            strict=True,
        )
    )
    # the ref's own keys reach its engine (not the actor's: ppo_micro_batch_size_per_gpu=2 in the base)
    assert got["mbs1"]["setting"][0] is False and got["mbs1"]["setting"][2] == 1
    assert got["mbs4"]["setting"][0] is False and got["mbs4"]["setting"][2] == 4
    assert got["dyn16"]["setting"][:2] == (True, 16) and got["dyn32"]["setting"][:2] == (True, 32)
    # one forward per micro-batch: 6 sequences in 6, in 2 (4 + 2), in token bins of <= 16 / 32
    assert len(got["mbs1"]["tokens"]) == 6 and sorted(got["mbs1"]["tokens"]) == sorted(LENS)
    assert got["mbs4"]["tokens"] == [sum(LENS[:4]), sum(LENS[4:])]
    for name, cap in (("dyn16", 16), ("dyn32", 32)):
        bins = split_packed_micro_batches(LENS, max_tokens=cap)
        assert sorted(got[name]["tokens"]) == sorted(sum(LENS[i] for i in b) for b in bins), name
        assert max(got[name]["tokens"]) <= cap, name
    assert len(got["dyn16"]["tokens"]) > len(got["dyn32"]["tokens"]) > 1
    # the split changes how the call runs, not its result
    for name in ("mbs4", "dyn16", "dyn32"):
        for key in ("log_probs", "entropy"):
            assert _rel(got[name][key], got["mbs1"][key]) < 1e-6, (name, key)


def _hf_config(model_dir: str) -> dict:
    return json.loads((Path(model_dir) / "config.json").read_text())


@pytest.mark.parametrize(("role", "section"), [("actor", AM), ("ref", RM)])
def test_megatron_seed_initialises_a_model_built_without_weights(
    model_dir: str, batch: dict, role: str, section: str
) -> None:
    # model.path is no directory: the model is built from hf_config alone, every weight from the seed
    nowhere = ["actor_rollout_ref.model.path=/nonexistent/tiny-qwen2"]
    layouts = [[*ONE, *nowhere, f"{section}.seed={s}"] for s in (11, 11, 12)]
    first, same, other = run_distributed(
        seeded_builds, world_size=1, args=(model_dir, role, layouts, batch, _hf_config(model_dir))
    )[0]
    assert set(first["params"]) == set(other["params"])
    for name, value in first["params"].items():
        assert torch.equal(same["params"][name], value), name
    assert torch.equal(same["output"], first["output"])
    differ = [n for n, v in first["params"].items() if not torch.equal(other["params"][n], v)]
    assert len(differ) > len(first["params"]) // 2, differ  # the randomly initialised weights
    assert not torch.equal(other["output"], first["output"])


def test_megatron_seed_initialises_the_critic_value_head(model_dir: str, batch: dict) -> None:
    layouts = [[*ONE, f"{CM}.seed={s}"] for s in (11, 11, 12)]
    first, same, other = run_distributed(
        seeded_builds, world_size=1, args=(model_dir, "critic", layouts, batch)
    )[0]
    assert all(torch.equal(same["params"][n], v) for n, v in first["params"].items())
    assert torch.equal(same["output"], first["output"])
    differ = [n for n, v in first["params"].items() if not torch.equal(other["params"][n], v)]
    assert differ == ["output_layer.weight"]  # the backbone is model.path's; the value head is the seed's
    assert not torch.equal(other["output"], first["output"])


@pytest.mark.parametrize(("role", "section"), [("actor", AM), ("critic", CM)])
def test_megatron_forward_only_builds_no_optimizer(
    model_dir: str, batch: dict, role: str, section: str
) -> None:
    layouts = [[*ONE, f"{section}.forward_only=false"], [*ONE, f"{section}.forward_only=true"]]
    trains, frozen = run_distributed(
        forward_only_engines, world_size=1, args=(model_dir, role, layouts, batch)
    )[0]
    assert trains["optimizer"] and trains["lr_schedule"] and trains["trainable"] > 0
    assert trains["train_error"] is None and trains["changed"]
    assert not frozen["optimizer"] and not frozen["lr_schedule"] and frozen["trainable"] == 0
    assert frozen["train_error"] and "forward_only" in frozen["train_error"] and frozen["changed"] == []
    assert torch.equal(frozen["output"], trains["output"])  # the same model, forward only


CRITIC_LORA = ["critic.model.lora.rank=4", "critic.model.lora.alpha=8"]


def test_critic_model_lora_builds_a_lora_critic(model_dir: str, batch: dict) -> None:
    overrides = [*ONE, *CRITIC_LORA, "critic.model.lora.target_modules=[linear_qkv,linear_fc1]"]
    got = run_distributed(critic_lora_step, world_size=1, args=(model_dir, overrides, batch))[0]
    assert got["actor_lora_rank"] == 0 and got["lora"] == (4, 8.0)  # the critic's own block
    adapters = [n for n in got["trainable"] if ".lora_A." in n or ".lora_B." in n]
    assert adapters and set(got["trainable"]) - set(adapters) == {"output_layer.weight"}  # + the value head
    # target_modules: adapters on linear_qkv and linear_fc1 only
    assert {n.split(".lora_")[0].rsplit(".", 1)[-1] for n in adapters} == {"linear_qkv", "linear_fc1"}
    assert len(got["all"]) > len(got["trainable"])  # the base model is there, frozen
    assert got["changed"] and set(got["changed"]) <= set(got["trainable"])
    assert any(".lora_" in n for n in got["changed"])
    assert not torch.equal(got["values_after"], got["values"])
    plain = run_distributed(critic_lora_step, world_size=1, args=(model_dir, ONE, batch))[0]
    assert plain["lora"] is None and not any(".lora_" in n for n in plain["all"])
    assert torch.equal(got["values"], plain["values"])  # lora_B starts at zero: the same critic at step 0


def test_gradients_are_reduced_in_fp32_unless_override_ddp_config_says_otherwise(model_dir: str) -> None:
    layouts = [ONE, [*ONE, f"+{AM}.override_ddp_config.grad_reduce_in_fp32=false"],
               [*ONE, f"+{AM}.override_ddp_config.grad_reduce_in_fp32=true"]]  # fmt: skip
    (fp32,) = run_distributed(gradient_reduction_dtypes, world_size=1, args=(model_dir, layouts))
    assert fp32 == [True, False, True]
