"""The GRPO loop (``verl_engine.apps.grpo_run``) end to end on CPU: the embedded arithmetic task, a real actor and
reference engine, the transformers rollout engine.

* Invariants per step: GRPO advantages have zero mean in every group; the KL to the reference is exactly 0 at the
  first step (the reference is the warm-started initial policy); every step writes one metrics record; after
  the run every tensor of the rollout model equals the actor engine's export (bitwise).
* Resume: 6 steps straight vs 3 steps + checkpoint, then a fresh process with ``resume=True`` for steps 4-6: the
  same rewards, KL, losses and gradient norms (bitwise: engine state, RNG and LR schedule come back and the
  sampling is seeded by step).
* Colocation: the same 3 steps with verl's offload keys (actor params / grads / optimizer and ref params leave
  the device between phases; on CPU the copies go through the same code) give bitwise the same records.
* Learning: a trivially learnable variant (sums of 0..4) raises the sampled reward within a few steps.
* A Hugging Face model directory (``actor_rollout_ref.model.path``, its own tokenizer) runs the same loop.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from rl_engine_workers import grpo_run

from verl_mcore_utils.testing import run_distributed

pytestmark = pytest.mark.above_engine

RUN = {"warmup_steps": 15, "warmup_batch_size": 32, "eval_size": 16, "seed": 3}
SMALL = [
    "data.train_batch_size=8",
    "actor_rollout_ref.rollout.n=4",
    "actor_rollout_ref.actor.ppo_mini_batch_size=4",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8",
    "trainer.test_freq=3",
]
OFFLOAD = [
    "actor_rollout_ref.actor.megatron.param_offload=true",
    "actor_rollout_ref.actor.megatron.grad_offload=true",
    "actor_rollout_ref.actor.megatron.optimizer_offload=true",
    "actor_rollout_ref.ref.megatron.param_offload=true",
]
TIMING = ("seconds", "tokens_per_s", "peak_memory_gib", "memory_gib", "offload")


def _strip(record: dict) -> dict:
    return {k: v for k, v in record.items() if k not in TIMING}


def test_grpo_loop_invariants_exact_resume_and_offload(tmp_path: Path) -> None:
    straight = run_distributed(
        grpo_run,
        world_size=1,
        args=(
            str(tmp_path / "a"),
            [*SMALL, "trainer.total_training_steps=6", "trainer.save_freq=3"],
            RUN,
            True,
        ),
    )[0]
    records = straight["records"]
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 6]
    assert records[0]["kl"] == 0.0
    assert all(r["advantage_group_mean_abs_max"] < 1e-6 for r in records)
    assert all(0.0 <= r["reward_mean"] <= 1.0 and r["response_length"] > 0 for r in records)
    assert all(r["offload"] is False and r["memory_gib"] is None for r in records)
    assert all(r["entropy"] > 0 and 0 <= r["actor/pg_clipfrac"] <= 1 for r in records)
    assert set(records[0]["seconds"]) == {"sync", "generate", "old_log_prob", "ref_log_prob", "train", "step"}
    assert set(straight["eval"]) == {0, 3, 6}
    assert straight["eval_records"] == [{"step": 0, "eval_accuracy": straight["eval"][0]}]
    assert straight["sync_names"] and straight["sync_mismatches"] == []
    assert (tmp_path / "a" / "checkpoints" / "global_step_6" / "meta.json").is_file()

    first = run_distributed(
        grpo_run,
        world_size=1,
        args=(str(tmp_path / "b"), [*SMALL, "trainer.total_training_steps=3", "trainer.save_freq=3"], RUN),
    )[0]
    assert [_strip(r) for r in first["records"]] == [_strip(r) for r in records[:3]]
    resumed = run_distributed(
        grpo_run,
        world_size=1,
        args=(
            str(tmp_path / "b"),
            [*SMALL, "trainer.total_training_steps=6", "trainer.save_freq=3"],
            {**RUN, "resume": True},
        ),
    )[0]
    assert resumed["start"] == 3
    assert [_strip(r) for r in resumed["records"]] == [_strip(r) for r in records]
    assert resumed["eval_records"] == straight["eval_records"]  # the warm start's point survives the resume

    offloaded = run_distributed(
        grpo_run,
        world_size=1,
        args=(str(tmp_path / "c"), [*SMALL, *OFFLOAD, "trainer.total_training_steps=3"], RUN),
    )[0]
    assert all(r["offload"] is True for r in offloaded["records"])
    assert [_strip(r) for r in offloaded["records"]] == [_strip(r) for r in records[:3]]


def test_grpo_raises_the_reward_of_a_trivially_learnable_variant(tmp_path: Path) -> None:
    steps = 12
    result = run_distributed(
        grpo_run,
        world_size=1,
        args=(
            str(tmp_path / "easy"),
            [
                "data.train_batch_size=16",
                "actor_rollout_ref.rollout.n=8",
                "actor_rollout_ref.actor.ppo_mini_batch_size=16",
                "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=128",
                f"trainer.total_training_steps={steps}",
                "trainer.test_freq=0",
                "trainer.save_freq=0",
            ],
            {"warmup_steps": 100, "warmup_batch_size": 32, "max_operand": 4, "eval_size": 4, "seed": 0},
        ),
    )[0]
    rewards = [r["reward_mean"] for r in result["records"]]
    early, late = sum(rewards[:3]) / 3, sum(rewards[-3:]) / 3
    assert late > early + 0.15, rewards  # measured: 0.34 -> 0.57 (deterministic on CPU)


def _char_model_dir(path: Path) -> str:
    """A Hugging Face directory: a random tiny Qwen2 and a character-level fast tokenizer (no download)."""
    import transformers
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    from verl_engine.apps.grpo_run import tiny_arithmetic_hf_config

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, **{c: i + 3 for i, c in enumerate("0123456789+-*=")}}
    tk = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    tk.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tk.decoder = decoders.Fuse()
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tk, bos_token="<s>", eos_token="</s>", pad_token="<pad>"
    )
    fast.save_pretrained(path)
    config = transformers.AutoConfig.for_model(**tiny_arithmetic_hf_config(vocab_size=32))
    torch_seed = 11
    import torch

    torch.manual_seed(torch_seed)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(path)
    return str(path)


def test_grpo_on_a_hugging_face_model_directory(tmp_path: Path) -> None:
    model = _char_model_dir(tmp_path / "model")
    result = run_distributed(
        grpo_run,
        world_size=1,
        args=(
            str(tmp_path / "run"),
            [*SMALL, f"actor_rollout_ref.model.path={model}", "trainer.total_training_steps=3"],
            {**RUN, "warmup_steps": 10},
        ),
    )[0]
    records = result["records"]
    assert [r["step"] for r in records] == [1, 2, 3] and records[0]["kl"] == 0.0
    assert all(r["advantage_group_mean_abs_max"] < 1e-6 for r in records)
    assert set(result["eval"]) == {0, 3}
    sft = tmp_path / "run" / "sft"
    assert (sft / "config.json").is_file() and (sft / "tokenizer_config.json").is_file()
    # its warm-started sft/ is a model directory too (init from it, no warm start): the same step-0 accuracy
    again = run_distributed(
        grpo_run,
        world_size=1,
        args=(
            str(tmp_path / "again"),
            [*SMALL, f"actor_rollout_ref.model.path={sft}", "trainer.total_training_steps=1"],
            {**RUN, "warmup_steps": 0},
        ),
    )[0]
    assert again["eval"][0] == result["eval"][0]


def test_grpo_command_line(capsys, tmp_path: Path) -> None:
    from verl_engine.apps.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(["grpo", "--help"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    flags = (
        "--out",
        "--steps",
        "--warmup-steps",
        "--init-from",
        "--resume",
        "--offload",
        "--ray",
        "--no-plot",
    )
    assert all(flag in text for flag in flags)
    assert main(["grpo", "--out", "/nonexistent/run", "--resume"]) == 2  # nothing to resume: a clear error
    assert "no checkpoint to resume from" in capsys.readouterr().err
    assert main(["grpo", "--out", str(tmp_path), "--warmup-steps", "0", "--no-plot"]) == 2
    assert "actor_rollout_ref.model.path" in capsys.readouterr().err
    # --init-from a directory without a tokenizer whose vocabulary is not the embedded one: named, before any work
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "config.json").write_text(
        '{"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], "vocab_size": 1000}'
    )
    assert (
        main(["grpo", "--out", str(tmp_path / "run"), "--init-from", str(tmp_path / "other"), "--no-plot"])
        == 2
    )
    assert "has no tokenizer" in capsys.readouterr().err


def test_two_data_parallel_ranks_give_the_one_rank_run(tmp_path: Path) -> None:
    """The loop over a DP2 process group (as under ``torchrun --nproc-per-node 2``; gloo here) is the DP1 loop.

    Every rank samples the same rollouts (seeded by run seed and step) and the engine splits each batch over
    the two ranks, so rewards and held-out accuracy are identical, and the first step's loss and gradient
    norm (same weights, same data) agree to float32 reduction order (1e-5). After the first update the two
    runs' weights differ by that rounding and Adam's first steps (normalised by tiny second moments) amplify
    it: later losses, KL and gradient norms are compared to 1e-3 (measured: 2e-4 at most).
    """
    overrides = [*SMALL, "trainer.total_training_steps=3"]
    runs = {
        world: run_distributed(
            grpo_run,
            world_size=world,
            args=(
                str(tmp_path / f"dp{world}"),
                [*overrides, f"trainer.n_gpus_per_node={world}"],
                RUN,
                False,
                1,
            ),
        )[0]
        for world in (1, 2)
    }
    one, two = runs[1], runs[2]
    assert one["eval"] == two["eval"]
    assert [r["step"] for r in two["records"]] == [1, 2, 3]
    for step, (a, b) in enumerate(zip(one["records"], two["records"], strict=True), start=1):
        assert a["reward_mean"] == b["reward_mean"], step
        tol = 1e-5 if step == 1 else 1e-3
        for key in ("actor/pg_loss", "grad_norm", "kl", "entropy"):
            assert abs(a[key] - b[key]) <= tol * abs(a[key]) + 1e-7, (step, key, a[key], b[key])


def test_grpo_command_under_torchrun_with_two_ranks(tmp_path: Path) -> None:
    """``torchrun --nproc-per-node 2 -m verl_engine grpo`` on CPU (gloo): one run, written once by rank 0."""
    import subprocess
    import sys

    out = tmp_path / "run"
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
        "-m", "verl_engine", "grpo", "--out", str(out), "--steps", "2", "--warmup-steps", "5", "--no-plot",
        "trainer.device=cpu",
    ]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    records = (out / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in records] == [0, 1, 2]  # 0: the warm start's evaluation
    assert done.stdout.count("held-out accuracy after step 2") == 1
    assert (out / "checkpoints").is_dir() and (out / "sft" / "config.json").is_file()
