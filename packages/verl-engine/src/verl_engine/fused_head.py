"""Log-probabilities and entropy straight from the last hidden states: the LM head fused into the loss.

The output layer's matmul runs inside :mod:`verl_engine.logprobs`' chunk loop (recomputed in backward), so
only ``chunk_size`` tokens' logits ever exist; :func:`lm_head_returns_hidden` makes a megatron-core
``GPTModel`` return its hidden states for one forward. Why and how: the package README's "Log-probs and
entropy".
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from verl_engine.logprobs import (
    ChunkOptions,
    LogitChunks,
    check_arguments,
    chunked_backward,
    chunked_forward,
    lead_shaped,
)

__all__ = ["HeadCapture", "fused_lm_head_log_probs", "lm_head_returns_hidden"]

# Tokens per chunk when the caller does not choose: about 1 GiB of float32 logits per chunk.
_CHUNK_BYTES = 1 << 30


def default_chunk_size(vocab_local: int) -> int:
    """Tokens per chunk so one chunk's float32 logits take about 1 GiB (at least 64 tokens)."""
    return max(64, _CHUNK_BYTES // (4 * vocab_local))


def fused_lm_head_log_probs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    tp_group: dist.ProcessGroup | None = None,
    temperature: float = 1.0,
    compute_entropy: bool = True,
    chunk_size: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``log p(label)`` and entropy per token of ``softmax(hidden @ weight^T / temperature)``, chunked.

    Args:
        hidden: ``[..., H]`` the output layer's input on this rank (after the TP copy / SP gather).
        weight: ``[V_local, H]`` this rank's vocabulary shard of the output layer (or tied embedding).
        labels: ``[...]`` ids in the GLOBAL vocabulary ``[0, tp * V_local)``; others give log-prob 0.
        tp_group: the group sharding the vocabulary; None or size 1 = whole vocabulary here.
        temperature: logits are divided by it (verl's convention).
        compute_entropy: skip the entropy statistic when False.
        chunk_size: tokens per chunk; default about 1 GiB of float32 logits (:func:`default_chunk_size`).

    Returns:
        ``(log_probs, entropy)`` float32 ``[...]`` (entropy None when not computed), differentiable with
        respect to ``hidden`` and ``weight``.
    """
    if weight.dim() != 2 or hidden.shape[-1] != weight.shape[1]:
        raise ValueError(
            f"hidden [..., H] and weight [V_local, H] do not match: {tuple(hidden.shape)} vs {tuple(weight.shape)}"
        )
    if hidden.dtype != weight.dtype:
        raise ValueError(
            f"hidden is {hidden.dtype} but the output weight is {weight.dtype}; the output layer computes in one dtype"
        )
    if chunk_size is None:
        chunk_size = default_chunk_size(weight.shape[0])
    check_arguments(
        logits=hidden, labels=labels, temperature=temperature, chunk_size=chunk_size
    )  # hidden has the logits' leading shape and float dtype
    lead_shape = hidden.shape[:-1]
    options = ChunkOptions(tp_group, float(temperature), compute_entropy, int(chunk_size))
    flat_hidden, flat_labels = hidden.reshape(-1, hidden.shape[-1]), labels.reshape(-1).long()
    return lead_shaped(_FusedLMHead.apply(flat_hidden, weight, flat_labels, options), lead_shape)


def _head_chunks(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor) -> LogitChunks:
    """The logits as the output layer computes them, one chunk at a time (hidden and weight share a dtype)."""

    def chunk(start: int, end: int) -> torch.Tensor:
        return hidden[start:end] @ weight.t()

    return LogitChunks(chunk=chunk, vocab_local=weight.shape[0], labels=labels, source=hidden)


class _FusedLMHead(torch.autograd.Function):
    """Chunked head matmul + softmax statistics; backward recomputes each chunk's logits."""

    @staticmethod
    def forward(
        ctx: Any, hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, options: ChunkOptions
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        chunks = _head_chunks(hidden, weight, labels)
        return chunked_forward(ctx, chunks, options, inputs=(hidden, weight, labels))

    @staticmethod
    def backward(ctx: Any, *grad_outputs: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        hidden, weight, labels, lse, entropy = ctx.saved_tensors
        need_hidden, need_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_hidden = torch.zeros_like(hidden) if need_hidden else None
        grad_weight: torch.Tensor | None = None
        chunks = _head_chunks(hidden, weight, labels)
        # the recomputed chunk is this loop's own: its gradient may replace it
        for start, end, chunk_grad in chunked_backward(
            ctx, chunks, saved=(lse, entropy), grad_outputs=grad_outputs, overwrite_chunk=True
        ):
            g = chunk_grad
            del chunk_grad
            if grad_hidden is not None:
                torch.mm(g, weight, out=grad_hidden[start:end])
            if need_weight:
                part = g.t() @ hidden[start:end]
                if grad_weight is None:
                    grad_weight = part.float() if part.dtype != torch.float32 else part
                else:
                    grad_weight.add_(part)
                del part
            del g
        if grad_weight is not None:
            grad_weight = grad_weight.to(weight.dtype)
        elif need_weight:
            grad_weight = torch.zeros_like(weight)
        return grad_hidden, grad_weight, None, None


@dataclass
class HeadCapture:
    """What the output layer was called with during :func:`lm_head_returns_hidden`: its weight."""

    weight: torch.Tensor | None = None

    def log_probs(
        self,
        hidden: torch.Tensor,
        labels: torch.Tensor,
        *,
        tp_group: dist.ProcessGroup | None,
        temperature: float = 1.0,
        compute_entropy: bool = True,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """:func:`fused_lm_head_log_probs` of the model's returned hidden states with the captured weight.

        megatron-core's Float16Module hands the last stage's output back in float32; that is an exact
        upcast of the bf16 / fp16 hidden states, so they go back to the weight's dtype losslessly.
        """
        if self.weight is None:
            raise RuntimeError("the model's forward never called its output layer (is this the last stage?)")
        return fused_lm_head_log_probs(
            hidden.to(self.weight.dtype),
            self.weight,
            labels,
            tp_group=tp_group,
            temperature=temperature,
            compute_entropy=compute_entropy,
        )


@contextlib.contextmanager
def lm_head_returns_hidden(gpt: Any) -> Iterator[HeadCapture]:
    """Within the block, ``gpt``'s output layer returns its (TP-prepared) input instead of logits.

    ``GPTModel.forward(labels=None)`` then returns ``[b, s, H]`` hidden states where it returned
    ``[b, s, V/tp]`` logits; the weight the model passed (its own, or the tied word embedding) is left in
    the yielded :class:`HeadCapture` for :func:`fused_lm_head_log_probs`. The input goes through the same
    TP region as in megatron-core's ``ColumnParallelLinear`` (all-gather of the sequence-parallel shards,
    or the identity whose backward all-reduces over TP), so gradients reach the decoder as before.
    Only the instance's ``forward`` is replaced (restored on exit): state dicts and other callers of the
    layer outside the block are untouched.
    """
    layer = getattr(gpt, "output_layer", None)
    if layer is None or not getattr(gpt, "post_process", True):
        raise ValueError(
            "the fused LM head needs the pipeline's last stage (a GPTModel with an output_layer)"
        )
    if getattr(layer, "bias", None) is not None:
        raise ValueError("the fused LM head does not support an output layer with a bias")
    config = getattr(gpt, "config", None)
    if getattr(config, "use_mup", False):
        raise ValueError("the fused LM head does not apply MuP's output scaling; turn use_fused_kernels off")
    if getattr(config, "mtp_num_layers", None):
        # GPTModel's own MTP path calls the output layer for its depths too (verl_engine builds MTP outside it)
        raise ValueError("the fused LM head needs a GPTModel built without mtp_num_layers")
    capture = HeadCapture()
    tp_group = getattr(layer, "tp_group", None)
    if tp_group is None:  # older megatron-core layers do not carry their group
        from megatron.core import parallel_state

        tp_group = parallel_state.get_tensor_model_parallel_group()

    def forward(
        input_: torch.Tensor, weight: torch.Tensor | None = None, **_: Any
    ) -> tuple[torch.Tensor, None]:
        capture.weight = layer.weight if weight is None else weight
        return _tp_input_region(input_, layer=layer, tp_group=tp_group), None

    layer.forward = forward
    try:
        yield capture
    finally:
        del layer.forward  # back to the class's forward


def _tp_input_region(input_: torch.Tensor, *, layer: Any, tp_group: Any) -> torch.Tensor:
    """The output layer's input as its matmul sees it on this rank (megatron-core's ColumnParallelLinear)."""
    if tp_group is None or dist.get_world_size(group=tp_group) == 1:
        return input_
    from megatron.core.tensor_parallel.mappings import (
        copy_to_tensor_model_parallel_region,
        gather_from_sequence_parallel_region,
    )

    if getattr(layer, "sequence_parallel", False):
        return gather_from_sequence_parallel_region(input_, tensor_parallel_output_grad=True, group=tp_group)
    return copy_to_tensor_model_parallel_region(input_, group=tp_group)
