"""The engine RL and SFT trainers drive: verl's engine surface over a megatron-core model (actor, critic,
reference, SFT policy). One object per role.

Per call it takes the step's whole batch (verl's keys, the same on every rank), packs the valid tokens,
cuts micro-batches, lets verl-dyncp's planner spread each over the DP x CP ranks (static or dynamic CP),
runs the model on each rank's share and merges the per-token outputs back, so the loss sees whole
sequences. Why the whole batch on every rank: no rank can be given a different number of micro-batches,
and a bad batch fails on every rank with the same error instead of hanging one. Design notes: README.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from verl_engine.decoder_graphs import release_decoder_graphs
from verl_engine.forward import ModelForward, _unwrap
from verl_engine.lifetime import Closeable
from verl_engine.metrics import MetricAccumulator
from verl_engine.micro_batching import MicroBatching, split_to_multiple
from verl_engine.moe import MoeRouting
from verl_engine.mtp import MtpSettings, MtpTracker, mtp_target_counts
from verl_engine.packed import (
    CPLayout,
    PackedBatch,
    PlannedMicroBatch,
    check_same_batch_on_every_rank,
    plan_micro_batches,
)
from verl_engine.pipeline import PipelineLayout, share_from_last_stage
from verl_engine.rl_batch import RLBatch, read_scalar
from verl_engine.router_replay import RouterReplayMixin
from verl_engine.weight_export import WeightExport

__all__ = ["LossFunction", "MicroBatching", "RLEngine", "split_to_multiple"]

# verl's loss call shape: loss, metrics = loss_fn(model_output=..., data=..., dp_group=...)
LossFunction = Callable[..., tuple[torch.Tensor, Mapping[str, Any]]]


@dataclasses.dataclass
class _Call:
    """What one forward_backward_batch call carries from micro-batch to micro-batch."""

    data: Mapping[str, Any]
    batch: RLBatch
    loss_function: LossFunction | None
    temperature: float
    entropy: bool
    scalars: dict[str, Any]
    tracker: MtpTracker | None
    mtp_packed: PackedBatch | None = None
    mtp_counts: list[int] = dataclasses.field(default_factory=list)
    per_seq: dict[str, list[Any]] = dataclasses.field(default_factory=dict)
    metrics: MetricAccumulator = dataclasses.field(default_factory=MetricAccumulator)
    # per micro-batch (loss, metrics) as a trainer adapter keeps them (verl_engine.integrations.verl)
    records: list[Any] = dataclasses.field(default_factory=list)


class RLEngine(RouterReplayMixin, ModelForward, WeightExport, Closeable):
    """verl's engine surface (``BaseEngine``) for one role over a built model and optimizer.

    Built by :func:`verl_engine.build.build_rl_engine`; see the module docstring for the data path.
    """

    def __init__(
        self,
        *,
        model: torch.nn.Module | Sequence[torch.nn.Module],
        optimizer: Any,
        backend: Any,
        tp_group: Any,
        tp_size: int,
        device: torch.device,
        cp_layout: CPLayout,
        cp_groups: Any,
        cp_workload: Any,
        micro_batching: MicroBatching,
        value_model: bool,
        use_remove_padding: bool = True,
        lr_schedule: Any = None,
        tokenizer_path: str | None = None,
        pipeline: PipelineLayout | None = None,
        mtp: MtpSettings | None = None,
        mtp_embedding_copy: bool = False,
        hf_config: Mapping[str, Any] | None = None,
        lora: Any = None,
        fused_lm_head: bool = False,
        moe: MoeRouting | None = None,
    ) -> None:
        # ``chunks``: this rank's model chunks (one, or one per virtual pipeline stage); ``model`` is the
        # chunk itself when there is one, else a ModuleList of them (train / eval / parameters cover all).
        self.chunks = [model] if isinstance(model, torch.nn.Module) else list(model)
        self.model = self.chunks[0] if len(self.chunks) == 1 else torch.nn.ModuleList(self.chunks)
        self.pipeline = pipeline or PipelineLayout.single_stage()
        if self.pipeline.num_chunks != len(self.chunks):
            raise ValueError(
                f"{len(self.chunks)} model chunks for a pipeline layout of {self.pipeline.num_chunks} chunks per stage"
            )
        self.mtp = mtp
        # pipeline stages with MTP layers: the last stage's copy of the word embedding takes the summed
        # gradient of both copies (verl_mcore_utils.mtp.sync_mtp_embedding) so they stay equal
        self.mtp_embedding_copy = mtp_embedding_copy
        self.hf_config = hf_config
        # verl-config's LoraConfig when the model carries LoRA adapters (rank > 0), else None
        self.lora = lora
        # mixture-of-experts routing (verl_engine.moe): padding mask and aux-loss scale; None for dense models
        self.moe = moe
        self.optimizer = optimizer
        self.backend = backend
        self.tp_group = tp_group
        self.tp_size = tp_size
        self.device = device
        self.cp_layout = cp_layout
        self.cp_groups = cp_groups
        self.cp_workload = cp_workload
        self.micro_batching = micro_batching
        self.value_model = value_model
        self.use_remove_padding = use_remove_padding
        # model.use_fused_kernels: log-probs / entropy from the last hidden states with the LM head's matmul
        # inside the chunk loop (verl_engine.fused_head); a value model has no LM head to fuse.
        self.fused_lm_head = fused_lm_head and not value_model
        self.lr_schedule = lr_schedule
        self.mode: str | None = None
        self._tokenizer_path = tokenizer_path
        self._tokenizer: Any = None

    # ------------------------------------------------------------------------------ modes
    @contextlib.contextmanager
    def train_mode(self, **_: Any) -> Iterator[RLEngine]:
        """Training context: model in train mode; gradients are zeroed on exit (as verl's Megatron engine)."""
        previous = self.mode
        self.mode = "train"
        self.model.train()
        try:
            yield self
        finally:
            self.optimizer_zero_grad()
            self.mode = previous

    @contextlib.contextmanager
    def eval_mode(self, **_: Any) -> Iterator[RLEngine]:
        """Inference context: model in eval mode (no dropout)."""
        previous, was_training = self.mode, self.model.training
        self.mode = "eval"
        self.model.eval()
        try:
            yield self
        finally:
            self.model.train(was_training)
            self.mode = previous

    @contextlib.contextmanager
    def disable_adapter(self) -> Iterator[None]:
        """The model without its LoRA adapters (verl's reference policy = the actor without its adapter).

        Inside, forwards run the frozen base model (peft's adapter switch); without LoRA the model already is
        the base model and this does nothing.
        """
        if self.lora is None:
            yield
            return
        from verl_mcore_utils.lora import adapters_disabled

        with adapters_disabled(self.chunks):
            yield

    # ------------------------------------------------------------------------------ ranks
    def get_data_parallel_size(self) -> int:
        """1: every rank takes the whole batch (the engine spreads it over DP x CP itself)."""
        return 1

    def get_data_parallel_rank(self) -> int:
        return 0

    def get_data_parallel_group(self) -> Any:
        return None

    def is_mp_src_rank_with_outputs(self) -> bool:
        """Rank 0 returns outputs to a controller (every rank, every pipeline stage, holds the same outputs)."""
        return not dist.is_initialized() or dist.get_rank() == 0

    @property
    def megatron_fsdp(self) -> bool:
        """True when the chunks are wrapped by Megatron-FSDP (``megatron.use_megatron_fsdp`` on CUDA)."""
        return any(getattr(getattr(c, "ddp_config", None), "use_megatron_fsdp", False) for c in self.chunks)

    @property
    def pool_size(self) -> int:
        """Ranks whose gradients are averaged: DP x CP (the pool verl-dyncp plans over)."""
        return int(self.cp_groups.world_size)

    @property
    def tokenizer(self) -> Any:
        """The Hugging Face tokenizer of ``model.path`` (transformers AutoTokenizer, loaded on first use)."""
        if self._tokenizer is None:
            if self._tokenizer_path is None:
                raise ValueError("this engine was built without a model path; it has no tokenizer")
            from transformers import AutoTokenizer

            self._tokenizer = AutoTokenizer.from_pretrained(self._tokenizer_path)
        return self._tokenizer

    def describe(self) -> dict[str, Any]:
        """What actually runs: backend, wrapper, optimizer classes and the DDP settings in effect."""
        info: dict[str, Any] = {
            "backend": self.backend.describe(self.chunks[0]),
            "model_wrapper": type(self.chunks[0]).__name__,
            "cp_layout": self.cp_layout.describe(),
        }
        inner = getattr(self.optimizer, "chained_optimizers", None) or [self.optimizer]
        info["optimizer"] = [type(o).__name__ for o in inner if o is not None]
        ddp_config = getattr(self.chunks[0], "ddp_config", None)
        if ddp_config is not None:
            from verl_mcore_utils.ddp import describe_ddp_config

            info["ddp_config"] = describe_ddp_config(ddp_config)
        return info

    # ------------------------------------------------------------------------------ optimizer
    def optimizer_zero_grad(self) -> None:
        if self.optimizer is not None:
            self.backend.zero_grad(self)

    def optimizer_step(self) -> float:
        """Clip and step; returns the gradient norm before clipping."""
        if self.optimizer is None:
            raise RuntimeError(
                "this engine has no optimizer (a forward-only role such as the reference policy)"
            )
        return self.backend.step(self)

    def lr_scheduler_step(self) -> float:
        """Advance the learning-rate schedule one step; returns the new learning rate."""
        if self.lr_schedule is None:
            raise RuntimeError("this engine has no learning-rate schedule (no optimizer section was given)")
        return float(self.lr_schedule.step(self.optimizer))

    def get_lr(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"])

    # ------------------------------------------------------------------------------ offload
    def offload(self, *, params: bool = True, grads: bool = True, optimizer: bool = True) -> dict[str, Any]:
        """Move the selected training state to host memory (between phases: rollout uses the GPU meanwhile).

        verl-mcore-utils' offload: whole device storages copied into one reused host buffer each (host memory
        stays 1x), device memory released; DDP / distributed-optimizer views stay valid. A group already
        offloaded is an error, as is using the engine before :meth:`onload`. Returns the transfer stats.
        """
        release_decoder_graphs(self)  # their memory pools too; the next fitting micro-batch captures again
        return self._transfer("offload", params=params, grads=grads, optimizer=optimizer)

    def onload(self, *, params: bool = True, grads: bool = True, optimizer: bool = True) -> dict[str, Any]:
        """Bring back, bit for bit, what :meth:`offload` moved (the same selection)."""
        return self._transfer("onload", params=params, grads=grads, optimizer=optimizer)

    def _transfer(self, direction: str, *, params: bool, grads: bool, optimizer: bool) -> dict[str, Any]:
        out: dict[str, Any] = {}
        move_model, move_optimizer = self._offload_functions(direction)
        if params or grads:
            out["model"] = move_model(self.chunks, params=params, grads=grads).as_dict()
        if optimizer and self.optimizer is not None:
            out["optimizer"] = move_optimizer(self.optimizer).as_dict()
        return out

    def _offload_functions(self, direction: str) -> tuple[Callable[..., Any], Callable[..., Any]]:
        """(model, optimizer) functions of verl-mfsdp for Megatron-FSDP chunks, else of verl-mcore-utils."""
        if self.megatron_fsdp:
            import verl_mfsdp.offload as fsdp

            return (
                getattr(fsdp, f"{direction}_megatron_fsdp_model"),
                getattr(fsdp, f"{direction}_megatron_fsdp_optimizer"),
            )
        import verl_mcore_utils.offload as ddp

        return getattr(ddp, f"{direction}_megatron_model"), getattr(ddp, f"{direction}_megatron_optimizer")

    # ------------------------------------------------------------------------------ checkpoints
    def save_checkpoint(
        self,
        path: str,
        *,
        global_step: int,
        data_position: Any = None,
        max_ckpt_to_keep: int | None = None,
    ) -> Any:
        """Atomic checkpoint under ``path/global_step_<N>`` (every rank calls it); see :mod:`verl_engine.checkpoint`."""
        from verl_engine.checkpoint import save_checkpoint

        return save_checkpoint(
            self,
            path,
            global_step=global_step,
            data_position=data_position,
            max_ckpt_to_keep=max_ckpt_to_keep,
        )

    def load_checkpoint(self, path: str, *, load_optimizer: bool = True) -> dict[str, Any]:
        """Restore a step directory or a root's latest step; returns its ``global_step`` and ``data_position``."""
        from verl_engine.checkpoint import load_checkpoint

        return load_checkpoint(self, path, load_optimizer=load_optimizer)

    # ------------------------------------------------------------------------------ batches
    def train_batch(self, data: Mapping[str, Any], loss_function: LossFunction) -> dict[str, Any]:
        """Zero grads, forward + backward over the batch, optimizer step; ``metrics["grad_norm"]`` added."""
        self.optimizer_zero_grad()
        out = self.forward_backward_batch(data, loss_function, forward_only=False)
        out["metrics"]["grad_norm"] = self.optimizer_step()
        return out

    @torch.no_grad()
    def infer_batch(
        self, data: Mapping[str, Any], loss_function: LossFunction | None = None
    ) -> dict[str, Any]:
        """Forward only: log-probs / entropy (or values) of every token, in input order."""
        return self.forward_backward_batch(data, loss_function, forward_only=True)

    def forward_backward_batch(
        self, data: Mapping[str, Any], loss_function: LossFunction | None, forward_only: bool = False
    ) -> dict[str, Any]:
        """Run every micro-batch; returns ``{"model_output": ..., "loss": float, "metrics": {...}}``.

        ``model_output``: ``log_probs`` and (with ``calculate_entropy``) ``entropy`` for a language model,
        ``values`` for a value model, in the input's layout (position ``c`` holds the output computed at
        token ``c``: log p(token c+1)), identical on every rank. ``loss`` is the global loss of the call,
        ``metrics`` the loss function's metrics reduced as each declares (:mod:`verl_engine.metrics`). Between
        the first and the last micro-batch nothing is read on the host: losses and metrics stay on the
        device and are read once, after the last one.
        """
        if not forward_only and loss_function is None:
            raise ValueError("forward_backward_batch(forward_only=False) needs a loss_function")
        if not forward_only and self.optimizer is None:
            # verl's worker asserts the same: a forward-only engine has frozen parameters and no optimizer
            raise RuntimeError(
                "this engine is forward only (megatron.forward_only=true, or the reference policy): it holds no"
                " optimizer and its parameters are frozen; train_batch / forward_backward_batch(forward_only=False)"
                " need a role built with forward_only=false and an optim section"
            )
        call = self._start_call(data, loss_function, forward_only=forward_only)
        micro = self._plan(call.batch)
        with self.route_replay_call(data, call.batch, forward_only=forward_only) as routes:
            self.backend.run(self, micro, lambda mb, m: self._step(call, mb, m), forward_only=forward_only)
        return routes.attach(self._finish_call(call))

    def plan_cp_sizes(self, data: Mapping[str, Any]) -> list[tuple[int, ...]]:
        """The CP sizes verl-dyncp's planner gives each micro-batch of ``data`` (largest first): what a call
        on this batch runs. Every rank must call it (the batch is checked to be the same everywhere)."""
        return [
            tuple(sorted({b.size for b in p.split.plan.blocks}, reverse=True))
            for p in self._plan(self._checked_batch(data))
        ]

    def _checked_batch(self, data: Mapping[str, Any]) -> RLBatch:
        """The call's batch, validated and checked to be the same on every rank (before any collective)."""
        batch = RLBatch.from_data(data)
        check_same_batch_on_every_rank(
            batch.packed,
            device=self.device,
            message="ranks were given different batches (lengths or tokens differ); the engine needs the call's"
            " whole batch, identical, on every rank (get_data_parallel_size() is 1)",
        )
        return batch

    def _start_call(
        self, data: Mapping[str, Any], loss_function: LossFunction | None, *, forward_only: bool
    ) -> _Call:
        """Validate the batch (the same on every rank) and read the call's settings, before any micro-batch."""
        batch = self._checked_batch(data)
        temperature = float(read_scalar(data, "temperature", 1.0))
        call = _Call(
            data=data,
            batch=batch,
            loss_function=loss_function,
            temperature=temperature,
            entropy=bool(read_scalar(data, "calculate_entropy", False)) and not self.value_model,
            scalars=self._loss_scalars(data, batch, temperature=temperature),
            tracker=self._mtp_tracker(forward_only=forward_only, has_loss=loss_function is not None),
        )
        if call.tracker is not None:  # the batch with its MTP targets (response tokens) as label mask
            call.mtp_packed = dataclasses.replace(batch.packed, label_mask=batch.response_token_mask())
            call.mtp_counts = mtp_target_counts(call.mtp_packed, num_layers=call.tracker.num_layers)
        return call

    def _step(self, call: _Call, mb: PlannedMicroBatch, model: torch.nn.Module) -> torch.Tensor | None:
        """One micro-batch: forward, outputs kept, loss and metrics recorded on the device (never read here:
        a host read would make the host wait for this forward before it can queue the backward)."""
        batch = call.batch
        if not _unwrap(model).post_process:  # an earlier pipeline stage: its activations go on
            return self._stage_forward(model, mb, packed=batch.packed)
        merged, mtp_term = self._forward(
            model,
            mb,
            packed=batch.packed,
            temperature=call.temperature,
            entropy=call.entropy,
            tracker=call.tracker,
            mtp_packed=call.mtp_packed,
            mtp_counts=call.mtp_counts,
        )
        self._keep_outputs(batch, mb, merged, call.per_seq)
        if call.loss_function is None:
            return None
        loss, metrics = self._call_loss(call, mb, merged)
        self._record(call, loss, metrics)
        return loss if mtp_term is None else loss + mtp_term

    def _call_loss(
        self, call: _Call, mb: PlannedMicroBatch, merged: dict[str, torch.Tensor]
    ) -> tuple[torch.Tensor, Mapping[str, Any]]:
        """The loss of one micro-batch, in our convention: response-aligned ``[mb, R]`` outputs and the rows of
        the micro-batch. A trainer adapter with another convention overrides this (verl_engine.integrations)."""
        batch = call.batch
        loss_data = batch.rows(call.data, mb.indices, device=self.device) | call.scalars
        model_output = {k: batch.response_view(v, indices=mb.indices) for k, v in merged.items()}
        # reached only with a loss function (_step returns before without one)
        return call.loss_function(model_output=model_output, data=loss_data, dp_group=None)  # type: ignore[misc]

    def _record(self, call: _Call, loss: torch.Tensor, metrics: Mapping[str, Any]) -> None:
        """Keep one micro-batch's loss and metrics on the device until the call ends."""
        call.metrics.add_loss(loss)
        call.metrics.add(metrics)

    def _summary(self, call: _Call) -> tuple[Any, Any]:
        """(loss, metrics) of the call on the last stage: ours reduce to floats (see :mod:`verl_engine.metrics`)."""
        return call.metrics.reduce(pool_size=self.pool_size)

    def _finish_call(self, call: _Call) -> dict[str, Any]:
        """The step's reduction (one host read) on the last stage, shared with every stage; outputs in the
        input's layout."""
        batch = call.batch
        flat: dict[str, torch.Tensor] | None = None
        extra: Any = None
        if self.pipeline.is_last_stage:
            flat = {key: torch.cat(values) for key, values in call.per_seq.items()}
            loss_total, summary = self._summary(call)
            # every last-stage rank joins the pool's MTP reduction (see verl_engine.mtp)
            if call.tracker is not None:
                summary.update(call.tracker.reduce(group=self.cp_groups.full_group))
            extra = (loss_total, summary)
        sizes = {key: sum(batch.packed.seq_lens) for key in self._output_keys(call.entropy)}
        flat, (loss_total, summary) = share_from_last_stage(
            self.pipeline, tensors=flat, sizes=sizes, extra=extra, device=self.device
        )
        outputs = {
            key: batch.to_input_layout(list(values.split(list(batch.packed.seq_lens))))
            for key, values in flat.items()
        }
        return {"model_output": outputs, "loss": loss_total, "metrics": summary}

    # ------------------------------------------------------------------------------ internals
    def _mtp_tracker(self, *, forward_only: bool, has_loss: bool) -> MtpTracker | None:
        """Tracker state exists on exactly the ranks that run MTP: last stage, training with a loss."""
        if self.mtp is None or forward_only or not has_loss or not self.pipeline.is_last_stage:
            return None
        return MtpTracker(num_layers=self.mtp.num_layers, device=self.device)

    def _loss_scalars(self, data: Mapping[str, Any], batch: RLBatch, *, temperature: float) -> dict[str, Any]:
        if "response_mask" in data:
            tokens = int(data["response_mask"].to(torch.bool).sum())
        else:
            tokens = sum(batch.response_lens)
        return {
            "dp_size": self.pool_size,
            "batch_num_tokens": tokens,
            "global_batch_size": batch.size,
            "temperature": temperature,
        }

    def _plan(self, batch: RLBatch) -> list[PlannedMicroBatch]:
        layout = self.cp_layout
        groups_per_pool = self.pool_size // (1 if layout.dynamic else layout.static_cp_size)
        splits = self.micro_batching.split(
            batch.packed.seq_lens,
            pool=self.pool_size,
            groups_per_pool=groups_per_pool,
            cp=(layout, self.cp_workload),
        )
        if self.pipeline.num_chunks > 1:
            splits = split_to_multiple(splits, multiple=self.pipeline.size)
        return plan_micro_batches(
            batch.packed,
            splits,
            layout=layout,
            groups=self.cp_groups,
            tp_size=self.tp_size,
            workload=self.cp_workload,
            device=self.device,
            max_tokens_per_rank=self.micro_batching.max_token_len_per_gpu
            if self.micro_batching.use_dynamic_bsz
            else None,
        )
