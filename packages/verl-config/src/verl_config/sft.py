"""Typed schema of ``verl-engine train``: an SFT run on the Megatron engine (small, self-contained).

Key names follow verl's trainer config (``megatron.tensor_model_parallel_size``,
``megatron.override_ddp_config``, ``optim.lr``, ``data.train_batch_size`` ...) so that users keep
their command lines; the ``megatron`` section IS verl-config's :class:`McoreEngineConfig` (one schema
per concept: the same keys, defaults, rules and converters as ``actor_rollout_ref.actor.megatron``). Every dataclass validates itself in ``__post_init__`` and raises
ConfigValueError naming the key, like megatron-core's TransformerConfig does.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from verl_config.engines import McoreEngineConfig, megatron_optimizer_kwargs
from verl_config.errors import ConfigValueError
from verl_config.validation import check_choice, check_positive, check_positive_keys

__all__ = [
    "MODEL_PRESETS",
    "SFTConfig",
    "SFTDataConfig",
    "SFTModelConfig",
    "SFTOptimConfig",
    "SFTTrainerConfig",
]

MODEL_PRESETS = ("tiny", "small", "base", "1b")


@dataclass
class SFTModelConfig:
    """Which model to build.

    ``preset`` names a locally built Qwen2-architecture config (no download); ``path`` would point at
    a Hugging Face checkpoint directory instead. ``override_config`` is merged into the Hugging Face
    config before the megatron-core model is made (e.g. ``num_hidden_layers``). ``use_fused_kernels``
    (verl's key) computes the loss from the last hidden states chunk by chunk, so the ``[tokens, vocab]``
    logits are never built (verl_engine.fused_head).
    """

    preset: str = "small"
    path: str | None = None
    override_config: dict[str, Any] = field(default_factory=dict)
    use_fused_kernels: bool = False

    def __post_init__(self) -> None:
        if self.path is None:
            check_choice("preset", self.preset, MODEL_PRESETS)


@dataclass
class SFTOptimConfig:
    """Optimizer (Adam with decoupled weight decay) and learning-rate schedule."""

    lr: float = 1e-3
    min_lr: float = 0.0
    weight_decay: float = 0.01
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    eps: float = 1e-8
    clip_grad: float = 1.0
    lr_warmup_steps: int = 10
    lr_decay_style: str = "cosine"

    def __post_init__(self) -> None:
        check_positive("lr", self.lr)
        check_positive("min_lr", self.min_lr, allow_zero=True)
        if self.min_lr > self.lr:
            raise ConfigValueError("min_lr", f"must not exceed lr ({self.lr}); got {self.min_lr}")
        check_positive("weight_decay", self.weight_decay, allow_zero=True)
        if len(self.betas) != 2 or not all(0.0 <= b < 1.0 for b in self.betas):
            raise ConfigValueError("betas", f"must be two numbers in [0, 1); got {list(self.betas)}")
        check_positive("eps", self.eps)
        check_positive("clip_grad", self.clip_grad, allow_zero=True)
        check_positive("lr_warmup_steps", self.lr_warmup_steps, allow_zero=True)
        check_choice("lr_decay_style", self.lr_decay_style, ("constant", "cosine", "linear"))

    def optimizer_config_kwargs(self, *, dtype: str, use_distributed_optimizer: bool) -> dict[str, Any]:
        """Keyword arguments for megatron-core's ``OptimizerConfig`` (Adam; the engine sets the lr per step)."""
        return megatron_optimizer_kwargs(
            self, dtype=dtype, use_distributed_optimizer=use_distributed_optimizer
        )


@dataclass
class SFTDataConfig:
    """Batch shape. ``train_batch_size`` is global (sequences per optimizer step, all DP ranks)."""

    train_batch_size: int = 32
    micro_batch_size_per_gpu: int = 8
    max_length: int = 128
    seed: int = 1234

    def __post_init__(self) -> None:
        check_positive_keys(self, "train_batch_size", "micro_batch_size_per_gpu", "max_length")
        if self.max_length < 16:
            raise ConfigValueError("max_length", f"must be >= 16 to hold one problem; got {self.max_length}")


@dataclass
class SFTTrainerConfig:
    """Run control."""

    total_training_steps: int = 60
    device: str = "auto"
    default_local_dir: str = "outputs/verl-engine"
    log_every: int = 1
    progress_bar: bool = True

    def __post_init__(self) -> None:
        check_positive("total_training_steps", self.total_training_steps)
        check_choice("device", self.device, ("auto", "cpu", "cuda"))
        check_positive("log_every", self.log_every)


@dataclass
class SFTConfig:
    """Entry config of ``verl-engine train``: an SFT run on the Megatron engine."""

    model: SFTModelConfig = field(default_factory=SFTModelConfig)
    megatron: McoreEngineConfig = field(default_factory=McoreEngineConfig)
    optim: SFTOptimConfig = field(default_factory=SFTOptimConfig)
    data: SFTDataConfig = field(default_factory=SFTDataConfig)
    trainer: SFTTrainerConfig = field(default_factory=SFTTrainerConfig)

    def __post_init__(self) -> None:
        warmup, steps = self.optim.lr_warmup_steps, self.trainer.total_training_steps
        if warmup > 0 and warmup >= steps:
            raise ConfigValueError(
                "optim.lr_warmup_steps",
                f"is {warmup} but trainer.total_training_steps is {steps}; the warm-up must end before the last"
                f" step (megatron-core's schedule): give optim.lr_warmup_steps < {steps}, e.g. optim.lr_warmup_steps=0",
            )

    def check_world_size(self, world_size: int) -> int:
        """Validate the batch and parallel layout for ``world_size`` processes; return the DP size."""
        from verl_config.validation import check_parallel_layout

        m = self.megatron
        dp = check_parallel_layout(
            world_size=world_size,
            tensor_model_parallel_size=m.tensor_model_parallel_size,
            pipeline_model_parallel_size=m.pipeline_model_parallel_size,
            context_parallel_size=m.context_parallel_size,
        )
        per_step = self.data.micro_batch_size_per_gpu * dp
        if self.data.train_batch_size % per_step != 0:
            raise ConfigValueError(
                "data.train_batch_size",
                f"{self.data.train_batch_size} is not divisible by data.micro_batch_size_per_gpu"
                f" ({self.data.micro_batch_size_per_gpu}) x data-parallel size ({dp}) = {per_step}",
            )
        return dp
