"""The GRPO loop (``verl_engine.grpo_run``) end to end on CPU: the embedded arithmetic task, a real actor and
reference engine, the transformers rollout engine.

* Invariants per step: GRPO advantages have zero mean in every group; the KL to the reference is exactly 0 at the
  first step (the reference is the warm-started initial policy); every step writes one metrics record.
* Resume: 6 steps straight vs 3 steps + checkpoint, then a fresh process with ``resume=True`` for steps 4-6: the
  same rewards, KL, losses and gradient norms (bitwise: engine state, RNG and LR schedule come back and the
  sampling is seeded by step).
"""

from __future__ import annotations

from pathlib import Path

from rl_engine_workers import grpo_run

from verl_mcore_utils.testing import run_distributed

RUN = {"warmup_steps": 15, "warmup_batch_size": 32, "eval_size": 16, "seed": 3}
SMALL = [
    "data.train_batch_size=8",
    "actor_rollout_ref.actor.ppo_mini_batch_size=4",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8",
    "trainer.test_freq=3",
]
TIMING = ("seconds", "tokens_per_s", "peak_memory_gib")


def _strip(record: dict) -> dict:
    return {k: v for k, v in record.items() if k not in TIMING}


def test_grpo_loop_invariants_and_exact_resume(tmp_path: Path) -> None:
    straight = run_distributed(
        grpo_run,
        world_size=1,
        args=(str(tmp_path / "a"), [*SMALL, "trainer.total_training_steps=6", "trainer.save_freq=3"], RUN),
    )[0]
    records = straight["records"]
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 6]
    assert records[0]["kl"] == 0.0
    assert all(r["advantage_group_mean_abs_max"] < 1e-6 for r in records)
    assert all(0.0 <= r["reward_mean"] <= 1.0 and r["response_length"] > 0 for r in records)
    assert set(straight["eval"]) == {0, 3, 6}
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


def test_grpo_command_line(capsys) -> None:
    import pytest

    from verl_engine.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(["grpo", "--help"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    assert all(flag in text for flag in ("--out", "--steps", "--warmup-steps", "--resume", "key=value"))
    assert main(["grpo", "--out", "/nonexistent/run", "--resume"]) == 2  # nothing to resume: a clear error
    assert "no checkpoint to resume from" in capsys.readouterr().err
