"""One GRPO step: weight sync, generation, reward, the actor's and the reference's log-probs, KL, GRPO
advantages and the PPO update over mini-batches; returns the step's metrics record."""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from verl_engine.apps.grpo import grpo_outcome_advantage, rollout_batch
from verl_engine.apps.grpo_colocation import Colocation, Phases
from verl_engine.apps.grpo_sync import sync_weights
from verl_engine.apps.grpo_task import ArithmeticTask
from verl_engine.apps.grpo_workers import Workers
from verl_engine.apps.rollout import RolloutEngine, SamplingParams

__all__ = ["StepLoop", "grpo_step"]


@dataclass
class StepLoop:
    """What every step reads: the engines, the task, the sampling settings and the loaded verl config."""

    workers: Workers
    rollout: RolloutEngine
    task: ArithmeticTask
    colo: Colocation
    params: SamplingParams
    cfg: Any
    device: torch.device
    seed: int
    use_ref: bool

    @property
    def n(self) -> int:
        return int(self.cfg.actor_rollout_ref.rollout.n)


def grpo_step(loop: StepLoop, step: int) -> dict[str, Any]:
    """Step ``step`` (0-based) of the run; its metrics record (``step`` is 1-based there)."""
    arr, n = loop.cfg.actor_rollout_ref, loop.n
    phase = Phases(loop.device)
    t0 = time.perf_counter()
    with phase("sync"):
        sync_weights(loop.workers, loop.rollout, loop.colo)
    with phase("generate"):
        problems, prompts, responses = _generate(loop, step)
    answers = [a for _, a in problems for _ in range(n)]
    scores = torch.tensor([loop.task.reward(r, a) for r, a in zip(responses, answers, strict=True)])
    batch: dict[str, Any] = rollout_batch(
        [p for p in prompts for _ in range(n)], responses, pad_token_id=loop.task.tokenizer.pad_id
    )
    mask = batch["response_mask"].float()
    metrics: dict[str, Any] = {}
    with phase("old_log_prob"):
        old = _old_log_probs(loop, batch, mask, metrics)
    if loop.use_ref:
        with phase("ref_log_prob"):
            ref_lp = _ref_log_probs(loop, batch)
        batch["ref_log_prob"] = ref_lp
        metrics["kl"] = _masked_mean(_kl(old, ref_lp, arr.actor.kl_loss_type), mask)
    group = [i // n for i in range(len(responses))]
    advantage = _advantages(loop, scores, old=old, batch=batch, mask=mask, group=group)
    batch.update(old_log_probs=old, advantages=advantage[:, None] * mask)
    with phase("train"):
        train_metrics, lr = _update(loop, batch, count=len(responses))
    tokens_in_batch = int(batch["attention_mask"].sum())
    elapsed = time.perf_counter() - t0
    metrics.update(
        step=step + 1,
        reward_mean=float(scores.mean()),
        accuracy=float((scores == 1).float().mean()),
        response_length=float(mask.sum(-1).mean()),
        advantage_group_mean_abs_max=_group_mean_abs_max(advantage, group),
        lr=lr,
        seconds={**phase.seconds, "step": elapsed},
        tokens_per_s=tokens_in_batch / elapsed,
        memory_gib=phase.memory_gib or None,
        peak_memory_gib=max((m["peak"] for m in phase.memory_gib.values()), default=None),
        offload=loop.colo.enabled,
        **{k: sum(v) / len(v) for k, v in train_metrics.items()},
    )
    return metrics


def _generate(loop: StepLoop, step: int) -> tuple[list[tuple[str, str]], list[list[int]], list[list[int]]]:
    """The step's problems, their prompt ids and ``n`` sampled responses per prompt (seeded by run seed and
    step, so a resumed run samples what the uninterrupted one did); the rollout sleeps afterwards."""
    task = loop.task
    problems = task.train_problems(step=step, count=int(loop.cfg.data.train_batch_size))
    prompts = [task.prompt_ids(p) for p, _ in problems]
    responses = loop.rollout.generate(
        prompts, SamplingParams(**{**loop.params.__dict__, "seed": loop.seed * 100_003 + step})
    )
    loop.colo.rollout_awake(False)
    return problems, prompts, responses


def _old_log_probs(
    loop: StepLoop, batch: Mapping[str, Any], mask: torch.Tensor, metrics: dict[str, Any]
) -> torch.Tensor:
    """The actor's log-probs of the responses; verl reports the policy's entropy from this pass
    (``calculate_entropy``), not from the update."""
    loop.colo.actor_to(params=True, grads=False, optimizer=False)
    entropy_on = bool(loop.cfg.actor_rollout_ref.actor.calculate_entropy)
    actor_out = loop.workers.call("actor", "infer_batch", {**batch, "calculate_entropy": entropy_on})
    old = _response_slice(actor_out["model_output"]["log_probs"].float(), batch)
    if entropy_on:
        entropy = _response_slice(actor_out["model_output"]["entropy"].float(), batch)
        metrics["entropy"] = _masked_mean(entropy, mask)
    return old


def _ref_log_probs(loop: StepLoop, batch: Mapping[str, Any]) -> torch.Tensor:
    loop.colo.ref_offload(on_device=True)
    ref_out = loop.workers.call("ref", "infer_batch", batch)
    ref_lp = _response_slice(ref_out["model_output"]["log_probs"].float(), batch)
    loop.colo.ref_offload(on_device=False)
    return ref_lp


def _advantages(
    loop: StepLoop,
    scores: torch.Tensor,
    *,
    old: torch.Tensor,
    batch: Mapping[str, Any],
    mask: torch.Tensor,
    group: list[int],
) -> torch.Tensor:
    """GRPO's advantage per response, of the score or (``use_kl_in_reward``) of the KL-penalised score."""
    algo = loop.cfg.algorithm
    outcome = scores
    if algo.use_kl_in_reward:
        outcome = _kl_penalised_outcome(scores, old, batch["ref_log_prob"], mask, algo)
    return grpo_outcome_advantage(
        outcome, group_ids=group, norm_adv_by_std_in_grpo=bool(algo.norm_adv_by_std_in_grpo)
    )


def _update(loop: StepLoop, batch: Mapping[str, Any], *, count: int) -> tuple[dict[str, list[float]], Any]:
    """``ppo_epochs`` passes of ``ppo_loss`` over mini-batches of ``ppo_mini_batch_size`` prompts, then the LR
    schedule's step; the training metrics of every mini-batch and the new learning rate."""
    actor = loop.cfg.actor_rollout_ref.actor
    size = int(actor.ppo_mini_batch_size) * loop.n
    train_metrics: dict[str, list[float]] = {}
    loop.colo.actor_to(params=True, grads=True, optimizer=True)
    for _ in range(int(actor.ppo_epochs)):
        for lo in range(0, count, size):
            part = {k: v[lo : lo + size] for k, v in batch.items()}
            result = loop.workers.call("actor", "train_batch", part, loss="ppo")
            for key, value in {**result["metrics"], "loss": result["loss"]}.items():
                train_metrics.setdefault(key, []).append(float(value))
    lr = loop.workers.call("actor", "lr_scheduler_step")
    loop.colo.actor_to(params=False, grads=False, optimizer=False)
    return train_metrics, lr


def _response_slice(full: torch.Tensor, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """Per-response-token values [B, R] from the engine's input-layout output [B, P + R]."""
    p, r = batch["prompts"].shape[1], batch["responses"].shape[1]
    mask = batch["response_mask"]  # the loop's tensors live on the host; the engine's outputs may not
    return full[:, p - 1 : p - 1 + r].to(mask.device) * mask


def _masked_mean(values: torch.Tensor, mask: torch.Tensor) -> float:
    return float((values * mask).sum() / mask.sum().clamp(min=1))


def _kl(log_prob: torch.Tensor, ref_log_prob: torch.Tensor, kind: str) -> torch.Tensor:
    from verl_engine.losses import kl_penalty

    return kl_penalty(log_prob=log_prob, ref_log_prob=ref_log_prob, kl_penalty=kind)


def _kl_penalised_outcome(
    scores: torch.Tensor, old: torch.Tensor, ref: torch.Tensor, mask: torch.Tensor, algo: Any
) -> torch.Tensor:
    """verl's reward-side KL: the score on the last response token minus kl_coef * KL per token, summed."""
    from verl_engine.losses import kl_reward_penalty

    token_scores = torch.zeros_like(mask)
    last_token = (mask.sum(-1).long() - 1).clamp(min=0)
    token_scores[torch.arange(len(scores)), last_token] = scores
    rewards, _ = kl_reward_penalty(
        token_level_scores=token_scores,
        old_log_prob=old,
        ref_log_prob=ref,
        response_mask=mask,
        kl_coef=float(algo.kl_ctrl.kl_coef),
        kl_penalty_type=algo.kl_penalty,
    )
    return rewards.sum(-1)


def _group_mean_abs_max(advantage: torch.Tensor, group: list[int]) -> float:
    ids = torch.tensor(group)
    return max(float(advantage[ids == g].mean().abs()) for g in set(group))
