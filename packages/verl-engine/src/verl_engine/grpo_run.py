"""A GRPO run end to end on the embedded arithmetic task: warm start, rollout, reward, advantages, KL, update.

Everything an RL trainer does around the engine, small enough to read in one sitting and to run on a laptop:

1. Warm start (skipped on resume): a few supervised steps of the actor on ``a+b=`` -> ``c<eos>`` (``sft_loss``),
   saved as a Hugging Face directory ``<out>/sft``; the reference policy is built from it (verl: the reference
   is the initial policy).
2. Per step: the actor's weights go to the rollout engine (``get_per_tensor_param`` -> ``update_weights``), it
   samples ``actor_rollout_ref.rollout.n`` responses per prompt (seeded by run seed and step, so a resumed run
   samples what the uninterrupted one did), the reward is exact match of the answer, advantages are GRPO's
   (``algorithm.norm_adv_by_std_in_grpo``), the actor's and the reference's log-probs of the responses are
   computed, KL enters as a loss (``actor.use_kl_loss``) or a reward penalty (``algorithm.use_kl_in_reward``),
   and the actor is updated with ``ppo_loss`` over ``ppo_mini_batch_size`` mini-batches for ``ppo_epochs``.
3. Metrics per step in ``<out>/metrics.jsonl``; held-out greedy accuracy every ``trainer.test_freq`` steps;
   checkpoints every ``trainer.save_freq`` steps under ``<out>/checkpoints`` (``resume=True`` continues from the
   latest one exactly: engine state, RNG and LR schedule come back, the sampling is seeded by step).

Every knob is verl's own key, read from the loaded verl-config ``ppo_trainer`` config; :class:`GRPORun` holds
only what the config has no key for (output directory, warm-start length, held-out set size).
"""

from __future__ import annotations

import json
import os
import random
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import torch

from verl_engine.demo import CharTokenizer
from verl_engine.grpo import grpo_outcome_advantage, rollout_batch
from verl_engine.rollout import HFRollout, RolloutEngine, SamplingParams

__all__ = ["ArithmeticTask", "GRPORun", "run_grpo", "tiny_arithmetic_hf_config"]


class ArithmeticTask:
    """``a op b =`` prompts with exact-match answers; a fixed held-out set never used for training."""

    def __init__(
        self, *, seed: int, operations: str = "+", max_operand: int = 20, eval_size: int = 64
    ) -> None:
        if not operations or set(operations) - set("+-*"):
            raise ValueError(f"operations must be a non-empty subset of '+-*', got {operations!r}")
        if max_operand < 1:
            raise ValueError(f"max_operand must be >= 1, got {max_operand}")
        self.tokenizer = CharTokenizer()
        self.seed = seed
        self.operations = operations
        self.max_operand = max_operand
        rng = random.Random(seed * 7_919 + 1)
        self.eval_set: list[tuple[str, str]] = []
        seen: set[str] = set()
        while len(self.eval_set) < min(eval_size, self._space() // 4):
            prompt, answer = self._problem(rng)
            if prompt not in seen:
                seen.add(prompt)
                self.eval_set.append((prompt, answer))
        self._held_out = seen

    def _space(self) -> int:
        return len(self.operations) * (self.max_operand + 1) ** 2

    def _problem(self, rng: random.Random) -> tuple[str, str]:
        op = rng.choice(self.operations)
        a, b = rng.randint(0, self.max_operand), rng.randint(0, self.max_operand)
        result = a + b if op == "+" else a - b if op == "-" else a * b
        return f"{a}{op}{b}=", str(result)

    def train_problems(self, *, step: int, count: int, stream: int = 0) -> list[tuple[str, str]]:
        """``count`` training problems of ``step`` (deterministic in seed, stream and step; no held-out one)."""
        rng = random.Random((self.seed * 1_000_003 + stream) * 1_000_033 + step)
        out: list[tuple[str, str]] = []
        while len(out) < count:
            problem = self._problem(rng)
            if problem[0] not in self._held_out:
                out.append(problem)
        return out

    def prompt_ids(self, prompt: str) -> list[int]:
        return [self.tokenizer.bos_id, *self.tokenizer.encode(prompt)]

    def answer_ids(self, answer: str) -> list[int]:
        return [*self.tokenizer.encode(answer), self.tokenizer.eos_id]

    def reward(self, response: Sequence[int], answer: str) -> float:
        """1 for exactly the answer followed by EOS, else 0."""
        return float(list(response) == self.answer_ids(answer))


def tiny_arithmetic_hf_config(*, vocab_size: int, hidden_size: int = 128, layers: int = 2) -> dict[str, Any]:
    """A small Qwen2 ``config.json`` for the character vocabulary (the embedded default model)."""
    return {
        "model_type": "qwen2",
        "architectures": ["Qwen2ForCausalLM"],
        "vocab_size": vocab_size,
        "hidden_size": hidden_size,
        "intermediate_size": 4 * hidden_size,
        "num_hidden_layers": layers,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 64,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "attention_dropout": 0.0,
        "torch_dtype": "float32",
        "hidden_act": "silu",
        "initializer_range": 0.02,
    }


@dataclass
class GRPORun:
    """What a GRPO run needs beyond the verl config. ``overrides`` are verl override strings."""

    out_dir: str
    overrides: list[str] = field(default_factory=list)
    warmup_steps: int = 40
    warmup_batch_size: int = 64
    eval_size: int = 64
    operations: str = "+"
    max_operand: int = 20
    seed: int = 0
    resume: bool = False
    device: str = "cpu"

    def __post_init__(self) -> None:
        if self.warmup_steps < 0:
            raise ValueError(f"warmup_steps must be >= 0, got {self.warmup_steps}")
        if self.warmup_batch_size < 1:
            raise ValueError(f"warmup_batch_size must be >= 1, got {self.warmup_batch_size}")
        if self.eval_size < 1:
            raise ValueError(f"eval_size must be >= 1, got {self.eval_size}")


_DEFAULTS = [
    "model_engine=megatron",
    "algorithm.adv_estimator=grpo",
    "trainer.n_gpus_per_node=1",
    "trainer.total_training_steps=20",
    "trainer.test_freq=5",
    "trainer.save_freq=10",
    "data.train_batch_size=16",
    "data.max_response_length=4",
    "actor_rollout_ref.rollout.n=4",
    "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=64",
    "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=64",
    "actor_rollout_ref.actor.ppo_mini_batch_size=16",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=16",
    "actor_rollout_ref.actor.optim.lr=1e-3",
    "actor_rollout_ref.actor.optim.total_training_steps=1000",
    "actor_rollout_ref.actor.use_kl_loss=true",
    "actor_rollout_ref.actor.kl_loss_coef=0.01",
    "actor_rollout_ref.actor.calculate_entropy=true",
    "critic.ppo_micro_batch_size_per_gpu=64",
    "actor_rollout_ref.model.use_remove_padding=true",
]


def _init_process_group() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        return
    if "RANK" not in os.environ:  # one process without torchrun: a group of one
        from verl_mcore_utils.testing import free_port

        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1")
        os.environ.setdefault("LOCAL_RANK", "0")
    dist.init_process_group("gloo" if not torch.cuda.is_available() else "nccl")


def _is_rank0() -> bool:
    import torch.distributed as dist

    return not dist.is_initialized() or dist.get_rank() == 0


def _response_slice(full: torch.Tensor, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """Per-response-token values [B, R] from the engine's input-layout output [B, P + R]."""
    p, r = batch["prompts"].shape[1], batch["responses"].shape[1]
    return full[:, p - 1 : p - 1 + r] * batch["response_mask"]


def _masked_mean(values: torch.Tensor, mask: torch.Tensor) -> float:
    return float((values * mask).sum() / mask.sum().clamp(min=1))


def run_grpo(run: GRPORun, *, rollout: RolloutEngine | None = None) -> dict[str, Any]:
    """The whole run (see the module docstring); returns the last step's metrics and the held-out accuracies."""
    from verl_config import load_config
    from verl_engine.build_rl import rl_engine_from_config
    from verl_engine.losses import kl_penalty, kl_reward_penalty, ppo_loss, sft_loss

    out = Path(run.out_dir)
    task = ArithmeticTask(
        seed=run.seed, operations=run.operations, max_operand=run.max_operand, eval_size=run.eval_size
    )
    tok = task.tokenizer
    overrides = [*_DEFAULTS, f"actor_rollout_ref.actor.megatron.seed={run.seed}", *run.overrides]
    sft_dir = out / "sft"
    ckpt_root = out / "checkpoints"
    resuming = run.resume and (ckpt_root / "latest_checkpointed_iteration.txt").is_file()
    if run.resume and not resuming:
        raise FileNotFoundError(f"resume=True but {ckpt_root} has no checkpoint to resume from")
    hf = tiny_arithmetic_hf_config(vocab_size=tok.vocab_size)
    user_model = any(o.startswith("actor_rollout_ref.model.path=") for o in run.overrides)
    if user_model:
        raise NotImplementedError(
            "a Hugging Face model (actor_rollout_ref.model.path) needs its own tokenizer and task; the embedded"
            " run uses the arithmetic character vocabulary"
        )
    _init_process_group()  # after every check that needs no process group
    device = (
        torch.device("cuda", torch.cuda.current_device()) if run.device == "cuda" else torch.device("cpu")
    )
    if not resuming:
        cfg = load_config(overrides=overrides)
        actor = rl_engine_from_config(cfg, role="actor", device=device, hf_config=hf)
        _warm_start(actor, task, run=run, loss=sft_loss)
        actor.save_hf(str(sft_dir))
        del actor
    cfg = load_config(overrides=[*overrides, f"actor_rollout_ref.model.path={sft_dir}"])
    actor = rl_engine_from_config(cfg, role="actor", device=device)
    arr, algo = cfg.actor_rollout_ref, cfg.algorithm
    use_ref = bool(arr.actor.use_kl_loss or algo.use_kl_in_reward)
    ref = rl_engine_from_config(cfg, role="ref", device=device) if use_ref else None
    if rollout is None:
        rollout = HFRollout(hf_config=hf, eos_token_id=tok.eos_id, pad_token_id=tok.pad_id, device=device)
    start = 0
    if resuming:
        start = int(actor.load_checkpoint(str(ckpt_root))["global_step"])
    metrics_file = out / "metrics.jsonl"
    if _is_rank0():
        kept = []
        if resuming and metrics_file.is_file():  # drop steps after the checkpoint: they are run again
            kept = [
                line for line in metrics_file.read_text().splitlines() if json.loads(line)["step"] <= start
            ]
        metrics_file.write_text("".join(line + "\n" for line in kept))
    loss = partial(ppo_loss, config=arr.actor)
    n, prompts_per_step = int(arr.rollout.n), int(cfg.data.train_batch_size)
    mini = int(arr.actor.ppo_mini_batch_size)
    total = int(cfg.trainer.total_training_steps)
    params = SamplingParams(
        max_new_tokens=int(cfg.data.max_response_length),
        n=n,
        temperature=float(arr.rollout.temperature),
        top_p=float(arr.rollout.top_p),
        top_k=max(0, int(arr.rollout.top_k)),
    )
    history: dict[str, Any] = {"eval": {}}
    if start == 0:
        history["eval"][0] = _evaluate(actor, rollout, task, params)
    last: dict[str, Any] = {}
    for step in range(start, total):
        t0 = time.perf_counter()
        weights, _ = actor.get_per_tensor_param()
        rollout.update_weights(weights)
        t_sync = time.perf_counter()
        problems = task.train_problems(step=step, count=prompts_per_step)
        prompts = [task.prompt_ids(p) for p, _ in problems]
        responses = rollout.generate(
            prompts, SamplingParams(**{**params.__dict__, "seed": run.seed * 100_003 + step})
        )
        t_gen = time.perf_counter()
        answers = [a for _, a in problems for _ in range(n)]
        scores = torch.tensor([task.reward(r, a) for r, a in zip(responses, answers, strict=True)])
        batch: dict[str, Any] = rollout_batch(
            [p for p in prompts for _ in range(n)], responses, pad_token_id=tok.pad_id
        )
        mask = batch["response_mask"].float()
        with actor.eval_mode():
            old = _response_slice(actor.infer_batch(batch)["model_output"]["log_probs"].float(), batch)
        metrics: dict[str, Any] = {}
        if ref is not None:
            with ref.eval_mode():
                ref_lp = _response_slice(ref.infer_batch(batch)["model_output"]["log_probs"].float(), batch)
            batch["ref_log_prob"] = ref_lp
            kl = kl_penalty(log_prob=old, ref_log_prob=ref_lp, kl_penalty=arr.actor.kl_loss_type)
            metrics["kl"] = _masked_mean(kl, mask)
        outcome = scores
        if algo.use_kl_in_reward:
            token_scores = torch.zeros_like(mask)
            last_token = (mask.sum(-1).long() - 1).clamp(min=0)
            token_scores[torch.arange(len(scores)), last_token] = scores
            rewards, _ = kl_reward_penalty(
                token_level_scores=token_scores,
                old_log_prob=old,
                ref_log_prob=batch["ref_log_prob"],
                response_mask=mask,
                kl_coef=float(algo.kl_ctrl.kl_coef),
                kl_penalty_type=algo.kl_penalty,
            )
            outcome = rewards.sum(-1)
        group = [i // n for i in range(len(responses))]
        advantage = grpo_outcome_advantage(
            outcome, group_ids=group, norm_adv_by_std_in_grpo=bool(algo.norm_adv_by_std_in_grpo)
        )
        batch.update(old_log_probs=old, advantages=advantage[:, None] * mask)
        t_ref = time.perf_counter()
        train_metrics: dict[str, list[float]] = {}
        with actor.train_mode():
            for _ in range(int(arr.actor.ppo_epochs)):
                for lo in range(0, len(responses), mini * n):
                    part = {k: v[lo : lo + mini * n] for k, v in batch.items()}
                    result = actor.train_batch(part, loss)
                    for key, value in {**result["metrics"], "loss": result["loss"]}.items():
                        train_metrics.setdefault(key, []).append(float(value))
        lr = actor.lr_scheduler_step()
        t_train = time.perf_counter()
        tokens = int(batch["attention_mask"].sum())
        metrics.update(
            step=step + 1,
            reward_mean=float(scores.mean()),
            accuracy=float((scores == 1).float().mean()),
            response_length=float(mask.sum(-1).mean()),
            advantage_group_mean_abs_max=_group_mean_abs_max(advantage, group),
            lr=lr,
            seconds={
                "sync": t_sync - t0,
                "generate": t_gen - t_sync,
                "logprobs": t_ref - t_gen,
                "train": t_train - t_ref,
            },
            tokens_per_s=tokens / (t_train - t0),
            peak_memory_gib=(torch.cuda.max_memory_allocated() / 2**30) if device.type == "cuda" else None,
            **{k: sum(v) / len(v) for k, v in train_metrics.items()},
        )
        test_freq, save_freq = int(cfg.trainer.test_freq), int(cfg.trainer.save_freq)
        if test_freq > 0 and ((step + 1) % test_freq == 0 or step + 1 == total):
            metrics["eval_accuracy"] = history["eval"][step + 1] = _evaluate(actor, rollout, task, params)
        if _is_rank0():
            with metrics_file.open("a") as f:
                f.write(json.dumps(metrics, sort_keys=True) + "\n")
        if save_freq > 0 and ((step + 1) % save_freq == 0 or step + 1 == total):
            actor.save_checkpoint(str(ckpt_root), global_step=step + 1, data_position={"step": step + 1})
        last = metrics
    return {"last": last, "eval": history["eval"], "start": start}


def _group_mean_abs_max(advantage: torch.Tensor, group: list[int]) -> float:
    ids = torch.tensor(group)
    return max(float(advantage[ids == g].mean().abs()) for g in set(group))


def _warm_start(actor: Any, task: ArithmeticTask, *, run: GRPORun, loss: Any) -> None:
    """``run.warmup_steps`` supervised steps on prompt -> answer + EOS (the response tokens only)."""
    with actor.train_mode():
        for step in range(run.warmup_steps):
            problems = task.train_problems(step=step, count=run.warmup_batch_size, stream=1)
            batch = rollout_batch(
                [task.prompt_ids(p) for p, _ in problems],
                [task.answer_ids(a) for _, a in problems],
                pad_token_id=task.tokenizer.pad_id,
            )
            actor.train_batch(batch, loss)


def _evaluate(actor: Any, rollout: RolloutEngine, task: ArithmeticTask, params: SamplingParams) -> float:
    """Greedy exact-match accuracy on the held-out prompts (weights synced first)."""
    weights, _ = actor.get_per_tensor_param()
    rollout.update_weights(weights)
    prompts = [task.prompt_ids(p) for p, _ in task.eval_set]
    greedy = SamplingParams(max_new_tokens=params.max_new_tokens, n=1, temperature=0.0)
    responses = rollout.generate(prompts, greedy)
    return sum(task.reward(r, a) for r, (_, a) in zip(responses, task.eval_set, strict=True)) / len(prompts)
