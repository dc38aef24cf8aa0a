"""The two ways the engine runs micro-batches and steps the optimizer.

* :class:`MegatronBackend` (CUDA): megatron-core's DDP (or Megatron-FSDP) gradient buffers, its optimizer
  (distributed or not) and its forward-backward schedule.
* :class:`DebugBackend` (CPU): plain autograd per micro-batch (pipeline stages through
  :func:`verl_engine.pipeline.run_cpu_pipeline`), gradients averaged over the DP x CP pool with all-reduces,
  a gradient norm over all model-parallel ranks, ``torch.optim.AdamW``, fp32. megatron-core's DDP buffers, optimizers and schedules hard-code CUDA;
  this runs the same model code on gloo so that the engine is tested without a GPU.

Both see the loss exactly as the loss function returned it (verl's convention: global normalisation with
``dp_size`` inside, see :mod:`verl_engine.losses`): megatron's schedule divides by the number of
micro-batches and its DDP averages over the pool, so the megatron backend multiplies by the former; the
debug backend sums and averages over the pool itself.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["DebugBackend", "MegatronBackend"]

Step = Callable[[Any, torch.nn.Module], "torch.Tensor | None"]


class DebugBackend:
    """CPU backend: autograd per micro-batch, SUM all-reduce / pool size, torch AdamW with clipping."""

    name = "debug (CPU, gloo, no DDP, torch AdamW, fp32)"

    def __init__(
        self, *, clip_grad: float, pool_group: Any, pool_size: int, expert_group: Any = None
    ) -> None:
        self.clip_grad = clip_grad
        self.pool_group = pool_group
        self.pool_size = pool_size
        # expert parallelism: the expert-data-parallel group (the ranks holding the same experts), else None
        self.expert_group = expert_group

    def run(self, engine: Any, micro: Sequence[Any], step: Step, *, forward_only: bool) -> None:
        with _moe_aux_loss_scale(engine, len(micro), forward_only=forward_only, schedule_sets_it=False):
            self._run(engine, micro, step, forward_only=forward_only)

    def _run(self, engine: Any, micro: Sequence[Any], step: Step, *, forward_only: bool) -> None:
        if engine.pipeline.size > 1:
            from verl_engine.pipeline import run_cpu_pipeline

            run_cpu_pipeline(engine.chunks, micro, step, layout=engine.pipeline, forward_only=forward_only)
        else:
            for mb in micro:
                if forward_only:
                    with torch.no_grad():
                        step(mb, engine.model)
                    continue
                loss = step(mb, engine.model)
                if loss is not None:
                    loss.backward()
        if not forward_only:
            from verl_engine.tp_grads import sum_tp_shared_grads

            # norms under SP, routers, q / k norms: finalize_model_grads' TP rule
            sum_tp_shared_grads(engine.chunks)
            self._average_gradients(engine.model)
            if engine.mtp_embedding_copy:
                from verl_mcore_utils.mtp import sync_mtp_embedding

                sync_mtp_embedding(engine.chunks, grads=True)

    def _average_gradients(self, model: torch.nn.Module) -> None:
        # the expert-DP group can be larger than the pool (ETP 1 at TP 2: TP ranks hold the same experts)
        experts_only = self.pool_size == 1
        if experts_only and (self.expert_group is None or dist.get_world_size(self.expert_group) == 1):
            return
        for p in model.parameters():
            if not p.requires_grad or (experts_only and getattr(p, "allreduce", True)):
                continue
            if p.grad is None:  # every rank must join every all-reduce
                p.grad = torch.zeros_like(p)
            # megatron-core's DDP rule: an expert (allreduce=False) already holds the gradient of every token
            # its EP group dispatched to it, so it is summed over the ranks holding the same expert only;
            # divided by the whole pool either way
            expert = self.expert_group is not None and not getattr(p, "allreduce", True)
            dist.all_reduce(p.grad, group=self.expert_group if expert else self.pool_group)
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
        params = [p for p in engine.model.parameters() if p.requires_grad and p.grad is not None]
        norm = _model_parallel_grad_norm(params)
        if self.clip_grad > 0:
            coef = self.clip_grad / (norm + 1e-6)  # torch.nn.utils.clip_grad_norm_'s rule, global norm
            if coef < 1.0:
                for p in params:
                    p.grad.mul_(coef)
        engine.optimizer.step()
        from verl_engine.expert_bias import update_expert_bias

        update_expert_bias(engine.chunks)  # megatron-core does it in finalize_model_grads (megatron backend)
        return norm


def _moe_aux_loss_scale(
    engine: Any, num_micro_batches: int, *, forward_only: bool, schedule_sets_it: bool
) -> contextlib.AbstractContextManager[None]:
    """The aux-loss scale of a mixture-of-experts model for this call (:func:`verl_engine.moe.aux_loss_scale`);
    nothing for a dense model or a forward-only call. An MoE call starts with megatron-core's metrics tracker
    dropped (:func:`verl_engine.moe.drop_moe_metrics_tracker`)."""
    if engine.moe is None:
        return contextlib.nullcontext()
    from verl_engine.moe import aux_loss_scale, drop_moe_metrics_tracker

    drop_moe_metrics_tracker()
    if forward_only:
        return contextlib.nullcontext()

    return aux_loss_scale(
        pool_size=engine.pool_size, num_micro_batches=num_micro_batches, schedule_sets_it=schedule_sets_it
    )


def _model_parallel_grad_norm(params: Sequence[torch.nn.Parameter]) -> float:
    """L2 norm of the whole model's gradient: TP shards and pipeline stages summed, each tensor once.

    megatron-core's rule: a parameter replicated over TP (norms, biases of row-parallel layers) counts on
    TP rank 0 only. With expert parallelism the experts (``allreduce=False``) differ between EP ranks: their
    squares are summed over the expert-model-parallel group (ETP x EP x PP), the rest over TP x PP.
    """
    from megatron.core import parallel_state as ps

    tp_rank = ps.get_tensor_model_parallel_rank()
    ep = ps.get_expert_model_parallel_world_size() > 1 or (
        ps.get_expert_tensor_parallel_world_size() != ps.get_tensor_model_parallel_world_size()
    )
    sq = torch.zeros((), dtype=torch.float64)
    expert_sq = torch.zeros((), dtype=torch.float64)
    for p in params:
        if tp_rank > 0 and not getattr(p, "tensor_model_parallel", False):
            continue
        # the caller passes only parameters with a grad
        part = p.grad.detach().double().pow(2).sum().cpu()  # type: ignore[union-attr]
        if ep and not getattr(p, "allreduce", True):
            expert_sq += part
        else:
            sq += part
    model_parallel = ps.get_model_parallel_group()
    if dist.get_world_size(model_parallel) > 1:
        dist.all_reduce(sq, group=model_parallel)
    if ep:
        dist.all_reduce(expert_sq, group=ps.get_expert_tensor_model_pipeline_parallel_group())
    return float((sq + expert_sq).sqrt())


class MegatronBackend:
    """CUDA backend: megatron-core's forward-backward schedule, DDP buffers and optimizer."""

    name = "megatron (DDP + megatron optimizer)"

    def run(self, engine: Any, micro: Sequence[Any], step: Step, *, forward_only: bool) -> None:
        from megatron.core.pipeline_parallel import get_forward_backward_func

        n = len(micro)

        def loss_func(output: torch.Tensor) -> tuple[torch.Tensor, dict[str, Any]]:
            return output * n, {}  # undo the schedule's 1 / num_microbatches

        def forward_step(data_iterator: Any, model: torch.nn.Module) -> tuple[torch.Tensor, Any]:
            out = step(next(data_iterator), model)  # activations before the last stage, else the loss
            if out is None:
                out = torch.zeros((), device=engine.device)
            return out, loss_func

        # Without pipeline stages the schedule never sends activations; with them the config has
        # variable_seq_lengths (shapes are exchanged first), so the shapes given here are unused either
        # way (verl passes 1 / 1 too): packed micro-batches need no padding to a common length.
        chunks = engine.chunks
        with _moe_aux_loss_scale(engine, n, forward_only=forward_only, schedule_sets_it=True):
            get_forward_backward_func()(
                forward_step_func=forward_step,
                data_iterator=iter(micro) if len(chunks) == 1 else [iter(micro) for _ in chunks],
                model=chunks,
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
        ddp_config: Any = getattr(model, "ddp_config", None)
        if getattr(ddp_config, "use_megatron_fsdp", False):
            return (
                f"megatron (Megatron-FSDP {ddp_config.data_parallel_sharding_strategy} + megatron optimizer)"
            )
        return self.name

    def zero_grad(self, engine: Any) -> None:
        for chunk in engine.chunks:
            zero = getattr(chunk, "zero_grad_buffer", None)
            if zero is not None:
                zero()
        engine.optimizer.zero_grad()

    def step(self, engine: Any) -> float:
        _, grad_norm, _ = engine.optimizer.step()
        return float(grad_norm) if grad_norm is not None else float("nan")
