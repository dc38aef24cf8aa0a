"""A GRPO run end to end on the embedded arithmetic task: warm start, rollout, reward, advantages, KL, update.

Everything an RL trainer does around the engine, small enough to read in one sitting and to run on a laptop:

1. Warm start (skipped on resume and with ``warmup_steps=0``): supervised steps of the actor on ``a+b=`` ->
   ``c<eos>`` (``sft_loss``) imitating a *sloppy demonstrator* (a fraction ``warmup_error_rate`` of its answers
   are one too high), saved as a Hugging Face directory ``<out>/sft``; the reference policy is built from it
   (verl: the reference is the initial policy). The imitating policy knows the arithmetic but its most likely
   answer is often wrong: the correct one is among its samples. That is the situation RL with a verifiable
   reward improves, and the improvement shows on held-out prompts within minutes on a laptop CPU.
2. Per step: the actor's weights go to the rollout engine (``update_weights``), it samples
   ``actor_rollout_ref.rollout.n`` responses per prompt (seeded by run seed and step, so a resumed run samples
   what the uninterrupted one did), the reward is exact match of the answer, advantages are GRPO's
   (``algorithm.norm_adv_by_std_in_grpo``), the actor's and the reference's log-probs of the responses are
   computed, KL enters as a loss (``actor.use_kl_loss``) or a reward penalty (``algorithm.use_kl_in_reward``),
   and the actor is updated with ``ppo_loss`` over ``ppo_mini_batch_size`` mini-batches for ``ppo_epochs``.
3. Colocation: with verl's offload keys (``actor_rollout_ref.actor.megatron.param_offload`` /
   ``grad_offload`` / ``optimizer_offload``, ``actor_rollout_ref.ref.megatron.param_offload``) the trainer's
   state leaves the GPU while the rollout generates, and the rollout sleeps while the trainer works
   (``actor_rollout_ref.rollout.free_cache_engine``); seconds and GPU memory are recorded per phase.
4. Metrics per step in ``<out>/metrics.jsonl``; held-out greedy accuracy every ``trainer.test_freq`` steps;
   checkpoints every ``trainer.save_freq`` steps under ``<out>/checkpoints`` (``resume=True`` continues from the
   latest one exactly: engine state, RNG and LR schedule come back, the sampling is seeded by step).

The engines run in this process (one rank of a torchrun launch, or a group of one) or, with a
:class:`~verl_engine.apps.ray_workers.RayWorkerGroup`, in Ray actors; the loop is the same code. Every knob is
verl's own key, read from the loaded verl-config ``ppo_trainer`` config; :class:`GRPORun` holds only what the
config has no key for (output directory, warm start, task, held-out set size).
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch

from verl_engine.apps.demo import CharTokenizer
from verl_engine.apps.grpo import grpo_outcome_advantage, rollout_batch
from verl_engine.apps.rollout import HFRollout, RolloutEngine, SamplingParams

__all__ = [
    "ArithmeticTask",
    "GRPORun",
    "HFTokens",
    "InProcessWorkers",
    "RayWorkers",
    "Tokens",
    "Workers",
    "run_grpo",
    "tiny_arithmetic_hf_config",
]


class Tokens(Protocol):
    """What the task needs from a tokenizer (the embedded :class:`CharTokenizer` or :class:`HFTokens`)."""

    bos_id: int | None
    eos_id: int
    pad_id: int

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


class HFTokens:
    """A Hugging Face tokenizer seen through :class:`Tokens` (no special tokens added by ``encode``)."""

    def __init__(self, tokenizer: Any) -> None:
        if tokenizer.eos_token_id is None:
            raise ValueError(
                f"the tokenizer {type(tokenizer).__name__} has no eos_token: the reward needs the response to end"
                " with EOS; set eos_token in the model directory's tokenizer_config.json"
            )
        self.tokenizer = tokenizer
        self.eos_id = int(tokenizer.eos_token_id)
        self.bos_id = None if tokenizer.bos_token_id is None else int(tokenizer.bos_token_id)
        self.pad_id = self.eos_id if tokenizer.pad_token_id is None else int(tokenizer.pad_token_id)

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def decode(self, ids: list[int]) -> str:
        return str(self.tokenizer.decode(ids, skip_special_tokens=True))


class ArithmeticTask:
    """``a op b =`` prompts with exact-match answers; a fixed held-out set never used for training."""

    def __init__(
        self,
        *,
        seed: int,
        operations: str = "+",
        max_operand: int = 20,
        eval_size: int = 64,
        tokenizer: Tokens | None = None,
    ) -> None:
        if not operations or set(operations) - set("+-*"):
            raise ValueError(f"operations must be a non-empty subset of '+-*', got {operations!r}")
        if max_operand < 1:
            raise ValueError(f"max_operand must be >= 1, got {max_operand}")
        self.tokenizer: Tokens = tokenizer if tokenizer is not None else CharTokenizer()
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

    def demonstrations(self, *, step: int, count: int, error_rate: float) -> list[tuple[str, str]]:
        """Warm-start examples of ``step`` from a sloppy demonstrator: a fraction ``error_rate`` of its answers
        are one too high (deterministic in seed and step; no held-out prompt).

        Imitating it gives a policy that knows the arithmetic but whose most likely answer is often wrong:
        the correct one is among its samples (pass@n > greedy accuracy), which RL with a verifiable reward
        improves, measurably on the held-out prompts.
        """
        rng = random.Random((self.seed * 1_000_003 + 7) * 1_000_033 + step)
        out = []
        for prompt, answer in self.train_problems(step=step, count=count, stream=1):
            if rng.random() < error_rate:
                answer = str(int(answer) + 1)
            out.append((prompt, answer))
        return out

    def prompt_ids(self, prompt: str) -> list[int]:
        bos = self.tokenizer.bos_id
        return [*([] if bos is None else [bos]), *self.tokenizer.encode(prompt)]

    def answer_ids(self, answer: str) -> list[int]:
        return [*self.tokenizer.encode(answer), self.tokenizer.eos_id]

    def reward(self, response: Sequence[int], answer: str) -> float:
        """1 for exactly the answer followed by EOS (compared as text: tokenizations may differ), else 0."""
        ids = list(response)
        if not ids or ids[-1] != self.tokenizer.eos_id:
            return 0.0
        return float(self.tokenizer.decode(ids[:-1]) == answer)


def tiny_arithmetic_hf_config(*, vocab_size: int, hidden_size: int = 128, layers: int = 2) -> dict[str, Any]:
    """A small Qwen2 ``config.json`` for the character vocabulary (the embedded default model)."""
    if hidden_size % 64:
        raise ValueError(f"hidden_size must be a multiple of 64 (head dim 64 or more), got {hidden_size}")
    heads = max(4, hidden_size // 64)
    return {
        "model_type": "qwen2",
        "architectures": ["Qwen2ForCausalLM"],
        "vocab_size": vocab_size,
        "hidden_size": hidden_size,
        "intermediate_size": 4 * hidden_size,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": heads // 2,
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
    """What a GRPO run needs beyond the verl config. ``overrides`` are verl override strings.

    ``hidden_size`` / ``layers`` size the embedded model (ignored with ``actor_rollout_ref.model.path``).
    ``progress``: a progress bar on rank 0 (else nothing per step); ``plot``: ``<out>/grpo.png`` at the end
    (matplotlib).
    """

    out_dir: str
    overrides: list[str] = field(default_factory=list)
    warmup_steps: int = 1000
    warmup_batch_size: int = 64
    warmup_error_rate: float = 0.7
    warmup_lr: float = 1e-3
    eval_size: int = 64
    operations: str = "+"
    max_operand: int = 20
    hidden_size: int = 128
    layers: int = 2
    seed: int = 0
    resume: bool = False
    device: str = "cpu"
    progress: bool = False
    plot: bool = False

    def __post_init__(self) -> None:
        if self.warmup_steps < 0:
            raise ValueError(f"warmup_steps must be >= 0, got {self.warmup_steps}")
        if self.warmup_batch_size < 1:
            raise ValueError(f"warmup_batch_size must be >= 1, got {self.warmup_batch_size}")
        if not 0.0 <= self.warmup_error_rate < 1.0:
            raise ValueError(f"warmup_error_rate must be in [0, 1), got {self.warmup_error_rate}")
        if not self.warmup_lr > 0:
            raise ValueError(f"warmup_lr must be > 0, got {self.warmup_lr}")
        if self.eval_size < 1:
            raise ValueError(f"eval_size must be >= 1, got {self.eval_size}")
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"device must be 'cpu' or 'cuda', got {self.device!r}")


_DEFAULTS = [
    "model_engine=megatron",
    "algorithm.adv_estimator=grpo",
    "trainer.n_gpus_per_node=1",
    "trainer.total_training_steps=100",
    "trainer.test_freq=10",
    "trainer.save_freq=50",
    "data.train_batch_size=32",
    "data.max_response_length=4",
    "actor_rollout_ref.rollout.n=8",
    "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=256",
    "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=256",
    "actor_rollout_ref.actor.ppo_mini_batch_size=16",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=128",
    "actor_rollout_ref.actor.optim.lr=3e-4",
    "actor_rollout_ref.actor.optim.total_training_steps=100000",
    "actor_rollout_ref.actor.use_kl_loss=true",
    "actor_rollout_ref.actor.kl_loss_coef=0.01",
    "actor_rollout_ref.actor.calculate_entropy=true",
    "critic.ppo_micro_batch_size_per_gpu=64",
    "actor_rollout_ref.model.use_remove_padding=true",
]
"""The embedded run's verl settings (user overrides go on top)."""


# ---------------------------------------------------------------------------------------------- workers
class Workers(Protocol):
    """Where the engines live: this process (:class:`InProcessWorkers`) or Ray actors (:class:`RayWorkers`)."""

    def build(self, role: str, overrides: Sequence[str], hf_config: dict[str, Any] | None = None) -> None: ...

    def drop(self, role: str) -> None: ...

    def call(
        self, role: str, method: str, data: Any = None, *, loss: str | None = None, **kw: Any
    ) -> Any: ...

    def export_weights(self, role: str) -> Iterable[tuple[str, torch.Tensor]]: ...


class InProcessWorkers:
    """The engines in this process: a group of one, or one rank of a torchrun launch (every rank runs the
    loop; rollout, rewards and advantages are computed identically on each, only rank 0 writes files)."""

    def __init__(self, *, device: str) -> None:
        from verl_engine.apps.ray_workers import EngineWorker

        self.worker = EngineWorker()
        self.device = device

    def build(self, role: str, overrides: Sequence[str], hf_config: dict[str, Any] | None = None) -> None:
        self.worker.build(role=role, overrides=overrides, device=self.device, hf_config=hf_config)

    def drop(self, role: str) -> None:
        self.worker.drop(role)

    def call(self, role: str, method: str, data: Any = None, *, loss: str | None = None, **kw: Any) -> Any:
        return self.worker.call_local(role, method, data, loss=loss, **kw)

    def export_weights(self, role: str) -> Iterable[tuple[str, torch.Tensor]]:
        weights, _ = self.worker.engines[role].get_per_tensor_param()  # streamed, no second copy
        return weights


class RayWorkers:
    """The engines in the actors of a :class:`~verl_engine.apps.ray_workers.RayWorkerGroup`; the loop (rollout,
    reward, advantages) runs in the driver and sends each phase's whole batch to every rank."""

    def __init__(self, group: Any, *, device: str) -> None:
        self.group = group
        self.device = device

    def build(self, role: str, overrides: Sequence[str], hf_config: dict[str, Any] | None = None) -> None:
        self.group.build(roles=[role], overrides=overrides, device=self.device, hf_config=hf_config)

    def drop(self, role: str) -> None:
        self.group.run("drop", role)

    def call(self, role: str, method: str, data: Any = None, *, loss: str | None = None, **kw: Any) -> Any:
        return self.group.call(role, method, data, loss=loss, **kw)

    def export_weights(self, role: str) -> Iterable[tuple[str, torch.Tensor]]:
        return self.group.run("export_weights", role)[0]


# ---------------------------------------------------------------------------------------------- phases
class _Phases:
    """Seconds and (on GPU) memory of each phase of a step: peak allocated during it, allocated at its end."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.seconds: dict[str, float] = {}
        self.memory_gib: dict[str, dict[str, float]] = {}

    @contextlib.contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        yield
        if self.cuda:
            torch.cuda.synchronize()
            self.memory_gib[name] = {
                "peak": torch.cuda.max_memory_allocated() / 2**30,
                "end": torch.cuda.memory_allocated() / 2**30,
            }
        self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start


class _Colocation:
    """verl's offload keys applied between phases (the trainer's state off the GPU while the rollout runs,
    the rollout asleep while the trainer works)."""

    def __init__(self, workers: Workers, rollout: RolloutEngine, *, cfg: Any, use_ref: bool) -> None:
        m = cfg.actor_rollout_ref.actor.megatron
        self.workers, self.rollout = workers, rollout
        self.actor = {
            "params": bool(m.param_offload),
            "grads": bool(m.grad_offload),
            "optimizer": bool(m.optimizer_offload),
        }
        self.ref = use_ref and bool(cfg.actor_rollout_ref.ref.megatron.param_offload)
        self.rollout_sleeps = bool(cfg.actor_rollout_ref.rollout.free_cache_engine) and hasattr(
            rollout, "sleep"
        )
        self._actor_on = dict.fromkeys(self.actor, True)

    @property
    def enabled(self) -> bool:
        return any(self.actor.values()) or self.ref

    def actor_to(self, *, params: bool, grads: bool, optimizer: bool) -> None:
        """Bring the selected actor state on the device (True) or off it (False), as far as offload is set."""
        want = {"params": params, "grads": grads, "optimizer": optimizer}
        moves = {"onload": {}, "offload": {}}
        for key, on in want.items():
            if self.actor[key] and self._actor_on[key] != on:
                moves["onload" if on else "offload"][key] = True
                self._actor_on[key] = on
        for direction, selected in moves.items():
            if selected:
                sel = {k: selected.get(k, False) for k in self.actor}
                self.workers.call("actor", direction, **sel)

    def ref_offload(self, on_device: bool) -> None:
        if self.ref:
            self.workers.call("ref", "onload" if on_device else "offload", grads=False, optimizer=False)

    def rollout_awake(self, awake: bool) -> None:
        if self.rollout_sleeps:
            getattr(self.rollout, "wake_up" if awake else "sleep")()


# ---------------------------------------------------------------------------------------------- the run
def _init_process_group(device: str) -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        return
    if "RANK" not in os.environ:  # one process without torchrun: a group of one
        from verl_mcore_utils.testing import free_port

        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1")
        os.environ.setdefault("LOCAL_RANK", "0")
    if device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl" if device == "cuda" else "gloo")


def _is_rank0() -> bool:
    import torch.distributed as dist

    return not dist.is_initialized() or dist.get_rank() == 0


def _response_slice(full: torch.Tensor, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """Per-response-token values [B, R] from the engine's input-layout output [B, P + R]."""
    p, r = batch["prompts"].shape[1], batch["responses"].shape[1]
    mask = batch["response_mask"]  # the loop's tensors live on the host; the engine's outputs may not
    return full[:, p - 1 : p - 1 + r].to(mask.device) * mask


def _masked_mean(values: torch.Tensor, mask: torch.Tensor) -> float:
    return float((values * mask).sum() / mask.sum().clamp(min=1))


def _model_path(overrides: Sequence[str]) -> str | None:
    found = [o.split("=", 1)[1] for o in overrides if o.startswith("actor_rollout_ref.model.path=")]
    return found[-1] if found else None


_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def _tokens_of(path: str, hf: Mapping[str, Any]) -> Tokens:
    """The tokenizer of a model directory; a directory without one (the ``sft/`` of an embedded run) must have
    the embedded character vocabulary's size, and then uses it."""
    if any((Path(path) / name).is_file() for name in _TOKENIZER_FILES):
        from transformers import AutoTokenizer

        return HFTokens(AutoTokenizer.from_pretrained(path))
    chars = CharTokenizer()
    if int(hf.get("vocab_size", -1)) != chars.vocab_size:
        from verl_config import ConfigError

        raise ConfigError(
            f"actor_rollout_ref.model.path={path} has no tokenizer ({', '.join(_TOKENIZER_FILES)}) and its"
            f" vocab_size {hf.get('vocab_size')} is not the embedded character vocabulary's ({chars.vocab_size}):"
            " add the model's tokenizer files to the directory"
        )
    return chars


def run_grpo(
    run: GRPORun,
    *,
    rollout: RolloutEngine | None = None,
    workers: Workers | None = None,
    on_step: Callable[[dict[str, Any]], None] | None = None,
) -> dict[str, Any]:
    """The whole run (see the module docstring); returns the last step's metrics and the held-out accuracies.

    ``workers``: where the engines live (default: this process; :class:`RayWorkers` for Ray). ``rollout``: the
    generation engine (default: :class:`~verl_engine.apps.rollout.HFRollout` on ``run.device``). ``on_step`` sees
    every step's metrics record (tests use it).
    """
    from verl_config import ConfigError, load_config
    from verl_engine.build import load_hf_config

    out = Path(run.out_dir)
    overrides = [*_DEFAULTS, f"actor_rollout_ref.actor.megatron.seed={run.seed}", *run.overrides]
    user_path = _model_path(run.overrides)
    sft_dir = out / "sft"
    ckpt_root = out / "checkpoints"
    resuming = run.resume and (ckpt_root / "latest_checkpointed_iteration.txt").is_file()
    if run.resume and not resuming:
        raise FileNotFoundError(f"resume=True but {ckpt_root} has no checkpoint to resume from")
    if user_path is not None:
        hf = load_hf_config(user_path)
        tokens: Tokens = _tokens_of(user_path, hf)
    else:
        tokens = CharTokenizer()
        hf = tiny_arithmetic_hf_config(
            vocab_size=tokens.vocab_size, hidden_size=run.hidden_size, layers=run.layers
        )
    task = ArithmeticTask(
        seed=run.seed,
        operations=run.operations,
        max_operand=run.max_operand,
        eval_size=run.eval_size,
        tokenizer=tokens,
    )
    cfg = load_config(overrides=overrides)  # errors in the overrides surface before any process group
    if user_path is None and run.warmup_steps == 0 and not (resuming and (sft_dir / "config.json").is_file()):
        raise ConfigError(
            "warmup_steps=0 needs a model: give actor_rollout_ref.model.path=<Hugging Face directory>"
            " (e.g. the sft/ directory of an earlier run, which holds its tokenizer or uses the embedded one)"
        )
    if workers is None:
        _init_process_group(run.device)
        workers = InProcessWorkers(device=run.device)
    device = (
        torch.device("cuda", torch.cuda.current_device()) if run.device == "cuda" else torch.device("cpu")
    )
    start_path = user_path
    if resuming:  # the warm start (if the run had one) is already in sft/
        start_path = str(sft_dir) if (sft_dir / "config.json").is_file() else user_path
    elif run.warmup_steps > 0:
        warm = [*overrides, f"actor_rollout_ref.actor.optim.lr={run.warmup_lr}"]
        workers.build("actor", warm, hf_config=None if user_path else hf)
        _warm_start(workers, task, run=run)
        workers.call("actor", "save_hf", str(sft_dir))
        if isinstance(tokens, HFTokens) and _is_rank0():  # sft/ is a complete model directory
            tokens.tokenizer.save_pretrained(str(sft_dir))
        workers.drop("actor")
        start_path = str(sft_dir)
    model_overrides = [*overrides, f"actor_rollout_ref.model.path={start_path}"]
    cfg = load_config(overrides=model_overrides)
    workers.build("actor", model_overrides)
    arr, algo = cfg.actor_rollout_ref, cfg.algorithm
    use_ref = bool(arr.actor.use_kl_loss or algo.use_kl_in_reward)
    if use_ref:
        workers.build("ref", model_overrides)
    if rollout is None:
        # the rollout's dtype is actor_rollout_ref.rollout.dtype on GPU; on CPU (the debug mode) float32
        dtype = getattr(torch, str(arr.rollout.dtype)) if device.type == "cuda" else torch.float32
        rollout = HFRollout(
            hf_config=hf, eos_token_id=tokens.eos_id, pad_token_id=tokens.pad_id, device=device, dtype=dtype
        )
    start = 0
    if resuming:
        start = int(workers.call("actor", "load_checkpoint", str(ckpt_root))["global_step"])
    metrics_file = out / "metrics.jsonl"
    if _is_rank0():
        out.mkdir(parents=True, exist_ok=True)
        kept = []
        if resuming and metrics_file.is_file():  # drop steps after the checkpoint: they are run again
            kept = [
                line for line in metrics_file.read_text().splitlines() if json.loads(line)["step"] <= start
            ]
        metrics_file.write_text("".join(line + "\n" for line in kept))
    n, prompts_per_step = int(arr.rollout.n), int(cfg.data.train_batch_size)
    mini = int(arr.actor.ppo_mini_batch_size)
    total = int(cfg.trainer.total_training_steps)
    test_freq, save_freq = int(cfg.trainer.test_freq), int(cfg.trainer.save_freq)
    params = SamplingParams(
        max_new_tokens=int(cfg.data.max_response_length),
        n=n,
        temperature=float(arr.rollout.temperature),
        top_p=float(arr.rollout.top_p),
        top_k=max(0, int(arr.rollout.top_k)),
    )
    colo = _Colocation(workers, rollout, cfg=cfg, use_ref=use_ref)
    colo.actor_to(params=False, grads=False, optimizer=False)
    colo.ref_offload(on_device=False)
    history: dict[str, Any] = {"eval": {}}
    if start == 0:
        history["eval"][0] = _evaluate(workers, rollout, task, params, colo)
    bar = None
    if run.progress and _is_rank0():
        from tqdm import tqdm

        bar = tqdm(total=total, initial=start, desc="grpo", unit="step", dynamic_ncols=True)
    last: dict[str, Any] = {}
    for step in range(start, total):
        phase = _Phases(device)
        t0 = time.perf_counter()
        with phase("sync"):
            _sync_weights(workers, rollout, colo)
        with phase("generate"):
            problems = task.train_problems(step=step, count=prompts_per_step)
            prompts = [task.prompt_ids(p) for p, _ in problems]
            responses = rollout.generate(
                prompts, SamplingParams(**{**params.__dict__, "seed": run.seed * 100_003 + step})
            )
            colo.rollout_awake(False)
        answers = [a for _, a in problems for _ in range(n)]
        scores = torch.tensor([task.reward(r, a) for r, a in zip(responses, answers, strict=True)])
        batch: dict[str, Any] = rollout_batch(
            [p for p in prompts for _ in range(n)], responses, pad_token_id=tokens.pad_id
        )
        mask = batch["response_mask"].float()
        metrics: dict[str, Any] = {}
        with phase("old_log_prob"):
            colo.actor_to(params=True, grads=False, optimizer=False)
            # verl reports the policy's entropy from this pass (calculate_entropy), not from the update
            entropy_on = bool(arr.actor.calculate_entropy)
            actor_out = workers.call("actor", "infer_batch", {**batch, "calculate_entropy": entropy_on})
            old = _response_slice(actor_out["model_output"]["log_probs"].float(), batch)
            if entropy_on:
                entropy = _response_slice(actor_out["model_output"]["entropy"].float(), batch)
                metrics["entropy"] = _masked_mean(entropy, mask)
        if use_ref:
            with phase("ref_log_prob"):
                colo.ref_offload(on_device=True)
                ref_out = workers.call("ref", "infer_batch", batch)
                ref_lp = _response_slice(ref_out["model_output"]["log_probs"].float(), batch)
                colo.ref_offload(on_device=False)
            batch["ref_log_prob"] = ref_lp
            kl = _kl(old, ref_lp, arr.actor.kl_loss_type)
            metrics["kl"] = _masked_mean(kl, mask)
        outcome = scores
        if algo.use_kl_in_reward:
            outcome = _kl_penalised_outcome(scores, old, batch["ref_log_prob"], mask, algo)
        group = [i // n for i in range(len(responses))]
        advantage = grpo_outcome_advantage(
            outcome, group_ids=group, norm_adv_by_std_in_grpo=bool(algo.norm_adv_by_std_in_grpo)
        )
        batch.update(old_log_probs=old, advantages=advantage[:, None] * mask)
        train_metrics: dict[str, list[float]] = {}
        with phase("train"):
            colo.actor_to(params=True, grads=True, optimizer=True)
            for _ in range(int(arr.actor.ppo_epochs)):
                for lo in range(0, len(responses), mini * n):
                    part = {k: v[lo : lo + mini * n] for k, v in batch.items()}
                    result = workers.call("actor", "train_batch", part, loss="ppo")
                    for key, value in {**result["metrics"], "loss": result["loss"]}.items():
                        train_metrics.setdefault(key, []).append(float(value))
            lr = workers.call("actor", "lr_scheduler_step")
            colo.actor_to(params=False, grads=False, optimizer=False)
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
            offload=colo.enabled,
            **{k: sum(v) / len(v) for k, v in train_metrics.items()},
        )
        if test_freq > 0 and ((step + 1) % test_freq == 0 or step + 1 == total):
            metrics["eval_accuracy"] = history["eval"][step + 1] = _evaluate(
                workers, rollout, task, params, colo
            )
        if _is_rank0():
            with metrics_file.open("a") as f:
                f.write(json.dumps(metrics, sort_keys=True) + "\n")
        if save_freq > 0 and ((step + 1) % save_freq == 0 or step + 1 == total):
            colo.actor_to(params=True, grads=True, optimizer=True)
            workers.call(
                "actor",
                "save_checkpoint",
                str(ckpt_root),
                global_step=step + 1,
                data_position={"step": step + 1},
            )
            colo.actor_to(params=False, grads=False, optimizer=False)
        if on_step is not None:
            on_step(metrics)
        if bar is not None:
            shown = {"reward": f"{metrics['reward_mean']:.2f}", "kl": f"{metrics.get('kl', 0.0):.4f}"}
            if history["eval"]:
                shown["held_out"] = f"{history['eval'][max(history['eval'])]:.2f}"
            bar.set_postfix(shown)
            bar.update(1)
        last = metrics
    if bar is not None:
        bar.close()
    if run.plot and _is_rank0():
        from verl_engine.apps.grpo_plot import plot_grpo_metrics

        plot_grpo_metrics(metrics_file, out / "grpo.png", eval_at_start=history["eval"].get(0))
    return {"last": last, "eval": history["eval"], "start": start}


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


def _warm_start(workers: Workers, task: ArithmeticTask, *, run: GRPORun) -> None:
    """``run.warmup_steps`` supervised steps on prompt -> demonstrated answer + EOS (response tokens only)."""
    for step in range(run.warmup_steps):
        problems = task.demonstrations(
            step=step, count=run.warmup_batch_size, error_rate=run.warmup_error_rate
        )
        batch = rollout_batch(
            [task.prompt_ids(p) for p, _ in problems],
            [task.answer_ids(a) for _, a in problems],
            pad_token_id=task.tokenizer.pad_id,
        )
        workers.call("actor", "train_batch", batch, loss="sft")


def _sync_weights(workers: Workers, rollout: RolloutEngine, colo: _Colocation) -> None:
    """The actor's weights into the rollout engine (its parameters on the device only for the export; the
    rollout awake from here until the caller's generation is done)."""
    colo.actor_to(params=True, grads=False, optimizer=False)
    colo.rollout_awake(True)
    rollout.update_weights(workers.export_weights("actor"))
    colo.actor_to(params=False, grads=False, optimizer=False)


def _evaluate(
    workers: Workers, rollout: RolloutEngine, task: ArithmeticTask, params: SamplingParams, colo: _Colocation
) -> float:
    """Greedy exact-match accuracy on the held-out prompts (weights synced first)."""
    _sync_weights(workers, rollout, colo)
    prompts = [task.prompt_ids(p) for p, _ in task.eval_set]
    greedy = SamplingParams(max_new_tokens=params.max_new_tokens, n=1, temperature=0.0)
    responses = rollout.generate(prompts, greedy)
    colo.rollout_awake(False)
    return sum(task.reward(r, a) for r, (_, a) in zip(responses, task.eval_set, strict=True)) / len(prompts)
