"""The training engine: one model, its optimizer and ``train_step`` over micro-batches.

Two backends run the same megatron-core GPTModel code:

* ``megatron`` (CUDA): Float16Module + megatron-core DistributedDataParallel (config from
  verl_mcore_utils.build_ddp_config), megatron-core's optimizer (distributed or not) and its
  forward-backward schedule.
* ``debug`` (CPU only, clearly labelled): gloo process group, no DDP wrapper, torch.optim.AdamW,
  float32; gradients are summed over DP with plain all-reduces. megatron-core's DDP buffers,
  optimizers and schedules hard-code CUDA, so this is how the model code is exercised without a GPU.

Both compute the same objective (verl_engine.loss), so a debug run on N gloo processes and a
single-process run give the same gradients.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
import torch.distributed as dist

from verl_config import SFTConfig
from verl_engine.data import Batch
from verl_engine.loss import masked_loss_sum, megatron_loss_scale
from verl_mcore_utils.compat import import_megatron_core
from verl_mcore_utils.ddp import WrapConfig, build_ddp_config
from verl_mcore_utils.model import build_gpt_model
from verl_mcore_utils.parallel import ParallelDims
from verl_mcore_utils.transformer_config import hf_to_transformer_config

import_megatron_core()
from megatron.core import parallel_state  # noqa: E402

__all__ = ["Engine", "StepMetrics", "build_engine", "lr_at_step"]


@dataclass(frozen=True)
class StepMetrics:
    """What one optimizer step reports (identical on every rank)."""

    loss: float  # mean token loss over the global batch
    grad_norm: float
    loss_tokens: int  # global number of tokens in the loss
    lr: float


def lr_at_step(
    step: int, *, total_steps: int, lr: float, min_lr: float, warmup_steps: int, style: str
) -> float:
    """Linear warm-up, then constant / linear / cosine decay to ``min_lr`` at ``total_steps``."""
    if warmup_steps > 0 and step < warmup_steps:
        return lr * (step + 1) / warmup_steps
    if style == "constant" or total_steps <= warmup_steps:
        return lr
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    if style == "linear":
        return min_lr + (lr - min_lr) * (1.0 - progress)
    return min_lr + 0.5 * (lr - min_lr) * (1.0 + math.cos(math.pi * progress))


def _no_weight_decay(name: str, param: torch.nn.Parameter) -> bool:
    """megatron-core's default: no weight decay on biases and 1-D parameters (norm weights)."""
    return name.endswith(".bias") or param.ndim == 1


class Engine:
    """A built model + optimizer; ``train_step`` runs one optimizer step over micro-batches."""

    def __init__(
        self,
        *,
        model: torch.nn.Module,
        optimizer: Any,
        dims: ParallelDims,
        device: torch.device,
        debug: bool,
        clip_grad: float,
    ) -> None:
        self.model = model
        self.optimizer = optimizer
        self.dims = dims
        self.device = device
        self.debug = debug
        self.clip_grad = clip_grad

    @property
    def backend(self) -> str:
        return (
            "debug (CPU, gloo, no DDP, torch AdamW, fp32)"
            if self.debug
            else "megatron (DDP + megatron optimizer)"
        )

    def describe(self) -> dict[str, Any]:
        """What actually runs: wrapper, optimizer classes and the DDP settings in effect."""
        info: dict[str, Any] = {"backend": self.backend, "model_wrapper": type(self.model).__name__}
        opt = self.optimizer
        inner = getattr(opt, "chained_optimizers", None) or [opt]
        info["optimizer"] = [type(o).__name__ for o in inner]
        ddp_config = getattr(self.model, "ddp_config", None)
        if ddp_config is not None:
            info["ddp_config"] = {
                k: getattr(ddp_config, k)
                for k in (
                    "use_distributed_optimizer",
                    "overlap_grad_reduce",
                    "grad_reduce_in_fp32",
                    "bucket_size",
                )
            }
        return info

    def set_lr(self, lr: float) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    def _global_count(self, value: float) -> float:
        t = torch.tensor([value], dtype=torch.float64, device=self.device)
        if self.dims.dp > 1:
            dist.all_reduce(t, group=parallel_state.get_data_parallel_group())
        return float(t.item())

    def compute_gradients(self, micro_batches: list[Batch]) -> tuple[float, int]:
        """Forward/backward every micro-batch of this rank and reduce gradients over DP.

        Afterwards every rank holds the gradient of the global-batch token-mean loss (in ``.grad`` for
        the debug backend, in DDP's ``main_grad`` buffers for megatron). Returns (global token-mean
        loss, global loss-token count), identical on every rank.
        """
        if not micro_batches:
            raise ValueError("compute_gradients needs at least one micro-batch")
        global_tokens = self._global_count(sum(mb.num_loss_tokens for mb in micro_batches))
        if global_tokens == 0:
            raise ValueError(
                "the global batch has no loss tokens (every loss_mask is 0); nothing to train on"
            )
        micro_batches = [mb.to(self.device) for mb in micro_batches]
        if self.debug:
            loss_sum = self._debug_backward(micro_batches, global_tokens)
        else:
            loss_sum = self._megatron_backward(micro_batches, global_tokens)
        return self._global_count(loss_sum) / global_tokens, int(global_tokens)

    def named_gradients(self) -> dict[str, torch.Tensor]:
        """Reduced gradients by parameter name (``main_grad`` under megatron DDP), as fp32 CPU copies."""
        out: dict[str, torch.Tensor] = {}
        for name, p in self.model.named_parameters():
            grad = getattr(p, "main_grad", None) if not self.debug else p.grad
            if grad is not None:
                # DDP and Float16Module each add one "module." in front of the GPTModel's names.
                out[name.removeprefix("module.").removeprefix("module.")] = (
                    grad.detach().float().cpu().clone()
                )
        return out

    def optimizer_step(self) -> float:
        """Clip, step the optimizer; return the gradient norm before clipping."""
        if not self.debug:
            _, grad_norm, _ = self.optimizer.step()
            return float(grad_norm) if grad_norm is not None else float("nan")
        params = [p for p in self.model.parameters() if p.requires_grad]
        max_norm = self.clip_grad if self.clip_grad > 0 else float("inf")
        grad_norm = float(torch.nn.utils.clip_grad_norm_(params, max_norm))
        self.optimizer.step()
        return grad_norm

    def train_step(self, micro_batches: list[Batch], *, lr: float) -> StepMetrics:
        """One optimizer step over this rank's micro-batches at learning rate ``lr``."""
        loss, tokens = self.compute_gradients(micro_batches)
        self.set_lr(lr)
        grad_norm = self.optimizer_step()
        return StepMetrics(loss=loss, grad_norm=grad_norm, loss_tokens=tokens, lr=lr)

    def _forward(self, model: torch.nn.Module, mb: Batch) -> torch.Tensor:
        # With labels, GPTModel returns the per-token cross entropy [b, s] (vocab-parallel under TP).
        return model(
            input_ids=mb.input_ids, position_ids=mb.position_ids, attention_mask=None, labels=mb.labels
        )

    def _debug_backward(self, micro_batches: list[Batch], global_tokens: float) -> float:
        self.optimizer.zero_grad(set_to_none=True)
        loss_sum = 0.0
        for mb in micro_batches:
            s = masked_loss_sum(self._forward(self.model, mb), mb.loss_mask)
            (s / global_tokens).backward()
            loss_sum += float(s.detach())
        if self.dims.dp > 1:
            group = parallel_state.get_data_parallel_group()
            for p in self.model.parameters():
                if p.requires_grad:
                    if p.grad is None:  # every rank must join every all-reduce
                        p.grad = torch.zeros_like(p)
                    dist.all_reduce(p.grad, group=group)
        return loss_sum

    def _megatron_backward(self, micro_batches: list[Batch], global_tokens: float) -> float:
        from megatron.core.pipeline_parallel import get_forward_backward_func

        scale = megatron_loss_scale(num_microbatches=len(micro_batches), dp_size=self.dims.dp)

        def loss_func(mb: Batch, output_tensor: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
            s = masked_loss_sum(output_tensor, mb.loss_mask)
            return s / global_tokens * scale, {"loss_sum": s.detach()}

        def forward_step(data_iterator: Any, model: torch.nn.Module) -> tuple[torch.Tensor, Any]:
            mb = next(data_iterator)
            return self._forward(model, mb), partial(loss_func, mb)

        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()
        first = micro_batches[0]
        reduced = get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=iter(micro_batches),
            model=[self.model],
            num_microbatches=len(micro_batches),
            seq_length=first.input_ids.shape[1],
            micro_batch_size=first.batch_size,
            forward_only=False,
        )
        return float(sum(float(r["loss_sum"]) for r in reduced))


def build_engine(
    cfg: SFTConfig,
    *,
    hf_config: Mapping[str, Any],
    dims: ParallelDims,
    device: torch.device,
) -> Engine:
    """Build the model and optimizer for ``cfg`` on ``device`` (CPU means the debug backend)."""
    m, o = cfg.megatron, cfg.optim
    debug = device.type == "cpu"
    dtype = "float32" if debug else m.dtype
    tf_config = hf_to_transformer_config(
        hf_config,
        dtype=dtype,
        tensor_model_parallel_size=m.tensor_model_parallel_size,
        pipeline_model_parallel_size=m.pipeline_model_parallel_size,
        context_parallel_size=m.context_parallel_size,
        sequence_parallel=m.sequence_parallel,
        overrides=m.override_transformer_config,
    )
    # CPU initialisation with one seed: identical weights whatever the parallel layout.
    torch.manual_seed(m.seed)
    model = build_gpt_model(hf_config=hf_config, tf_config=tf_config, device=device)
    if debug:
        decay, no_decay = [], []
        for name, p in model.named_parameters():
            (no_decay if _no_weight_decay(name, p) else decay).append(p)
        optimizer = torch.optim.AdamW(
            [{"params": decay, "weight_decay": o.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
            lr=o.lr,
            betas=(o.betas[0], o.betas[1]),
            eps=o.eps,
        )
        return Engine(
            model=model, optimizer=optimizer, dims=dims, device=device, debug=True, clip_grad=o.clip_grad
        )

    from megatron.core.distributed import DistributedDataParallel, finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer.module import Float16Module

    if tf_config.bf16 or tf_config.fp16:
        model = Float16Module(tf_config, model)
    ddp_config = build_ddp_config(
        wrap_config=WrapConfig(use_distributed_optimizer=m.use_distributed_optimizer),
        override_ddp_config=m.override_ddp_config,
    )
    ddp_model = DistributedDataParallel(config=tf_config, ddp_config=ddp_config, module=model)
    ddp_model.broadcast_params()
    opt_config = OptimizerConfig(
        optimizer="adam",
        lr=o.lr,
        min_lr=o.min_lr,
        weight_decay=o.weight_decay,
        adam_beta1=o.betas[0],
        adam_beta2=o.betas[1],
        adam_eps=o.eps,
        clip_grad=o.clip_grad,
        bf16=tf_config.bf16,
        fp16=tf_config.fp16,
        params_dtype=tf_config.params_dtype,
        use_distributed_optimizer=ddp_config.use_distributed_optimizer,
    )
    optimizer = get_megatron_optimizer(opt_config, [ddp_model])
    tf_config.finalize_model_grads_func = finalize_model_grads
    tf_config.grad_scale_func = optimizer.scale_loss
    return Engine(
        model=ddp_model, optimizer=optimizer, dims=dims, device=device, debug=False, clip_grad=o.clip_grad
    )
