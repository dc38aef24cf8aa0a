"""The engine RL trainers drive: verl's engine surface over a megatron-core model (actor, critic, reference).

One object per role. Per call it takes the step's whole batch (a TensorDict or mapping with verl's keys,
the same on every rank), packs the valid tokens, cuts micro-batches (a fixed number of sequences per GPU
or a token budget per GPU), lets verl-dyncp's planner spread every micro-batch over the DP x CP ranks
(static or dynamic CP; CP size 1 = plain data parallelism, still balanced by workload), runs the model on
each rank's share, and gathers the per-token outputs of the micro-batch back on every rank
(``dynamic_cp_merge_output``: each rank's own slot keeps its autograd graph). The loss function then
sees whole sequences, so every ``loss_agg_mode`` (token- or sequence-level) is exact, and the sum of the
ranks' gradients is the gradient of the global loss; ``data["dp_size"]`` is therefore the number of
ranks whose gradients are averaged (DP x CP), ``data["batch_num_tokens"]`` / ``data["global_batch_size"]``
the response tokens / sequences of the whole call.

Why the whole batch on every rank: no rank can be given a different number of micro-batches (the
planner runs on the same lengths everywhere, a digest of the batch is compared before any collective),
so a bad batch fails on every rank with the same error instead of hanging one of them.
``get_data_parallel_size()`` is 1 accordingly: a verl-style dispatcher sends the whole batch to every
rank and collects from ``is_mp_src_rank_with_outputs()`` (rank 0), and every rank returns the same outputs.

Pipeline parallelism: each rank holds the model chunks of its stage (several with virtual stages); every
stage runs the same planned micro-batches, only the last stage computes outputs and losses, and those are
then sent to the other stages (:mod:`verl_engine.pipeline`), so the call's result is the same everywhere.
Multi-token prediction (:mod:`verl_engine.mtp`) adds its loss on the last stage when training.

Two small backends run the micro-batches: megatron-core's DDP, optimizer and forward-backward schedules
(CUDA), and a CPU debug backend (gloo, no DDP wrapper, torch AdamW, fp32) that runs the same model code.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from verl_engine.fused_head import lm_head_returns_hidden
from verl_engine.lifetime import Closeable
from verl_engine.logprobs import vocab_parallel_log_probs_and_entropy
from verl_engine.mtp import MtpSettings, MtpTracker, mtp_target_counts, run_mtp
from verl_engine.packed import (
    CPLayout,
    PackedBatch,
    PlannedMicroBatch,
    check_same_batch_on_every_rank,
    plan_micro_batches,
    split_packed_micro_batches,
)
from verl_engine.pipeline import PipelineLayout, share_from_last_stage
from verl_engine.rl_batch import RLBatch, read_scalar

__all__ = ["SHARE_METRICS", "LossFunction", "MicroBatching", "RLEngine", "split_to_multiple"]

# verl's loss call shape: loss, metrics = loss_fn(model_output=..., data=..., dp_group=...)
LossFunction = Callable[..., tuple[torch.Tensor, Mapping[str, Any]]]
# Metrics that are a micro-batch's share of a globally normalised loss (summed over micro-batches, then
# divided by the pool size as the loss itself); every other metric is averaged over micro-batches.
SHARE_METRICS = frozenset({"pg_loss", "entropy", "kl_loss", "vf_loss", "sft_loss"})


@dataclass(frozen=True)
class MicroBatching:
    """How a call's sequences are cut into micro-batches (verl's keys of the role / engine section).

    ``use_dynamic_bsz``: micro-batches of at most ``max_token_len_per_gpu`` tokens per rank of the pool
    (first-fit decreasing by length); else ``micro_batch_size_per_gpu`` sequences per rank, in input order.
    """

    use_dynamic_bsz: bool
    max_token_len_per_gpu: int | None = None
    micro_batch_size_per_gpu: int | None = None

    def __post_init__(self) -> None:
        if self.use_dynamic_bsz and not (self.max_token_len_per_gpu or 0) > 0:
            raise ValueError(
                f"use_dynamic_bsz needs max_token_len_per_gpu > 0, got {self.max_token_len_per_gpu}"
            )
        if not self.use_dynamic_bsz and not (self.micro_batch_size_per_gpu or 0) > 0:
            raise ValueError(
                "micro_batch_size_per_gpu must be > 0 without use_dynamic_bsz, got"
                f" {self.micro_batch_size_per_gpu}"
            )

    def split(self, seq_lens: tuple[int, ...], *, pool: int, groups_per_pool: int) -> list[tuple[int, ...]]:
        """Sequence indices of every micro-batch (the same on every rank: it depends on lengths only)."""
        if self.use_dynamic_bsz:
            assert self.max_token_len_per_gpu is not None
            return split_packed_micro_batches(seq_lens, max_tokens=self.max_token_len_per_gpu * pool)
        assert self.micro_batch_size_per_gpu is not None
        per = self.micro_batch_size_per_gpu * groups_per_pool
        return [tuple(range(s, min(s + per, len(seq_lens)))) for s in range(0, len(seq_lens), per)]


def split_to_multiple(splits: list[tuple[int, ...]], *, multiple: int) -> list[tuple[int, ...]]:
    """Halve the largest micro-batches until their number is a multiple of ``multiple``.

    megatron-core's interleaved (virtual pipeline) schedule runs micro-batches in groups of the pipeline
    size and refuses a count that is not a multiple of it. Smaller micro-batches change nothing but
    memory and speed (losses are normalised over the whole call), so the engine splits rather than fail.
    """
    out = [tuple(s) for s in splits]
    while len(out) % multiple:
        largest = max(range(len(out)), key=lambda i: len(out[i]))
        if len(out[largest]) < 2:
            raise ValueError(
                f"virtual pipeline stages need a multiple of pipeline_model_parallel_size={multiple} micro-batches"
                f" (megatron-core's interleaved schedule), but this call has only {sum(map(len, out))} sequences in"
                f" {len(out)} micro-batches; give at least {multiple} sequences per call or set"
                " virtual_pipeline_model_parallel_size=null"
            )
        half = len(out[largest]) // 2
        out[largest : largest + 1] = [out[largest][:half], out[largest][half:]]
    return out


class RLEngine(Closeable):
    """verl's engine surface (``BaseEngine``) for one role over a built model and optimizer.

    Built by :func:`verl_engine.build_rl.build_rl_engine`; see the module docstring for the data path.
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
        out: dict[str, Any] = {}
        offload_model, offload_optimizer = self._offload_functions("offload")
        if params or grads:
            out["model"] = offload_model(self.chunks, params=params, grads=grads).as_dict()
        if optimizer and self.optimizer is not None:
            out["optimizer"] = offload_optimizer(self.optimizer).as_dict()
        return out

    def onload(self, *, params: bool = True, grads: bool = True, optimizer: bool = True) -> dict[str, Any]:
        """Bring back, bit for bit, what :meth:`offload` moved (the same selection)."""
        out: dict[str, Any] = {}
        onload_model, onload_optimizer = self._offload_functions("onload")
        if params or grads:
            out["model"] = onload_model(self.chunks, params=params, grads=grads).as_dict()
        if optimizer and self.optimizer is not None:
            out["optimizer"] = onload_optimizer(self.optimizer).as_dict()
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

    # ------------------------------------------------------------------------------ weights for rollout
    def export_weight_buckets(
        self, *, bucket_bytes: int = 1 << 29, lora_mode: str | None = None
    ) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """The model's weights under Hugging Face names, gathered over TP and PP, in buckets of at most
        ``bucket_bytes`` (a bigger tensor alone): what a rollout engine (vLLM / SGLang) loads.

        With LoRA, ``lora_mode`` (default from ``lora.merge``): ``"merged"`` = the full weights with
        ``W + alpha / r * B @ A`` for the adapted projections (computed on the exported copies: the model is
        not changed), ``"adapter"`` = only the adapter tensors, under PEFT's names
        (``base_model.model.model.layers.<i>...lora_A.weight``), for a rollout engine that serves the base
        model plus a LoRA adapter (see :meth:`peft_config`).

        Tensors are copies owned by each bucket; the extra memory is one bucket plus the tensor being
        gathered. A collective: every rank iterates to the end, in step (each gets every bucket). MTP layers
        are not included (the supported architectures have no Hugging Face names for them).
        """
        from verl_mcore_utils.weights import bucket_tensors

        self._check_exportable()
        mode = self._lora_mode(lora_mode)
        pairs = self._hf_weight_pairs(mode)
        # verl-mfsdp's gathered tensors are fresh copies: the bucket takes them as they are
        yield from bucket_tensors(pairs, bucket_bytes=bucket_bytes, owned=self.megatron_fsdp and mode is None)

    def _hf_weight_pairs(self, mode: str | None) -> Iterable[tuple[str, torch.Tensor]]:
        """The one place that picks the weight source: (HF name, tensor) pairs of ``mode`` (None: no LoRA)."""
        if mode == "adapter":
            from verl_mcore_utils.lora import export_hf_adapter

            return export_hf_adapter(self.chunks, hf_config=self.hf_config).items()
        if mode == "merged":
            from verl_mcore_utils.lora import export_merged_hf_weights

            return export_merged_hf_weights(self.chunks, hf_config=self.hf_config)
        if self.megatron_fsdp:
            from verl_mfsdp.export import export_megatron_fsdp_hf_weights

            return export_megatron_fsdp_hf_weights(self.chunks, hf_config=self.hf_config)
        from verl_mcore_utils.weights import export_hf_weights

        return export_hf_weights(self.chunks, hf_config=self.hf_config)

    def get_per_tensor_param(
        self, *, bucket_bytes: int = 1 << 29, lora_mode: str | None = None
    ) -> tuple[Iterator[tuple[str, torch.Tensor]], dict[str, Any] | None]:
        """verl's shape: ``((hf_name, tensor) generator, peft_config)``; the PEFT config (a dict) only when
        the adapter alone is sent (``lora_mode="adapter"``, or ``lora.merge=false``), else None."""
        mode = self._lora_mode(lora_mode)
        config = self.peft_config() if mode == "adapter" else None

        def pairs() -> Iterator[tuple[str, torch.Tensor]]:
            for bucket in self.export_weight_buckets(bucket_bytes=bucket_bytes, lora_mode=mode):
                yield from bucket

        return pairs(), config

    def peft_config(self) -> dict[str, Any]:
        """The adapter's PEFT ``adapter_config.json`` content (HF module names); a collective over TP and PP."""
        from verl_mcore_utils.lora import export_hf_adapter_with_config

        if self.lora is None:
            raise ValueError("this engine has no LoRA adapters (model.lora.rank is 0)")
        return export_hf_adapter_with_config(
            self.chunks, hf_config=self.hf_config, base_model_name_or_path=self._tokenizer_path
        )[1]

    def save_hf(self, path: str, *, merged: bool = False) -> Any:
        """A Hugging Face directory of the model (every rank calls; global rank 0 writes).

        Without LoRA: ``config.json`` + safetensors that ``transformers`` loads. With LoRA: a PEFT adapter
        directory (``adapter_config.json`` + ``adapter_model.safetensors``) that
        ``peft.PeftModel.from_pretrained(base, path)`` loads, or, with ``merged=True``, the full model with the
        adapter merged in.
        """
        from verl_mcore_utils.weights import save_hf_weights

        self._check_exportable()
        if self.lora is not None and not merged:
            from verl_mcore_utils.lora import save_hf_adapter

            return save_hf_adapter(
                self.chunks,
                path,
                hf_config=self.hf_config,
                lora=self.lora,
                base_model_name_or_path=self._tokenizer_path,
            )
        # megatron's own export path when it applies (save_hf_weights streams it); else the merged / FSDP pairs
        plain = self.lora is None and not self.megatron_fsdp
        weights = None if plain else self._hf_weight_pairs("merged" if self.lora is not None else None)
        return save_hf_weights(self.chunks, path, hf_config=self.hf_config, weights=weights)

    def _check_exportable(self) -> None:
        if self.value_model:
            raise ValueError(
                "a value model (critic) has no language-model weights to send to a rollout engine or save as one"
            )
        if self.hf_config is None:
            raise ValueError(
                "this engine was built without a Hugging Face config; it cannot name its weights"
            )

    def _lora_mode(self, lora_mode: str | None) -> str | None:
        if self.lora is None:
            if lora_mode is not None:
                raise ValueError(
                    f"lora_mode={lora_mode!r} but this engine has no LoRA adapters (model.lora.rank is 0)"
                )
            return None
        if lora_mode is None:
            return "merged" if self.lora.merge else "adapter"
        if lora_mode not in ("merged", "adapter"):
            raise ValueError(
                f"lora_mode must be 'merged' or 'adapter' (or None: from lora.merge); got {lora_mode!r}"
            )
        return lora_mode

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
        ``metrics`` the loss function's metrics averaged over micro-batches.
        """
        if not forward_only and loss_function is None:
            raise ValueError("forward_backward_batch(forward_only=False) needs a loss_function")
        batch = RLBatch.from_data(data)
        check_same_batch_on_every_rank(
            batch.packed,
            device=self.device,
            message="ranks were given different batches (lengths or tokens differ); the engine needs the call's"
            " whole batch, identical, on every rank (get_data_parallel_size() is 1)",
        )
        micro = self._plan(batch)
        temperature = float(read_scalar(data, "temperature", 1.0))
        entropy = bool(read_scalar(data, "calculate_entropy", False)) and not self.value_model
        scalars = self._loss_scalars(data, batch, temperature=temperature)
        per_seq: dict[str, list[torch.Tensor | None]] = {}
        losses: list[torch.Tensor] = []
        metrics: dict[str, list[Any]] = {}
        tracker = self._mtp_tracker(forward_only=forward_only, has_loss=loss_function is not None)
        mtp_packed = None  # the batch with its MTP targets (response tokens) as label mask
        mtp_counts: list[int] = []
        if tracker is not None:
            mtp_packed = dataclasses.replace(batch.packed, label_mask=batch.response_token_mask())
            mtp_counts = mtp_target_counts(mtp_packed, num_layers=tracker.num_layers)

        def step(mb: PlannedMicroBatch, model: torch.nn.Module) -> torch.Tensor | None:
            if not _unwrap(model).post_process:  # an earlier pipeline stage: its activations go on
                return self._stage_forward(model, mb, packed=batch.packed)
            merged, mtp_term = self._forward(
                model,
                mb,
                packed=batch.packed,
                temperature=temperature,
                entropy=entropy,
                tracker=tracker,
                mtp_packed=mtp_packed,
                mtp_counts=mtp_counts,
            )
            self._keep_outputs(batch, mb, merged, per_seq)
            if loss_function is None:
                return None
            loss_data = batch.rows(data, mb.indices, device=self.device) | scalars
            model_output = {k: batch.response_view(v, indices=mb.indices) for k, v in merged.items()}
            loss, mb_metrics = loss_function(model_output=model_output, data=loss_data, dp_group=None)
            # kept on the device and read once after the schedule: a float() here would make the host wait
            # for this micro-batch's forward before it can queue the backward (the GPU would run dry)
            losses.append(loss.detach())
            for key, value in mb_metrics.items():
                metrics.setdefault(key, []).append(
                    value.detach() if isinstance(value, torch.Tensor) else value
                )
            return loss if mtp_term is None else loss + mtp_term

        self.backend.run(self, micro, step, forward_only=forward_only)
        loss_values = [float(v) / self.pool_size for v in losses]
        metrics = {k: [float(v) for v in values] for k, values in metrics.items()}
        flat: dict[str, torch.Tensor] | None = None
        extra: Any = None
        if self.pipeline.is_last_stage:
            flat = {key: torch.cat(values) for key, values in per_seq.items()}  # type: ignore[arg-type]
            summary = {
                k: sum(v) / self.pool_size if k in SHARE_METRICS else sum(v) / len(v)
                for k, v in metrics.items()
            }
            if tracker is not None:  # every last-stage rank joins the pool's reduction (see verl_engine.mtp)
                summary.update(tracker.reduce(group=self.cp_groups.full_group))
            extra = (sum(loss_values), summary)
        sizes = {key: sum(batch.packed.seq_lens) for key in self._output_keys(entropy)}
        flat, (loss_total, summary) = share_from_last_stage(
            self.pipeline, tensors=flat, sizes=sizes, extra=extra, device=self.device
        )
        outputs = {
            key: batch.to_input_layout(list(values.split(list(batch.packed.seq_lens))))
            for key, values in flat.items()
        }
        return {"model_output": outputs, "loss": loss_total, "metrics": summary}

    # ------------------------------------------------------------------------------ internals
    def _output_keys(self, entropy: bool) -> list[str]:
        if self.value_model:
            return ["values"]
        return ["log_probs", "entropy"] if entropy else ["log_probs"]

    def _mtp_tracker(self, *, forward_only: bool, has_loss: bool) -> MtpTracker | None:
        """Tracker state exists on exactly the ranks that run MTP: last stage, training with a loss."""
        if self.mtp is None or forward_only or not has_loss or not self.pipeline.is_last_stage:
            return None
        return MtpTracker(num_layers=self.mtp.num_layers, device=self.device)

    def _stage_forward(
        self, model: torch.nn.Module, mb: PlannedMicroBatch, *, packed: PackedBatch
    ) -> torch.Tensor:
        """The chunk's raw output for this rank's share: activations before the last stage (input from
        ``set_input_tensor``), logits or values on it (packed path; the padded one post-processes them)."""
        if self.use_remove_padding:
            return model(
                input_ids=mb.split.batch.input_ids[None],
                position_ids=None,
                attention_mask=None,
                packed_seq_params=mb.packed_seq_params,
            )
        rows, _, _ = self._padded_rows(mb, packed=packed)
        return model(input_ids=rows, position_ids=None, attention_mask=None)

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
            batch.packed.seq_lens, pool=self.pool_size, groups_per_pool=groups_per_pool
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

    def _forward(
        self,
        model: torch.nn.Module,
        mb: PlannedMicroBatch,
        *,
        packed: PackedBatch,
        temperature: float,
        entropy: bool,
        tracker: MtpTracker | None = None,
        mtp_packed: PackedBatch | None = None,
        mtp_counts: Sequence[int] = (),
    ) -> tuple[dict[str, torch.Tensor], torch.Tensor | None]:
        """This rank's share through the model, per-token outputs merged over the pool (label-aligned).

        Also returns the MTP loss term (``tracker`` given: training with MTP) or None.
        """
        from verl_dyncp.planner import dynamic_cp_merge_output

        local = mb.split.batch
        gpt = _unwrap(model)
        captured: list[torch.Tensor] = []
        hook = None
        if tracker is not None:  # MTP starts from the decoder's final hidden states
            hook = gpt.decoder.register_forward_hook(lambda _m, _i, out: captured.append(out))
        head = lm_head_returns_hidden(gpt) if self.fused_lm_head else contextlib.nullcontext()
        try:
            with head as capture:  # fused: ``raw`` is the head's input [tokens, H], not logits
                if self.use_remove_padding:
                    raw = self._stage_forward(model, mb, packed=packed)[0]
                    labels = local.labels
                else:
                    raw, labels = self._padded_forward(model, mb, packed=packed)
        finally:
            if hook is not None:
                hook.remove()
        mtp_term = None
        if tracker is not None:
            assert self.mtp is not None and mtp_packed is not None
            sub = mtp_packed.select(mb.indices)
            mtp_term = run_mtp(
                gpt,
                hidden=captured[0],
                micro_batch=mb.split,
                packed_ids=sub.input_ids.to(self.device),
                label_mask=None if sub.label_mask is None else sub.label_mask.to(self.device),
                packed_seq_params=mb.packed_seq_params,
                settings=self.mtp,
                tp_group=self.tp_group if self.tp_size > 1 else None,
                counts=list(mtp_counts),
                pool_size=self.pool_size,
                tracker=tracker,
            )
        merged: dict[str, torch.Tensor] = {}
        if self.value_model:
            values = raw.squeeze(-1).float()
            merged["values"] = dynamic_cp_merge_output(values, micro_batch=mb.split, groups=self.cp_groups)
            return merged, mtp_term
        tp_group = self.tp_group if self.tp_size > 1 else None
        if capture is not None:
            log_probs, ent = capture.log_probs(
                raw, labels, tp_group=tp_group, temperature=temperature, compute_entropy=entropy
            )
        else:
            log_probs, ent = vocab_parallel_log_probs_and_entropy(
                raw, labels, tp_group=tp_group, temperature=temperature, compute_entropy=entropy
            )
        merged["log_probs"] = dynamic_cp_merge_output(log_probs, micro_batch=mb.split, groups=self.cp_groups)
        if ent is not None:
            merged["entropy"] = dynamic_cp_merge_output(ent, micro_batch=mb.split, groups=self.cp_groups)
        return merged, mtp_term

    def _padded_forward(
        self, model: torch.nn.Module, mb: PlannedMicroBatch, *, packed: PackedBatch
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """use_remove_padding=False: this rank's sequences right-padded [n, L] (BSHD, causal, no mask).

        Outputs are put back into the packed local layout, so the merge and everything after it is the
        packed path's: the two paths differ only in how attention sees the tokens (CP size is 1 here).
        """
        split = mb.split
        rows, labels, lens = self._padded_rows(mb, packed=packed)
        out = model(input_ids=rows, position_ids=None, attention_mask=None)  # [n, L, V/tp] or [n, L, 1]
        flat_out = torch.cat([out[r, :n] for r, n in enumerate(lens)])
        flat_labels = torch.cat([labels[r, :n] for r, n in enumerate(lens)])
        if split.is_dummy:
            return flat_out, torch.full_like(flat_labels, -100)
        meta = split.batch.meta
        return meta.take(flat_out, pad_value=0), meta.take(flat_labels, pad_value=-100)

    def _padded_rows(
        self, mb: PlannedMicroBatch, *, packed: PackedBatch
    ) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
        """This rank's sequences right-padded ``[n, L]``, their next-token labels, and their lengths."""
        split = mb.split
        if split.is_dummy:
            seqs = [split.batch.input_ids]
        else:  # split.sequence_indices are positions in the micro-batch, mb.indices the batch's sequences
            cu = packed.cu_seqlens
            seqs = [
                packed.input_ids[cu[i] : cu[i + 1]].to(self.device)
                for i in (mb.indices[j] for j in split.sequence_indices)
            ]
        lens = [int(s.shape[0]) for s in seqs]
        rows = torch.zeros((len(seqs), max(lens)), dtype=torch.int64, device=self.device)
        labels = torch.full_like(rows, -100)
        for r, s in enumerate(seqs):
            rows[r, : lens[r]] = s
            labels[r, : lens[r] - 1] = s[1:]
        return rows, labels, lens

    def _keep_outputs(
        self,
        batch: RLBatch,
        mb: PlannedMicroBatch,
        merged: Mapping[str, torch.Tensor],
        per_seq: dict[str, list[Any]],
    ) -> None:
        """Store each sequence's merged output (label-aligned, last slot zero) for the caller, detached."""
        offset = 0
        for i in mb.indices:
            n = batch.packed.seq_lens[i]
            for key, values in merged.items():
                slots = per_seq.setdefault(key, [None] * batch.size)
                piece = values[offset : offset + n].detach().clone()
                if key != "values":
                    piece[n - 1 :].zero_()  # the last token predicts nothing (no host scalar copied over)
                slots[i] = piece
            offset += n


def _unwrap(model: torch.nn.Module) -> Any:
    """The GPTModel inside DDP / Float16Module wrappers."""
    from verl_mcore_utils.module import unwrap_model

    return unwrap_model(model)
