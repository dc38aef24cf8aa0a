"""The two ways the engine runs micro-batches and steps the optimizer.

* :class:`MegatronBackend` (CUDA): megatron-core's DDP (or Megatron-FSDP) gradient buffers, its optimizer
  (distributed or not) and its forward-backward schedule.
* :class:`DebugBackend` (CPU): plain autograd per micro-batch, gradients averaged over the DP x CP pool with
  all-reduces, ``torch.optim.AdamW``, fp32. megatron-core's DDP buffers, optimizers and schedules hard-code
  CUDA; this runs the same model code on gloo so that the engine is tested without a GPU.

Both see the loss exactly as the loss function returned it (verl's convention: global normalisation with
``dp_size`` inside, see :mod:`verl_engine.losses`): megatron's schedule divides by the number of
micro-batches and its DDP averages over the pool, so the megatron backend multiplies by the former; the
debug backend sums and averages over the pool itself.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["DebugBackend", "MegatronBackend", "debug_adamw"]

Step = Callable[[Any, torch.nn.Module], "torch.Tensor | None"]


def debug_adamw(
    model: torch.nn.Module, *, lr: float, weight_decay: float, betas: Sequence[float], eps: float
) -> torch.optim.AdamW:
    """The debug backend's optimizer: ``torch.optim.AdamW`` over the trainable parameters.

    megatron-core's grouping: no weight decay on biases and 1-D parameters (norm weights).
    """
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if p.requires_grad:
            (no_decay if name.endswith(".bias") or p.ndim == 1 else decay).append(p)
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=lr,
        betas=(betas[0], betas[1]),
        eps=eps,
    )


class DebugBackend:
    """CPU backend: autograd per micro-batch, SUM all-reduce / pool size, torch AdamW with clipping."""

    name = "debug (CPU, gloo, no DDP, torch AdamW, fp32)"

    def __init__(self, *, clip_grad: float, pool_group: Any, pool_size: int) -> None:
        self.clip_grad = clip_grad
        self.pool_group = pool_group
        self.pool_size = pool_size

    def run(self, engine: Any, micro: Sequence[Any], step: Step, *, forward_only: bool) -> None:
        for mb in micro:
            if forward_only:
                with torch.no_grad():
                    step(mb, engine.model)
                continue
            loss = step(mb, engine.model)
            if loss is not None:
                loss.backward()
        if not forward_only:
            self._average_gradients(engine.model)

    def _average_gradients(self, model: torch.nn.Module) -> None:
        if self.pool_size == 1:
            return
        for p in model.parameters():
            if not p.requires_grad:
                continue
            if p.grad is None:  # every rank must join every all-reduce
                p.grad = torch.zeros_like(p)
            dist.all_reduce(p.grad, group=self.pool_group)
            p.grad /= self.pool_size

    def zero_grad(self, engine: Any) -> None:
        engine.optimizer.zero_grad(set_to_none=True)

    @staticmethod
    def gradient(param: torch.nn.Parameter) -> torch.Tensor | None:
        """The reduced gradient of ``param`` (after :meth:`run`)."""
        return param.grad

    def describe(self, model: torch.nn.Module) -> str:
        return self.name

    def step(self, engine: Any) -> float:
        params = [p for p in engine.model.parameters() if p.requires_grad]
        max_norm = self.clip_grad if self.clip_grad > 0 else float("inf")
        norm = float(torch.nn.utils.clip_grad_norm_(params, max_norm))
        engine.optimizer.step()
        return norm


class MegatronBackend:
    """CUDA backend: megatron-core's forward-backward schedule, DDP buffers and optimizer."""

    name = "megatron (DDP + megatron optimizer)"

    def run(self, engine: Any, micro: Sequence[Any], step: Step, *, forward_only: bool) -> None:
        from megatron.core.pipeline_parallel import get_forward_backward_func

        n = len(micro)

        def loss_func(output: torch.Tensor) -> tuple[torch.Tensor, dict[str, Any]]:
            return output * n, {}  # undo the schedule's 1 / num_microbatches

        def forward_step(data_iterator: Any, model: torch.nn.Module) -> tuple[torch.Tensor, Any]:
            loss = step(next(data_iterator), model)
            if loss is None:
                loss = torch.zeros((), device=engine.device)
            return loss, loss_func

        # Without pipeline stages the schedule never sends activations, so the shapes it is given are
        # unused (verl passes 1 / 1 too): variable sequence lengths need no padding to a common length.
        get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=iter(micro),
            model=[engine.model],
            num_microbatches=n,
            seq_length=1,
            micro_batch_size=1,
            forward_only=forward_only,
        )

    @staticmethod
    def gradient(param: torch.nn.Parameter) -> torch.Tensor | None:
        """The reduced gradient of ``param``: megatron-core's DDP keeps it in ``main_grad``."""
        return getattr(param, "main_grad", None)

    def describe(self, model: torch.nn.Module) -> str:
        ddp_config = getattr(model, "ddp_config", None)
        if getattr(ddp_config, "use_megatron_fsdp", False):
            return (
                f"megatron (Megatron-FSDP {ddp_config.data_parallel_sharding_strategy} + megatron optimizer)"
            )
        return self.name

    def zero_grad(self, engine: Any) -> None:
        zero = getattr(engine.model, "zero_grad_buffer", None)
        if zero is not None:
            zero()
        engine.optimizer.zero_grad()

    def step(self, engine: Any) -> float:
        _, grad_norm, _ = engine.optimizer.step()
        return float(grad_norm) if grad_norm is not None else float("nan")
