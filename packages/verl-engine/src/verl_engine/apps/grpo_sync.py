"""The actor's weights into the rollout engine, and the held-out evaluation that follows each sync."""

from __future__ import annotations

from verl_engine.apps.grpo_colocation import Colocation
from verl_engine.apps.grpo_task import ArithmeticTask
from verl_engine.apps.grpo_workers import Workers
from verl_engine.apps.rollout import RolloutEngine, SamplingParams

__all__ = ["evaluate", "sync_weights"]


def sync_weights(workers: Workers, rollout: RolloutEngine, colo: Colocation) -> None:
    """The actor's weights into the rollout engine (its parameters on the device only for the export; the
    rollout awake from here until the caller's generation is done)."""
    colo.actor_to(params=True, grads=False, optimizer=False)
    colo.rollout_awake(True)
    rollout.update_weights(workers.export_weights("actor"))
    colo.actor_to(params=False, grads=False, optimizer=False)


def evaluate(
    workers: Workers, rollout: RolloutEngine, task: ArithmeticTask, params: SamplingParams, colo: Colocation
) -> float:
    """Greedy exact-match accuracy on the held-out prompts (weights synced first)."""
    sync_weights(workers, rollout, colo)
    prompts = [task.prompt_ids(p) for p, _ in task.eval_set]
    greedy = SamplingParams(max_new_tokens=params.max_new_tokens, n=1, temperature=0.0)
    responses = rollout.generate(prompts, greedy)
    colo.rollout_awake(False)
    return sum(task.reward(r, a) for r, (_, a) in zip(responses, task.eval_set, strict=True)) / len(prompts)
