"""Learning-rate schedules of verl's two optimizer configs (FSDP and Megatron keys), as one small stateful object.

Why not the libraries' schedulers: the engine wants one object for either config that it can query (``lr_at``), step
and checkpoint without a megatron optimizer. Values reproduce verl's FSDP schedules and megatron-core's
``OptimizerParamScheduler``; the formulas and the step convention: the package README.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

import torch

__all__ = ["FSDP_LR_SCHEDULER_TYPES", "MEGATRON_LR_DECAY_STYLES", "LRSchedule", "lr_schedule_from_config"]

FSDP_LR_SCHEDULER_TYPES: tuple[str, ...] = ("constant", "cosine")
"""``lr_scheduler_type`` values of the FSDP optimizer config."""

MEGATRON_LR_DECAY_STYLES: tuple[str, ...] = ("constant", "linear", "cosine")
"""``lr_decay_style`` values implemented here (megatron-core also has inverse-square-root and WSD)."""

_MEGATRON_NOT_IMPLEMENTED: tuple[str, ...] = ("inverse-square-root", "WSD")


@dataclass
class LRSchedule:
    """Warm-up + decay schedule of one optimizer; ``num_steps`` is its only state.

    ``flavor`` is ``"fsdp"`` or ``"megatron"`` (which library's formula); ``decay_steps`` is the FSDP
    ``num_training_steps`` or megatron's ``lr_decay_steps`` (None only for a constant schedule).
    """

    flavor: str
    decay_style: str
    lr: float
    warmup_steps: int = 0
    decay_steps: int | None = None
    min_lr: float = 0.0
    min_lr_ratio: float = 0.0
    warmup_init_lr: float = 0.0
    num_cycles: float = 0.5
    zero_indexed_step: bool = True
    num_steps: int = 0

    def __post_init__(self) -> None:
        """Refuse a schedule the library would assert on, with the config key in the message."""
        if self.flavor not in ("fsdp", "megatron"):
            raise ValueError(f"LRSchedule.flavor must be 'fsdp' or 'megatron'; got {self.flavor!r}")
        styles = FSDP_LR_SCHEDULER_TYPES if self.flavor == "fsdp" else MEGATRON_LR_DECAY_STYLES
        if self.decay_style not in styles:
            raise ValueError(
                f"{self.flavor} lr schedule {self.decay_style!r} is not one of {', '.join(styles)}"
            )
        if self.warmup_steps < 0:
            raise ValueError(f"lr_warmup_steps must be >= 0 once resolved; got {self.warmup_steps}")
        if self.decay_style != "constant" and self.decay_steps is None:
            raise ValueError(
                f"a {self.decay_style} lr schedule needs the number of training steps: set "
                "optim.total_training_steps (> 0) or pass total_training_steps="
            )
        if self.flavor == "megatron":
            self._check_megatron()
        elif not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ValueError(f"min_lr_ratio must be in [0, 1]; got {self.min_lr_ratio}")

    def _check_megatron(self) -> None:
        """megatron-core's OptimizerParamScheduler asserts these; fail earlier and name the key."""
        if self.min_lr < 0 or self.min_lr > self.lr:
            raise ValueError(f"min_lr must be in [0, lr={self.lr}]; got {self.min_lr}")
        if self.warmup_init_lr > self.lr:
            raise ValueError(f"lr_warmup_init ({self.warmup_init_lr}) must not exceed lr ({self.lr})")
        if self.decay_steps is not None and not 0 <= self.warmup_steps < self.decay_steps:
            raise ValueError(
                f"lr_warmup_steps ({self.warmup_steps}) must be below lr_decay_steps ({self.decay_steps}); "
                "lr_decay_steps defaults to total_training_steps"
            )

    def lr_at(self, step: int) -> float:
        """Learning rate after ``step`` scheduler steps (the lr of the ``step``-th optimizer step, 0-based)."""
        if step < 0:
            raise ValueError(f"step must be >= 0; got {step}")
        if self.flavor == "fsdp":
            return self.lr * self._fsdp_factor(step)
        return self._megatron_lr(step)

    def _fsdp_factor(self, step: int) -> float:
        """verl's LambdaLR factor (constant or cosine with warm-up from 0)."""
        if self.decay_style == "cosine" and not self.zero_indexed_step:
            step += 1
        if step < self.warmup_steps:
            return float(step) / float(max(1, self.warmup_steps))
        if self.decay_style == "constant":
            return 1.0
        assert self.decay_steps is not None  # checked in __post_init__
        progress = float(step - self.warmup_steps) / float(max(1, self.decay_steps - self.warmup_steps))
        m = self.min_lr_ratio
        cosine = math.cos(math.pi * float(self.num_cycles) * 2.0 * progress)
        return max(m, cosine * (1.0 - m) * 0.5 + (1.0 + m) * 0.5)

    def _megatron_lr(self, step: int) -> float:
        """megatron-core's OptimizerParamScheduler.get_lr for constant / linear / cosine."""
        if self.warmup_steps > 0 and step <= self.warmup_steps:
            return self.warmup_init_lr + (self.lr - self.warmup_init_lr) * float(step) / float(
                self.warmup_steps
            )
        if self.decay_style == "constant":
            return self.lr
        assert self.decay_steps is not None  # checked in __post_init__
        if step > self.decay_steps:
            return self.min_lr
        decay_ratio = float(step - self.warmup_steps) / float(self.decay_steps - self.warmup_steps)
        if self.decay_style == "linear":
            coeff = 1.0 - decay_ratio
        else:
            coeff = 0.5 * (math.cos(math.pi * decay_ratio) + 1.0)
        return self.min_lr + coeff * (self.lr - self.min_lr)

    def apply(self, optimizer: torch.optim.Optimizer) -> float:
        """Write the current lr into every param group (times its ``lr_mult``); return the base lr."""
        lr = self.lr_at(self.num_steps)
        for group in optimizer.param_groups:
            value = lr * group.get("lr_mult", 1.0)
            if isinstance(group.get("lr"), torch.Tensor):
                group["lr"].fill_(value)  # capturable / fused optimizers keep lr as a tensor
            else:
                group["lr"] = value
        return lr

    def step(self, optimizer: torch.optim.Optimizer) -> float:
        """Advance one step (call after each optimizer step), set the new lr on ``optimizer``, return it."""
        self.num_steps += 1
        return self.apply(optimizer)

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume (``num_steps``) plus the schedule's settings for inspection."""
        return asdict(self)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Resume at the saved step; the settings of *this* schedule win (megatron's override mode, verl's default).

        Call :meth:`apply` afterwards to put the resumed lr into the optimizer.
        """
        num_steps = int(state_dict["num_steps"])
        if num_steps < 0:
            raise ValueError(f"state_dict['num_steps'] must be >= 0; got {num_steps}")
        self.num_steps = num_steps


def _total_steps(optim: Any, total_training_steps: int | None) -> int | None:
    """optim.total_training_steps when > 0 (verl injects it at runtime), else the argument; None if neither."""
    configured = getattr(optim, "total_training_steps", None)
    if configured is not None and configured > 0:
        return int(configured)
    if total_training_steps is not None and total_training_steps > 0:
        return int(total_training_steps)
    return None


def _warmup_steps(optim: Any, *, basis: int | None, basis_key: str) -> int:
    """verl's rule: lr_warmup_steps when > 0, else int(lr_warmup_steps_ratio * basis)."""
    explicit = getattr(optim, "lr_warmup_steps", None)
    if explicit is not None and explicit > 0:
        return int(explicit)
    ratio = float(getattr(optim, "lr_warmup_steps_ratio", 0.0) or 0.0)
    if ratio == 0.0:
        return 0
    if basis is None:
        raise ValueError(
            f"lr_warmup_steps_ratio={ratio} needs {basis_key}: set optim.total_training_steps (> 0) or pass "
            "total_training_steps=, or give lr_warmup_steps (> 0) instead"
        )
    return int(ratio * basis)


def _fsdp_schedule(optim: Any, total: int | None) -> LRSchedule:
    """The FSDP engine's schedule (``warmup_style`` is verl's deprecated spelling and wins when set)."""
    style = (
        optim.warmup_style if getattr(optim, "warmup_style", None) is not None else optim.lr_scheduler_type
    )
    if style not in FSDP_LR_SCHEDULER_TYPES:
        raise ValueError(f"lr_scheduler_type {style!r} is not one of {', '.join(FSDP_LR_SCHEDULER_TYPES)}")
    min_lr_ratio = getattr(optim, "min_lr_ratio", None)
    return LRSchedule(
        flavor="fsdp",
        decay_style=style,
        lr=float(optim.lr),
        warmup_steps=_warmup_steps(optim, basis=total, basis_key="total_training_steps"),
        decay_steps=total,
        min_lr_ratio=0.0 if min_lr_ratio is None else float(min_lr_ratio),
        num_cycles=float(getattr(optim, "num_cycles", 0.5)),
        zero_indexed_step=bool(getattr(optim, "zero_indexed_step", True)),
    )


def _megatron_schedule(optim: Any, total: int | None) -> LRSchedule:
    """The Megatron engine's schedule (verl's get_megatron_optimizer_param_scheduler arguments)."""
    style = optim.lr_decay_style
    if style in _MEGATRON_NOT_IMPLEMENTED:
        raise NotImplementedError(
            f"lr_decay_style={style!r} is not implemented by verl_engine.lr_schedule (only "
            f"{', '.join(MEGATRON_LR_DECAY_STYLES)}); use megatron-core's OptimizerParamScheduler for it"
        )
    if style not in MEGATRON_LR_DECAY_STYLES:
        raise ValueError(f"lr_decay_style {style!r} is not one of {', '.join(MEGATRON_LR_DECAY_STYLES)}")
    decay_steps = getattr(optim, "lr_decay_steps", None)
    decay_steps = total if decay_steps is None else int(decay_steps)
    return LRSchedule(
        flavor="megatron",
        decay_style=style,
        lr=float(optim.lr),
        warmup_steps=_warmup_steps(
            optim, basis=decay_steps, basis_key="lr_decay_steps or total_training_steps"
        ),
        decay_steps=decay_steps,
        min_lr=float(getattr(optim, "min_lr", 0.0)),
        warmup_init_lr=float(getattr(optim, "lr_warmup_init", 0.0)),
    )


def lr_schedule_from_config(optim: Any, *, total_training_steps: int | None = None) -> LRSchedule:
    """The schedule of a verl_config ``FSDPOptimConfig`` or ``McoreOptimConfig`` (or an object with their keys).

    ``total_training_steps`` is used when ``optim.total_training_steps`` is not set (> 0): verl fills that
    key at runtime from the data set size, which the config file does not know.
    """
    total = _total_steps(optim, total_training_steps)
    if hasattr(optim, "lr_decay_style"):
        return _megatron_schedule(optim, total)
    if hasattr(optim, "lr_scheduler_type") or hasattr(optim, "warmup_style"):
        return _fsdp_schedule(optim, total)
    raise ValueError(
        f"{type(optim).__name__} is not an optimizer config: it has neither lr_decay_style (megatron) nor "
        "lr_scheduler_type (fsdp)"
    )
