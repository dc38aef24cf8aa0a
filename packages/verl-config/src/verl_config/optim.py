"""The optimizer sections of both engines (``optim``): verl's keys and defaults, validated, and the keyword
arguments of megatron-core's OptimizerConfig (:func:`megatron_optimizer_kwargs`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from verl_config.errors import ConfigValueError
from verl_config.notes import adjusting, note
from verl_config.validation import check_choice, check_positive, check_unit_interval

__all__ = ["FSDPOptimConfig", "McoreOptimConfig", "megatron_optimizer_kwargs"]

# dtypes megatron-core's precision-aware optimizer keeps its state in (verl's accepted spellings)
_OPTIM_STATE_DTYPES = ("fp32", "float32", "32", "bf16", "bfloat16")


def _check_optim_common(cfg: Any) -> None:
    """Rules shared by both optimizers. verl accepts lr = 0 and any betas: those are warnings here."""
    check_positive("lr", cfg.lr, allow_zero=True)
    if cfg.lr == 0 and adjusting():
        note("lr", "is 0: the optimizer will not change the weights")
    check_positive("weight_decay", cfg.weight_decay, allow_zero=True)
    check_positive("clip_grad", cfg.clip_grad)
    if len(cfg.betas) != 2:
        raise ConfigValueError("betas", f"must be two numbers (beta1, beta2); got {list(cfg.betas)}")
    if not all(0.0 <= b < 1.0 for b in cfg.betas) and adjusting():
        note("betas", f"{list(cfg.betas)} are outside [0, 1): Adam's moment estimates will not converge")
    check_unit_interval("lr_warmup_steps_ratio", cfg.lr_warmup_steps_ratio)
    if cfg.lr_warmup_steps is not None and cfg.lr_warmup_steps < -1:
        raise ConfigValueError(
            "lr_warmup_steps", f"must be -1 (use lr_warmup_steps_ratio) or >= 0; got {cfg.lr_warmup_steps}"
        )


@dataclass
class FSDPOptimConfig:
    """A torch optimizer + warm-up / cosine schedule of the FSDP engine (verl's keys and defaults).

    ``optimizer`` names a class of the module ``optimizer_impl`` (``AdamW`` of ``torch.optim`` by
    default); ``override_optimizer_config`` holds extra keyword arguments for it. ``warmup_style``
    is verl's deprecated spelling of ``lr_scheduler_type`` (null = not given; moved there with a
    warning when the config is loaded).
    """

    optimizer: str = "AdamW"
    optimizer_impl: str = "torch.optim"
    lr: float = 1e-6
    lr_warmup_steps: int | None = -1
    lr_warmup_steps_ratio: float = 0.0
    min_lr_ratio: float | None = 0.0
    num_cycles: float = 0.5
    lr_scheduler_type: str = "constant"
    warmup_style: str | None = None
    weight_decay: float = 0.01
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    clip_grad: float = 1.0
    total_training_steps: int = -1
    override_optimizer_config: dict[str, Any] | None = None
    zero_indexed_step: bool = True

    def __post_init__(self) -> None:
        _check_optim_common(self)
        check_choice("lr_scheduler_type", self.lr_scheduler_type, ("constant", "cosine"))
        if self.warmup_style is not None:
            check_choice("warmup_style", self.warmup_style, ("constant", "cosine"))
        if self.min_lr_ratio is not None:
            check_unit_interval("min_lr_ratio", self.min_lr_ratio)


@dataclass
class McoreOptimConfig:
    """megatron-core optimizer + OptimizerParamScheduler settings (verl's megatron keys and defaults)."""

    optimizer: str = "adam"
    lr: float = 1e-6
    lr_warmup_steps: int | None = -1
    lr_warmup_steps_ratio: float = 0.0
    lr_warmup_init: float = 0.0
    lr_decay_steps: int | None = None
    lr_decay_style: str = "constant"
    min_lr: float = 0.0
    weight_decay: float = 0.01
    weight_decay_incr_style: str = "constant"
    lr_wsd_decay_style: str = "exponential"
    lr_wsd_decay_steps: int | None = None
    use_checkpoint_opt_param_scheduler: bool = False
    clip_grad: float = 1.0
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    total_training_steps: int = -1
    # precision-aware optimizer: dtypes of the main grads and of Adam's two moments
    use_precision_aware_optimizer: bool = False
    main_grads_dtype: str = "fp32"
    exp_avg_dtype: str = "fp32"
    exp_avg_sq_dtype: str = "fp32"
    # Muon (optimizer=muon, through megatron-core's emerging optimizers); ignored by adam / sgd
    use_layer_wise_distributed_optimizer: bool = False
    use_layer_wise_param_layout: bool | None = None
    muon_momentum: float = 0.95
    muon_nesterov: bool = False
    muon_split_qkv: bool = True
    muon_scale_mode: str = "spectral"
    muon_coefficient_type: str = "quintic"
    muon_num_ns_steps: int = 5
    muon_tp_mode: str = "blockwise"
    muon_fp32_matmul_prec: str = "medium"
    muon_extra_scale_factor: float = 1.0
    muon_scalar_optimizer: str = "adam"
    muon_match_adamw_update_rms: bool = False
    override_optimizer_config: dict[str, Any] | None = field(default_factory=dict)

    def __post_init__(self) -> None:
        _check_optim_common(self)
        for key in ("main_grads_dtype", "exp_avg_dtype", "exp_avg_sq_dtype"):
            check_choice(key, str(getattr(self, key)), _OPTIM_STATE_DTYPES)
        check_positive("muon_num_ns_steps", self.muon_num_ns_steps)
        if self.optimizer not in ("adam", "sgd", "muon") and adjusting():
            note(
                "optimizer",
                f"{self.optimizer!r} is not one of megatron-core's ('adam', 'sgd', 'muon' through its emerging"
                " optimizers); newer releases may provide it",
            )
        check_choice(
            "lr_decay_style",
            self.lr_decay_style,
            ("constant", "linear", "cosine", "inverse-square-root", "WSD"),
        )
        check_choice(
            "weight_decay_incr_style", self.weight_decay_incr_style, ("constant", "linear", "cosine")
        )
        check_positive("min_lr", self.min_lr, allow_zero=True)
        if self.min_lr > self.lr and adjusting():
            note(
                "min_lr", f"({self.min_lr}) exceeds lr ({self.lr}): the schedule will raise the learning rate"
            )

    def optimizer_config_kwargs(self, *, dtype: str, use_distributed_optimizer: bool) -> dict[str, Any]:
        """Keyword arguments for megatron-core's ``OptimizerConfig`` (override_optimizer_config last)."""
        kwargs = megatron_optimizer_kwargs(
            self, dtype=dtype, use_distributed_optimizer=use_distributed_optimizer
        )
        kwargs.update(self.override_optimizer_config or {})
        return kwargs


def megatron_optimizer_kwargs(optim: Any, *, dtype: str, use_distributed_optimizer: bool) -> dict[str, Any]:
    """megatron-core ``OptimizerConfig`` keywords from any optimizer section with verl's key names.

    Reads ``optimizer`` (default adam), ``lr``, ``min_lr``, ``weight_decay``, ``betas``, ``clip_grad`` and,
    when the section has it, ``eps``. ``params_dtype`` is the dtype's name: this package has no torch, so
    the caller turns it into a ``torch.dtype``.
    """
    kwargs: dict[str, Any] = {
        "optimizer": getattr(optim, "optimizer", "adam"),
        "lr": optim.lr,
        "min_lr": optim.min_lr,
        "weight_decay": optim.weight_decay,
        "adam_beta1": optim.betas[0],
        "adam_beta2": optim.betas[1],
        "clip_grad": optim.clip_grad,
        "bf16": dtype == "bfloat16",
        "fp16": dtype == "float16",
        "params_dtype": dtype,
        "use_distributed_optimizer": use_distributed_optimizer,
    }
    if getattr(optim, "eps", None) is not None:
        kwargs["adam_eps"] = optim.eps
    return kwargs
