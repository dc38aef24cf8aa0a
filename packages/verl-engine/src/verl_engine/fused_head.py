"""Log-probabilities and entropy straight from the last hidden states: the LM head fused into the loss.

Why: :mod:`verl_engine.logprobs` already avoids float32 copies of the logits, but the logits themselves
(``[T, V/tp]`` in bf16) and their gradient are still full size: at the Qwen2.5-1.5B shape with 32K
packed tokens that is 2 x 10 GB, and RL's forward-only log-prob passes pay it too. Here the output
layer's matmul moves inside the chunk loop, so only ``chunk_size`` tokens' logits ever exist:

* forward: for each chunk, ``logits = hidden[chunk] @ W^T`` (in the hidden states' dtype, as the output
  layer computes them), the chunk's softmax statistics, then the chunk's logits are freed; autograd saves
  the hidden states, the weight, the labels and two float32 numbers per token;
* backward: each chunk's logits are recomputed, their gradient formed in float32 and cast to the
  weight's dtype (what autograd would hand the output layer), then ``grad_hidden[chunk] = g @ W`` and
  ``grad_W += g^T @ hidden[chunk]`` (accumulated in float32 over chunks).

The price is one extra ``T x V x H`` matmul in backward (the recompute); the gain is a peak that no
longer grows with ``T x V``. Under tensor parallelism the hidden states are this rank's input to the
vocab-parallel output layer (after megatron-core's copy-to-TP or sequence-parallel gather, whose backward
reduces ``grad_hidden`` over TP), the softmax statistics are combined over TP as in
:mod:`verl_engine.logprobs`.

:func:`lm_head_returns_hidden` makes a megatron-core ``GPTModel`` return those hidden states instead
of logits for the duration of one forward, so the same model call serves both paths.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from verl_engine.logprobs import _check_arguments, chunked_backward, chunked_forward

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
    _check_arguments(
        logits=hidden, labels=labels, temperature=temperature, chunk_size=chunk_size
    )  # hidden has the logits' leading shape and float dtype
    lead_shape = hidden.shape[:-1]
    outputs = _FusedLMHead.apply(
        hidden.reshape(-1, hidden.shape[-1]),
        weight,
        labels.reshape(-1).long(),
        tp_group,
        float(temperature),
        compute_entropy,
        int(chunk_size),
    )
    if not compute_entropy:
        return outputs.view(lead_shape), None
    log_probs, entropy = outputs
    return log_probs.view(lead_shape), entropy.view(lead_shape)


class _FusedLMHead(torch.autograd.Function):
    """Chunked head matmul + softmax statistics; backward recomputes each chunk's logits."""

    @staticmethod
    def forward(
        ctx: Any,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        labels: torch.Tensor,
        tp_group: dist.ProcessGroup | None,
        temperature: float,
        compute_entropy: bool,
        chunk_size: int,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        log_probs, entropy, lse = chunked_forward(
            ctx,
            lambda start, end: hidden[start:end] @ weight.t(),
            num_tokens=hidden.shape[0],
            vocab_local=weight.shape[0],
            labels=labels,
            tp_group=tp_group,
            temperature=temperature,
            compute_entropy=compute_entropy,
            chunk_size=chunk_size,
            device=hidden.device,
        )
        ctx.save_for_backward(hidden, weight, labels, lse, None if entropy is None else entropy.clone())
        return log_probs if entropy is None else (log_probs, entropy)

    @staticmethod
    def backward(ctx: Any, *grad_outputs: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        hidden, weight, labels, lse, entropy = ctx.saved_tensors
        need_hidden, need_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_hidden = torch.zeros_like(hidden) if need_hidden else None
        grad_weight: torch.Tensor | None = None
        for start, end, chunk_grad in chunked_backward(
            ctx,
            lambda start, end: hidden[start:end] @ weight.t(),
            num_tokens=hidden.shape[0],
            vocab_local=weight.shape[0],
            labels=labels,
            lse=lse,
            entropy=entropy,
            grad_outputs=grad_outputs,
            grad_dtype=weight.dtype,
            overwrite_chunk=True,  # the recomputed chunk is this loop's own: its gradient may replace it
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
        return grad_hidden, grad_weight, None, None, None, None, None


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
